"""The paged cache of a `padgraph.hf.Target`, in padgraph.llm's layout: per attention site (one
attention call of a forward: a layer, or each call of a layer that calls attention twice)
`k[site] [n_slots, kv_heads, k_dim]` keys and `v[site] [n_slots, kv_heads, v_dim]` values, and
padgraph.llm's `req_to_token [n_req_rows, max_context]` table, which its engine's admission
writes. The widths are the ones the model's layers hand the attention function
(`support.survey`), not the config's `head_dim`: MLA's keys and values differ, Gemma 4's layers
differ.

A hybrid model's recurrent states (`recurrent.StateSpec`: convolution windows, SSM and delta-net
states) live beside them in pools of one row per request row, `[n_req_rows, *spec.shape]`: row r
is request row r's, row 0 the sink padded lanes read and write (`recurrent.py`). The engine's
programs bind the convolution windows as `conv_state` and the other recurrent states as
`ssm_state` (padgraph.llm's names for a recurrent pool).

Slot 0 and request row 0 are the sinks, slot 1 and row 1 padgraph.llm's canaries: a padded lane
(row 0, position 0) writes slot 0 and reads only slot 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .recurrent import CONV, StateSpec

SINK = 0


@dataclass(frozen=True)
class Site:
    """One attention call's cache: its layer, KV heads, key and value widths."""

    layer_idx: int
    n_kv_heads: int
    k_dim: int
    v_dim: int


@dataclass(frozen=True)
class Shape:
    """What the cache must hold for one model: its sites, in the order a forward calls them, the
    dtype, and the recurrent states of its mixers (none for an attention-only model)."""

    sites: tuple[Site, ...]
    dtype: torch.dtype
    states: tuple[StateSpec, ...] = ()

    def index(self) -> dict[int, tuple[int, ...]]:
        """layer_idx -> its sites, in call order (`attention.Sites`)."""
        out: dict[int, tuple[int, ...]] = {}
        for i, site in enumerate(self.sites):
            out[site.layer_idx] = out.get(site.layer_idx, ()) + (i,)
        return out


class PagedCache:
    """Keys and values of every site over `n_slots` slots, the slot table, and the recurrent
    pools (`conv`: the convolution windows, `ssm`: the other recurrent states, each in the order
    of `shape.states`). Storage is fixed after construction (graphs bind it)."""

    def __init__(self, shape: Shape, n_slots: int, max_context: int, n_req_rows: int, device):
        self.shape = shape
        self.k = [torch.zeros(n_slots, s.n_kv_heads, s.k_dim, dtype=shape.dtype, device=device)
                  for s in shape.sites]
        self.v = [torch.zeros(n_slots, s.n_kv_heads, s.v_dim, dtype=shape.dtype, device=device)
                  for s in shape.sites]
        self.req_to_token = torch.zeros(n_req_rows, max_context, dtype=torch.int32, device=device)
        pools = [torch.zeros(n_req_rows, *s.shape, dtype=s.dtype, device=device) for s in shape.states]
        self.conv = [p for p, s in zip(pools, shape.states) if s.kind == CONV]
        self.ssm = [p for p, s in zip(pools, shape.states) if s.kind != CONV]

    @property
    def recurrent(self) -> list[torch.Tensor]:
        """Every recurrent pool, in the order of `shape.states`."""
        return pools_of(self.shape.states, self)

    def state(self) -> dict:
        """The bound state a runner program declares for it (req_to_token aside): the pools it has."""
        named = {"k_cache": self.k, "v_cache": self.v, "conv_state": self.conv, "ssm_state": self.ssm}
        return {name: pools for name, pools in named.items() if pools}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.k, *self.v, *self.conv, *self.ssm,
                                                          self.req_to_token])


def pools_of(states: tuple[StateSpec, ...], kv) -> list[torch.Tensor]:
    """The recurrent pools of `kv` (a `PagedCache` or a runner's bound caches: `conv`, `ssm`) in
    the order of `states`."""
    by_kind = {CONV: iter(getattr(kv, "conv", ())), "other": iter(getattr(kv, "ssm", ()))}
    return [next(by_kind[CONV if s.kind == CONV else "other"]) for s in states]
