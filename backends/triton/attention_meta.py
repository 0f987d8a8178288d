"""The paged metadata an attention launch reads besides q and the cache, as one frozen value.

Every paged kernel (GQA split-KV decode and tree verify, the MLA kernel in its three modes)
reads the same request metadata: `req_to_token [n_req_rows, max_context]` (slot of each
(row, position); row 0 and slot 0 are the sinks of padded lanes, `kv.py`),
`req_pool_indices [bs]` and `seq_lens [bs]`. A mode adds what its queries need:

    DECODE  one query a request, seeing positions 0 .. seq_len - 1
    TREE    k draft queries a request (request-major), the last k positions masked by
            `tree_mask [bs, k, k]` bool
    CAUSAL  packed new tokens, request r's at q[qo_indptr[r] : qo_indptr[r + 1]], each seeing
            up to its own position (`qo_indptr [bs + 1]`)

`PagedMeta.decode` / `.tree` / `.causal` build the value and check what their mode needs, from
shapes and dtypes only (no value is read: graph-safe). The value holds the caller's tensors as
given: a captured graph binds their addresses, a replay reads their new contents.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from padgraph.errors import ContractTypeError, ContractValueError, mismatch

DECODE, TREE, CAUSAL = 0, 1, 2  # the MLA kernel's MODE constexpr (it tests MODE == 1, == 2)
MODE_NAMES = {DECODE: "decode", TREE: "tree", CAUSAL: "causal"}
INDEX_DTYPES = (torch.int32, torch.int64)
_PROGRAM = "paged attention"


def check_tree_mask(tree_mask: Tensor) -> tuple[int, int]:
    """tree_mask [bs, k, k] bool; returns (bs, k)."""
    if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2] \
            or tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be [bs, k, k] bool; got {tuple(tree_mask.shape)} "
                         f"{tree_mask.dtype}")
    return tree_mask.shape[0], tree_mask.shape[1]


def check_qo_indptr(qo_indptr: Tensor, bs: int) -> None:
    """qo_indptr [bs + 1] int32 / int64."""
    if tuple(qo_indptr.shape) != (bs + 1,) or qo_indptr.dtype not in INDEX_DTYPES:
        raise ValueError(f"qo_indptr must be [bs+1={bs + 1}] int32/int64; "
                         f"got {tuple(qo_indptr.shape)} {qo_indptr.dtype}")


@dataclass(frozen=True, eq=False)  # eq by identity: fields are tensors
class PagedMeta:
    """What one paged attention call reads besides q and the cache (module doc). Build it with
    `decode`, `tree` or `causal`; construction refuses a mode without its metadata, metadata
    of another mode, a num_q that is not the mode's, and request rows or lengths that are not
    [bs] int."""
    req_to_token: Tensor      # [n_req_rows, max_context] int: slot of each (row, position)
    req_pool_indices: Tensor  # [bs] int: each request's row (0: a padded lane)
    seq_lens: Tensor          # [bs] int: each request's length, its new tokens included
    mode: int = DECODE        # DECODE / TREE / CAUSAL
    num_q: int = 1            # queries a request: 1 (DECODE, CAUSAL: packed by qo_indptr), k (TREE)
    tree_mask: Tensor | None = None  # TREE: [bs, k, k] bool
    qo_indptr: Tensor | None = None  # CAUSAL: [bs + 1] int

    def __post_init__(self):
        if self.mode not in MODE_NAMES:
            raise ContractValueError(mismatch(_PROGRAM, None, "mode", "DECODE (0), TREE (1) "
                                              "or CAUSAL (2)", self.mode))
        self._check_requests()
        self._check_mode()

    def _check_requests(self) -> None:
        """req_to_token 2-d; req_pool_indices and seq_lens [bs] int."""
        if self.req_to_token.dim() != 2:
            raise ContractValueError(mismatch(_PROGRAM, "req_to_token", "shape",
                                              "[n_req_rows, max_context]",
                                              tuple(self.req_to_token.shape)))
        rows = self.req_pool_indices
        bs = rows.shape[0] if rows.dim() == 1 else "n"
        for field in ("req_pool_indices", "seq_lens"):
            t = getattr(self, field)
            if tuple(t.shape) != (bs,):
                raise ContractValueError(mismatch(_PROGRAM, field, "shape", f"[bs={bs}]",
                                                  tuple(t.shape)))
            if t.dtype not in INDEX_DTYPES:
                raise ContractTypeError(mismatch(_PROGRAM, field, "dtype", "int32 or int64",
                                                 t.dtype))

    def _check_mode(self) -> None:
        """The mode's own metadata, none of another mode's, and its num_q."""
        name = MODE_NAMES[self.mode]
        for field, mode in (("tree_mask", TREE), ("qo_indptr", CAUSAL)):
            given = getattr(self, field) is not None
            if given != (self.mode == mode):
                raise ContractValueError(mismatch(
                    _PROGRAM, field, f"presence in {name} mode",
                    f"given in {MODE_NAMES[mode]} mode only", "a tensor" if given else "None"))
        k = 1
        if self.mode == TREE:
            bs, k = check_tree_mask(self.tree_mask)
            if bs != self.bs:
                raise ContractValueError(mismatch(_PROGRAM, "tree_mask", "shape",
                                                  f"[bs={self.bs}, k, k]",
                                                  tuple(self.tree_mask.shape)))
        if self.mode == CAUSAL:
            check_qo_indptr(self.qo_indptr, self.bs)
        if self.num_q != k:
            raise ContractValueError(mismatch(_PROGRAM, None, f"num_q in {name} mode",
                                              k if self.mode == TREE else "1", self.num_q))

    @classmethod
    def decode(cls, req_to_token: Tensor, req_pool_indices: Tensor,
               seq_lens: Tensor) -> "PagedMeta":
        """One query a request, seeing positions 0 .. seq_lens[r] - 1."""
        return cls(req_to_token, req_pool_indices, seq_lens)

    @classmethod
    def tree(cls, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
             tree_mask: Tensor) -> "PagedMeta":
        """k = tree_mask.shape[1] draft queries a request at its last k positions; draft i sees
        the prefix and draft j iff tree_mask[r, i, j]."""
        num_q = tree_mask.shape[1] if tree_mask.dim() == 3 else 0  # a bad mask fails the check
        return cls(req_to_token, req_pool_indices, seq_lens, TREE, num_q, tree_mask=tree_mask)

    @classmethod
    def causal(cls, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
               qo_indptr: Tensor) -> "PagedMeta":
        """Packed new tokens (a causal extend): request r's at q[qo_indptr[r] : qo_indptr[r+1]],
        at its last positions, each seeing up to its own; tokens past qo_indptr[bs] pad."""
        return cls(req_to_token, req_pool_indices, seq_lens, CAUSAL, qo_indptr=qo_indptr)

    @property
    def bs(self) -> int:
        """Requests of the call (padded lanes included)."""
        return self.req_pool_indices.shape[0]

    @property
    def max_context(self) -> int:
        """Positions a request row can hold: the width of req_to_token."""
        return self.req_to_token.shape[1]
