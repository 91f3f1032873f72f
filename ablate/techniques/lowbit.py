"""optimizer group, continued: AdamW with low-bit states, bitsandbytes' (adamw8bit) and torchao's
(adamw4bit, adamw8bit_ao, adamw_fp8), beside torch's optimizers in ablate/techniques/optimizer.py.
Each option's states in bytes are the analytic predictor's (ablate/predict/analytic.py)."""
from __future__ import annotations

import functools
import math

import torch

from ablate.techniques import Invalid, Plan, require_fp8_gpu
from ablate.techniques.optimizer import TorchOptimizer, _installed


class LowBitAdamW(TorchOptimizer):
    """torchao's AdamW with both states quantised blockwise (torchao/optim/adam.py, subclass_*.py).

    A parameter tensor of >= 4096 elements whose element count divides by `block_size` gets two
    quantised states, each its codes plus one fp32 scale per `block_size` values (plus, for the
    integer formats, its own fp32 lookup table); any other tensor keeps two plain states in the
    parameter's dtype, as AdamW does. The step count is a 0-d fp32 tensor on the host. Each tensor
    is stepped by a torch.compile'd function (fullgraph) that dequantises, updates and requantises
    it; on a CPU, and under MemTracker's traced step (ablate.measure.traced_step), it runs eagerly.
    Under precision.stochastic_rounding, bf16 parameters are updated with stochastic rounding.
    """

    supports_stochastic_rounding = True
    reads_values = True
    torchao_class = ""  # the class in torchao.optim
    # Bytes per element of a quantised state's codes; elements of each state's own fp32 lookup table;
    # bytes per element of the compiled step's temporaries, per quantised tensor (inductor's buffers in
    # its generated code on a CPU: 4-bit two unpacked uint8 codes, two fp32 updates and two int64 code
    # searches; 8-bit two fp32 updates; fp8 two fp8 codes). Not yet checked on a GPU.
    code_bytes, qmap, compiled_temp = 1.0, 0, 0

    def __init__(self, lr: float, betas: tuple[float, float], weight_decay: float, block_size: int,
                 in_backward: bool):
        super().__init__(lr, weight_decay, in_backward)
        self.betas, self.block_size = tuple(betas), block_size
        self._round_stochastically = False  # set by check(plan), which always runs before build

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if not _installed("torchao"):
            raise Invalid(f"optimizer={self.name} needs torchao: pip install torchao")
        if self.block_size < 1:
            raise Invalid(f"optimizer.block_size={self.block_size} must be >= 1 (values per fp32 scale)")
        self._round_stochastically = plan.stochastic_rounding

    def check_values(self) -> None:
        """Left to torchao in the worker: importing it would cost the job process seconds."""

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        import torchao.optim  # optional dependency, imported only when used

        return getattr(torchao.optim, self.torchao_class)

    def make(self, groups: list[dict]) -> torch.optim.Optimizer:
        # On a CPU torch.compile is inductor's C++ build of each parameter shape's step: 52 s of a
        # 36-layer scale=cpu run's 98 s, for a step that runs eagerly in milliseconds with the same
        # values. A CPU row's memory is its traced step's, which runs eagerly whatever the run does.
        on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
        return (_eager(self.optimizer_class()) if on_cpu else self.optimizer_class())(groups, **self.optimizer_kwargs())

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay,
                "block_size": self.block_size, "bf16_stochastic_round": self._round_stochastically}

    def quantised(self, numel: int) -> bool:
        """torchao's _new_buffer quantises a tensor of >= 4096 elements that divides into blocks; any
        other keeps zeros_like(param) states."""
        return numel >= 4096 and numel % self.block_size == 0

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        """torchao/optim/adam.py: `step` is a host fp32 tensor even on CUDA; a quantised state is its
        codes, fp32 scales of numel // block_size, and for the integer formats its own fp32 qmap."""
        numel, step = math.prod(shape), 4 if device == "cpu" else 0
        if not self.quantised(numel):
            return 2 * numel * d + step
        return 2 * (numel * self.code_bytes + numel // self.block_size * 4 + self.qmap * 4) + step

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        if device == "cpu":
            # What the traced step runs (and, on a CPU, all that is measured): torchao's step eagerly
            # (MemTracker is a dispatch mode, which torch.compile refuses), 24 bytes/elem of fp32
            # copies of the tensor being stepped, 28 with 16-bit parameters (their fp32 upcast), for
            # every tensor, quantised or not; MemTracker saw exactly that (torch 2.13, torchao 0.18).
            return max(n for g in groups for n in g) * (24 if d == 4 else 28)
        return max([n for g in groups for n in g if self.quantised(n)] or [0]) * self.compiled_temp  # plain ones in place

    def before_trace(self) -> None:
        self.make_tables()  # cached for the process: made of real values, not of the trace's fake 1.0s

    def make_tables(self) -> None:
        """torchao's quantisation lookup tables, which it computes once per process and caches."""
        from torchao.optim import subclass_4bit, subclass_8bit

        for module in (subclass_4bit, subclass_8bit):
            module.get_qmap_signed(), module.get_qmap_unsigned()


class AdamW4bit(LowBitAdamW):
    """torchao.optim.AdamW4bit: 4-bit codes, two per byte, so 0.5 bytes/param per state, plus 4 bytes
    per `block_size` (128: 0.03 bytes/param) of scale: about 1.06 bytes/param instead of AdamW's 8."""

    label = "4-bit AdamW"

    name, torchao_class = "adamw4bit", "AdamW4bit"
    code_bytes, qmap, compiled_temp = 0.5, 16, 26

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 block_size: int = 128, in_backward: bool = False):
        super().__init__(lr, betas, weight_decay, block_size, in_backward)

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if self.block_size % 2:  # two codes share a byte: an odd-sized tensor would lose its last one
            raise Invalid(f"optimizer.block_size={self.block_size} must be even: two 4-bit codes pack into a byte")


class AdamW8bitAO(LowBitAdamW):
    """torchao.optim.AdamW8bit: 1 byte/param per state plus 4 bytes per `block_size` (256: 0.016
    bytes/param) of scale: about 2.03 bytes/param instead of 8. Pure PyTorch, unlike bitsandbytes'."""

    label = "8-bit AdamW (torchao)"

    name, torchao_class = "adamw8bit_ao", "AdamW8bit"
    code_bytes, qmap, compiled_temp = 1.0, 256, 8

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 block_size: int = 256, in_backward: bool = False):
        super().__init__(lr, betas, weight_decay, block_size, in_backward)


class AdamWFp8(LowBitAdamW):
    """torchao.optim.AdamWFp8: float8_e4m3fn states, 1 byte/param each, plus 4 bytes per `block_size`
    (256) of scale: about 2.03 bytes/param instead of 8. Needs fp8 conversions in hardware."""

    label = "fp8-state AdamW"

    name, torchao_class = "adamw_fp8", "AdamWFp8"  # Triton's fp8e4m3 conversions need sm89
    code_bytes, qmap, compiled_temp = 1.0, 0, 2

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 block_size: int = 256, in_backward: bool = False):
        super().__init__(lr, betas, weight_decay, block_size, in_backward)

    def check(self, plan: Plan) -> None:
        super().check(plan)
        # On a CPU it does step (torch emulates fp8 casts in software), but fp8 states are a GPU
        # technique: a CPU row would time an emulation no one trains with.
        require_fp8_gpu(plan, "optimizer=adamw_fp8")


class AdamWBf16(LowBitAdamW):
    """AdamW whose two moments are stored in bf16 (torchtitan's bf16 optimizer states), whatever the
    parameters' dtype: 4 bytes/param instead of 8 beside fp32 parameters (fp32 training, autocast);
    beside bf16 parameters the same bytes as AdamW, with the update computed in fp32.

    torchao's AdamW step (upcast, update in fp32, round the states back) over plain bf16 states:
    torchao quantises only its own formats, so the states are made here by overriding its buffer
    factory, a private method (torchao has no public bf16-state option)."""

    label = "bf16-state AdamW"

    name, torchao_class = "adamw_bf16", "_AdamW"
    code_bytes = 2.0

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 in_backward: bool = False):
        super().__init__(lr, betas, weight_decay, 1, in_backward)

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return _bf16_state_adamw()

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay,
                "bf16_stochastic_round": self._round_stochastically}

    def quantised(self, numel: int) -> bool:
        return True  # every tensor's states are bf16

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        return 2 * math.prod(shape) * 2 + (4 if device == "cpu" else 0)  # `step`: a host fp32 tensor

    def before_trace(self) -> None:
        """No lookup tables: bf16 is no quantised format."""


@functools.cache
def _eager(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`cls` whose step runs torchao's compiled per-tensor functions eagerly."""
    class Eager(cls):
        def step(self, closure=None):
            # torch wraps a class's step in its hook runner (marking it `hooked`) when the class's first
            # instance is built: this class's step runs the hooks, so the base's runs unwrapped
            base = cls.step
            base = base.__wrapped__ if getattr(base, "hooked", False) else base
            with torch.compiler.set_stance("force_eager"):
                return base(self, closure)

    Eager.__name__ = Eager.__qualname__ = f"{cls.__name__}Eager"
    return Eager


@functools.cache
def _bf16_state_adamw() -> type[torch.optim.Optimizer]:
    from torchao.optim import _AdamW  # optional dependency, imported only when used

    class AdamWBf16States(_AdamW):
        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16)

    return AdamWBf16States


class AdamW8bit(TorchOptimizer):
    """bitsandbytes' AdamW with both states quantised blockwise to 8 bits: 2 bytes/param (plus one
    fp32 absmax per 256 values) instead of 8. Tensors under `min_8bit_size` elements keep fp32 states."""

    label = "8-bit AdamW"

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 min_8bit_size: int = 4096, in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)
        self.betas, self.min_8bit_size = tuple(betas), min_8bit_size

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if not _installed("bitsandbytes"):
            raise Invalid("optimizer=adamw8bit needs bitsandbytes: pip install bitsandbytes")

    def check_values(self) -> None:
        """Left to bitsandbytes in the worker: importing it would cost the job process seconds."""

    reads_values = True

    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        numel = math.prod(shape)
        if numel < self.min_8bit_size:
            return 2 * numel * 4  # small tensors keep fp32 states
        return 2 * numel + 2 * math.ceil(numel / 256) * 4  # uint8 states + one fp32 absmax per 256 values

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        return 0.0  # one fused kernel per tensor

    def shared_state_bytes(self, largest: int) -> float:
        return 2 * 256 * 4 if largest >= self.min_8bit_size else 0.0  # the two fp32 quantisation maps

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        from bitsandbytes.optim import AdamW8bit  # optional dependency, imported only when used

        return AdamW8bit

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay,
                "min_8bit_size": self.min_8bit_size}
