"""ablate/worker.py's classify: an exception raised in a worker -> its row's (status, reason)."""
from __future__ import annotations

import torch

from ablate.techniques import Invalid
from ablate.worker import status_of


def test_exception_classification():
    assert status_of(torch.OutOfMemoryError("CUDA out of memory. Tried"))[0] == "oom"
    assert status_of(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"))[0] == "oom"
    assert status_of(Invalid("batch_size=3 ..."))[0] == "invalid"
    assert status_of(KeyError("x")) == ("error", "KeyError: 'x'")
