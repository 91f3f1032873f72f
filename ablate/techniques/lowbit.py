"""optimizer group, continued: torchao's AdamW with low-bit states (adamw4bit, adamw8bit_ao,
adamw_fp8), beside torch's optimizers and bitsandbytes' 8-bit AdamW in ablate/techniques/optimizer.py.
Each option's states in bytes are the analytic predictor's (ablate/predict/analytic.py)."""
from __future__ import annotations

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
    it; under MemTracker's traced step it runs eagerly (ablate.measure.traced_step).
    Under precision.stochastic_rounding, bf16 parameters are updated with stochastic rounding.
    """

    supports_stochastic_rounding = True
    torchao_class = ""  # the class in torchao.optim

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

    def optimizer_kwargs(self) -> dict:
        return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay,
                "block_size": self.block_size, "bf16_stochastic_round": self._round_stochastically}

    def make_tables(self) -> None:
        """torchao's quantisation lookup tables, which it computes once per process and caches."""
        from torchao.optim import subclass_4bit, subclass_8bit

        for module in (subclass_4bit, subclass_8bit):
            module.get_qmap_signed(), module.get_qmap_unsigned()


class AdamW4bit(LowBitAdamW):
    """torchao.optim.AdamW4bit: 4-bit codes, two per byte, so 0.5 bytes/param per state, plus 4 bytes
    per `block_size` (128: 0.03 bytes/param) of scale: about 1.06 bytes/param instead of AdamW's 8."""

    name, torchao_class = "adamw4bit", "AdamW4bit"

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

    name, torchao_class = "adamw8bit_ao", "AdamW8bit"

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 block_size: int = 256, in_backward: bool = False):
        super().__init__(lr, betas, weight_decay, block_size, in_backward)


class AdamWFp8(LowBitAdamW):
    """torchao.optim.AdamWFp8: float8_e4m3fn states, 1 byte/param each, plus 4 bytes per `block_size`
    (256) of scale: about 2.03 bytes/param instead of 8. Needs fp8 conversions in hardware."""

    name, torchao_class = "adamw_fp8", "AdamWFp8"  # Triton's fp8e4m3 conversions need sm89

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                 block_size: int = 256, in_backward: bool = False):
        super().__init__(lr, betas, weight_decay, block_size, in_backward)

    def check(self, plan: Plan) -> None:
        super().check(plan)
        # On a CPU it does step (torch emulates fp8 casts in software), but fp8 states are a GPU
        # technique: a CPU row would time an emulation no one trains with.
        require_fp8_gpu(plan, "optimizer=adamw_fp8")
