"""Live bytes by category over one played step: what `Step` (ablate/predict/timeline.py) allocates
and frees, and the peak it keeps."""
from __future__ import annotations

KEYS = ("params", "grads", "optimizer", "activations", "other")  # the result contract's breakdown_mib keys


class Timeline:
    """Live bytes per category over one step; keeps the peak total, the breakdown at it and
    each category's own maximum."""

    def __init__(self):
        self.now = dict.fromkeys(KEYS, 0.0)
        self.peak, self.at_peak, self.max = 0.0, dict(self.now), dict(self.now)

    def alloc(self, kind: str, nbytes: float) -> None:
        self.now[kind] += nbytes
        self.max[kind] = max(self.max[kind], self.now[kind])
        total = sum(self.now.values())
        if total > self.peak:
            self.peak, self.at_peak = total, dict(self.now)

    def free(self, kind: str, nbytes: float) -> None:
        self.now[kind] -= nbytes

    def transient(self, kind: str, nbytes: float) -> None:
        """Allocated and freed again before anything else happens."""
        self.alloc(kind, nbytes)
        self.free(kind, nbytes)
