"""peft group: train small adapters beside frozen base weights (LoRA, DoRA, QLoRA) instead of every
parameter.

A frozen weight has no gradient and no optimizer state, and its linear layer no longer keeps its
input for a weight gradient; each adapted linear gains two trainable matrices A (r, in) and B
(out, r), and keeps what their matmuls need in backward: its input (for A's gradient) and the
(tokens, r) product x·Aᵀ (for B's). The adapters come from Hugging Face's `peft`
(`inject_adapter_in_model`, which wraps the named linear layers in place, so the module tree and
every technique's paths stay as they were); DoRA is its `use_dora`. QLoRA's 4-bit base is
bitsandbytes' `Linear4bit`, the layer peft adapts natively, and it runs on the CPU (the tests) as
on CUDA (the measurements); torchao's NF4 tensor has no peft layer.
"""
from __future__ import annotations

import importlib.util
import logging
import math

import torch
from torch import nn

from ablate.techniques import Invalid, Option, Plan

# bitsandbytes (which peft imports) warns on a CPU without the optional `kernels` package that its
# fast 4-bit CPU kernel is missing; its own CPU path runs instead, and every point printed it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

TARGETS = ("attention", "mlp", "all")  # which linear layers of each decoder layer get adapters
# bitsandbytes' NF4 with double quantisation, as the QLoRA paper: one 8-bit absmax per block of 64
# weights, those absmaxes quantised again in blocks of 256 with an fp32 absmax each, and the
# 256-entry fp32 code of that second quantisation plus its fp32 offset per weight.
NF4_BLOCK, NESTED_BLOCK = 64, 256


class Full(Option):
    """Every parameter trains (the plain run): no adapter, nothing frozen."""

    label = "Full fine-tune"
    freezes_base = False  # base weights, norms, embeddings and head train
    r, dropout, train_embeddings = 0, 0.0, True
    use_dora = False  # a trained magnitude beside each adapter (DoRA)
    base_on_host = False  # the build materialises the model on the host, not the device (QLoRA)

    def trains(self, part: str) -> str:
        """How a decoder layer's linear layers in `part` ("attention", "mlp") train: "full" (their
        weights), "adapter" (frozen, an adapter beside each) or "frozen": the analytic predictor's
        question (ablate/predict/adapters.py Training)."""
        return "full"

    def quant_state_bytes(self, numel: int) -> float:
        """Bytes a quantised base weight of `numel` elements keeps beside its packed storage."""
        return 0.0


class LoRA(Full):
    """LoRA (Hu et al. 2021): each targeted linear layer y = x·Wᵀ gains (alpha / r)·dropout(x)·Aᵀ·Bᵀ,
    B zero at the start, and only A and B train. Saves: the frozen weights' gradients and optimizer
    states (three quarters of AdamW's model state for an 8B model); the input a frozen,
    unadapted linear layer would have kept. Spends: per adapted layer its input kept for A, the
    (tokens, r) product, and with dropout its mask and dropped copy; per token 2·r·(in + out) more
    FLOPs each way. Embeddings and head stay frozen unless `train_embeddings`."""

    freezes_base = True

    def __init__(self, r: int = 8, alpha: float = 16, dropout: float = 0.0, targets: str = "all",
                 train_embeddings: bool = False):
        self.r, self.alpha, self.dropout, self.targets = r, alpha, dropout, targets
        self.train_embeddings = train_embeddings

    @property
    def label(self) -> str:
        name = f"{type(self).__name__} r={self.r}" + (f" alpha={self.alpha:g}" if self.alpha != 2 * self.r else "")
        return name if self.targets == "all" else f"{name} ({self.targets})"

    def check(self, plan: Plan) -> None:
        if importlib.util.find_spec("peft") is None:  # looked up, not imported: the job checks too
            raise Invalid(f"peft={type(self).__name__.lower()} needs Hugging Face peft: pip install -e '.[hf]' "
                          f"in ablate's repository")
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise Invalid(f"peft.r={self.r!r} must be a positive integer (the adapters' rank)")
        if self.targets not in TARGETS:
            raise Invalid(f"peft.targets={self.targets!r} is not one of {', '.join(TARGETS)}")
        if not 0 <= self.dropout < 1:
            raise Invalid(f"peft.dropout={self.dropout!r} must be in [0, 1)")

    def trains(self, part: str) -> str:
        return "adapter" if self.targets in (part, "all") else "frozen"

    def imports(self) -> None:
        import peft  # noqa: F401  (with bitsandbytes and torchao: 3.6 s on 2 cores, after torch)

    def change_params(self, model, adapter):
        from peft import LoraConfig, inject_adapter_in_model

        for p in model.parameters():
            p.requires_grad_(False)
        names = self.linear_names(model, adapter, self.targets)
        self.quantise(model, adapter)
        dtype = model.get_submodule(adapter.embedding).weight.dtype  # the precision option's parameter dtype
        meta = model.get_submodule(adapter.embedding).weight.is_meta  # the predictor's model: shapes only
        config = LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=names,
                            use_dora=self.use_dora, bias="none")
        model = inject_adapter_in_model(config, model, low_cpu_mem_usage=meta)
        for name, p in model.named_parameters():
            if "lora_" in name:  # peft makes them fp32 over a quantised base: the model's dtype, as every other
                p.data = p.data.to(dtype)
                p.requires_grad_(True)
        if self.train_embeddings:
            for path in (adapter.embedding, adapter.lm_head):
                model.get_submodule(path).weight.requires_grad_(True)
        return model

    @staticmethod
    def linear_names(model: nn.Module, adapter, targets: str) -> list[str]:
        """The full names of the linear layers inside each decoder layer's attention and/or MLP."""
        parts = {"attention": (adapter.attention,), "mlp": (adapter.mlp,), "all": (adapter.attention, adapter.mlp)}
        names = []
        for i, layer in enumerate(adapter.layer_list(model)):
            for part in parts[targets]:
                root = f"{adapter.layers}.{i}.{part}"
                names += [f"{root}.{n}" for n, m in layer.get_submodule(part).named_modules()
                          if isinstance(m, adapter.linears)]
        return names

    def quantise(self, model: nn.Module, adapter) -> None:
        """Nothing: LoRA's base keeps the precision option's dtype."""


class DoRA(LoRA):
    """DoRA (Liu et al. 2024): LoRA with the adapted weight split into a direction and a trained
    magnitude per output (peft's use_dora). Spends beyond LoRA: the magnitude vector (trainable),
    per layer the dense (out, in) weight W + B·A built in forward to take its column norms (held
    detached, as the paper's section 4.3 does, so it is not kept for backward), and the base and
    adapter outputs the magnitude's gradient needs."""

    use_dora = True


class QLoRA(LoRA):
    """QLoRA (Dettmers et al. 2023): LoRA over a base whose decoder linear layers are stored in
    4-bit NormalFloat with double quantisation (bitsandbytes' Linear4bit), dequantised to the
    compute dtype one layer at a time in forward and again in backward. Saves: three quarters of a
    16-bit base's bytes (0.5 B per weight plus about 0.13 bit of scales). Spends: the dequantised
    weight alive during each matmul, and the dequantisation's time. The embeddings and head stay
    in the precision option's dtype."""

    def check(self, plan: Plan) -> None:
        super().check(plan)
        if plan.autocast:  # bitsandbytes' 4-bit matmul is no autocast op: it computes in its own dtype
            raise Invalid("peft=qlora computes its 4-bit layers in the parameters' dtype, which autocast does not "
                          "reach: use precision=bf16_pure (bf16 compute and adapters, as QLoRA does) or fp32")
        if plan.sharded:
            raise Invalid("peft=qlora with FSDP (parallel=fsdp, fsdp1, fsdp_grad_op or offload=params): a shard of a "
                          "4-bit weight loses its quantisation state; use parallel=ddp or single")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise Invalid(f"peft=qlora needs bitsandbytes ({e}): pip install 'bitsandbytes>=0.45,<0.51'") from None

    # The 16-bit base is built on the host and each weight quantised as the build moves it to the
    # device (ablate/build.py): built on the device, an 8B base would take 15 GiB there before it
    # took 5, and no 8 GiB card could start the run it fits once quantised.
    base_on_host = True

    def quantise(self, model: nn.Module, adapter) -> None:
        """Every linear layer of the decoder layers (attention and MLP, whatever the targets, as the
        QLoRA paper quantises all of them) replaced by a 4-bit one holding the same weight."""
        for name in self.linear_names(model, adapter, "all"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _linear_4bit(model.get_submodule(name)))

    def quant_state_bytes(self, numel: int) -> float:
        blocks = math.ceil(numel / NF4_BLOCK)
        return blocks + math.ceil(blocks / NESTED_BLOCK) * 4 + NESTED_BLOCK * 4 + 4


def _linear_4bit(linear: nn.Linear) -> nn.Module:
    """`linear` as bitsandbytes' NF4 Linear4bit with double quantisation, computing in its own
    dtype; on the meta device (the predictor's model) its packed storage's shape, not quantised."""
    import bitsandbytes as bnb

    weight = linear.weight
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=weight.dtype, compress_statistics=True, quant_type="nf4", device="meta")
    if weight.is_meta:  # two 4-bit values per byte, as Params4bit packs them, and the shape they stand for
        data = torch.empty(((weight.numel() + 1) // 2, 1), dtype=torch.uint8, device="meta")
        q.weight = bnb.nn.Params4bit(data, requires_grad=False, compress_statistics=True, quant_type="nf4")
        q.weight.quant_state = bnb.functional.QuantState(absmax=None, shape=weight.shape, dtype=weight.dtype,
                                                         blocksize=NF4_BLOCK, quant_type="nf4")
    else:  # quantised by the build's move to the device (Params4bit.to), one weight at a time
        q.weight = bnb.nn.Params4bit(weight.data, requires_grad=False, compress_statistics=True,
                                     quant_type="nf4", module=q)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    # On a CPU, bitsandbytes repacks the weight in place for its AVX-512 kernel the first time the
    # layer runs in eval mode without gradients (ablate's eval phase): a layout training then
    # continues on, and one that needs out_features divisible by 32. Training's path is kept.
    q.support_avx512bf16_for_cpu = False
    return q
