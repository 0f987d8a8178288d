"""The paged KV cache padgraph.hf owns: per attention site (one attention call of a forward:
a layer, or each call of a layer that calls attention twice) `[slots, kv_heads, k_dim]` keys and
`[slots, kv_heads, v_dim]` values, and an SGLang-style `req_to_token[row, pos] -> slot` table.
The widths are the ones the model's layers hand the attention function (`support.survey`), not
the config's `head_dim`: MLA's keys and values differ, Gemma 4's layers differ.

Layout is static: request row r in 1..max_batch owns slots `1 + (r - 1) * max_len + pos`, so the
table never changes after allocation. Row 0 and slot 0 are the sinks: a padded lane (row 0,
position 0) writes slot 0 and reads only slot 0.

A hybrid model's recurrent states (`recurrent.StateSpec`: convolution windows, SSM and delta-net
states) live beside the keys and values in a pool of `1 + max_batch` rows per state: row r is
request row r's, row 0 the sink (`recurrent.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import recurrent
from .recurrent import StateSpec

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
    """Keys and values of every layer over `1 + max_batch * max_len` slots, the slot table, and
    the recurrent pool: one `[1 + max_batch, *spec.shape]` tensor per recurrent state."""

    def __init__(self, shape: Shape, max_batch: int, max_len: int, device):
        self.shape, self.max_batch, self.max_len = shape, max_batch, max_len
        n_slots = 1 + max_batch * max_len
        # [k0, v0, k1, v1, ...] per site: one flat list, bound as one pytree state
        self.kv = [torch.zeros(n_slots, site.n_kv_heads, dim, dtype=shape.dtype, device=device)
                   for site in shape.sites for dim in (site.k_dim, site.v_dim)]
        self.req_to_token = slot_table(max_batch, max_len, device)        # [1 + max_batch, max_len] int32
        self.recurrent = recurrent.pool(shape.states, max_batch, device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.kv, *self.recurrent])


def slot_table(max_batch: int, max_len: int, device) -> torch.Tensor:
    """req_to_token [1 + max_batch, max_len] int32: row 0 all sink, row r >= 1 contiguous slots."""
    pos = torch.arange(max_len, dtype=torch.int32)
    rows = torch.arange(max_batch, dtype=torch.int32)[:, None] * max_len + 1 + pos   # [max_batch, max_len]
    return torch.cat([torch.zeros(1, max_len, dtype=torch.int32), rows]).to(device)
