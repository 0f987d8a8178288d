"""Tree (speculative draft) verification attention, paged and graph-safe; torch reference beside it.

Request r has k draft tokens, already stored at positions `seq_lens[r]-k .. seq_lens[r]-1`. Draft
token i sees every prefix position `< seq_lens[r]-k` and draft token j iff `tree_mask[r, i, j]`
(a chain is lower-triangular). Padded requests (seq_lens 1, row 0, mask of ones) have
seq_lens < k: the prefix is `max(seq_lens-k, 0)` and positions < 0 are never read.

The kernel is the decode split-KV kernel with NUM_Q = k queries per request and the tree mask
applied to the tail positions (see `attention_decode.py`).
"""
from __future__ import annotations

import torch

from .attention_decode import (SplitPolicy, attend_reference, check_paged_args, check_tree_args,
                               default_sm_scale, gather_kv, split_kv_attention)
from .attention_meta import PagedMeta
from .kv import resolve_impl


def tree_visible(tree_mask_r, seq_len: int):
    """[k, seq_len] bool: which positions each of the k draft tokens of one request sees."""
    k = tree_mask_r.shape[0]
    first_draft = seq_len - k  # position of draft token 0 (negative for padded requests)
    pos = torch.arange(seq_len, device=tree_mask_r.device)
    in_prefix = (pos < max(first_draft, 0)).expand(k, seq_len)
    j = (pos - first_draft).clamp(0, k - 1)  # draft index of each tail position
    in_tree = tree_mask_r[:, j] & (pos >= max(first_draft, 0))
    return in_prefix | in_tree


def tree_verify_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                    seq_lens, tree_mask, sm_scale=None):
    """Torch reference (and CPU path) of `tree_verify_attention`."""
    bs, k = tree_mask.shape[:2]
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    o = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    for r, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        k_r, v_r = gather_kv(k_cache, v_cache, req_to_token, row, n)
        visible = tree_visible(tree_mask[r], n)
        o[r * k:(r + 1) * k] = attend_reference(q[r * k:(r + 1) * k], k_r, v_r, visible,
                                                sm_scale).to(q.dtype)
    return o


def tree_verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                          tree_mask, sm_scale=None, num_splits=None, impl="auto", pdl=False):
    """Draft-tree attention: q [bs * k, n_q_heads, head_dim] (request-major), tree_mask
    [bs, k, k] bool -> [bs * k, n_q_heads, v_head_dim]. `pdl`: `SplitPolicy.pdl` (the kernel
    just before may write only q and the k tree tokens' K / V)."""
    bs, _ = check_tree_args(q, tree_mask)
    check_paged_args(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    if resolve_impl(impl, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    tree_mask) == "torch":
        return tree_verify_attention_reference(q, k_cache, v_cache, req_to_token,
                                               req_pool_indices, seq_lens, tree_mask, sm_scale)
    meta = PagedMeta.tree(req_to_token, req_pool_indices, seq_lens, tree_mask.contiguous())
    return split_kv_attention(q, k_cache, v_cache, meta, sm_scale,
                              SplitPolicy(num_splits, pdl=pdl))
