"""The attention function padgraph.hf registers with Hugging Face's `AttentionInterface`.

HF's attention modules compute q, k, v (RoPE applied) and hand them to the registered function
with the layer's own `scaling`, `sliding_window`, `softcap` and learned sink logits (`s_aux`,
gpt-oss); where HF's mask for the layer limits it further (a sliding window the layer does not
pass on, Llama 4's chunks), the Target binds that rule to the module while it serves
(`HORIZON`, read from the mask factory: `masks`); the model runs with
`use_cache=False`, so HF keeps no cache of its own. padgraph's per-call metadata rides in the
model's `**kwargs` as `padgraph_batch`, a `Prefill` or a `Decode`, built by the `Target`'s
forwards from padgraph.llm's `Batch`. The function stores k and v into the paged cache at the
batch's slots and attends over it. Each attention *call* of a forward owns a cache site (`cache.Shape`): a layer
that calls attention twice (DiffLlama) has two, found by counting the calls of a `layer_idx`
within one forward (`Sites`); a site's keys and values have their own widths (MLA: k 192, v 128).

Padded lanes (request row 0, position 0, seq_len 1) write only the sink slot 0 and read only it.

A decode whose layers are compiled as regions (one graph every layer shares) reads its layer's
cache from the attention module itself, bound for the call (`bound`), not through `layer_idx`:
dynamo guards on a Python int it indexes with, and would compile a graph per layer.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch

from .errors import NotBoundError

NAME = "padgraph"
BOUND_KV = "_padgraph_kv"     # an attention module's (k_cache, v_cache) while a regional decode runs
HORIZON = "_padgraph_horizon"  # an attention module's window and chunk (`Target.horizons`) while served


@dataclass(frozen=True)
class Layer:
    """What one attention call asks for: the softmax scale, window, logit soft-cap and the
    per-head sink logits (`s_aux` [h]: a key every query sees, with no value), or None; the
    window and chunk of HF's own mask for the layer where its mask factory says so (`masks`)."""

    scaling: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = field(default=None, compare=False)
    chunk: int | None = None    # keys of the query's own chunk of positions only (HF's chunked mask)


class Sites:
    """Which cache site an attention call writes and reads: `index[layer_idx]` holds the sites of
    that layer's calls in call order; `calls` counts this forward's calls per layer (a batch
    object lives for one forward, so the count restarts with it)."""

    def __init__(self, index: dict[int, tuple[int, ...]]):
        self.index, self.calls = index, {}

    def call(self, module) -> int:
        """Which of its layer's calls this is (0 for a layer that calls attention once)."""
        idx = module.layer_idx
        if len(self.index[idx]) == 1:
            return 0
        n = self.calls.get(idx, 0)
        self.calls[idx] = n + 1
        return n % len(self.index[idx])

    def site(self, module) -> int:
        return self.index[module.layer_idx][self.call(module)]

    def fresh(self) -> "Sites":
        return Sites(self.index)


@dataclass
class Prefill:
    """Left-padded prompts, run eagerly: every token's K/V is stored, attention is over the prompt."""

    k: list                     # per site [slots, kv_heads, k_dim]
    v: list                     # per site [slots, kv_heads, v_dim]
    slots: torch.Tensor         # [n, P] int64: the slot each token writes (left pads: sink 0)
    positions: torch.Tensor     # [n, P] int64: the token's position in its request
    valid: torch.Tensor         # [n, P] bool: False on left pads
    sites: Sites

    def attend(self, module, q, k, v, layer: Layer):
        """q [n, h, P, d], k [n, kv_heads, P, d], v [n, kv_heads, P, dv] -> [n, P, h, dv]."""
        site = self.sites.site(module)
        store(self.k[site], self.v[site], self.slots.reshape(-1), k, v)
        visible = self.visible(layer)                                                  # [n, P, P]
        own = torch.eye(visible.shape[-1], dtype=torch.bool, device=q.device)          # a left pad sees itself
        return attend(q, k, v, visible | own, layer)                                   # (no all-masked row: no NaN)

    def visible(self, layer: Layer) -> torch.Tensor:
        """[n, P, P] bool: what a real query of this prefill sees (causal, own request, window)."""
        P = self.valid.shape[1]
        causal = torch.ones(P, P, dtype=torch.bool, device=self.valid.device).tril()
        return causal & self.valid[:, None, :] & in_window(self.positions[:, :, None], self.positions[:, None, :],
                                                          layer)


@dataclass
class Decode:
    """One new token per request over the paged cache (a decode program's padded view: a padded
    lane has row 0, position 0, slot 0 and length 1)."""

    k: list                     # per site [slots, kv_heads, k_dim]
    v: list                     # per site [slots, kv_heads, v_dim]
    req_to_token: torch.Tensor  # [rows, max_context] int32
    rows: torch.Tensor          # [bs] int64: the request's row (padded lanes: 0)
    positions: torch.Tensor     # [bs] int64: the new token's position (padded lanes: 0)
    out_cache_loc: torch.Tensor  # [bs] int64: the slot it writes (padded lanes: 0)
    seq_lens: torch.Tensor      # [bs] int32: keys it reads, itself included (padded lanes: 1)
    sites: Sites
    kernel: object = None       # Triton paged decode attention, or None for the torch path
    bound: bool = False         # each attention module holds its sites' (k_cache, v_cache): see `bound`

    def attend(self, module, q, k, v, layer: Layer):
        """q [bs, h, 1, d], k [bs, kv_heads, 1, d], v [bs, kv_heads, 1, dv] -> [bs, 1, h, dv]."""
        k_cache, v_cache = self.caches(module)
        store(k_cache, v_cache, self.out_cache_loc, k, v)
        if (self.kernel is not None and kernel_serves(layer, self.req_to_token.shape[1])
                and q.shape[-1] == k.shape[-1] == v.shape[-1]):
            o = self.kernel(q[:, :, 0], k_cache, v_cache, self.req_to_token, self.rows, self.seq_lens,
                            sm_scale=layer.scaling)                                    # [bs, h, d]
            return o[:, None]
        return self.gathered(q, k_cache, v_cache, self.seq_lens, layer)

    def caches(self, module) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's site's (k_cache, v_cache): held by the module in a regional decode (one
        graph for every layer: no layer_idx to specialise on), else looked up by site."""
        if self.bound:
            pairs = getattr(module, BOUND_KV)      # its length, not layer_idx: no guard on which layer
            return pairs[0] if len(pairs) == 1 else pairs[self.sites.call(module)]
        site = self.sites.site(module)
        return self.k[site], self.v[site]

    def gathered(self, q, k_cache, v_cache, seq_lens, layer: Layer):
        """The torch path: each lane's row of the cache, masked to its length and window."""
        slots = self.req_to_token[self.rows].long()                                    # [bs, L]
        keys = k_cache[slots].transpose(1, 2)                                          # [bs, kv_heads, L, d]
        values = v_cache[slots].transpose(1, 2)
        cols = torch.arange(slots.shape[1], device=q.device)                           # [L]
        visible = cols[None, :] < seq_lens[:, None]                                    # [bs, L]
        visible = visible & in_window(self.positions[:, None], cols[None, :], layer)
        return attend(q, keys, values, visible[:, None, :], layer)


def with_rule(layer: Layer, rule: tuple | None) -> Layer:
    """`layer` with a mask rule (window, chunk) in place of what its call passed (`HORIZON`, as
    `Target.horizons` resolves it); unchanged for None."""
    if rule is None:
        return layer
    return dataclasses.replace(layer, sliding_window=rule[0], chunk=rule[1])


def kernel_serves(layer: Layer, max_len: int) -> bool:
    """The Triton decode kernel attends to every key below seq_len, unscaled logits: no soft-cap,
    no sink logits, and a window or chunk only where it covers the whole row."""
    return (layer.softcap is None and layer.sinks is None
            and (layer.sliding_window is None or layer.sliding_window >= max_len)
            and (layer.chunk is None or layer.chunk >= max_len))


def in_window(q_pos, k_pos, layer: Layer):
    """For keys at or before the query: HF's sliding rule (a key is visible while q_pos - k_pos <
    window) and chunked rule (while it is in the query's chunk, q_pos // chunk == k_pos // chunk,
    i.e. k_pos >= the chunk's first position), positions counted from the request's first token;
    True without either."""
    visible = torch.ones((), dtype=torch.bool, device=q_pos.device)
    if layer.sliding_window is not None:
        visible = visible & ((q_pos - k_pos) < layer.sliding_window)
    if layer.chunk is not None:
        # the chunk's first position, not an equality of two floor divisions: inductor (torch 2.13)
        # compiles `q // c == arange(n) // c` wrongly for most c (16 among them), a start bound right
        visible = visible & (k_pos >= q_pos - torch.remainder(q_pos, layer.chunk))
    return visible


def store(k_cache, v_cache, loc, k, v) -> None:
    """k / v [b, kv_heads, t, d] into slots loc [b * t] (request-major) of the layer's cache."""
    k_cache.index_copy_(0, loc, k.transpose(1, 2).reshape(-1, *k_cache.shape[1:]).to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.transpose(1, 2).reshape(-1, *v_cache.shape[1:]).to(v_cache.dtype))


def attend(q, k, v, visible, layer: Layer):
    """Softmax attention, GQA by head repeat: torch's SDPA, or in fp32 with the logit soft-cap and
    sink logits as HF's eager paths apply them (SDPA has neither).

    q [b, h, nq, d], k [b, kv_heads, nk, d], v [b, kv_heads, nk, dv], visible [b, nq, nk] bool
    -> [b, nq, h, dv]. Every query must see at least one key (a prefill's left pads see themselves).
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)      # [b, h, nk, d / dv]
    mask = visible[:, None]                                                            # [b, 1, nq, nk]
    if layer.softcap is None and layer.sinks is None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                                             scale=layer.scaling)     # [b, h, nq, dv]
        return o.transpose(1, 2)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * layer.scaling     # [b, h, nq, nk]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:   # one more logit per head, whose value is zero: it only takes probability
        sink = layer.sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)   # [b, h, nq, 1]
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, v.float()).transpose(1, 2).to(q.dtype)                      # [b, nq, h, dv]


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as attn_implementation "padgraph": (attn_output [b, q, h, d], None).
    HF's layers pass `sliding_window`, `softcap` and `s_aux` where they have them; padgraph's
    Target passes `padgraph_batch` (where this call's K/V go and what its queries read). A batch
    with an `observe` method (the Decoder's probe) also sees HF's mask and every keyword."""
    padgraph_batch = kwargs.get("padgraph_batch")
    if padgraph_batch is None:
        raise NotBoundError(f"attention implementation {NAME!r} ran outside a padgraph.hf Target's forward "
                            f"(layer {type(module).__name__} {getattr(module, 'layer_idx', '?')}): "
                            f"padgraph_batch must be passed, got none")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    layer = Layer(scaling, kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux"))
    layer = with_rule(layer, getattr(module, HORIZON, None))   # the layer's HF mask rule, bound while serving
    observe = getattr(padgraph_batch, "observe", None)
    if observe is not None:
        observe(module, query, key, value, layer, attention_mask, kwargs)
    return padgraph_batch.attend(module, query, key, value, layer), None


@contextlib.contextmanager
def bound(modules, k: list, v: list, sites: Sites):
    """For a decode whose layers are compiled regions: every attention module holds its sites'
    (k_cache, v_cache) pairs of `k` / `v` for the call (`batch.bound` tells `attend` to read them
    there). `modules` None: nothing to bind."""
    if modules is None:
        yield
        return
    for m in modules:
        setattr(m, BOUND_KV, tuple((k[s], v[s]) for s in sites.index[m.layer_idx]))
    try:
        yield
    finally:
        for m in modules:
            delattr(m, BOUND_KV)


def register() -> None:
    """Register `attention` under NAME with HF's AttentionInterface (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention)
