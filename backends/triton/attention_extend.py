"""Paged extend (chunked prefill) attention, causal, graph-safe; torch reference beside it.

New tokens are packed along one token axis: request r owns `q[qo_indptr[r]:qo_indptr[r+1]]`;
with n_r of them they sit at positions `seq_lens[r]-n_r .. seq_lens[r]-1` (already stored) and
each attends to positions `0 .. its own`. Tokens at index >= qo_indptr[bs] are padding (output 0).

Grid (n_tiles, n_kv_heads * S) is fixed by the shapes: n_tiles bounds the row tiles of all
requests together, sum_r cdiv(n_r * GROUP, BLOCK_M) <= cdiv(n_tok * GROUP + bs * (BLOCK_M - 1),
BLOCK_M) (`extend_tiles`). Program (t, kv_head, s) finds on the device which request's row tile
t is (a prefix sum of the requests' tile counts from qo_indptr, `tile_owner`) and holds its
BLOCK_M rows = (new token, q head of kv_head's group) pairs, so a K/V tile is read once for the
whole GQA group; tiles past the last request's exit at once. No host planning from values, and
cost follows real lengths: the grid grows as bs + n_tok, where one program per (request, tile
any request could need) grew as bs * n_tok (at bs 32 x 6 tokens: 12288 programs, of which
1024 had work). Each tile reads positions up to its last
token's; short extends (draft-extend: a few tokens per request) split that range over S
programs like decode and merge in the same launch (`attention_split.py`); long ones use S = 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import (MAX_SPLITS, MIN_SPLIT_TOKENS, PROGRAMS_PER_SM, attend_reference,
                               check_kernel_dtypes, check_paged_args, default_sm_scale,
                               gather_kv, mma, sm_count, upcast_dots)
from .attention_meta import check_qo_indptr
from .attention_split import (aligned, finish_split, merge_unroll, partials, should_fold,
                              split_len, tickets)
from .kv import resolve_impl

PARTIALS_MAX_BYTES = 64 << 20  # fp32 partials of a split extend
TILE_OWNER_BLOCK = 64  # requests a step of `tile_owner`'s prefix sum reads


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
def tile_owner(QoIndptr, bs, t, GROUP, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    """(request r, its row tile) of packed tile t: request r owns tiles [sum_{b<r} T_b,
    sum_{b<=r} T_b) with T_b = cdiv(n_b * GROUP, BLOCK_M) its new tokens' row tiles (GROUP rows
    a token: the q heads of a kv head). Reads qo_indptr BLOCK_B requests at a time; r = bs when
    t is past every request's tiles."""
    r = tl.full([], 0, tl.int32)       # requests whose tiles all come before t
    before = tl.full([], 0, tl.int32)  # their tiles
    base = tl.full([], 0, tl.int32)    # tiles of the requests of earlier chunks
    for b0 in range(0, bs, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        ok = offs_b < bs
        lo = tl.load(QoIndptr + offs_b, mask=ok, other=0).to(tl.int32)
        hi = tl.load(QoIndptr + offs_b + 1, mask=ok, other=0).to(tl.int32)
        n_t = tl.where(ok, tl.cdiv(tl.maximum(hi - lo, 0) * GROUP, BLOCK_M), 0)
        done = ok & (base + tl.cumsum(n_t, 0) <= t)
        r += tl.sum(done.to(tl.int32))
        before += tl.sum(tl.where(done, n_t, 0))
        base += tl.sum(n_t)
    return r, t - before


@triton.jit(do_not_specialize=["stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t",
                               "stride_ml_h", "num_splits", "bs"])
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, SeqLens, QoIndptr, MidO, MidLse, Counters, sm_scale,
    stride_q_t, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_rt,
    stride_o_t, stride_o_h, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    head_dim, v_head_dim, num_splits, bs,
    GROUP: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MERGE_UNROLL: tl.constexpr, BLOCK_B: tl.constexpr,
):
    # program (t, kv_head * S + split): t is row tile `tile` of request r (`tile_owner`); rows
    # m = (new token m // GROUP, head m % GROUP of kv_head's group) of request r, against one
    # split of the positions the tile's rows see
    stride_mo_t, stride_mo_h, stride_mo_s = (aligned(stride_mo_t), aligned(stride_mo_h),
                                             aligned(stride_mo_s))  # padded partials
    t_glob = tl.program_id(0)
    kvh = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    r, tile = tile_owner(QoIndptr, bs, t_glob, GROUP, BLOCK_M, BLOCK_B)
    live = r < bs  # else t is past the last request's tiles
    r = tl.minimum(r, bs - 1)
    q_start = tl.load(QoIndptr + r)
    n_new = tl.load(QoIndptr + r + 1) - q_start
    n_rows = n_new * GROUP
    seq_len = tl.load(SeqLens + r)
    last_t = (tl.minimum((tile + 1) * BLOCK_M, n_rows) - 1) // GROUP  # the tile's last token
    kv_end = tl.minimum(seq_len, seq_len - n_new + last_t + 1)  # ... sees up to its position
    share = split_len(seq_len, num_splits, BLOCK_N)
    n_used = tl.cdiv(kv_end, share)  # the same for every split of this tile
    start = split * share
    end = tl.minimum(start + share, kv_end)
    if live & (tile * BLOCK_M < n_rows) & (start < end):  # spare tiles exit at once
        row = tl.load(ReqPoolIdx + r).to(tl.int64)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < n_rows
        tok = offs_m // GROUP
        qh = kvh * GROUP + offs_m % GROUP
        pos_q = seq_len - n_new + tok  # [BLOCK_M] position of each row's token
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < head_dim
        dv_ok = offs_dv < v_head_dim
        t = (q_start + tok).to(tl.int64)
        q = tl.load(Q + t[:, None] * stride_q_t + qh[:, None] * stride_q_h + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        idx = ReqToToken + row * stride_rt
        offs_first = start + tl.arange(0, BLOCK_N)
        slot = tl.load(idx + offs_first, mask=offs_first < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            # issue K, V and the next tile's slot indices together: one memory round trip a tile
            k = tl.load(K + slot[None, :] * stride_k_s + kvh * stride_k_h + offs_d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            v = tl.load(V + slot[:, None] * stride_v_s + kvh * stride_v_h + offs_dv[None, :],
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
            slot = tl.load(idx + offs_n + BLOCK_N, mask=offs_n + BLOCK_N < end,
                           other=0).to(tl.int64)
            s = (mma(q, k, UPCAST) * sm_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]; inductor may pass a fp64 scale
            visible = n_ok[None, :] & (offs_n[None, :] <= pos_q[:, None]) & m_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
            m_i = m_new

        # more than one split: always folded (a tile's splits depend on its causal range)
        finish_split(acc, m_i, l_i, split, n_used, 1,
                     Counters + t_glob * (tl.num_programs(1) // num_splits) + kvh,
                     Out + t[:, None] * stride_o_t + qh[:, None] * stride_o_h
                     + offs_dv[None, :],
                     MidO + t[:, None] * stride_mo_t + qh[:, None] * stride_mo_h
                     + offs_dv[None, :],
                     MidLse + t * stride_ml_t + qh * stride_ml_h,
                     stride_mo_s, 1, m_ok, dv_ok, MERGE_UNROLL)


def extend_tiles(bs: int, n_tok: int, group: int, block_m: int) -> int:
    """Row tiles of the grid, from shapes only: enough for any split of n_tok new tokens over bs
    requests (each request's last tile may be partial), and never more than bs tiles of n_tok."""
    return max(1, min(bs * triton.cdiv(n_tok * group, block_m),
                      triton.cdiv(n_tok * group + bs * (block_m - 1), block_m)))


def extend_blocks(head_dim: int, v_head_dim: int) -> dict:
    """Tiles: 64 x 64 (32 past d = 128), head dims padded to powers of 2; 8 warps for 64-row
    tiles (sm_90, d = 64..128: 4 warps spill 0.2-1.3 KB a thread, 8 warps <= 0.2 KB)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_head_dim))
    block = 64 if max(block_d, block_dv) <= 128 else 32
    return dict(BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, BLOCK_DV=block_dv,
                num_warps=8 if block * max(block_d, block_dv) >= 4096 else 4)


def choose_extend_splits(bs: int, n_tok: int, n_kv_heads: int, group: int, max_context: int,
                         v_head_dim: int, n_sm: int, block_m: int) -> int:
    """Static split count from shapes only. Short extends (draft-extend: a few tokens per
    request) leave most of the GPU idle with one program per (request, tile, kv head), so their
    context is split like decode's; long ones (tiles >= programs wanted) get 1. Bounded so the
    folded merge and the partials stay small (<= PARTIALS_MAX_BYTES)."""
    rows = triton.cdiv(n_tok, max(bs, 1)) * group  # rows of an average request
    tiles = triton.cdiv(rows, block_m)
    want = triton.cdiv(PROGRAMS_PER_SM * n_sm, max(1, bs * tiles * n_kv_heads))
    cap = max(1, max_context // MIN_SPLIT_TOKENS)
    splits = max(1, min(want, cap, MAX_SPLITS))
    while splits > 1 and not (should_fold(splits, min(rows, block_m), v_head_dim) and
                              n_tok * n_kv_heads * group * splits * v_head_dim * 4
                              <= PARTIALS_MAX_BYTES):
        splits //= 2
    return splits


def extend_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, qo_indptr,
                     sm_scale=None, impl="auto", num_splits=None):
    """Causal paged attention of packed new tokens: q [n_tok, n_q_heads, head_dim],
    qo_indptr [bs+1] -> [n_tok, n_q_heads, v_head_dim] (padding tokens give 0).
    `num_splits` overrides the static split count (`choose_extend_splits`)."""
    bs = req_pool_indices.shape[0]
    check_qo_indptr(qo_indptr, bs)
    check_paged_args(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    if resolve_impl(impl, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    qo_indptr) == "torch":
        return extend_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                          seq_lens, qo_indptr, sm_scale)
    check_kernel_dtypes(q, k_cache, v_cache)
    n_tok, n_q_heads, head_dim = q.shape
    n_kv_heads, v_head_dim = k_cache.shape[1], v_cache.shape[2]
    group = n_q_heads // n_kv_heads
    o = q.new_zeros(n_tok, n_q_heads, v_head_dim)  # zeros: padding tokens are never visited
    blocks = extend_blocks(head_dim, v_head_dim)
    if n_tok == 0 or bs == 0:
        return o
    n_tiles = extend_tiles(bs, n_tok, group, blocks["BLOCK_M"])
    if num_splits is None:
        num_splits = choose_extend_splits(bs, n_tok, n_kv_heads, group, req_to_token.shape[1],
                                          v_head_dim, sm_count(q.device), blocks["BLOCK_M"])
    counters, ready = tickets(q.device, n_tiles * n_kv_heads if num_splits > 1 else 0,
                              num_splits > 1)
    if not ready:  # no zeroed counters (first call inside a capture): no split
        num_splits = 1
    if num_splits > 1:
        mid_o, mid_lse = partials(n_tok, n_q_heads, num_splits, v_head_dim, q.device)
    else:
        mid_o, mid_lse = partials(1, 1, 1, 1, q.device)
    grid = (n_tiles, n_kv_heads * num_splits)
    # the kernel indexes 1-d metadata with unit stride (a no-op for dense tensors)
    req_pool_indices, seq_lens = req_pool_indices.contiguous(), seq_lens.contiguous()
    qo_indptr = qo_indptr.contiguous()
    _extend_kernel[grid](
        q, k_cache, v_cache, o, req_to_token, req_pool_indices, seq_lens, qo_indptr, mid_o,
        mid_lse, counters, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), o.stride(0), o.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        head_dim, v_head_dim, num_splits, bs,
        GROUP=group, UPCAST=upcast_dots(q.dtype), num_stages=2, BLOCK_B=TILE_OWNER_BLOCK,
        MERGE_UNROLL=merge_unroll(blocks["BLOCK_M"], blocks["BLOCK_DV"], blocks["num_warps"]),
        **blocks,
    )
    return o
