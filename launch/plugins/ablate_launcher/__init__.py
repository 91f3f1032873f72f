"""Installed as `hydra_plugins.ablate_launcher` (see pyproject.toml): Hydra accepts launcher
classes only from the `hydra_plugins` namespace package."""
