"""Paged extend (chunked prefill) attention, causal, graph-safe; torch reference beside it.

New tokens are packed along one token axis: request r owns `q[qo_indptr[r]:qo_indptr[r+1]]`;
with n_r of them they sit at positions `seq_lens[r]-n_r .. seq_lens[r]-1` (already stored) and
each attends to positions `0 .. its own`. Tokens at index >= qo_indptr[bs] are padding (output 0).

Grid (bs, cdiv(n_tok, BLOCK_M), n_q_heads) is fixed by the shapes; program (r, m, h) reads r's
token count from qo_indptr on the device and exits at once when tile m is past it, so no host
planning from values is needed and cost follows real lengths.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import (attend_reference, check_paged_args, default_sm_scale,
                               check_kernel_dtypes, gather_kv, mma, upcast_dots)
from .kv import resolve_impl


def extend_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                               qo_indptr, sm_scale=None):
    """Torch reference (and CPU path) of `extend_attention`."""
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    o = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])  # padding tokens stay 0
    indptr = qo_indptr.tolist()
    for r, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        lo, hi = indptr[r], indptr[r + 1]
        if hi == lo:
            continue
        k, v = gather_kv(k_cache, v_cache, req_to_token, row, n)
        pos_q = torch.arange(n - (hi - lo), n, device=q.device)  # [n_r]
        visible = torch.arange(n, device=q.device)[None, :] <= pos_q[:, None]  # [n_r, n]
        o[lo:hi] = attend_reference(q[lo:hi], k, v, visible, sm_scale).to(q.dtype)
    return o


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, SeqLens, QoIndptr, sm_scale,
    stride_q_t, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_rt,
    stride_o_t, stride_o_h,
    head_dim, v_head_dim,
    GROUP: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(QoIndptr + r)
    n_new = tl.load(QoIndptr + r + 1) - q_start
    if tile * BLOCK_M < n_new:  # tiles past this request's new tokens exit at once
        seq_len = tl.load(SeqLens + r)
        row = tl.load(ReqPoolIdx + r).to(tl.int64)
        kvh = h // GROUP
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_new
        pos_q = seq_len - n_new + offs_m  # [BLOCK_M] position of each new token
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < head_dim
        dv_ok = offs_dv < v_head_dim
        t = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + t[:, None] * stride_q_t + h * stride_q_h + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        kv_end = tl.minimum(seq_len, seq_len - n_new + (tile + 1) * BLOCK_M)  # last query + 1
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            slot = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_ok, other=0).to(tl.int64)
            k = tl.load(K + slot[None, :] * stride_k_s + kvh * stride_k_h + offs_d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            s = (mma(q, k, UPCAST) * sm_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]; inductor may pass a fp64 scale
            visible = n_ok[None, :] & (offs_n[None, :] <= pos_q[:, None]) & m_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_v_s + kvh * stride_v_h + offs_dv[None, :],
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
            m_i = m_new

        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(Out + t[:, None] * stride_o_t + h * stride_o_h + offs_dv[None, :],
                 o.to(Out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])


def extend_blocks(head_dim: int, v_head_dim: int) -> dict:
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_head_dim))
    block = 64 if max(block_d, block_dv) <= 128 else 32
    return dict(BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, BLOCK_DV=block_dv)


def extend_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, qo_indptr,
                     sm_scale=None, impl="auto"):
    """Causal paged attention of packed new tokens: q [n_tok, n_q_heads, head_dim],
    qo_indptr [bs+1] -> [n_tok, n_q_heads, v_head_dim] (padding tokens give 0)."""
    bs = req_pool_indices.shape[0]
    if tuple(qo_indptr.shape) != (bs + 1,) or qo_indptr.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"qo_indptr must be [bs+1={bs + 1}] int32/int64; "
                         f"got {tuple(qo_indptr.shape)} {qo_indptr.dtype}")
    check_paged_args(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    if resolve_impl(impl, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    qo_indptr) == "torch":
        return extend_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                          seq_lens, qo_indptr, sm_scale)
    check_kernel_dtypes(q, k_cache, v_cache)
    n_tok, n_q_heads, head_dim = q.shape
    v_head_dim = v_cache.shape[2]
    o = q.new_zeros(n_tok, n_q_heads, v_head_dim)  # zeros: padding tokens are never visited
    blocks = extend_blocks(head_dim, v_head_dim)
    if n_tok == 0 or bs == 0:
        return o
    grid = (bs, triton.cdiv(n_tok, blocks["BLOCK_M"]), n_q_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, qo_indptr, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), o.stride(0), o.stride(1),
        head_dim, v_head_dim,
        GROUP=n_q_heads // k_cache.shape[1], UPCAST=upcast_dots(q.dtype),
        num_warps=4, num_stages=2, **blocks,
    )
    return o
