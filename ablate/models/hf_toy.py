"""A toy copy of a transformers config (2 layers, hidden size 64, a 128-token vocabulary), and what
it is for here: checking on the CPU, in a fraction of a second, something a family's own code
decides whatever its sizes, such as whether its logits are its head's output alone.

The toy keeps every key of the config but its sizes: Cohere's logit_scale, Gemma 2's softcapping
and any rescaling a family writes into its forward come along, at the same code paths.
"""
from __future__ import annotations

import functools
import json

import torch

# A family's size keys, small: whichever of these its config has (names differ between families).
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 128, "head_dim": 16, "pad_token_id": None,
         "n_embd": 64, "n_head": 4, "n_layer": 2, "n_inner": 128, "d_model": 64, "ffn_dim": 128,
         # mixtures of experts
         "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "n_shared_experts": 1,
         "n_group": 1, "topk_group": 1,
         # multi-head latent attention (DeepSeek V2/V3)
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
         # Gemma 3n / 4's per-layer token embeddings (262,144 x 256 of their own)
         "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 16, "global_head_dim": 32,
         "num_kv_shared_layers": 0}  # Gemma 3n's last 15 of 35 layers reuse others' keys and values: none here


def toy_keys(keys: dict) -> dict:
    """The keys that make a config with these `keys` (its to_dict()) a toy one: each size key it
    has, small, and what follows from them."""
    toy = {k: v for k, v in SMALL.items() if k in keys}
    for k in ("num_hidden_layers", "n_layer"):  # fewer layers already: kept, with their kinds
        if isinstance(keys.get(k), int):
            toy[k] = min(keys[k], SMALL[k])
    if "qk_rope_head_dim" in keys:  # multi-head latent attention: head_dim is the rotary part's, and
        toy["head_dim"] = SMALL["qk_rope_head_dim"]  # every head has its own keys and values (made
        if "num_key_value_heads" in keys:  # from the shared latent): DeepSeek V3's 128 and 128
            toy["num_key_value_heads"] = SMALL["num_attention_heads"]
    if "rotary_dim" in keys:  # GPT-J, CodeGen: rotary over part of each head (16 wide here)
        toy["rotary_dim"] = 8
    n, layers = toy.get("num_hidden_layers", 2), keys.get("num_hidden_layers")
    for k, v in keys.items():  # per-layer lists (Gemma 3n's activation sparsity): as many as the layers
        if isinstance(v, list) and len(v) == layers and layers > n:
            toy[k] = v[:n]
    kinds, picked = keys.get("layer_types"), list(range(n))  # the real layers the toy's stand for
    if isinstance(kinds, list) and kinds:  # each kind of layer once, first come first (Gemma 4: a
        toy["layer_types"] = (list(dict.fromkeys(kinds)) + kinds)[:n]  # sliding-window one, a full one)
        picked = [kinds.index(kind) for kind in toy["layer_types"]]
    overrides = keys.get("per_layer_config")  # transformers' per-layer keys, by layer: {"05": {"head_dim": 512}}
    if isinstance(overrides, dict) and overrides:
        by_layer = {int(i): o for i, o in overrides.items()}
        toy["per_layer_config"] = {i: {k: _scaled(k, v, keys, toy) for k, v in by_layer[real].items()}
                                   for i, real in enumerate(picked) if real in by_layer}
    return toy


def _scaled(key: str, value, keys: dict, toy: dict):
    """A layer's own size as the toy's size in the same ratio to the toy's global one (Gemma 4's
    full-attention head_dim of 512 against 256: 32 against 16); any other value as it is."""
    if isinstance(value, int) and isinstance(keys.get(key), int) and keys[key] and key in toy:
        return max(1, round(toy[key] * value / keys[key]))
    return value


def toy_overrides(model_type: str) -> list[str]:
    """The command line that makes `model_type` a toy model: `model=hf` and its keys."""
    from transformers import AutoConfig

    keys = toy_keys(AutoConfig.for_model(model_type).to_dict())
    return ["model=hf", f"+model.config.model_type={model_type}",
            *(f"+model.config.{k}={_hydra(v)}" for k, v in keys.items())]


def _hydra(value) -> str:
    """A value as Hydra's override grammar writes it: None -> null, [a,b], {1:{head_dim:32}}."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    return str(value)


# How large the probe makes its logits (their standard deviation): where a family caps them
# (Gemma 2: tanh(x / 30) x 30) the cap then bends them far beyond rounding, as a scale would.
_LOGIT_STD = 100.0


def head_is_not_plain(config, attn_implementation: str = "sdpa") -> str | None:
    """None where `config`'s family makes its logits as lm_head(base model's last hidden states),
    which loss=chunked and loss=fused compute for themselves (ablate/models/hf.py HFModule); else
    why not, in a few words. Checked on a toy copy of the config, in fp32 on the CPU, with the
    global random state left as it was; its attention the run's (the attention group's)."""
    return _probe(config.to_json_string(), attn_implementation)


@functools.lru_cache(maxsize=32)
def _probe(config_json: str, attn_implementation: str) -> str | None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    keys = json.loads(config_json)
    keys.update(toy_keys(keys))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the toy's token ids beyond its vocabulary, kernels not installed: not the user's
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            toy = AutoConfig.for_model(**{k: v for k, v in keys.items() if k != "transformers_version"})
            lm = AutoModelForCausalLM.from_config(toy, attn_implementation=attn_implementation,
                                                  dtype=torch.float32).eval()
            head = lm.get_output_embeddings()
            with torch.no_grad():
                for p in lm.parameters():  # each weight 1 to 1.5 times itself: a learned scale that starts
                    p.mul_(1 + torch.rand_like(p) / 2)  # at 1 (Dory's logit_scale) is seen from step 0
                head.weight.normal_(0.0, _LOGIT_STD / head.in_features ** 0.5)  # normed hidden states: logits ~ N(0, 100²)
                idx = torch.randint(0, toy.vocab_size, (2, 8))
                logits = lm(input_ids=idx, use_cache=False).logits.float()
                hidden = getattr(lm.base_model(input_ids=idx, use_cache=False), "last_hidden_state", None)
                if hidden is None:  # Llama 4's text model is its own base_model: logits, no hidden states
                    return f"its base model ({type(lm.base_model).__name__}) gives no last_hidden_state for the head"
                # what the chunked loss computes: the head's weight and bias, not its module's forward
                ours = torch.nn.functional.linear(hidden, head.weight, head.bias).float()
    except Exception as e:  # noqa: BLE001 (a family's code can raise anything on a toy config)
        return f"its toy copy could not be checked ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    finally:
        hf_logging.set_verbosity(verbosity)
    if ours.shape != logits.shape:
        return f"its logits ({tuple(logits.shape)}) are not its head's output ({tuple(ours.shape)})"
    if not torch.allclose(ours, logits, rtol=1e-4, atol=1e-3):
        ratio = (logits.std() / ours.std()).item()
        return f"its forward changes the head's output (a toy copy's logits have {ratio:.3g} times its spread)"
    return None
