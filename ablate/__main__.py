"""`python -m ablate [-m] group=option,... key=value`: compose conf/, run each grid point as a job."""
import signal
import sys

import hydra
from omegaconf import DictConfig

import launch  # noqa: F401  (importing it lets Hydra list ablate's launchers: launch/__init__.py)
from ablate.command_line import unknown_key
from ablate.schema import CONF, register

register()


_single: list[dict] = []  # the result of a single run (not -m), for its exit status


# An absolute path: run as the `ablate` console script, Hydra would read "../conf" as a Python package.
@hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ablate.job import run_point  # after composition: `--cfg job` and `--help` stay fast

    result = run_point(cfg)  # the result: a sweeper may decide what to run next from it
    if HydraConfig.get().mode == RunMode.RUN:
        _single.append(result)
    return result


def cli() -> None:
    """`ablate ARGS` (the console script) and `python -m ablate ARGS`. Exit status: 0, or 1 for a
    command line it refuses and for a single run whose point ended invalid, oom, error, timeout or
    diverged (so a script notices; a sweep that survives its failing points exits 0, its rows say how each
    ended), 130 for Ctrl-C."""
    if sys.argv[1:] == ["--version"]:  # Hydra's own flag would print only "Hydra 1.3.8"
        from importlib.metadata import version

        print(f"ablate {version('ablate')} (torch {version('torch')}, Hydra {version('hydra-core')})")
        return
    error = unknown_key(sys.argv[1:])
    if error:
        sys.exit(error)
    try:
        main()
    except KeyboardInterrupt:  # a local worker's process group is already down (launch/local.py)
        print("\ninterrupted: finished points keep their rows; the same command again skips them and "
              "runs the rest.", file=sys.stderr)
        # End by SIGINT itself, as Python does after a traceback: a calling shell loop sees the
        # interrupt (exit status 130) and stops too.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.raise_signal(signal.SIGINT)
    if _single and _single[0].get("status") not in ("ok", "predicted"):
        sys.exit(1)


if __name__ == "__main__":
    cli()
