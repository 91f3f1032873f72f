"""ablate/worker.py's classify: an exception raised in a worker -> its row's (status, reason)."""
from __future__ import annotations

import torch

from ablate.techniques import Invalid
from ablate.worker import classify as classify_exception


def test_exception_classification():
    assert classify_exception(torch.OutOfMemoryError("CUDA out of memory. Tried"))[0] == "oom"
    assert classify_exception(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"))[0] == "oom"
    assert classify_exception(Invalid("batch_size=3 ..."))[0] == "invalid"
    assert classify_exception(KeyError("x")) == ("error", "KeyError: 'x'")
