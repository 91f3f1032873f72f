"""Turning one grid point into processes: a single worker, torchrun, or a SLURM task.

Importing this package makes ablate's Hydra plugins (launch/plugins/ablate_launcher, the package
`hydra_plugins.ablate_launcher`) importable from this checkout, installed or not: Hydra lists the
`hydra_plugins` namespace's folders to find launchers, an editable install maps the package without
listing its folder, and a checkout run from PYTHONPATH (a GPU host without network) has no mapping
at all. A launcher's job unpickles it in a fresh process through `rebuild_launcher`, which imports
this package first (hydra_plugins.ablate_launcher.launchers._Portable).
"""
import contextlib
import os
from pathlib import Path

PLUGINS = Path(__file__).parent / "plugins"  # holds ablate_launcher (pyproject.toml's package-dir)


def plugins_importable() -> None:
    """Add PLUGINS to the `hydra_plugins` namespace package's folders, once."""
    try:
        import hydra_plugins  # the namespace hydra-submitit-launcher installs into
    except ImportError:  # without it there is no launcher of ours to import either
        return
    if PLUGINS.is_dir() and str(PLUGINS) not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(str(PLUGINS))


@contextlib.contextmanager
def environ(key: str, value: str | None):
    """os.environ[key] = value (None: unset) for the block, then as it was."""
    before = os.environ.pop(key, None)
    if value is not None:
        os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)
        if before is not None:
            os.environ[key] = before


def rebuild_launcher(name: str, state: dict):
    """The launcher class `name` of hydra_plugins.ablate_launcher.launchers with `state` as its
    attributes: how a submitit job (a fresh process, perhaps without ablate installed) unpickles it."""
    from hydra_plugins.ablate_launcher import launchers

    cls = getattr(launchers, name)
    launcher = cls.__new__(cls)
    launcher.__dict__.update(state)
    return launcher


plugins_importable()  # before anything unpickled after this package names the plugin
