"""Paged-attention plumbing every target and draft head shares (the Llama reference, the HF
target, the DeepSeek MLA target, the EAGLE and MTP heads, the runner bodies).

KV layout (as SGLang's): per layer `k_cache[slot, kv_head, head_dim]`, `req_to_token[row, pos]`
maps a request's position to its slot; slot 0 and row 0 are sinks for padded lanes. An
`AttnPlan` is what every layer needs for one call, derived from a `Batch` once per forward;
`PagedForwards` turns a target's `_run` into the decode / extend / verify forwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from .batch import Batch

AttendFn = Callable[..., Tensor]  # (q [n,Hq,D], k_cache, v_cache, sm_scale=None) -> [n,Hq,D]


@dataclass(frozen=True)
class AttnPlan:
    """What every layer needs for one call, derived from the `Batch` once per forward: where new
    K/V go and how queries attend (the attention kernel with the batch's metadata bound; a
    caller may pass the layer's `sm_scale`, default head_dim ** -0.5)."""
    out_cache_loc: Tensor  # [n_tok] int64 slot per new token (0 = sink for padded lanes)
    attend: AttendFn


def _attn():
    from padgraph.backends.triton import attention
    return attention


def decode_batch(b: Batch) -> AttnPlan:
    """One new token per request at position seq_lens - 1."""
    fn = partial(_attn().decode_attention, req_to_token=b.req_to_token,
                 req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens, impl=b.impl)
    return AttnPlan(b.out_cache_loc, fn)


def extend_batch(b: Batch) -> AttnPlan:
    """Packed new tokens: request r's at q[qo_indptr[r]:qo_indptr[r+1]], ending at seq_lens[r]."""
    fn = partial(_attn().extend_attention, req_to_token=b.req_to_token,
                 req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
                 qo_indptr=b.qo_indptr, impl=b.impl)
    return AttnPlan(b.out_cache_loc, fn)


def tree_batch(b: Batch) -> AttnPlan:
    """k tree tokens per request at req_to_token positions seq_lens-k..seq_lens-1, tree_mask [bs,k,k]."""
    fn = partial(_attn().tree_verify_attention, req_to_token=b.req_to_token,
                 req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
                 tree_mask=b.tree_mask, impl=b.impl)
    return AttnPlan(b.out_cache_loc, fn)


def store_kv(k_cache, v_cache, loc, k, v):
    """k / v [n_tok, kv_heads, D] into the layer's cache at slots `loc` (the Triton store,
    imported on first use)."""
    from padgraph.backends.triton import store
    store.store_kv(k_cache, v_cache, loc, k, v)


def last_tokens(qo_indptr: Tensor) -> Tensor:
    """[bs] int64 row of each request's last token in a packed extend (a request without
    tokens, a padded one, gives the row before its start, clamped to 0)."""
    return (qo_indptr[1:] - 1).clamp_min(0).long()


def dense_forward(model, input_ids: Tensor, last_only: bool = False):
    """A target's cacheless forward, the oracle its paged forwards are checked against:
    [B, T] tokens -> (logits [B, T, V] fp32, or [B, V] of the last position with last_only;
    hidden [B, T, H]). Needs the model's `embed`, `layers` (each with
    `forward_dense(x, positions, rope)`), `rope`, `norm` and `logits`."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    x = model.embed(input_ids)
    for layer in model.layers:
        x = layer.forward_dense(x, positions, model.rope)
    hidden = model.norm(x)
    return model.logits(hidden[:, -1] if last_only else hidden), hidden


class PagedForwards:
    """The paged forwards of a target, given its `_run(ids, positions, attn, kv) -> hidden` and
    `logits(hidden)`: every target (single GPU, one tensor-parallel rank, the MLA target)
    shares them. Each takes the tokens, their positions and one `Batch`; the attention plan
    comes from `_decode_batch` / `_extend_batch` / `_tree_batch` of it: GQA's here, the MLA
    target overrides them."""

    def _decode_batch(self, b: Batch) -> AttnPlan:
        return decode_batch(b)

    def _extend_batch(self, b: Batch) -> AttnPlan:
        return extend_batch(b)

    def _tree_batch(self, b: Batch) -> AttnPlan:
        return tree_batch(b)

    def forward_decode(self, input_ids, positions, batch: Batch):
        """[bs] tokens → (logits [bs, V] fp32, hidden [bs, H])."""
        hidden = self._run(input_ids, positions, self._decode_batch(batch), batch.kv)
        return self.logits(hidden), hidden

    def forward_extend(self, input_ids, positions, batch: Batch):
        """Packed [n_tok] tokens → (logits at each request's last token [bs, V], hidden [n_tok, H])."""
        hidden = self.forward_extend_hidden(input_ids, positions, batch)
        return self.logits(hidden[last_tokens(batch.qo_indptr)]), hidden

    def forward_extend_hidden(self, input_ids, positions, batch: Batch):
        """Packed [n_tok] tokens → hidden [n_tok, H] only (the prefill program: the caller takes
        the lm_head of the requests' last rows, not of every padded request)."""
        return self._run(input_ids, positions, self._extend_batch(batch), batch.kv)

    def forward_verify(self, input_ids, positions, batch: Batch):
        """[bs*k] tree tokens (seq_lens = prefix + k) → (logits [bs*k, V], hidden [bs*k, H])."""
        hidden = self.forward_verify_hidden(input_ids, positions, batch)
        return self.logits(hidden), hidden

    def forward_verify_hidden(self, input_ids, positions, batch: Batch):
        """`forward_verify`'s hidden [bs*k, H] only (greedy verification takes `greedy_ids` of
        it: no [bs*k, V] fp32 logits written and read back)."""
        return self._run(input_ids, positions, self._tree_batch(batch), batch.kv)

    def greedy_ids(self, hidden: Tensor) -> Tensor:
        """argmax of `logits(hidden)` [n] int64 (ties to the lower id)."""
        return self.logits(hidden).argmax(-1)
