"""`python -m ablate [-m] group=option,... key=value`: compose conf/, run each grid point as a job."""
import signal
import sys
from pathlib import Path

import hydra
import hydra_plugins
from omegaconf import DictConfig

import launch
from ablate.schema import register, unknown_key

register()
# Hydra finds launchers by listing the `hydra_plugins` namespace folders. An editable install maps
# hydra_plugins.ablate_launcher to launch/plugins/ (pyproject.toml), which imports fine but is not
# listed; naming the folder here lets Hydra see conf/hydra/launcher/slurm.yaml's launcher.
_PLUGINS = Path(launch.__file__).parent / "plugins"
if _PLUGINS.is_dir() and str(_PLUGINS) not in list(hydra_plugins.__path__):
    hydra_plugins.__path__.append(str(_PLUGINS))


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from ablate.job import run_point  # after composition: `--cfg job` and `--help` stay fast

    return run_point(cfg)  # the result: a sweeper may decide what to run next from it


if __name__ == "__main__":
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
