"""A plain GPT-2 (after nanoGPT's model.py). It knows nothing about memory techniques: they wrap it.

Names follow GPT-2 (`transformer.wte`, `transformer.h[i].attn.c_attn`, ...) so Hugging Face
checkpoints map onto it one to one (see ablate/models/gpt.py); techniques find its blocks through
that family's adapter.
"""
from __future__ import annotations

import contextlib
import math
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # SDPA picks flash / memory-efficient kernels on GPU: no (T, T) attention matrix is stored.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


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


class GPT(nn.Module):
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
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).

        Separate from __init__ so a model built on the meta device can be initialised after
        `to_empty(device=...)`, directly on the target device.
        """
        tokens = self.transformer.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                # the token rows only (pad_vocab_to): the same random draws as the unpadded model's
                w = module.weight[:self.config.vocab_size] if module.weight is tokens else module.weight
                nn.init.normal_(w, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
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
