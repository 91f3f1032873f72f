"""A nanoGPT-like decoder that keeps ablate's model contract (ablate/models/contract.py), its parts
where conf/model/custom.yaml's paths look: `python -m ablate model=custom model.target=examples.tiny_lm:TinyLM`."""
import torch
import torch.nn.functional as F
from torch import nn

from ablate.models import lm_loss


class Attention(nn.Module):  # causal self-attention: (B, T, C) -> (B, T, C)
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=64):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.loss_fn = None  # set by loss=chunked and loss=fused: (hidden, head, targets) -> mean loss
        self.tie_weights()

    def tie_weights(self):
        self.lm_head.weight = self.transformer.wte.weight

    def reset_parameters(self):  # ablate builds on the meta device, then initialises on the real one
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                m.reset_parameters()

    def forward(self, idx, targets=None):  # (B, T) token ids; (B, T) next tokens or None
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None and self.loss_fn is not None:  # the head and the loss together: no logits
            return None, self.loss_fn(x, self.lm_head, targets)
        logits = self.lm_head(x)
        return logits, None if targets is None else lm_loss(logits, targets)
