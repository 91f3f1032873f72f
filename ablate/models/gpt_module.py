"""A plain GPT-2 (after nanoGPT's model.py). It knows nothing about memory techniques: they wrap it.

Names follow GPT-2 (`transformer.wte`, `transformer.h[i].attn.c_attn`, ...) so Hugging Face
checkpoints map onto it one to one (see ablate/models/gpt.py); techniques find its blocks through
that family's adapter.
"""
from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    block_size: int = 1024  # longest sequence the position embedding covers
    dropout: float = 0.0
    bias: bool = True
    # The embedding's and the head's rows rounded up to a multiple of this (1: none), so that the
    # head's matmuls and each logits row are aligned (50,257 is odd; 64 gives llm.c's 50,304). The
    # padded rows are zero and never a token: logits and the loss still cover vocab_size exactly.
    pad_vocab_to: int = 1
    attention: str = "sdpa"  # sdpa | eager: nanoGPT's plain-ops path, which keeps the (T, T) probabilities

    @property
    def padded_vocab(self) -> int:
        """Rows of the token embedding and the LM head: vocab_size rounded up to pad_vocab_to."""
        return -(-self.vocab_size // self.pad_vocab_to) * self.pad_vocab_to


# (n_layer, n_head, n_embd): minGPT's small models and GPT-2's four sizes.
SIZES = {
    "gpt-nano": (3, 3, 48),
    "gpt-micro": (4, 4, 128),
    "gpt-mini": (6, 6, 192),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.eager = cfg.attention == "eager"
        if self.eager:  # not a buffer: no state_dict key, and meta builds need no values for it
            self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.eager:
            y = self.attn_dropout(_causal_softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(k.size(-1))))) @ v
        else:  # SDPA picks flash / memory-efficient kernels on GPU: no (T, T) attention matrix is stored.
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax of (B, heads, T, T) scores over the keys at or before each query."""
    T = scores.size(-1)
    future = torch.ones(T, T, dtype=torch.bool, device=scores.device).triu_(1)
    return F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def normal_draws(draws: list[tuple[torch.Tensor, float]]) -> None:
    """Fill each (tensor, std) with N(0, std), each from a generator of its own seeded from the
    default generator (so `torch.manual_seed` decides them): the values depend on the seed and each
    draw's place in the list, not on the order the draws run in, so on a CPU they run on torch's
    threads at once (one normal_ runs on one core, ~11 ns per value). Under a dispatch mode (fake
    tensors for a prediction) they are drawn plainly: the mode follows this thread only. Meta
    tensors get nothing."""
    if any(w.is_meta for w, _ in draws):  # on_meta(): shapes only, no values to draw
        return
    if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
        for w, std in draws:
            nn.init.normal_(w, 0.0, std)
        return
    base = int(torch.randint(0, 2**62, (), device="cpu"))  # one value of the default generator per model

    def draw(i: int) -> None:
        w, std = draws[i]
        with torch.no_grad():  # parameters (and views of them) filled in place; grad mode is per thread
            w.normal_(0.0, std, generator=torch.Generator(device=w.device).manual_seed(base + i))

    largest_first = sorted(range(len(draws)), key=lambda i: -draws[i][0].numel())  # evens the threads' loads
    if draws and draws[0][0].device.type == "cpu" and torch.get_num_threads() > 1:
        with ThreadPoolExecutor(torch.get_num_threads()) as pool:
            list(pool.map(draw, largest_first))
    else:
        for i in largest_first:
            draw(i)


_PLAIN = (torch.Tensor, nn.Parameter)  # tensors whose storage is their own


class DeferredNormals(TorchFunctionMode):
    """Within it, torch.nn.init.normal_(w, 0, std) calls (as transformers' `_init_weights` makes
    them, one after another in module order: Llama 3.2 1B's 1.2 G values took 12.4 s that way) are
    collected and drawn together by `normal_draws`, on torch's threads. A later call that
    touches a pending tensor's storage (a padding row zeroed after its embedding's draw, a copy)
    first has the pending draws made, so every value ends as if each call ran where it was made;
    the rest are made on leaving. The values are normal_draws': decided by the seed and the calls'
    order, not by the threads."""

    def __init__(self):
        super().__init__()
        self.pending: list[tuple[torch.Tensor, float]] = []  # (tensor, std), in the calls' order

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.draw()
        return out

    def draw(self) -> None:
        draws, self.pending = self.pending, []
        normal_draws(draws)

    def touches_pending(self, tensors) -> bool:
        """Whether any of `tensors` may share memory with a pending draw (a tensor subclass or a
        sparse one, whose storage is not its own, is taken to)."""
        storages = {w.untyped_storage().data_ptr() for w, _ in self.pending}
        return any(isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or t.layout != torch.strided
                                                     or t.untyped_storage().data_ptr() in storages) for t in tensors)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.init.normal_:
            w, mean, std, generator = _normal_args(*args, **kwargs)
            if mean == 0 and generator is None and type(w) in _PLAIN and w.layout == torch.strided and not w.is_meta:
                # A tied head drawn after its embedding: the later draw overwrites the whole tensor,
                # so the earlier is dropped (two draws into one buffer at once would race).
                self.pending = [(p, s) for p, s in self.pending if not _same_view(p, w)]
                if self.touches_pending([w]):
                    self.draw()  # a part of a pending tensor: that one first
                self.pending.append((w, std))
                return w
        if self.pending and getattr(func, "__name__", "") != "__get__":  # a property reads no values
            if self.touches_pending(torch.utils._pytree.tree_leaves((args, kwargs))):
                self.draw()
        return func(*args, **kwargs)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


def _normal_args(tensor, mean=0.0, std=1.0, generator=None):
    return tensor, mean, std, generator


class GPTModule(nn.Module):
    """GPT-2 as an nn.Module: what the GPT2 family (ablate/models/gpt.py, the `_target_` of
    conf/model/gpt2*.yaml) builds, as HFModule is what the HFCausalLM family builds."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        # loss_fn(hidden (B, T, C), lm_head, targets (B, T)) -> mean loss, when set: the head and the
        # loss computed together (a chunked loss never makes the whole logits). None: below.
        self.loss_fn = None
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        """The output projection is the token embedding, as in GPT-2 (one tensor, counted once)."""
        self.lm_head.weight = self.transformer.wte.weight

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 * n_layer)), biases 0,
        LayerNorms 1.

        Separate from __init__ so a model built on the meta device can be initialised after
        `to_empty(device=...)`, directly on the target device. Each weight is drawn once, by
        `normal_draws` (on a CPU in parallel: drawn one after another, gpt2-xl's 1.56 G values took
        12-16 s of each point's start, benchmarks/results/NVIDIA-H200/README.md).
        """
        tokens = self.transformer.wte.weight
        draws = []
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight is not tokens:  # the head: tied
                residual = name.endswith("c_proj")
                draws.append((module.weight, 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02))
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # the token rows only (pad_vocab_to): the same values as the unpadded model's
        draws.insert(0, (tokens[:self.config.vocab_size], 0.02))
        normal_draws(draws)
        nn.init.zeros_(tokens[self.config.vocab_size:])  # padding: no token's row

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (the tied lm_head is wte). non_embedding drops wpe (PaLM FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab) and the mean loss or None;
        with a loss_fn and targets, no logits (None)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        vocab = self.config.vocab_size
        if targets is not None and self.loss_fn is not None:
            return None, self.loss_fn(x, self.lm_head, targets, vocab=vocab)
        logits = self.lm_head(x)  # (B, T, padded_vocab)
        if logits.size(-1) != vocab:  # (B, T, vocab): a view, its rows still padded_vocab apart in memory
            logits = logits[..., :vocab]
        if targets is None:
            return logits, None
        # The loss is taken in fp32 whatever the compute dtype: (B*T, vocab) logits upcast.
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


class _SkipInit(TorchFunctionMode):
    """Returns torch.nn.init's initialisers' tensor untouched (normal_, uniform_, kaiming_uniform_,
    ...: each dispatches through torch function modes with its tensor as the first argument)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Modules built here have shapes and dtypes but no storage, and no values: their
    initialisers are skipped. Running them would give nothing (meta tensors hold no values), and
    on meta they go through torch._refs, whose first call imports torch._dynamo: 1.1 s of every
    `python -m ablate` start on a CPU, spent on a random init of nothing."""
    with torch.device("meta"), _SkipInit():
        yield
