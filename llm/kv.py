"""Paged KV storage in SGLang's layout, allocated once, and host-side free lists for it.

Layout: per layer `k[layer] [n_slots, n_kv_heads, head_dim]`, `v[layer] [n_slots, n_kv_heads,
v_head_dim]`; `req_to_token [n_req_rows, max_context] int32` maps (request row, position) to a
slot. Slot 0 and request row 0 are sinks: padded lanes write their KV to slot 0 and read through
row 0 (whose entries are all 0), so a padded lane never touches a real request's state. Slot 1
and request row 1 are canaries (`pg.State(canary=1)`): no call may write them, and the runners
check on every replay that none did. Requests get ids from `FIRST` on.
"""
from __future__ import annotations

import torch

SINK, CANARY = 0, 1    # slot / request row: padded lanes' sink; a canary no call may write
FIRST = 2              # the first slot and request row a request gets


class KVCache:
    """Per-layer K and V pools plus the request→slot map; storage is fixed after construction.

    A CUDA graph binds these tensors' addresses, so nothing here ever reallocates them.
    """

    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int,
                 head_dim: int | tuple[int, int], max_context: int, n_req_rows: int,
                 dtype: torch.dtype, device: torch.device | str):
        """head_dim: K's and V's width per head, or (K's, V's) where they differ."""
        if n_slots < FIRST or n_req_rows < FIRST:
            raise ValueError(
                f"n_slots and n_req_rows must be >= {FIRST} (slot 0 and row 0 are sinks, 1 canaries); "
                f"got n_slots={n_slots}, n_req_rows={n_req_rows}")
        head_dim, v_head_dim = head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim)
        self.n_layers, self.n_slots, self.n_kv_heads = n_layers, n_slots, n_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.max_context, self.n_req_rows = max_context, n_req_rows
        self.dtype, self.device = dtype, torch.device(device)
        # [n_slots, n_kv_heads, head_dim] per layer
        self.k = [torch.zeros(n_slots, n_kv_heads, head_dim, dtype=dtype, device=self.device)
                  for _ in range(n_layers)]
        # [n_slots, n_kv_heads, v_head_dim] per layer
        self.v = [torch.zeros(n_slots, n_kv_heads, self.v_head_dim, dtype=dtype,
                              device=self.device) for _ in range(n_layers)]
        # [n_req_rows, max_context]; zeros = every position maps to the sink slot
        self.req_to_token = torch.zeros(n_req_rows, max_context, dtype=torch.int32,
                                        device=self.device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of layer i."""
        return self.k[i], self.v[i]

    def nbytes(self) -> int:
        """Bytes held by the K/V pools and the request map."""
        pools = sum(t.numel() * t.element_size() for t in self.k + self.v)
        return pools + self.req_to_token.numel() * self.req_to_token.element_size()


class _FreeList:
    """Ids FIRST .. n-1 (0 is the sink, 1 the canary), kept on a stack (fresh pools give 2, 3, ...)."""

    kind = "id"

    def __init__(self, n: int):
        if n <= FIRST:
            raise ValueError(f"a {type(self).__name__} needs n >= {FIRST + 1} (ids 0 and 1 are reserved); got {n}")
        self.n = n
        self._free = list(range(n - 1, FIRST - 1, -1))  # stack: pop() gives the lowest id
        self._is_free = [False] * FIRST + [True] * (n - FIRST)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def all_free(self) -> bool:
        """Every id a request can get is free (nothing leaked)."""
        return len(self._free) == self.n - FIRST

    def alloc(self, n: int) -> list[int]:
        """n distinct ids, never 0 or 1; raises when fewer than n are free (nothing is taken then)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {self.kind}s: {n}")
        if n > len(self._free):
            raise RuntimeError(
                f"{type(self).__name__} exhausted: asked for {n} {self.kind}s, "
                f"{len(self._free)} of {self.n - FIRST} free (ids 0 and 1 are the reserved sink and canary)")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._is_free[i] = False
        return ids

    def free(self, ids) -> None:
        """Return ids to the pool; freeing 0, 1, an out-of-range id or a free id raises."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not FIRST <= i < self.n:
                raise ValueError(f"cannot free {self.kind} {i}: valid ids are {FIRST} .. {self.n - 1}")
            if self._is_free[i]:
                raise ValueError(f"{self.kind} {i} freed twice")
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate {self.kind}s in one free(): {sorted(ids)}")
        for i in reversed(sorted(ids)):
            self._is_free[i] = True
            self._free.append(i)


class SlotAllocator(_FreeList):
    """Free list of KV slots 2 .. n_slots-1 (slot 0 is the sink padded lanes write to, 1 a canary)."""

    kind = "slot"


class RowAllocator(_FreeList):
    """Free list of req_to_token rows 2 .. n_rows-1 (row 0 is the sink padded lanes read, 1 a canary)."""

    kind = "row"


def new_cache(target, n_layers: int, n_slots: int, max_context: int, n_req_rows: int,
              tree_nodes: int = 0):
    """The target's paged cache: a hybrid target's K/V and recurrent pools (its
    `new_hybrid_cache`, with room for the per-node recurrent states of a verify of `tree_nodes`
    nodes a request; 0: no verify), its own `new_cache` (e.g. a latent cache), else K/V pools."""
    if hasattr(target, "new_hybrid_cache"):
        return target.new_hybrid_cache(n_slots, max_context, n_req_rows, tree_nodes)
    if hasattr(target, "new_cache"):
        return target.new_cache(n_layers, n_slots, max_context, n_req_rows)
    return _kv_pools(target, n_layers, n_slots, max_context, n_req_rows)


def new_draft_cache(target, n_slots: int):
    """The draft head's one-layer cache (its req_to_token is unused: the runners bind the
    target's): the target's `new_draft_cache` where it has one; else the head's layer is of the
    target's kind (`new_cache` of one layer), except for a hybrid target, whose head is an
    attention layer (`EagleHead`): K/V pools."""
    if hasattr(target, "new_draft_cache"):
        return target.new_draft_cache(n_slots)
    if hasattr(target, "new_hybrid_cache"):
        return _kv_pools(target, 1, n_slots, 2, FIRST)
    return new_cache(target, 1, n_slots, 2, FIRST)


def _kv_pools(target, n_layers: int, n_slots: int, max_context: int, n_req_rows: int) -> KVCache:
    cfg, p = target.cfg, target.lm_head.weight
    return KVCache(n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, max_context, n_req_rows,
                   p.dtype, p.device)


def cache_state(cache) -> dict:
    """A cache's bound state by name, req_to_token aside: its `state()`, or K/V pools."""
    return cache.state() if hasattr(cache, "state") else {"k_cache": cache.k, "v_cache": cache.v}
