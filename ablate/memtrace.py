"""One training step traced under torch's MemTracker: the peak, its breakdown by category, and
where the memory went per module. Sizes are MiB (2**20 bytes). ablate.measure re-exports it.
"""
from __future__ import annotations

import gc
import types
import warnings
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState, _UpdateType

MIB = 2**20

_CATEGORY = {
    _MemRefType.PARAM: "params", _MemRefType.GRAD: "grads", _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations", _MemRefType.BUFFER: "other", _MemRefType.TEMP: "other",
    _MemRefType.OTH: "other",
}
BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "other")


@dataclass
class Trace:
    """One traced training step, in MiB. MemTracker labels optimizer-step temporaries "optimizer"
    while they live, so `after` (the steady state once the step is over) holds the states alone."""

    peak_mib: float
    at_peak: dict  # breakdown_mib at the moment of the peak total (what result.json reports)
    category_max: dict  # each category's own maximum over the step (they peak at different times)
    after: dict  # breakdown_mib when the step has finished
    # Where the memory went, per module (ablate.artifacts makes memory_by_module.csv of it), bytes on
    # the device, by ModTracker's module names ("GPTModule.transformer.h.0"):
    held: dict = field(default_factory=dict)  # (owner, _MemRefType) -> bytes alive at the peak
    windows: dict = field(default_factory=dict)  # name -> [fwd, bwd] highest total while it ran, -1: never


_GLOBAL = "Global"  # ModTracker's name for "inside no module" (the optimizer step, the loss outside forward)


_NO_HOOK = types.SimpleNamespace(remove=lambda: None)  # a hook handle's interface, for a hook never made


class _CategoryTracker(MemTracker):
    """MemTracker reduced to what a Trace reports: the peak total with the breakdown at it, each
    category's own maximum, and where the memory went, per module.

    torch updates its peaks after every op, and there also walks every module seen so far to keep
    per-module peak snapshots (for display_modulewise_snapshots): O(ops x modules), about 85% of a
    gpt2-xl trace (~50k ops x ~580 modules). This keeps the global part with torch's own rule (a new
    peak when the total strictly exceeds it) and, per module, only what memory_by_module.csv needs:
    - `windows`: the highest total while the module's forward / backward ran, updated for the
      modules running now (ModTracker's `parents`, ~5 deep): O(ops x depth);
    - `held`: live bytes by (owner, kind), the owner being the module running when the storage
      appeared (`_owner`). Parameters, and the gradients and optimizer state alive before the
      step: the module holding the parameter (`adopt`). Copied at the step's peak, lazily: only
      when memory is about to fall below a new peak, which in forward (activations pile up) is seldom.
    """

    def __init__(self) -> None:
        super().__init__()
        # Read only by torch's _update_snap, as dict.fromkeys(_ref_class, 0) on every tensor it
        # counts: an enum class is iterated through its metaclass, a tuple of its members at C speed.
        self._ref_class = tuple(self._ref_class)
        self.category_max: dict[torch.device, dict] = {}
        # (device, fqn) -> [fwd, bwd]: the highest total while the module ran, bytes; -1: never ran
        self.windows: dict[tuple[torch.device, str], list[int]] = {}
        self.held: dict[torch.device, dict[tuple[str, _MemRefType], int]] = {}  # live bytes by (owner fqn, kind)
        self.held_at_peak: dict[torch.device, dict[tuple[str, _MemRefType], int]] = {}
        self._at_peak: set[torch.device] = set()  # devices whose `held` is their peak state, not yet copied
        self._clock = 0  # ops dispatched so far
        self._began: dict[str, int] = {}  # fqn -> _clock when its latest forward or backward began
        self._ended: dict[str, int] = {}  # fqn -> _clock when its latest backward ended
        self.layers: set[int] = set()  # ids of the modules whose forward starts a new layer (_pre_fw_hook)

    def _update_peak_stats(self, peak_state) -> None:  # after every op
        self._clock += 1
        bwd = int(peak_state == _ModState.PEAK_BW)
        # the modules running, as _owner counts them (not Global, not an identity module's leftover)
        running = [f for f in self._mod_tracker.parents if f in self._began and self._ended.get(f) != self._began[f]]
        for dev, snap in self._curr_mem_snap.items():  # snap: bytes by _MemRefType, plus "Total"
            total = snap[_TOTAL_KEY]
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self._peak_mem_snap[dev] = dict(snap)  # int values: a shallow copy is a copy
                self._at_peak.add(dev)
            seen = self.category_max.setdefault(dev, {})
            for kind, nbytes in snap.items():
                seen[kind] = max(seen.get(kind, 0), nbytes)
            for fqn in running:
                peaks = self.windows.setdefault((dev, fqn), [-1, -1])
                peaks[bwd] = max(peaks[bwd], total)

    def _enter_window(self, module: torch.nn.Module) -> None:
        """A module starting: its window's peak is at least what is alive now (it may run no op)."""
        fqn, bwd = self._mod_tracker.get_known_fqn(module), int(self._mod_tracker.is_bw)
        self._began[fqn] = self._clock
        for dev, snap in self._curr_mem_snap.items():
            peaks = self.windows.setdefault((dev, fqn), [-1, -1])
            peaks[bwd] = max(peaks[bwd], snap[_TOTAL_KEY])

    def _pre_fw_hook(self, module, inputs) -> None:
        if id(module) in self.layers and not self._mod_tracker.is_bw:  # before ModTracker hooks its inputs
            gc.collect()
            gc.freeze()
        super()._pre_fw_hook(module, inputs)
        self._enter_window(module)

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        super()._post_fw_hook(module, inputs, outputs)
        # In forward, ModTracker hooks each module's inputs with torch's register_multi_grad_hook,
        # whose "all" mode keeps the hooked grad_fn in its own closure: a reference cycle. A graph no
        # backward reaches (DoRA's weight norm, lora_B(lora_A(eye)), detached) then outlives the
        # module that made it until Python's collector runs, which an untraced step never waits
        # for. Collecting as each module returns frees it where refcounting would. Each collection
        # walks only the objects made since the last freeze: the step's first, then each layer's
        # start in forward (`layers`), so a step costs collections in proportion to its layers, not
        # to their square (every earlier layer's hooks and graph are alive until backward). A graph
        # made in one layer and freed in a later one would be missed: layers hand each other hidden
        # states. A recompute in backward makes no such cycle (ModTracker hooks nothing there).
        if not self._mod_tracker.is_bw:
            gc.collect()

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # MemTracker hooks every parameter's gradient, and torch refuses a hook on a parameter that
        # needs none (a frozen router bias: AFMoE, ERNIE 4.5 MoE): the step failed. Such a
        # parameter is given a pair of handles that hook nothing; it never has a gradient to count.
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_bw_hook(self, module, args) -> None:
        super()._pre_bw_hook(module, args)
        if module is not None:
            self._enter_window(module)

    def _post_bw_hook(self, module, args) -> None:
        super()._post_bw_hook(module, args)
        if module is not None:
            self._ended[self._mod_tracker.get_known_fqn(module)] = self._clock

    def _owner(self) -> str:
        """The module a new storage belongs to: of those running (ModTracker's `parents`), the one
        whose forward or backward began last, the deepest of those that began together (in
        forward: the innermost; in backward, where `parents` is not a chain, the one whose
        backward runs now). A module whose backward ended as it began ran no op: an identity
        module (dropout with p=0), whose post-backward hook fired before its pre-backward one,
        so ModTracker never takes it out of `parents`. Global: inside no module."""
        owner, best = _GLOBAL, (-1, -1)
        for fqn in self._mod_tracker.parents:
            began = self._began.get(fqn)
            if began is None or self._ended.get(fqn) == began:
                continue
            if (began, fqn.count(".")) > best:
                owner, best = fqn, (began, fqn.count("."))
        return owner

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        dev = winfo.device
        if dev in self._at_peak and u_type != _UpdateType.ADD:  # about to leave the peak state: keep it
            self.held_at_peak[dev] = dict(self.held.get(dev, {}))
            self._at_peak.discard(dev)
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        held = self.held.setdefault(dev, {})
        if u_type == _UpdateType.ADD:
            winfo.owner = self._owner()
        owner = getattr(winfo, "owner", _GLOBAL)  # a storage first seen empty was never added
        if u_type == _UpdateType.DEL:
            change = -winfo.mem_consumed
        elif u_type == _UpdateType.SIZE:
            change = winfo.mem_consumed - old_mem_consumed
        else:  # ADD, or REF: relabelled (a backward temporary becoming .grad), moved between kinds
            change = winfo.mem_consumed
            if u_type == _UpdateType.REF:
                held[(owner, old_reftype)] -= winfo.mem_consumed
        held[(owner, winfo.reftype)] = held.get((owner, winfo.reftype), 0) + change

    def adopt(self, model: torch.nn.Module, optimizer) -> None:
        """Credit each parameter, and the gradient and optimizer state already alive for it, to the
        module that holds it (they were made before tracking, inside no module). Names follow
        ModTracker's: the root's class name, then named_modules' path. After track_external."""
        root = type(model).__name__
        state = optimizer.state if isinstance(optimizer, torch.optim.Optimizer) else {}
        for name, module in model.named_modules():
            fqn = f"{root}.{name}" if name else root
            for p in module.parameters(recurse=False):
                for t in (p, p.grad, *state.get(p, {}).values()):
                    for st in get_untyped_storages(t) if isinstance(t, torch.Tensor) else ():
                        winfo = self._WINFO.get(st, (None, None))[0]
                        if winfo is None or not winfo.mem_consumed or getattr(winfo, "owner", _GLOBAL) != _GLOBAL:
                            continue  # untracked or empty, or a tied parameter already credited
                        held = self.held.setdefault(winfo.device, {})
                        held[(_GLOBAL, winfo.reftype)] -= winfo.mem_consumed
                        held[(fqn, winfo.reftype)] = held.get((fqn, winfo.reftype), 0) + winfo.mem_consumed
                        winfo.owner = fqn
        self._at_peak = set(self.held)  # the state on entry is torch's first peak

    def finish(self) -> None:
        for dev in self._at_peak:  # the step ended at its peak
            self.held_at_peak[dev] = dict(self.held.get(dev, {}))
        self._at_peak.clear()


def _breakdown(snapshot: dict, device: torch.device) -> dict:
    """A MemTracker per-device snapshot (bytes by _MemRefType) -> breakdown_mib for `device`'s type."""
    per_device = next((v for d, v in snapshot.items() if d.type == device.type), {})
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    for kind, nbytes in per_device.items():
        if kind in _CATEGORY:
            breakdown[_CATEGORY[kind]] += nbytes / MIB
    return breakdown


def traced_step(step, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Trace:
    """Run `step()` once under torch's MemTracker and return what it saw on `device`.

    MemTracker follows every tensor through a dispatch mode, so it works on CPU as on GPU (and on
    fake tensors, for predictions), and labels each byte as parameter, gradient, optimizer state
    or activation. It slows the step down, so the caller runs it outside the timed steps.
    """
    tracker = _CategoryTracker()
    tracker.track_external(model, optimizer)
    tracker.adopt(model, optimizer)
    # A model's repeated layers are the entries of its ModuleLists (decoder layers, MoE experts).
    tracker.layers = {id(m) for seq in model.modules() if isinstance(seq, torch.nn.ModuleList) for m in seq}

    def next_micro_step(module, args) -> None:
        # MemTracker refuses a second forward of the root module (it takes it for a new iteration);
        # under gradient accumulation that is the next micro-batch. Its own per-module stats are
        # not used here, so they are cleared; the global peak and our per-module figures (windows:
        # the max over micro-batches; held) are kept.
        if module is model and module in tracker.memory_tracking:
            tracker.reset_mod_stats()

    # Registered before MemTracker's own global hooks, so it runs first.
    hook = torch.nn.modules.module.register_module_forward_pre_hook(next_micro_step)
    try:
        # Eager: torch.compile refuses to trace under a dispatch mode, and a fullgraph=True function
        # (torchao's optimizer steps) raises instead of falling back; the math is the same.
        with tracker, warnings.catch_warnings(), torch.compiler.set_stance("force_eager"):
            # With optimizer.in_backward the gradient is freed by our hook before MemTracker's own
            # post-accumulate hook looks at it; it warns and carries on, with the breakdown intact.
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            # What is alive now is frozen, so that each collection in the step walks only the step's
            # own objects (see _post_fw_hook). The young generations are collected first, so that
            # the last steps' garbage is not frozen with it; the old one is not: a full collection
            # walks every object of the process, and an old cycle's tensors are none MemTracker counts.
            gc.collect(1)
            gc.freeze()
            step()
            after = tracker.get_tracker_snapshot()
    finally:
        gc.unfreeze()
        hook.remove()
    tracker.finish()
    peak = tracker.get_tracker_snapshot("peak")
    total = next((v.get(_TOTAL_KEY, 0) for d, v in peak.items() if d.type == device.type), 0)
    return Trace(peak_mib=total / MIB, at_peak=_breakdown(peak, device),
                 category_max=_breakdown(tracker.category_max, device), after=_breakdown(after, device),
                 held=next((v for d, v in tracker.held_at_peak.items() if d.type == device.type), {}),
                 windows={fqn: v for (d, fqn), v in tracker.windows.items() if d.type == device.type})
