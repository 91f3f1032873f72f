"""offload group: which tensors live in host memory instead of on the training device."""
from __future__ import annotations

import contextlib

from ablate.techniques import Option


class NoOffload(Option):
    """Keep activations, parameters and optimizer states on the training device."""

    def context(self) -> contextlib.AbstractContextManager:
        """Wraps the forward pass (where saved activations are packed)."""
        return contextlib.nullcontext()
