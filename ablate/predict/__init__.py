"""Memory prediction for one grid point, before (or instead of) running it.

Two methods, one result shape (`Prediction`):
- analytic (ablate/predict/analytic.py): closed-form tensor sizes played through one training
  step as a timeline of allocations and frees; instant, no torch allocation at all.
- trace (ablate/predict/trace.py): the real training step run on fake tensors (FakeTensorMode)
  under torch's MemTracker; needs no memory (a CUDA point: a visible GPU), takes seconds to minutes.

Both predict one rank's device memory as the torch allocator sees it (peak_allocated_mib), in MiB.
Beside it, whatever the method, the seconds of one optimizer step (ablate/predict/step_time.py).
"""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("analytic", "trace", "none")


@dataclass
class Prediction:
    peak_mib: float  # one rank's peak of live tensor bytes on the training device
    breakdown_mib: dict  # params, grads, optimizer, activations, other at that peak
    category_max_mib: dict  # each category's own maximum over the step (they peak at different times)
    method: str  # analytic | trace
    steady_mib: dict | None = None  # what stays once the step is over: params, optimizer states
    step_time_s: float | None = None  # one optimizer step's seconds; None where it cannot be predicted

    def to_result(self) -> dict:
        """The result contract's `prediction` field."""
        return {"peak_mib": self.peak_mib, "breakdown_mib": self.breakdown_mib, "method": self.method,
                "step_time_s": self.step_time_s}


def predict(spec, method: str) -> Prediction | None:
    """Predict a point's memory (an ablate.spec.RunSpec) with `method` (one of METHODS); None for "none"."""
    if method not in METHODS:
        raise ValueError(f"predict={method!r} is not one of {', '.join(METHODS)}")
    if method == "analytic":
        from ablate.predict.analytic import analytic

        return analytic(spec)
    if method == "trace":
        from ablate.predict.trace import trace  # imports torch: only when asked for

        return trace(spec)
    return None
