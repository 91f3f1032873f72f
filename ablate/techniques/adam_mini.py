"""optimizer=adam_mini: the adam-mini package's Adam_mini, one second moment per block of parameters.

The package partitions the parameters by name (adam_mini/adam_mini.py, `Adam_mini.__init__` and
`step`): a name containing "bias" keeps Adam's per-element second moment; a query or key
projection one per attention head; an embedding, output head, value or attention-output projection
or MLP one per row (output neuron, token); anything else (norms) one for the whole tensor. The
predictor mirrors that partition here (`block`), and tests/test_adam_mini.py holds the mirror to a
built optimizer's states, byte for byte.
"""
from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from ablate.models.layout import bare_name
from ablate.techniques import Invalid, Plan, Unmodelled
from ablate.techniques.optimizer import TorchOptimizer, _installed

PACKAGE = "adam-mini==1.1.1"  # the release pyproject pins and this glue was read against

# The package's name sets (Adam_mini.__init__), each matched as a substring of a lower-cased name.
FULL = {"bias"}  # adam_block_names: Adam's per-element v
PER_HEAD = {"k_proj", "q_proj", "wq", "wk", "query", "key"}  # wqk_names
PER_ROW = {"embed", "embd", "wte",  # embd_names
           "lm_head", "output", "final_layer",  # output_names
           "v_proj", "wv", "value",  # wv_names
           "o_proj", "wo", "attn.proj",  # attn_proj_names
           "feed_forward", "linear", "mlp"}  # mlp_names

# ablate's GPT-2 names two matrices the package does not recognise and warns about ("No Query or Key
# found", "No attn_proj found"), asking for their names to be added to its sets. attn.c_attn is
# q, k and v fused, an nn.Linear weight (3·hidden, hidden): as a query/key block it views as
# 3·heads blocks of head_dim rows, one v each for every head of q, k and v (v's heads coarser than
# the per-neuron blocks of a separate value projection; the package notes one v for all of v also
# works). attn.c_proj is the attention's output projection: one v per row.
GPT2_NAMES = {"wqk_names": {"attn.c_attn"}, "attn_proj_names": {"attn.c_proj"}}


def device_bytes(nbytes: int, device: str) -> int:
    """What a tensor of `nbytes` takes: the CUDA caching allocator rounds every block up to 512
    bytes (so does MemTracker on CUDA); a CPU tensor takes its bytes."""
    return -(-nbytes // 512) * 512 if device == "cuda" else nbytes


def import_package(option: str, module: str, package: str):
    """The package's module, imported in the worker; a failed import (not installed, or built for
    another torch) is the point's invalid row, naming the release the option was written for."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 -- any failure to import is the same refusal
        raise Invalid(f"optimizer={option} needs {package} (importing {module} failed: "
                      f"{type(exc).__name__}: {exc}): pip install {package}") from None


class AdamMini(TorchOptimizer):
    """Adam-mini (Zhang et al. 2024, "Adam-mini: Use Fewer Learning Rates To Gain More"): Adam's
    first moment per element, its second moment per block (a head of a query or key projection, a
    row of an embedding, value, output or MLP matrix, a whole norm), biases full Adam.

    Saves: nearly all of Adam's second moment, 4 of AdamW's 8 bytes/param in fp32 (the blocks'
    means: one value per head or row). Spends: the states take the parameters' dtype (2+2 bytes
    /param under precision=bf16_pure, a 16-bit first moment), a mean over each block per step, and
    temporaries of two tensors the size of the largest parameter (the update and its negative).

    Needs the model's attention sizes (the family's hidden size, heads and key/value heads);
    ablate's GPT-2 names its fused qkv and output projections to the package (GPT2_NAMES).
    Whole parameters only: parallel=single or ddp (every rank then holds the same gradient, and
    nothing needs reducing); the model's own, not peft's adapters.
    """

    label = "Adam-mini"
    name = "adam_mini"
    reads_values = True  # a norm's block size is read back with .item() when its state is made

    def __init__(self, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, in_backward: bool = False):
        super().__init__(lr, weight_decay, in_backward)
        self.betas, self.eps = tuple(betas), eps

    def check(self, plan: Plan) -> None:
        if not _installed("adam_mini"):
            raise Invalid(f"optimizer=adam_mini needs {PACKAGE}: pip install {PACKAGE}")
        super().check(plan)  # its values, stochastic rounding, and in_backward's own rules
        if plan.sharded:
            raise Invalid("optimizer=adam_mini needs whole parameters: parallel=fsdp, fsdp_grad_op, fsdp1 and "
                          "offload=params hand it shards, and its sharded path reduces each block's second "
                          "moment over torch.cuda.device_count() GPUs (not the process group, and never on a "
                          "CPU); use parallel=ddp or single")
        if plan.frozen_base:
            raise Invalid("optimizer=adam_mini with peft=lora, dora or qlora: the package partitions by name, and "
                          "an adapter's matrices take their projection's (q_proj.lora_A) but not its shape, which "
                          "its per-head view cannot split; use optimizer=adamw")
        if plan.states_on_host:
            raise Invalid("optimizer=adam_mini with offload=optimizer: torchao's CPUOffloadOptimizer passes "
                          "parameter groups, and Adam-mini partitions by parameter name; use offload=none")
        self.sizes()

    def check_values(self) -> None:
        """The package's own checks (Adam_mini.__init__), made here without importing it: the job
        process checks too."""
        if not self.lr >= 0:
            raise Invalid(f"optimizer.lr={self.lr} must be >= 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise Invalid(f"optimizer.betas={list(self.betas)} must each be in [0, 1)")
        if not self.weight_decay >= 0:
            raise Invalid(f"optimizer.weight_decay={self.weight_decay} must be >= 0")
        if not self.eps > 0:  # h = sqrt(v) + eps divides the update: a zero block would divide by 0
            raise Invalid(f"optimizer.eps={self.eps} must be > 0")

    def sizes(self) -> tuple[int, int, int, int, str]:
        """(hidden, heads, key/value heads, head_dim, layout kind) of the model family, from the
        analytic predictor's Arch, or a transformers config's own keys where it has none."""
        from ablate.predict.arch import arch_of  # the predictor imports this module's package

        if self.family is None:
            raise RuntimeError("optimizer=adam_mini needs the model family (set by ablate.build.Techniques)")
        try:
            a = arch_of(self.family)
            return a.hidden, a.heads, a.kv_heads, a.head_dim, a.kind
        except Unmodelled:
            hf = getattr(self.family, "hf_config", None)
            heads, hidden = getattr(hf, "num_attention_heads", None), getattr(hf, "hidden_size", None)
            if not heads or not hidden:
                raise Invalid(f"optimizer=adam_mini needs the model's hidden size and attention heads, which "
                              f"model={self.family.name} does not give") from None
            kv = getattr(hf, "num_key_value_heads", None) or heads
            return hidden, heads, kv, getattr(hf, "head_dim", None) or hidden // heads, hf.model_type

    def head_numel(self) -> int:
        """Elements of one query/key head: its head_dim rows of the hidden size. The package takes
        hidden²/heads, the same unless heads × head_dim ≠ hidden (Qwen3), so it is set to this."""
        hidden, _, _, head_dim, _ = self.sizes()
        return head_dim * hidden

    def names(self) -> dict[str, set[str]]:
        """Names added to the package's sets for this family (GPT2_NAMES for ablate's GPT-2)."""
        return GPT2_NAMES if self.sizes()[4] == "gpt2" else {}

    def block(self, name: str) -> str:
        """Which of the package's partitions a parameter falls in, by its name, in the order its
        step tests them: full (per element), head, row, or one (the whole tensor)."""
        name, extra = name.lower(), self.names()
        if any(k in name for k in FULL):
            return "full"
        if any(k in name for k in PER_HEAD | extra.get("wqk_names", set())):
            return "head"
        if any(k in name for k in PER_ROW | extra.get("attn_proj_names", set())):
            return "row"
        return "one"

    def param_groups(self, model: nn.Module) -> list[dict]:
        """One group: every trainable parameter in the model's order, with its bare name (the
        package partitions by name, and decays all but norms and biases itself)."""
        named = [(bare_name(n, model), p) for n, p in model.named_parameters() if p.requires_grad]
        return [{"params": [p for _, p in named], "names": {id(p): n for n, p in named}}]

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return import_package(self.name, "adam_mini", PACKAGE).Adam_mini

    def optimizer_kwargs(self) -> dict:
        hidden, heads, kv, _, _ = self.sizes()
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                "dim": hidden, "n_heads": heads, "n_kv_heads": kv, "verbose": False}

    def make(self, groups: list[dict]) -> torch.optim.Optimizer:
        named = [(g["names"][id(p)], p) for g in groups for p in g["params"]]
        opt = self.optimizer_class()(named, **self.optimizer_kwargs())
        opt.head_numel = self.head_numel()
        # Its world size is torch.cuda.device_count(), which asks for collectives over however many
        # GPUs the host shows; with whole parameters (sharding is refused) every rank's gradient is
        # already the whole, averaged one, and there is nothing to reduce.
        opt.world_size = 1
        for attr, names in self.names().items():
            getattr(opt, attr).update(names)
        return opt

    # The analytic predictor's questions (TorchOptimizer).
    def state_bytes(self, shape: tuple, d: int, device: str, name: str = "") -> float:
        """m is zeros_like(param) (the parameters' dtype); v per block, in that dtype too: per element
        ("full"), per head (n / head_numel values), per row (shape[0]), or one 0-d value. The step
        count is a Python int."""
        if not name:
            raise Unmodelled("optimizer=adam_mini partitions by parameter name, and none was given")
        n = math.prod(shape)
        v = {"full": n, "head": n // self.head_numel(), "row": shape[0], "one": 1}[self.block(name)]
        return device_bytes(n * d, device) + device_bytes(v * d, device)

    def step_temp_bytes(self, groups: list[list[int]], d: int, device: str) -> float:
        """A for-loop over the tensors: each makes its update (m / sqrt(v)) and the update's
        negative, two tensors of its size, while the previous tensor's update is freed as the name
        is rebound; at most twice the largest tensor (the blocks' means beside them are a row or a
        head per block)."""
        return 2 * max((n for g in groups for n in g), default=0) * d
