"""`Target`: an unmodified Hugging Face causal LM as a `padgraph.llm` target model.

padgraph.llm's engine runs its programs over any model with the `TargetModel` protocol's paged
forwards: plain decoding (`Engine(Target(model, n, draft=False), None, ...)`: the engine's decode
program, sampler and stop tokens) and EAGLE's (prefill, verify, draft, draft-extend). `Target`
gives an HF model those forwards: each runs the model with `use_cache=False` and padgraph's
attention function registered, handing it a batch (`attention.Prefill`, `attention.Decode`,
`Paged`) that stores every attention call's k / v in the Target's own cache (`cache.PagedCache`:
one site per attention call, each of its own widths; a hybrid's recurrent pools) at the slots
padgraph.llm's admission gave the request, and attends over it:

    decode    one token per request, as a batch [bs, 1] (a hybrid's recurrent mixers see one row
              per request: `recurrent.Step`, read from the pools by request row and written
              back to them): padgraph's Triton paged decode kernel where it computes the layer as HF does
              (on a GPU, at half precision), else the torch path (windows, soft-caps, sinks, ...)
    extend    the prompts left-padded into one batch [n, P] through the model's forward (HF's
              first forward: a hybrid's mixers start from no state and leave theirs in the
              requests' rows), eagerly: the engine's prefill
    verify    (draft only) a draft tree, packed, through padgraph.llm's paged tree kernel

`draft=False` serves every model `support.check_served` passes: its logits are the causal LM's
own (soft-capped, scaled, as its forward computes them), and the forwards return no hidden state
(`hidden` None). `draft=True` (what `Decoder(..., draft=Eagle())` builds, and an EAGLE head needs)
takes only what padgraph.llm's draft and verify programs compute as HF does: attention layers of
one width, one call a layer, no soft-cap, no sink logits, no window shorter than the context, no
recurrent state (`UnsupportedModelError` otherwise); its forwards return the final-normed hidden
state the head reads, and its logits are the lm_head's.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import padgraph as pg

from padgraph.llm.batch import Batch
from padgraph.llm.kv import FIRST, KVCache
from padgraph.llm.models.llama import LlamaConfig, Rotary
from padgraph.llm.paged import AttnPlan, store_kv, tree_batch

from . import attention
from .attention import Decode, Layer, Prefill, Sites, kernel_serves
from .cache import PagedCache, Shape, pools_of
from .errors import UnsupportedModelError
from .masks import rule_of
from .recurrent import Step, cache_argument
from .support import attention_modules, cache_shape, check_served, decoder_of, graph_safe_experts, serving


@dataclass(frozen=True)
class Paged:
    """One packed forward's attention over the Target's cache through padgraph.llm's paged
    kernels (the draft tree: `tree_batch`), at each layer's scale."""

    plan: AttnPlan
    k: list
    v: list
    sites: Sites

    def attend(self, module, q, k, v, layer: Layer):
        """q [1, h, n, d], k / v [1, kv_heads, n, d] (n packed tokens) -> [1, n, h, d]."""
        site = self.sites.site(module)
        k_cache, v_cache = self.k[site], self.v[site]
        dtype = q.dtype
        q, k, v = (t[0].transpose(0, 1).to(k_cache.dtype) for t in (q, k, v))      # [n, heads, d]
        store_kv(k_cache, v_cache, self.plan.out_cache_loc, k, v)
        o = self.plan.attend(q.contiguous(), k_cache, v_cache, sm_scale=layer.scaling)   # [n, h, d]
        return o.to(dtype)[None]


@dataclass(frozen=True)
class Widths:
    """What padgraph.llm's worker and programs read of a target served without a draft head:
    the vocabulary, the hidden width, and the attention calls a forward makes (`n_layers`, the
    cache's sites)."""

    vocab_size: int
    hidden_size: int
    n_layers: int


def mask_horizons(model, calls, max_context: int) -> dict:
    """Each attention module's rule as HF's own mask applies it (`masks.Horizon`, from the
    survey's census; the window the layer passes itself where it passes one): {module: Horizon},
    modules whose mask no factory built left out (their keywords are their rule). Refused
    (UnsupportedModelError) where the mask is not causal or lays another rule over it, or where
    the layer's own window and its mask's disagree within max_context."""
    out, same = {}, {}      # equal rules as one object: a compiled region guards once, not per layer
    for c in calls:
        h = c.mask
        if h is None:
            continue
        where = f"padgraph.hf.Decoder({type(model).__name__}): layer {c.path!r}"
        if h.rule == "other":
            raise UnsupportedModelError(
                f"{where} attends with a mask HF builds that is not causal, or with another rule laid over "
                f"it (a mask function, blocks); padgraph's attention applies causal masks with a sliding "
                f"window or chunks only")
        passed = c.layer.sliding_window
        if passed is not None and passed != h.window and min(passed, h.window or max_context) < max_context:
            raise UnsupportedModelError(
                f"{where} passes sliding_window={passed} to attention while HF's mask for it "
                f"{'is a window of ' + str(h.window) if h.window else 'has no window (' + h.rule + ')'}; HF's "
                f"attention implementations disagree on such a layer, so padgraph cannot tell which to reproduce")
        h = dataclasses.replace(h, window=passed if passed is not None else h.window)
        out[c.module] = same.setdefault(h, h)
    return out


def refuse_cache_positions(model, max_context: int) -> None:
    """UnsupportedModelError for a model whose layers take positions from HF's cache length
    rather than from position_ids, where that changes a result within max_context: Llama 4's
    attention temperature tuning scales the queries of its NoPE layers by log1p(floor((p + 1) /
    floor_scale)), p counted from the cache's length (left pads included). padgraph's forwards
    run without HF's cache, so p would read 0: exact only while every position is below
    floor_scale - 1."""
    cfg = text_config(model)
    scale = getattr(cfg, "floor_scale", None)
    if getattr(cfg, "attn_temperature_tuning", False) and scale is not None and max_context >= scale:
        raise UnsupportedModelError(
            f"padgraph.hf.Decoder({type(model).__name__}): attention temperature tuning (attn_temperature_tuning, "
            f"floor_scale={scale}) scales queries by positions HF counts from its cache, which padgraph's "
            f"cache-free forwards do not give; served only with max_len (here {max_context} with the engine's "
            f"margins) below floor_scale")


def rope_switch_lengths(model) -> list[tuple[str, int]]:
    """(rope type, sequence length past which HF changes the frequencies) for each rotary
    embedding of `model` whose frequencies depend on the forward's longest position
    (transformers' `dynamic_rope_update`): "longrope" switches to its long factors once
    max(position_ids) + 1 exceeds original_max_position_embeddings, "dynamic" types rescale
    past max_position_embeddings (and reset below it)."""
    out = []
    for mod in model.modules():
        kinds = getattr(mod, "rope_type", None)
        cfg = getattr(mod, "config", None)
        if kinds is None or cfg is None:
            continue
        params = getattr(cfg, "rope_parameters", None) or {}
        per_type = isinstance(kinds, dict)
        for layer_type, kind in (kinds.items() if per_type else [(None, kinds)]):
            p = params.get(layer_type, {}) if per_type else params
            if kind == "longrope":
                limit = p.get("original_max_position_embeddings",
                              getattr(cfg, "original_max_position_embeddings", None))
                limit = limit or getattr(cfg, "max_position_embeddings", None)
            elif isinstance(kind, str) and "dynamic" in kind:
                limit = getattr(mod, "original_max_seq_len", None) or getattr(
                    cfg, "max_position_embeddings", None)
            else:
                continue
            out.append((kind, int(limit) if limit is not None else 0))
    return out


def refuse_length_dependent_rope(model, max_context: int) -> None:
    """UnsupportedModelError for a rotary embedding whose frequencies HF picks from the longest
    position of each forward (`rope_switch_lengths`), where max_context reaches past the switch:
    HF's result then depends on the batch a request shares (a finished row that HF keeps
    stepping moves the others' frequencies) and Phi-3's generate re-encodes the whole sequence
    at the switch, while padgraph's cache keeps keys rotated with the frequencies of the step
    that wrote them. Below the switch every position takes the same frequencies: exact."""
    for kind, limit in rope_switch_lengths(model):
        if max_context > limit:
            raise UnsupportedModelError(
                f"padgraph.hf.Decoder({type(model).__name__}): rope_type {kind!r} changes its frequencies "
                f"once a forward's positions pass {limit}, picked by the longest row of HF's batch (and Phi-3's "
                f"generate re-encodes the sequence there); padgraph's cache keeps keys rotated as they were written, so it "
                f"serves such a model only with max_len (here {max_context} with the engine's margins) at most "
                f"{limit}")


def refuse_unless_plain(layer: Layer, max_context: int, where: str) -> None:
    """UnsupportedModelError for attention the paged kernels do not compute as HF does: they
    attend to every key below a request's length, uncapped (`attention.kernel_serves`)."""
    if not kernel_serves(layer, max_context):
        raise UnsupportedModelError(
            f"padgraph.hf.Target: {where} attends with a logit soft-cap ({layer.softcap}), sink logits "
            f"({'yes' if layer.sinks is not None else 'none'}), within a sliding window ({layer.sliding_window}) "
            f"or within chunks ({layer.chunk}) shorter than max_context {max_context}; padgraph.llm's paged "
            f"kernels attend to every key below a request's length, uncapped, with no sink")


def uniform_cache(model, calls) -> Shape:
    """The one (KV heads, head dim) a draft head's programs take for every layer, or
    UnsupportedModelError: padgraph.llm's paged kernels take one width for q, k and v, one call
    per layer."""
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
    return cache_shape(model, calls)


# the decoder's final norm by the names HF's causal LMs give it
FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")


def final_norm(model) -> torch.nn.Module | None:
    """The decoder's final norm (FINAL_NORMS), or None where it has none of those names. Only an
    EAGLE head's start reads it: the verified tokens are the model's own."""
    decoder = decoder_of(model)
    for name in FINAL_NORMS:
        norm = getattr(decoder, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    return None


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


def draft_shape(model, calls, max_context: int) -> Shape:
    """The uniform cache of a target that serves a draft head, or UnsupportedModelError for what
    the draft and verify programs do not compute as HF does."""
    shape = uniform_cache(model, calls)
    if getattr(text_config(model), "final_logit_softcapping", None):
        raise UnsupportedModelError(f"padgraph.hf.Target({type(model).__name__}): soft-capped logits; "
                                    f"greedy verification over padgraph.llm's logits does not cap")
    for c in calls:
        refuse_unless_plain(c.layer, max_context, f"{type(model).__name__} layer {c.layer_idx}")
    return shape


def layer_list(model) -> nn.ModuleList:
    """The decoder's one ModuleList of layers (empty where it has none or several)."""
    lists = [c for c in decoder_of(model).children() if isinstance(c, nn.ModuleList)]
    return lists[0] if len(lists) == 1 else nn.ModuleList()


class Target(nn.Module):
    """An HF causal LM with padgraph.llm's paged forwards (`TargetModel`). `max_context` bounds
    a request's prompt + output (+ the engine's margins).

    draft: the target serves an EAGLE head (`Decoder(..., draft=Eagle())`): plain attention of
    one width only, the forwards return the final-normed hidden; `cfg` holds the widths the head
    takes and `rope` is a rotary embedding for the head's own layer. False: every model the
    Decoder serves, the causal LM's own logits, no hidden.
    kernel: the paged decode attention for layers it computes as HF does (`Decoder` picks
    padgraph's Triton kernel on a GPU at half precision), None for the torch path everywhere.
    bound: the decode binds each attention module's caches on the module for the call
    (`attention.bound`), for decoder layers compiled as regions that share one graph.
    Its extend left-pads the packed prompts to their longest, read on the host: it runs eagerly
    only (`extend_in_graph`; the worker refuses prefill="runner")."""

    extend_in_graph = False

    def __init__(self, model, max_context: int, *, draft: bool = True, kernel=None, bound: bool = False):
        super().__init__()
        served = check_served(model, recurrent=not draft)
        refuse_cache_positions(model, max_context)
        refuse_length_dependent_rope(model, max_context)
        self.horizons = mask_horizons(model, served.calls, max_context)
        calls = [dataclasses.replace(c, layer=attention.with_rule(
                     c.layer, rule_of(self.horizons.get(c.module)))) for c in served.calls]
        shape = (draft_shape(model, calls, max_context) if draft
                 else cache_shape(model, calls, served.states))
        cfg = text_config(model)
        self.hf, self.draft, self.shape, self.max_context, self.kernel = model, draft, shape, max_context, kernel
        self.sites = Sites(shape.index())
        self.experts = graph_safe_experts(next(model.parameters()).device)
        self.cache_arg = cache_argument(model) if shape.states else None
        self.bound_modules = attention_modules(model, served.calls) if bound else None
        self.layers = layer_list(model)
        self.lm_head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        if not draft:
            self.cfg = Widths(cfg.vocab_size, cfg.hidden_size, len(shape.sites))
            return
        self.cfg = llm_config(model, shape, max_context)
        self.norm = final_norm(model)          # an EAGLE head's passthrough start copies its weight
        self.rope = Rotary(self.cfg.head_dim, max_context, self.cfg.rope_theta).to(self.lm_head.weight.device)

    # ---- caches (padgraph.llm's worker allocates them through these) ------------------------
    def new_cache(self, n_layers: int, n_slots: int, max_context: int, n_req_rows: int) -> PagedCache:
        """The Target's cache: one K/V pair per site (`n_layers` of them), recurrent pools."""
        if n_layers != len(self.shape.sites):
            raise pg.ContractValueError(f"padgraph.hf.Target.new_cache: n_layers must be the model's "
                                        f"{len(self.shape.sites)} attention sites, got {n_layers}")
        return PagedCache(self.shape, n_slots, max_context, n_req_rows, self.lm_head.weight.device)

    def new_draft_cache(self, n_slots: int) -> KVCache:
        """The draft head's one-layer K/V pools (an EAGLE head's Llama layer, `cfg`'s widths); a
        target served without a head: no layer."""
        w = self.lm_head.weight
        if not self.draft:
            return KVCache(0, n_slots, 1, 1, 2, FIRST, w.dtype, w.device)
        return KVCache(1, n_slots, self.cfg.n_kv_heads, self.cfg.head_dim, 2, FIRST, w.dtype, w.device)

    # ---- the forwards -----------------------------------------------------------------------
    def forward_decode(self, input_ids: Tensor, positions: Tensor, batch: Batch):
        """[bs] tokens -> (logits [bs, V] fp32, hidden [bs, H] or None)."""
        rows = batch.req_pool_indices.long()
        sites = self.sites.fresh()
        attn = Decode(batch.kv.k if self.shape.sites else [], batch.kv.v if self.shape.sites else [],
                      batch.req_to_token, rows, positions, batch.out_cache_loc, batch.seq_lens, sites,
                      self.kernel, bound=self.bound_modules is not None)
        pools = pools_of(self.shape.states, batch.kv)
        step = Step.gathered(self.shape.states, pools, rows) if pools else None
        with attention.bound(self.bound_modules, attn.k, attn.v, sites):
            out = self._forward(input_ids[:, None], positions[:, None], attn, step)    # [bs, 1, V or H]
        if step is not None:
            step.scatter(pools, rows)                                                  # padded lanes: row 0
        # [bs, 1, .] -> [bs, .] as a view: inductor's select of the last position guards on a batch of one
        return self._logits_hidden(out.flatten(0, 1))

    def forward_extend(self, input_ids: Tensor, positions: Tensor, batch: Batch, prefill_cls=Prefill):
        """Packed [n_tok] prompts (`batch.qo_indptr`), each from position 0 -> (logits of each
        request's last token [n, V] fp32, hidden [n_tok, H] or None). Run eagerly: the prompts are
        left-padded into one batch, whose width is read on the host. prefill_cls: the attention
        batch (the probe's records HF's masks)."""
        lens = batch.qo_indptr[1:] - batch.qo_indptr[:-1]                              # [n]
        n, width = lens.shape[0], int(lens.max())
        valid = torch.arange(width, device=lens.device)[None, :] >= (width - lens)[:, None]   # [n, P] left pads
        ids, pos, slots = (torch.zeros(n, width, dtype=torch.int64, device=lens.device).masked_scatter(valid, t.long())
                           for t in (input_ids, positions, batch.out_cache_loc))     # pads: token 0, position 0, sink
        kv = batch.kv
        attn = prefill_cls(kv.k if self.shape.sites else [], kv.v if self.shape.sites else [], slots, pos, valid,
                           self.sites.fresh())
        step = Step.fresh_rows(self.shape.states, n, lens.device) if self.shape.states else None
        keep = {} if self.draft else {"logits_to_keep": 1}                            # the head reads every hidden
        out = self._forward(ids, pos, attn, step, attention_mask=valid.long(), **keep)  # [n, P or 1, H or V]
        if step is not None:
            step.scatter(pools_of(self.shape.states, kv), batch.req_pool_indices.long())
        logits, _ = self._logits_hidden(out[:, -1])
        return logits, (out[valid] if self.draft else None)

    def forward_extend_hidden(self, input_ids: Tensor, positions: Tensor, batch: Batch) -> Tensor:
        """`forward_extend`'s hidden [n_tok, H] (a target that serves a draft head)."""
        self._draft_only("forward_extend_hidden")
        return self.forward_extend(input_ids, positions, batch)[1]

    def forward_verify(self, input_ids: Tensor, positions: Tensor, batch: Batch):
        """[bs*k] tree tokens (seq_lens = prefix + k) -> (logits [bs*k, V] fp32, hidden [bs*k, H])."""
        hidden = self.forward_verify_hidden(input_ids, positions, batch)
        return self.logits(hidden), hidden

    def forward_verify_hidden(self, input_ids: Tensor, positions: Tensor, batch: Batch) -> Tensor:
        """`forward_verify`'s hidden [bs*k, H] only (greedy verification takes `greedy_ids` of it)."""
        self._draft_only("forward_verify")
        paged = Paged(tree_batch(batch), batch.kv.k, batch.kv.v, self.sites.fresh())
        return self._forward(input_ids[None], positions[None].long(), paged, None)[0]

    def logits(self, hidden: Tensor) -> Tensor:
        """The lm_head's logits [n, V] fp32 of final hidden states [n, H] (a draft head's target)."""
        return self.lm_head(hidden).float()

    def greedy_ids(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).argmax(-1)

    @torch.no_grad()
    def forward_dense(self, input_ids: Tensor, last_only: bool = False):
        """[B, T] -> (logits, hidden [B, T, H]) through HF's own attention (distillation's corpus)."""
        hidden = decoder_of(self.hf)(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.logits(hidden[:, -1] if last_only else hidden), hidden

    # ---- helpers ----------------------------------------------------------------------------
    def _forward(self, input_ids: Tensor, position_ids: Tensor, attn, step, **kwargs) -> Tensor:
        """The model over [b, t] tokens with `attn` as its attention batch and `step` (or None) as
        its recurrent cache: the causal LM's logits [b, t, V] (draft=False) or the decoder's
        final hidden [b, t, H] (draft=True)."""
        if step is not None:
            kwargs[self.cache_arg] = step
        with self._serving():
            if self.draft:
                return decoder_of(self.hf)(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                             padgraph_batch=attn, **kwargs).last_hidden_state
            return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                           padgraph_batch=attn, **kwargs).logits

    def _logits_hidden(self, out: Tensor) -> tuple[Tensor, Tensor | None]:
        """(fp32 logits, hidden or None) of `_forward`'s rows [n, V or H]."""
        return (self.logits(out), out) if self.draft else (out.float(), None)

    def _serving(self):
        """The model's attention set to padgraph's for an eager forward; a traced one (a whole
        body compiled) runs inside the caller's (`Decoder`'s) setting."""
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return serving(self.hf, self.experts, self.horizons)

    def _draft_only(self, what: str) -> None:
        if not self.draft:
            raise pg.ContractRuntimeError(
                f"padgraph.hf.Target.{what}: this Target serves no draft head (draft=False) and keeps no "
                f"hidden state; build Target(model, max_context, draft=True) for EAGLE's programs")
