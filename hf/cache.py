"""The paged KV cache padgraph.hf owns: per-layer `[slots, kv_heads, head_dim]` keys and values and
an SGLang-style `req_to_token[row, pos] -> slot` table.

Layout is static: request row r in 1..max_batch owns slots `1 + (r - 1) * max_len + pos`, so the
table never changes after allocation. Row 0 and slot 0 are the sinks: a padded lane (row 0,
position 0) writes slot 0 and reads only slot 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SINK = 0


@dataclass(frozen=True)
class Shape:
    """What the cache must hold for one model: layers, KV heads, head dim, dtype."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class PagedCache:
    """Keys and values of every layer over `1 + max_batch * max_len` slots, and the slot table."""

    def __init__(self, shape: Shape, max_batch: int, max_len: int, device):
        self.shape, self.max_batch, self.max_len = shape, max_batch, max_len
        n_slots = 1 + max_batch * max_len
        kv = (n_slots, shape.n_kv_heads, shape.head_dim)
        # [k0, v0, k1, v1, ...]: one flat list, bound as one pytree state
        self.kv = [torch.zeros(kv, dtype=shape.dtype, device=device) for _ in range(2 * shape.n_layers)]
        self.req_to_token = slot_table(max_batch, max_len, device)        # [1 + max_batch, max_len] int32

    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[2 * idx], self.kv[2 * idx + 1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)


def slot_table(max_batch: int, max_len: int, device) -> torch.Tensor:
    """req_to_token [1 + max_batch, max_len] int32: row 0 all sink, row r >= 1 contiguous slots."""
    pos = torch.arange(max_len, dtype=torch.int32)
    rows = torch.arange(max_batch, dtype=torch.int32)[:, None] * max_len + 1 + pos   # [max_batch, max_len]
    return torch.cat([torch.zeros(1, max_len, dtype=torch.int32), rows]).to(device)
