"""Any decoder-only causal LM of Hugging Face transformers as a model family, built from its
config.json with no network: Llama, Qwen2, Mistral, GPT-NeoX, GPT-2 and the others
AutoModelForCausalLM knows.

The model comes in as transformers writes it; `HFModule` only puts it behind ablate's interface
(forward(idx, targets) -> (logits, loss), with the same fp32 loss as ablate's GPTModule), and
`find_adapter` reads where its parts are from the model itself: the repeated layer is the class
transformers names in `_no_split_modules` (the unit it never splits across devices), its
attention and MLP the layer's children of those kinds, the LM head and the token embedding what
`get_output_embeddings` / `get_input_embeddings` return. transformers is an optional extra
(`pip install -e '.[hf]'` in ablate's repository; PyPI's `ablate` is another project): without
it such a point is an `invalid` row saying so.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ablate.models.gpt_module import DeferredNormals
from ablate.models import MAX_LAYERS, Adapter, Family, lm_loss, weights
from ablate.models.hf_adapter import _transformers, find_adapter
from ablate.models.hf_toy import head_is_not_plain
from ablate.techniques import Invalid, Plan

# config.json keys that are not the model's shape: transformers' own bookkeeping, and the dtype
# the weights were saved in (the precision option decides the dtype here).
_IGNORED_KEYS = ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map")
# Families whose logits are exactly lm_head(base model's last hidden states), which a loss that
# takes the hidden states and the head (loss=chunked, fused) relies on; tests/test_families.py
# checks each against transformers' own forward. Any other family is checked when it asks for such
# a loss, on a toy copy of its config (hf_toy.head_is_not_plain): some scale or cap their logits
# after the head in their own code (Cohere's logit_scale, Gemma 2's softcapping always on), where
# the chunked loss would be another loss.
PLAIN_HEAD = ("llama", "mistral", "qwen2", "gpt_neox", "gpt2", "qwen3", "smollm3", "gemma", "gemma3_text", "phi",
              "phi3", "olmo", "olmo2", "stablelm", "falcon", "starcoder2", "granite", "mixtral", "qwen2_moe",
              "qwen3_moe", "olmoe")
# Config keys by which a family of PLAIN_HEAD can still change its logits after the head, and the
# value that leaves them as they are (Gemma 3's softcapping, Granite's divisor).
LOGIT_KEYS = {"final_logit_softcapping": None, "logits_scaling": 1.0}
# Families whose decoder layers are all built alike from the config (no per-layer sizes, no switch
# from dense to mixture-of-experts MLPs at some index), so that a sample of two layers stands for
# all of them (Family.layout): counting and the analytic predictor then build two layers, not all.
# Any other family is built whole.
UNIFORM_LAYERS = ("llama", "mistral", "qwen2", "gpt_neox", "gpt2", "qwen3", "mixtral", "olmoe", "qwen2_moe",
                  "qwen3_moe")


def _per_layer(c, key: str) -> list | None:
    """`key`'s value for each layer: from transformers' per-layer configs where it differs between
    layers (Gemma 4's head_dim: 256 in sliding-window layers, 512 in full-attention ones, which
    the global config refuses to answer for), else the config's one value for every layer; None
    where the config has no such key."""
    if key in (getattr(c, "per_layer_attributes", None) or ()):
        return [getattr(layer, key) for layer in c.per_layer_config]
    value = getattr(c, key, None)
    return None if value is None else [value] * c.num_hidden_layers


def _causal_lm_class(config):
    """The transformers class AutoModelForCausalLM builds for `config`; None for a family with none."""
    return _transformers().AutoModelForCausalLM._model_mapping.get(type(config), None)


# Sizes a config must give as positive counts (transformers checks few of them itself).
_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
          "intermediate_size")

class HFModule(nn.Module):
    """A transformers causal LM behind ablate's model interface: the nn.Module the HFCausalLM family
    builds. `lm` is the transformers model."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.loss_fn = None  # as ablate's GPTModule's: (hidden, head, targets) -> loss, the head and loss together

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids, targets already shifted (the data's y): transformers'
        own `labels` would shift them again. No KV cache: this is training. With a loss_fn, the
        base model's last hidden states (final norm applied) go to it with the head: no logits."""
        if targets is not None and self.loss_fn is not None:
            out = self.lm.base_model(input_ids=idx, use_cache=False)
            hidden = out.last_hidden_state  # (B, T, C)
            return None, self.loss_fn(hidden, self.lm.get_output_embeddings(), targets) + self._router_loss(out)
        out = self.lm(input_ids=idx, use_cache=False)
        logits = out.logits  # (B, T, vocab) in the compute dtype
        return logits, None if targets is None else lm_loss(logits, targets) + self._router_loss(out)

    def _router_loss(self, out) -> torch.Tensor | float:
        """A mixture of experts' load-balancing loss x router_aux_loss_coef where its config asks for
        one (output_router_logits), as transformers adds it to its own loss given labels; else 0.
        The causal LM's output carries it; the base model's (the chunked loss's) only the router
        logits, which the family's own loss function takes."""
        if not getattr(self.lm.config, "output_router_logits", False):
            return 0.0
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            balance = sys.modules[type(self.lm).__module__].load_balancing_loss_func
            aux = balance(out.router_logits, self.lm.num_experts, self.lm.num_experts_per_tok, None)
        return self.lm.router_aux_loss_coef * aux

    def tie_weights(self) -> None:
        self.lm.tie_weights()

    def reset_parameters(self) -> None:
        """transformers' own initialisation (its `_init_weights` per module, rotary buffers
        included), so a model built on meta and given storage on the device starts as a fresh one.
        Its N(0, std) draws are made together, on torch's threads (DeferredNormals)."""
        with DeferredNormals():
            self.lm.init_weights()


def _language_model(model_type: str) -> str:
    """What to give instead of a multimodal model_type (Gemma 3, Llama 4): its language model's."""
    try:
        text = _transformers().AutoConfig.for_model(model_type).get_text_config().model_type
    except ValueError:  # several (MusicGen: a text encoder and a decoder)
        return "its language model's model_type, with the keys of that part of its config.json"
    return f"model.config.model_type={text!r}, with the keys of its config.json's text_config"


class HFCausalLM(Family):
    """A transformers causal LM from its config: `config_path` (a directory with config.json, or
    the file), then the keys of `config` on top (`model.config.num_hidden_layers=2`); without a
    config_path, `init_from`'s config.json. Random initialisation (transformers' own) unless
    `init_from` names a local directory of safetensors weights. `name` labels the rows."""

    def __init__(self, name: str = "hf", config: dict | None = None, config_path: str | None = None,
                 init_from: str | None = None):
        self.name, self.config_path, self.init_from = name, config_path, init_from
        self.overrides = dict(config or {})
        self._hf_config = None

    @property
    def hf_config(self):
        """The transformers config (PretrainedConfig) this option builds."""
        if self._hf_config is None:
            keys = {**self._file_config(), **self.overrides}
            if "model_type" not in keys:
                raise Invalid("model.config.model_type is missing: name the family (llama, qwen2, mistral, "
                              "gpt_neox, gpt2, ...) or give model.config_path=DIR with a config.json")
            keys = {k: v for k, v in keys.items() if k not in _IGNORED_KEYS}
            for key in _SIZES:  # before transformers divides by one (num_attention_heads=0)
                if isinstance(keys.get(key), int) and keys[key] < 1:
                    raise Invalid(f"model.config.{key}={keys[key]} must be >= 1")
            try:
                self._hf_config = _transformers().AutoConfig.for_model(**keys)
            except ValueError as e:  # an unknown model_type: transformers lists the known ones
                raise Invalid(f"model.config.model_type={keys['model_type']!r}: {str(e).splitlines()[0]}") from None
            except (ArithmeticError, TypeError, AttributeError) as e:  # a key the config's own code chokes on
                raise Invalid(f"model.config: transformers' {keys['model_type']} config rejects these keys: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
            if _causal_lm_class(self._hf_config) is None:
                self._hf_config = None  # a vision model (vit), an encoder-decoder (t5): no causal LM class
                raise Invalid(f"model.config.model_type={keys['model_type']!r} is not a causal LM in transformers "
                              f"(AutoModelForCausalLM has no class for it): ablate trains decoder-only models")
            if not hasattr(self._hf_config, "vocab_size"):  # a vision or audio model around a language model
                self._hf_config = None
                raise Invalid(f"model.config.model_type={keys['model_type']!r} is a multimodal model; ablate trains "
                              f"its language model alone: {_language_model(keys['model_type'])}")
        return self._hf_config

    def _file_config(self) -> dict[str, Any]:
        source, key = (self.config_path, "config_path") if self.config_path else (self.init_from, "init_from")
        if not source:
            return {}
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise Invalid(f"model.{key}={source}: no config.json there")
        return json.loads(path.read_text())

    def imports(self) -> None:
        _causal_lm_class(self.hf_config)  # transformers, its config and modeling modules for this model_type

    def check(self, plan: Plan) -> None:
        c = self.hf_config
        # Again on the built config: a family's own names for the sizes (HF GPT-2's n_layer) reach
        # these only through its attribute_map.
        for key in _SIZES:
            if isinstance(getattr(c, key, None), int) and getattr(c, key) < 1:  # 0 layers: an embedding alone
                raise Invalid(f"model.config.{key}={getattr(c, key)} must be >= 1")
        if c.num_hidden_layers > MAX_LAYERS:
            raise Invalid(f"model.config.num_hidden_layers={c.num_hidden_layers} is more than {MAX_LAYERS:,} layers")
        if plan.seq_len > self.max_seq_len:
            raise Invalid(f"seq_len={plan.seq_len} > model.config.max_position_embeddings={self.max_seq_len}")
        heads, hidden = getattr(c, "num_attention_heads", None), getattr(c, "hidden_size", None)
        if heads and hidden and not _per_layer(c, "head_dim") and hidden % heads:
            raise Invalid(f"model.config.hidden_size={hidden} is not divisible by "
                          f"model.config.num_attention_heads={heads}")
        family = _causal_lm_class(c)
        if self.attn_implementation == "sdpa" and getattr(family, "_supports_sdpa", True) is False:
            raise Invalid(f"attention=sdpa: transformers' {family.__name__} has no sdpa attention; "
                          f"use attention=eager")
        why = plan.chunked_loss and c.model_type not in PLAIN_HEAD and head_is_not_plain(c, self.attn_implementation)
        if why:
            raise Invalid(f"loss=chunked, fused, liger and cce need logits that are the head's output alone; "
                          f"model_type={c.model_type!r}: {why}: use loss=standard")
        for key, neutral in LOGIT_KEYS.items():
            if plan.chunked_loss and getattr(c, key, neutral) not in (neutral, None):
                raise Invalid(f"loss=chunked, fused, liger and cce need logits that are the head's output alone; "
                              f"model.config.{key}={getattr(c, key)} changes them after it: use loss=standard")
        pad = getattr(c, "pad_token_id", None)
        if isinstance(pad, int) and not 0 <= pad < c.vocab_size:  # the embedding's zeroed row: an assert inside torch
            raise Invalid(f"model.config.pad_token_id={pad} is not a row of the {c.vocab_size}-token embedding "
                          f"(model.config.vocab_size): give model.config.pad_token_id=null or an id below it")
        kv = getattr(c, "num_key_value_heads", None)
        if heads and kv and heads % kv:
            raise Invalid(f"model.config.num_attention_heads={heads} is not divisible by "
                          f"model.config.num_key_value_heads={kv}")
        if self.init_from:  # the files' headers against the meta model: refused here, before any worker loads them
            weights.hf_state(self.init_from, self.meta_model.lm, weights.read(Path(self.init_from), meta=True))

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return getattr(self.hf_config, "max_position_embeddings", None) or 2**31

    @property
    def adapter(self) -> Adapter:
        # Paths and classes are the same at any layer count: read from one layer where a sample can be
        # built, once (a planned point asks for it some 150 times, and a read walks every module).
        if getattr(self, "_adapter", None) is None:
            sample = self.sample(1)
            self._adapter = find_adapter(self.meta_model if sample is None else sample)
        return self._adapter

    def build(self) -> nn.Module:
        return self._build(self.hf_config)

    def constants(self) -> nn.Module:
        """As Family's, with no initialiser run (transformers' no_init_weights): the weights are
        uninitialised host memory, which a 7B model's pages never touch."""
        _transformers()  # the install check: an invalid row naming the extra, not an ImportError
        from transformers.initialization import no_init_weights

        with no_init_weights():
            return super().constants()

    def _build(self, config) -> HFModule:
        tf = _transformers()
        try:
            lm = tf.AutoModelForCausalLM.from_config(config, attn_implementation=self.attn_implementation,
                                                     dtype=torch.get_default_dtype())
        except ValueError as e:  # a kernel the family does not support (Gemma 2 and sdpa)
            if "attention implementation" not in str(e) and "attn_implementation" not in str(e):
                raise
            option = {"flex_attention": "flex"}.get(self.attn_implementation, self.attn_implementation)
            raise Invalid(f"attention={option}: {str(e).splitlines()[0].split('. ')[0]} "
                          f"(attention=sdpa,eager)") from None
        return HFModule(lm)

    uses_transformers = True
    has_flex_attention = True

    def arch(self):
        from ablate.predict.arch import hf_arch

        return hf_arch(self.hf_config)

    @property
    def n_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def dims(self) -> tuple[int, float]:
        """(layers, attention width): query heads x head_dim where the config sets a head_dim of
        its own (Qwen3 0.6B: 16 x 128 = 2048 on a hidden size of 1024), else the hidden size. Where
        head_dim differs between layers, their mean: attention's FLOPs add up linearly in it."""
        layers, hidden = super().dims()
        c = self.hf_config
        heads, head_dims = getattr(c, "num_attention_heads", None), _per_layer(c, "head_dim")
        return layers, heads * sum(head_dims) / len(head_dims) if heads and head_dims else hidden

    def with_layers(self, n: int) -> HFModule | None:
        """The config with n layers: its per-layer attention kinds (Qwen2's `layer_types`) cut to
        n where they are all one kind; None for a family not in UNIFORM_LAYERS, or whose layers
        are of more than one kind."""
        kinds = getattr(self.hf_config, "layer_types", None)
        if self.hf_config.model_type not in UNIFORM_LAYERS or len(set(kinds or ())) > 1:
            return None
        c = self.hf_config  # Qwen-MoE's dense layers among the experts': at chosen indices, or every n-th
        if getattr(c, "mlp_only_layers", None) or (getattr(c, "decoder_sparse_step", None) or 1) != 1:
            return None
        config = copy.deepcopy(self.hf_config)
        config.num_hidden_layers = n
        if kinds:
            config.layer_types = list(kinds[:n])
        return self._build(config)

    def load_weights(self, model: nn.Module) -> None:
        """Copy init_from's safetensors into `model` in place (any device, any dtype), under the names
        the family's conversion mapping in transformers gives them (ablate/models/weights.py)."""
        if self.init_from:
            state = weights.hf_state(self.init_from, model.lm, weights.read(Path(self.init_from)))
            with torch.no_grad():
                model.lm.load_state_dict(state, strict=False)
            model.tie_weights()
