"""offload=activations_overlap: activation offload whose copies run beside the compute.

Forward: each saved tensor is copied to pinned host memory on a side CUDA stream while the compute
stream runs on. Backward: when a layer's first saved tensor is unpacked, the saved tensors of the
next layer(s) in backward order are fetched back on the side stream while this layer's backward
runs. torchtune's stream-based OffloadActivations is the model; its copy in TRL is not used, as TRL
requires datasets, pyarrow and accelerate, which ablate does not install, and fetches each tensor
only when its node asks, never a layer ahead.

Layers are the family adapter's repeated layers, marked by forward hooks (`change_params`); the
tensors saved between two marks are one group, fetched together.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ablate.techniques import Invalid, Plan
from ablate.techniques.offload import Activations


@dataclass
class OffloadStats:
    """Counts over the option's life. On a CPU the host is the device: the tensors chosen are
    counted as offloaded and fetched, and no copy is made."""

    packed: int = 0  # tensors saved for backward under the hooks
    offloaded: int = 0  # of them, sent to the host (the rest stayed on the device)
    offloaded_bytes: int = 0
    fetched_ahead: int = 0  # brought back before their own layer's backward asked for them


@dataclass(eq=False)
class _Saved:
    """One packed tensor."""

    group: int  # index of the layer run that saved it, in forward order; -1: kept on the device
    kept: torch.Tensor | None = None  # never moved
    host: torch.Tensor | None = None  # its copy in host memory (on a CPU, the tensor itself)
    # Forward: the original, held until its copy is done. Backward: the tensor fetched back.
    device: torch.Tensor | None = None
    event: torch.cuda.Event | None = None  # when `device` may be used or dropped (None: at once)
    home: torch.device | None = None
    unpacked: bool = False  # handed to autograd: never fetched again


class SideStreamOffload:
    """The pack and unpack hooks, their bookkeeping and their streams.

    On CUDA, three orderings keep the copies correct: the side stream waits for the compute stream
    before a host copy (the producing kernel may still be queued); a saved tensor is held until
    its copy's event is done, or the compute stream waits on that event before the tensor is
    dropped (else the allocator could hand its block to a kernel while the copy still reads it);
    the compute stream waits on a fetch's event before backward reads the fetched tensor.
    A fake tensor (the predictor's traced step) is copied synchronously and held as CUDA would at
    most hold it, so the trace counts this option's bound."""

    def __init__(self, min_bytes: int, prefetch: int):
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.stats = OffloadStats()
        self._ids = itertools.count()  # never reused: a stale handle cannot name a newer tensor
        self._side: dict[torch.device, torch.cuda.Stream] = {}  # made at first use: the job never touches CUDA
        self._compute: torch.cuda.Stream | None = None
        self._lock = threading.Lock()  # backward may unpack on the caller's and on a device's thread
        self._saved: dict[int, _Saved] = {}
        self._groups: list[list[_Saved]] = []
        self._fetched: set[int] = set()
        self._stash: list[_Saved] = []  # offloaded, the original still held: in copy order
        self._new_group = True
        self._in_forward = self._in_backward = False

    @contextlib.contextmanager
    def hooks(self):
        """Wraps one forward pass; its backward may run after the block."""
        self._drop()  # what an earlier backward never unpacked
        self._in_forward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._in_forward = False

    def layer_boundary(self, *_) -> None:
        """A layer starts or ends (a forward hook's signature): the next offloaded tensor opens a
        group. Returns None, as a forward hook that keeps the module's output must."""
        self._new_group = True

    def offloadable(self, t: torch.Tensor) -> bool:
        """Whether moving `t` to the host can free device memory worth its transfers."""
        if type(t) is not torch.Tensor and not is_fake(t):
            return False  # float8, NF4, DTensor: a subclass may not copy into a plain host tensor
        if t.layout != torch.strided or t.device.type == "meta":
            return False
        nbytes = t.numel() * t.element_size()
        # A small tensor (a norm's per-token statistics, the token ids) is a negligible share of the
        # activations, and its two copies would cost launch latency and events.
        if nbytes < self.min_bytes:
            return False
        # A parameter or a view of one (a Linear's transposed weight) stays on the device with
        # the model: its host copy would free nothing and cost two transfers.
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return False
        # A broadcast view (stride 0) shares a smaller storage; its copy would materialise it.
        return t.untyped_storage().nbytes() >= nbytes

    def pack(self, t: torch.Tensor) -> int:
        handle = next(self._ids)
        self.stats.packed += 1
        if not self.offloadable(t):
            self._saved[handle] = _Saved(group=-1, kept=t)
            return handle
        if self._new_group:
            self._new_group = False
            self._groups.append([])
            self._release(wait=True)  # the previous layer's originals: the stash holds one layer at most
        else:
            self._release(wait=False)
        saved = _Saved(group=len(self._groups) - 1, home=t.device)
        self._to_host(saved, t)
        self._groups[-1].append(saved)
        self._saved[handle] = saved
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        return handle

    def unpack(self, handle: int) -> torch.Tensor:
        with self._lock:
            saved = self._saved.pop(handle, None)  # autograd unpacks a saved tensor once, then frees it
            if saved is None:
                raise RuntimeError("offload=activations_overlap: a saved tensor was unpacked twice or after its "
                                   "backward (a second backward through one graph is not supported)")
            if not (self._in_backward or self._in_forward):  # in forward: a nested backward (autograd.grad)
                self._start_backward()
            if saved.kept is not None:
                return saved.kept
            if saved.device is None:
                self._fetch(saved.group, ahead=False)
            for g in range(saved.group - 1, saved.group - 1 - self.prefetch, -1):
                if g >= 0 and g not in self._fetched:
                    self._fetch(g, ahead=True)
            t, event = saved.device, saved.event
            # Autograd's now, freed after its node. The pinned host block is reused only once the
            # copies queued on it are done (torch's host allocator records their streams).
            saved.device = saved.event = saved.host = None
            saved.unpacked = True
            if event is not None:
                torch.cuda.current_stream(t.device).wait_event(event)
            return t

    def _to_host(self, saved: _Saved, t: torch.Tensor) -> None:
        if t.device.type == "cpu":
            saved.host = t  # the host is the device: nothing to move
        elif is_fake(t):
            saved.host, saved.device = t.to("cpu"), t
            self._stash.append(saved)
        else:
            compute = self._compute = torch.cuda.current_stream(t.device)
            side = self._side_stream(t.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
            saved.host, saved.device, saved.event = host, t, side.record_event()
            self._stash.append(saved)

    def _release(self, wait: bool) -> None:
        """Drop the originals whose copies are done; with `wait`, all of them, the compute stream
        first waiting for the last copy (the side stream runs its copies in order)."""
        if wait:
            done = len(self._stash)
            if done and self._stash[-1].event is not None:
                torch.cuda.current_stream(self._stash[-1].home).wait_event(self._stash[-1].event)
        else:  # a fake tensor has no event: held until the next layer, CUDA's bound
            done = next((i for i, s in enumerate(self._stash) if s.event is None or not s.event.query()),
                        len(self._stash))
        for saved in self._stash[:done]:
            saved.device = saved.event = None
        del self._stash[:done]

    def _fetch(self, group: int, ahead: bool) -> None:
        self._fetched.add(group)
        todo = [s for s in self._groups[group] if s.device is None and not s.unpacked]
        if todo:
            self._bring_back(todo)
            if ahead:
                self.stats.fetched_ahead += len(todo)

    def _bring_back(self, todo: list[_Saved]) -> None:
        home = todo[0].home
        if home.type == "cpu":
            for s in todo:
                s.device = s.host
        elif is_fake(todo[0].host):
            for s in todo:
                s.device = s.host.to(home)
        else:
            compute, side = torch.cuda.current_stream(home), self._side_stream(home)
            # Allocated on the compute stream, so that the blocks return to its pool when backward
            # drops them; the side stream first waits for the kernels queued there, which may still
            # read those blocks' earlier tensors. The fetch then overlaps this layer's backward.
            targets = [torch.empty_like(s.host, device=home) for s in todo]
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                for s, target in zip(todo, targets):
                    target.copy_(s.host, non_blocking=True)
            event = side.record_event()
            for s, target in zip(todo, targets):
                s.device, s.event = target, event

    def _start_backward(self) -> None:
        self._in_backward = True
        if torch._C._current_graph_task_id() != -1:  # else unpacked outside backward (a test reading a node)
            torch.autograd.Variable._execution_engine.queue_callback(self._drop)

    def _drop(self) -> None:
        """Forget every saved tensor: at the end of a backward, and before a forward."""
        if self._compute is not None:
            for side in self._side.values():
                # A fetched tensor never used, or an original still being copied, returns its block to
                # the compute stream's pool: the side stream's work on it must come first.
                self._compute.wait_stream(side)
        self._saved.clear()
        self._groups.clear()
        self._fetched.clear()
        self._stash.clear()
        self._new_group = True
        self._in_backward = False

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]


class OverlappedActivations(Activations):
    """Copy every tensor saved for backward (but small ones and parameters) to pinned host memory on
    a side CUDA stream, and fetch the next `prefetch` layers' back while a layer's backward runs.
    Saves: as offload=activations, less the tensors under `min_bytes`. Spends: host RAM and PCIe
    transfers, hidden behind compute where the link keeps up; up to one layer's saved tensors held
    on the device in forward until their copies finish, and 1 + `prefetch` layers' in backward."""

    label = "Overlapped activation offload"

    def __init__(self, min_bytes: int = 2**20, prefetch: int = 1):
        self.min_bytes = min_bytes
        self.prefetch = self.layers_ahead = prefetch
        self._offload = SideStreamOffload(min_bytes, prefetch)

    @property
    def stats(self) -> OffloadStats:
        return self._offload.stats

    def check(self, plan: Plan) -> None:
        try:
            super().check(plan)  # what offload=activations refuses (nothing, so far) is refused here too
        except Invalid as e:
            raise Invalid(str(e).replace("offload=activations", "offload=activations_overlap", 1)) from None
        if self.min_bytes < 0:
            raise Invalid(f"offload.min_bytes={self.min_bytes} must be >= 0")
        if self.prefetch < 0:
            raise Invalid(f"offload.prefetch={self.prefetch} must be >= 0 (layers fetched ahead in backward)")

    def apply(self, model: nn.Module, adapter) -> nn.Module:
        for layer in adapter.layer_list(model):
            layer.register_forward_pre_hook(self._offload.layer_boundary)
            layer.register_forward_hook(self._offload.layer_boundary, always_call=True)
        return model

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        return self._offload.hooks()
