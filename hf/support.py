"""Which Hugging Face models padgraph.hf serves, and the cache shape each needs.

A model is served when every token mixer is an attention module that calls HF's attention
interface: then padgraph's registered function sees every layer's q, k, v. State-space and
linear-recurrent mixers (Mamba, Mamba2, Bamba, Jamba, gated delta nets) keep a recurrent state
that no attention function sees; they are refused by name before anything runs.
"""
from __future__ import annotations

import torch

from .cache import Shape
from .errors import UnsupportedModelError

# a parameter every recurrent mixer HF ships has (the state decay A = -exp(A_log)), and no
# attention module has
_RECURRENT_PARAM = "A_log"


def check_supported(model) -> None:
    """UnsupportedModelError naming the first layer padgraph.hf cannot serve, else None."""
    name = type(model).__name__
    for path, module in model.named_modules():
        if hasattr(module, _RECURRENT_PARAM):
            raise UnsupportedModelError(
                f"padgraph.hf.Decoder({name}): layer {path!r} is a {type(module).__name__}, a recurrent "
                f"(state-space) mixer with no attention interface; every token mixer must be an "
                f"attention layer that calls HF's AttentionInterface")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"padgraph.hf.Decoder({name}): the model must support HF's attention interface "
            f"(_supports_attention_backend = True); {name} does not")
    if not attention_layers(model):
        raise UnsupportedModelError(f"padgraph.hf.Decoder({name}): no attention module with a layer_idx found")


def attention_modules(model) -> list:
    """Every attention module: those with q_proj and a layer_idx."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]


def attention_layers(model) -> list[int]:
    """layer_idx of every attention module, sorted."""
    return sorted({m.layer_idx for m in attention_modules(model)})


def cache_shape(model) -> Shape:
    """Layers, KV heads, head dim and dtype of the cache the model's attention layers fill."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    return Shape(max(attention_layers(model)) + 1, n_kv_heads, head_dim, dtype)


def device_of(model) -> torch.device:
    return next(model.parameters()).device
