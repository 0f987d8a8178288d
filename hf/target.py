"""`Target`: an unmodified Hugging Face causal LM as a `padgraph.llm` target model.

padgraph.llm's worker runs its programs over any model with the `TargetModel` protocol's paged
forwards: plain decoding (`Engine(Target(model, n), None, ...)`, the engine's decode program and
sampler) and EAGLE's (prefill, verify, draft, draft-extend). `Target` gives an HF model those
forwards: each runs HF's decoder stack with `use_cache=False` and the padgraph attention function registered,
handing it a `Paged` batch that stores every layer's k / v in padgraph.llm's KV cache at the
batch's slots and attends with padgraph's paged kernels: decode, a packed extend (`qo_indptr`),
or a draft tree (`tree_mask`). The final-normed hidden state is what the draft head reads.

The paged kernels attend to every key below a request's length with the layer's own scale: a
layer with a logit soft-cap, or a sliding window shorter than the context, is refused
(`UnsupportedModelError`) rather than served with other tokens than HF's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from padgraph.llm.batch import Batch
from padgraph.llm.models.llama import LlamaConfig, Rotary
from padgraph.llm.paged import AttnPlan, PagedForwards, decode_batch, extend_batch, store_kv, tree_batch

from .attention import Layer, kernel_serves
from .cache import Shape, Site
from .errors import UnsupportedModelError
from .support import check_supported, graph_safe_experts, serving


@dataclass(frozen=True)
class Paged:
    """One forward's attention over padgraph.llm's KV cache (`kv.k[i]`, `kv.v[i]`): the plan
    padgraph.llm's own models use (`decode_batch`, `extend_batch`, `tree_batch`), at each
    layer's scale."""

    plan: AttnPlan
    kv: object

    def attend(self, module, q, k, v, layer: Layer):
        """q [1, h, n, d], k / v [1, kv_heads, n, d] (n packed tokens) -> [1, n, h, d]."""
        k_cache, v_cache = self.kv.k[module.layer_idx], self.kv.v[module.layer_idx]
        dtype = q.dtype
        q, k, v = (t[0].transpose(0, 1).to(k_cache.dtype) for t in (q, k, v))      # [n, heads, d]
        store_kv(k_cache, v_cache, self.plan.out_cache_loc, k, v)
        o = self.plan.attend(q.contiguous(), k_cache, v_cache, sm_scale=layer.scaling)   # [n, h, d]
        return o.to(dtype)[None]


def refuse_unless_plain(layer: Layer, max_context: int, where: str) -> None:
    """UnsupportedModelError for attention the paged kernels do not compute as HF does: they
    attend to every key below a request's length, uncapped (`attention.kernel_serves`)."""
    if not kernel_serves(layer, max_context):
        raise UnsupportedModelError(
            f"padgraph.hf.Target: {where} attends with a logit soft-cap ({layer.softcap}), sink logits "
            f"({'yes' if layer.sinks is not None else 'none'}) or within a sliding window ({layer.sliding_window}) "
            f"shorter than max_context {max_context}; padgraph.llm's paged kernels attend to every key below "
            f"a request's length, uncapped, with no sink")


def attention_specs(calls) -> dict[int, Layer]:
    """layer index -> `Layer` as the model's attention modules pass them at run time (a config
    field such as `sliding_window` is used by some architectures and ignored by others)."""
    return {c.layer_idx: c.layer for c in calls}


def uniform_cache(model, calls) -> Shape:
    """The one (KV heads, head dim) padgraph.llm's cache holds for every layer, or
    UnsupportedModelError: its paged kernels take one width for q, k and v, one call per layer."""
    name = type(model).__name__
    idx = [c.layer_idx for c in calls]
    widths = {(c.n_kv_heads, c.k_dim, c.v_dim) for c in calls}
    if idx != list(range(len(calls))):
        raise UnsupportedModelError(f"padgraph.hf.Target({name}): padgraph.llm's cache takes one attention call "
                                    f"per layer, layers 0..n-1; the model's calls are on layers {idx}")
    if len(widths) != 1 or len({d for w in widths for d in w[1:]}) != 1:
        raise UnsupportedModelError(f"padgraph.hf.Target({name}): padgraph.llm's paged kernels take one head "
                                    f"width for queries, keys and values in every layer; the model's (KV heads, "
                                    f"k width, v width) are {sorted(widths)}")
    return Shape(tuple(Site(c.layer_idx, c.n_kv_heads, c.k_dim, c.v_dim) for c in calls),
                 next(model.parameters()).dtype)


def text_config(model):
    return model.config.get_text_config()


def llm_config(model, shape: Shape, max_position: int) -> LlamaConfig:
    """The widths padgraph.llm's programs, cache and an EAGLE head of this model need."""
    cfg, site = text_config(model), shape.sites[0]
    rope = getattr(cfg, "rope_parameters", None) or {}
    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_layers=len(shape.sites),
                       n_heads=cfg.num_attention_heads, n_kv_heads=site.n_kv_heads, head_dim=site.k_dim,
                       ffn_size=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
                       rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
                       rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), max_position=max_position)


class Target(PagedForwards, nn.Module):
    """An HF causal LM with padgraph.llm's paged forwards (`TargetModel`): `Decoder(...,
    draft=Eagle())` serves it with EAGLE. `max_context` bounds a request's prompt + output.
    `cfg` holds the widths; `rope` is a rotary embedding for a draft head's own layer."""

    def __init__(self, model, max_context: int):
        super().__init__()
        calls = check_supported(model)
        shape = uniform_cache(model, calls)
        cfg = text_config(model)
        if getattr(cfg, "final_logit_softcapping", None):
            raise UnsupportedModelError(f"padgraph.hf.Target({type(model).__name__}): soft-capped logits; "
                                        f"greedy verification over padgraph.llm's logits does not cap")
        for idx, layer in sorted(attention_specs(calls).items()):
            refuse_unless_plain(layer, max_context, f"{type(model).__name__} layer {idx}")
        self.hf = model
        self.experts = graph_safe_experts(next(model.parameters()).device)
        self.max_context = max_context
        self.cfg = llm_config(model, shape, max_context)
        self.layers = model.model.layers
        self.lm_head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self.norm = model.model.norm            # the final norm: an EAGLE head's passthrough start copies it
        self.rope = Rotary(self.cfg.head_dim, max_context, self.cfg.rope_theta).to(self.lm_head.weight.device)

    def _decode_batch(self, b: Batch) -> Paged:
        return Paged(decode_batch(b), b.kv)

    def _extend_batch(self, b: Batch) -> Paged:
        return Paged(extend_batch(b), b.kv)

    def _tree_batch(self, b: Batch) -> Paged:
        return Paged(tree_batch(b), b.kv)

    def _run(self, input_ids: Tensor, positions: Tensor, paged: Paged, kv) -> Tensor:
        """Packed tokens [n] at positions [n] -> final-normed hidden [n, H]."""
        with serving(self.hf, self.experts):
            out = self.hf.model(input_ids=input_ids[None], position_ids=positions[None].long(), use_cache=False,
                                padgraph_batch=paged)
        return out.last_hidden_state[0]

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def greedy_ids(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).argmax(-1)

    @torch.no_grad()
    def forward_dense(self, input_ids: Tensor, last_only: bool = False):
        """[B, T] -> (logits, hidden [B, T, H]) through HF's own attention (distillation's corpus)."""
        hidden = self.hf.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.logits(hidden[:, -1] if last_only else hidden), hidden
