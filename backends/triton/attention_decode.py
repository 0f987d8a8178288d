"""Paged decode attention, split-KV (flash-decoding), graph-safe; torch reference beside it.

One query per request attends to positions `0 .. seq_lens[r]-1` of its `req_to_token` row.

The split count S is static: chosen on the host from (bs, n_kv_heads, max_context, SM count),
never from `seq_lens` values, so one captured graph serves every length. On the device, program
(r, kv_head, s) takes the s-th of S equal shares of request r's *own* length (rounded up to
BLOCK_N): cost follows real lengths, and splits past the end exit without reading. The split
count is a runtime argument, so every bucket runs one compiled kernel (two where a ladder
holds a bucket of at most PREFETCH_MAX_PAIRS (request, kv head) pairs with short splits, which
runs a double-buffered loop: `choose_prefetch`). The splits' partial
outputs are merged by their log-sum-exp in the same launch (the last split of a request to
finish merges; `attention_split.py`) or, when the partials are large, by a second small
kernel. A request that fits one split is written directly.

The same kernel serves tree verification (`attention_verify.py`): NUM_Q queries per request and
a tree mask over the last NUM_Q positions.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import einops
import torch
import triton
import triton.language as tl

from .attention_meta import DECODE, MODE_NAMES, TREE, PagedMeta, check_tree_mask
from .attention_split import (aligned, finish_split, launch_merge, merge_unroll, partials,
                              should_fold, split_len, tickets, tile_slots)
from .kv import resolve_impl
from .pdl import launch_options, wait_for_previous

# Split-count policy (see docs/attention.md): aim for ~PROGRAMS_PER_SM programs per SM
# (2-3 fit at once: 5-8 waves, so the last, partial wave costs <= ~15 %), but never make a
# split shorter than MIN_SPLIT_TOKENS of the cache width, nor use more than MAX_SPLITS splits.
# - MIN_SPLIT_TOKENS 256 -> 128 (2 tiles of BLOCK_N 64): it bounded the merge, which read the
#   splits one L2 round trip each; the merge now reads MERGE_UNROLL (4 at d 128) splits a round
#   trip (`attention_split.merge_partials`), while each tile a split saves is an HBM round trip of
#   the split's serial chain. Changes short contexts only: bs 1 ctx 512 -> 4 splits (was 2 of 4
#   tiles each), bs 1 / 8 ctx 4096 -> 32 (was 16), all still folded (<= FOLD_MAX_BYTES). Not
#   measured; the next candidate of a sweep is 64 (1 tile a split: bs 1 ctx 512 -> 8 splits).
# - PROGRAMS_PER_SM: about wave quantization of the split pass, not the merge: unchanged.
# - MAX_SPLITS (128: 256 tokens a split at 32K) bounds partials memory and `num_splits` (<=
#   2 * MAX_SPLITS); at 128 splits the merge is the separate kernel, now spread over bs * H *
#   DV/64 programs: unchanged (a sweep may try 256 for bs 1 at 32K: 2048 programs of 2 tiles).
# - DECODE_PROGRAMS_PER_SM (one query a request): an H200 sweep (`bench.bench_attention`,
#   32/8 heads, d 128, BLOCK_N 64) was fastest at 256-1024 programs, 2-8 per SM, where 16 an SM
#   asked for 4-8x more splits: bs 8 ctx 4096 best at 4 splits (49.6 us eager) against the 32
#   of 16 an SM (63.0); bs 32 ctx 4096 at 2 (142.0 against 151-165 for 8-16); bs 128 ctx 4096
#   at 1 (510.6 against 3's ~520); bs 8 ctx 32768 at 8 (262.7 against 33's ~275); bs 1 ctx
#   32768 at 32 (55.1 against 128's 69.7). In CUDA graphs (same sweep) 2 an SM was faster
#   than 16 at every point with ctx <= 4096 or bs * kv heads >= 256 (bs 8 ctx 4096
#   53.2 us against 60.6, bs 32 ctx 4096 142.6 against 152.6, bs 128 ctx 512 81.4 against
#   94.6) but slower at long contexts with few (request, head) pairs (bs 1 ctx 32768 60.1
#   against 56.0, bs 8 ctx 32768 299.3 against 275.9), which then took 16 an SM.
# - Decode (graph-timed sweep, `bench.bench_attention --no-spec --no-cold`,
#   results/attention.md): the largest power of two <= 4 programs an SM
#   (DECODE_PROGRAMS_PER_SM), at most DECODE_MAX_SPLITS, the merge folded up to
#   DECODE_FOLD_MAX_SPLITS splits. bs 8 ctx 4096: 8 splits folded 49.4 us (the policy's 5:
#   51.9); bs 8 ctx 32768: 8 folded 257.7 (33 + merge: 271.8); bs 1 ctx 4096: 32 + merge 18.2
#   (32 folded: 19.9); bs 1 ctx 32768: 64 + merge 51.0 (128 + merge: 54.8); bs 32 and 128
#   unchanged (2 folded, 1: the best measured). Folding costs the last program a serial pass
#   over every split: slower from 16 splits on at bs 1, faster at <= 8.
#   Short contexts (`bench.bench_attention --in-graph 20`, swept at ctx 512): where
#   128-token splits leave fewer than DECODE_FOLD_MAX_SPLITS, decode splits go down to
#   DECODE_MIN_SPLIT_TOKENS (one tile of 64) while they stay folded: bs 1 ctx 512 8 splits
#   folded 11.4 us against the 4 of 128 tokens' 12.9 (SDPA 11.7); bs 8 ctx 512 8 folded 16.5
#   against 16.4 (unchanged within noise). Longer contexts keep 128 tokens a split.
#   Tree verify (k query rows a request) keeps PROGRAMS_PER_SM with 64-token tiles. With its
#   128-token tiles (`tree_block_n`) it takes the largest power of two of splits that keeps
#   TREE_WIDE_PROGRAMS_PER_SM programs an SM at most: H100, `bench.sweep_decode_attention
#   --head-dim 128 --tree 8` (32 / 8 heads), µs a call, PROGRAMS_PER_SM's splits -> these:
#   ctx 4096 bs 1 32 -> 32 splits 17.7 -> 17.3, bs 8 32 -> 4 87.6 -> 58.8, bs 32 9 -> 1
#   259.8 -> 190.1 (floor 179.3); ctx 512 bs 1 4 -> 4, bs 8 4 -> 4, bs 32 4 -> 1 48.0 -> 31.3.
#   Every other split count of the sweep (1 .. 32) was slower at bs 8 and 32, and within 0.5 µs
#   at bs 1.
PROGRAMS_PER_SM = 16
TREE_WIDE_PROGRAMS_PER_SM = 2
DECODE_PROGRAMS_PER_SM = 4
DECODE_MAX_SPLITS = 64
DECODE_FOLD_MAX_SPLITS = 8
MIN_SPLIT_TOKENS = 128
DECODE_MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 128
CPU_SM_COUNT = 4  # under the interpreter: few programs keep tests fast
# Decode with few (request, kv head) pairs (bs 1 at 8 kv heads) runs a double-buffered loop over
# 32-token tiles: each step issues the next tile's K and V before computing its own, so a split
# keeps two tiles in flight (at the default 2 stages the single-buffered loop keeps one: its K /
# V addresses come from the slot table; 3 stages pipeline it, swept at bs 8 ctx 512 only).
# H100, `bench.bench_attention --ab` in a graph, same process, 32 / 8 heads, d 128: bs 1 ctx 512 7.6 us against 8.1 (cuDNN SDPA 8.2), ctx 4096 14.3
# against 15.0 (SDPA 13.9); at bs 8 and more it was slower (ctx 512: 16.7 against 14.0; with
# 64-token tiles 18.6), so larger batches keep the single-buffered loop (results/attention.md).
# ... while a split's share of the cache row is at most PREFETCH_MAX_SPLIT_TOKENS tokens: a
# longer chain streams faster through the single-buffered loop's wider tiles. H100,
# `bench.sweep_decode_attention --head-dim 128 --sizes 1 --ctx 32768 --layout random` (32 / 8
# heads, bf16, 16 layer caches, graph replays), 64 splits (512 tokens each): the double-buffered
# loop 67.7 us (59.2 with 64-token tiles), the single-buffered one 54.1 with 64-token tiles
# (floor 44.5); 128 tokens a split (ctx 4096, 32 splits) and 64 (ctx 512) are the measured wins
# above; 256 (ctx 16384) was not measured and takes the single-buffered loop.
PREFETCH_MAX_PAIRS = 8
PREFETCH_MAX_SPLIT_TOKENS = 128
PREFETCH_BLOCK_N = 32
# Decode's single-buffered loop at head dims <= NARROW_HEAD_DIM takes 128-token tiles
# (`decode_block_n`), the bytes a tile that d 128's 64 read. H100, `bench.sweep_decode_attention`
# (the Llama-1B step's attention: 32 / 8 heads, d 64, contexts 256..1022 in 1024-slot rows, one
# cache a layer, graph replays, no PDL), µs a call with 64-token tiles -> 128, the splits
# unchanged: bs 16 16.43 -> 15.06 and 15.74 -> 13.91 (two runs), bs 32 25.04 -> 22.31 and
# 25.59 -> 23.38, bs 64 41.12 -> 35.42 (floor 27.1). The double-buffered loop (bs 1) keeps
# PREFETCH_BLOCK_N: 64-token tiles ran it faster there (5.13 against 5.54 µs) but spill
# registers on sm_90 (24 bytes a thread, 440 with PDL, which the fused step's attention takes).
# Measured at d 64 in bf16 only; tree verify and fp32 keep their tiles (fp32's of 128 keys
# spill on sm_90: 352 bytes a thread at d 64, 72 at d 32).
NARROW_HEAD_DIM = 64
# Tree verify (num_q > 1) at head dims in (64, 128] takes 128-token tiles where its
# query tile has <= TREE_WIDE_ROWS rows (`tree_block_n`). H100, `bench.sweep_decode_attention
# --head-dim 128 --ctx 512 --tree K` (32 / 8 heads, bf16, 16 layer caches, graph replays), µs a
# call at the policy's 4 splits, 64-token tiles -> 128: 8 drafts bs 1 17.4 -> 10.9, bs 8 23.3 ->
# 17.4, bs 32 65.2 -> 48.0; 4 drafts bs 8 16.3 -> 14.5. At d 64 the 64-token tile stays (8
# drafts, 2 splits: bs 1 10.4 against 15.6 with 128, bs 16 28.2 against 35.3), and with 64 rows
# (16 drafts at group 4: 30.4 against 75.9). 8 warps were slower at every tree point but one
# (bs 1, 8 drafts: 10.3 against 10.9), though 4 warps spill registers there on sm_90.
TREE_WIDE_ROWS = 32


# ----------------------------------------------------------------------------- reference

def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    return head_dim ** -0.5 if sm_scale is None else float(sm_scale)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, or fp64 when the inputs are fp64 (for high-precision references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_kv(k_cache, v_cache, req_to_token, row: int, n: int):
    """The first n positions of request row `row`: ([n, n_kv_heads, head_dim], [n, .., v_dim])."""
    slots = req_to_token[row, :n].long()
    return k_cache[slots], v_cache[slots]


def attend_reference(q, k, v, visible, sm_scale: float):
    """Masked softmax attention of one request, GQA by head grouping, in fp32 (or fp64).

    q [n_q, n_q_heads, head_dim], k [n_k, n_kv_heads, head_dim], v [n_k, n_kv_heads, v_dim],
    visible [n_q, n_k] bool -> [n_q, n_q_heads, v_dim]. A query that sees nothing gives 0.
    """
    acc = acc_dtype(q.dtype)
    n_kv_heads = k.shape[1]
    q_g = einops.rearrange(q.to(acc), "q (hk g) d -> hk g q d", hk=n_kv_heads)
    k_h = einops.rearrange(k.to(acc), "k hk d -> hk k d")
    v_h = einops.rearrange(v.to(acc), "k hk d -> hk k d")
    scores = torch.einsum("hgqd,hkd->hgqk", q_g, k_h) * sm_scale  # [hk, g, n_q, n_k]
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(visible.any(dim=-1, keepdim=True), p, 0.0)  # all-masked rows: 0, not NaN
    o = torch.einsum("hgqk,hkd->hgqd", p, v_h)
    return einops.rearrange(o, "hk g q d -> q (hk g) d")


def decode_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                               sm_scale=None):
    """Torch reference (and CPU path) of `decode_attention`: gather each request's KV, softmax."""
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    o = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    for r, (row, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        k, v = gather_kv(k_cache, v_cache, req_to_token, row, n)
        visible = torch.ones(1, n, dtype=torch.bool, device=q.device)
        o[r] = attend_reference(q[r:r + 1], k, v, visible, sm_scale)[0].to(q.dtype)
    return o


# ----------------------------------------------------------------------------- kernels

def upcast_dots(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter computes bf16 `tl.dot` wrongly: upcast there (GPU: native)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32 (UPCAST: operands to fp32 first, for the interpreter)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def _kv_tile(K, V, slot, ok, kv_k, kv_v, stride_k_s, stride_v_s, offs_d, d_ok, offs_dv, dv_ok):
    """A tile's K [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_DV] at its slots (0 where not ok);
    kv_k / kv_v: the kv head's offsets in the caches."""
    k = tl.load(K + slot[None, :] * stride_k_s + kv_k + offs_d[:, None],
                mask=ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_v_s + kv_v + offs_dv[None, :],
                mask=ok[:, None] & dv_ok[None, :], other=0.0)
    return k, v


@triton.jit(do_not_specialize=["stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t",
                               "stride_ml_h", "num_splits", "fold"])
def _split_kv_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, TreeMask, Out, MidO, MidLse, Counters, sm_scale,
    stride_q_t, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_rt,
    stride_o_t, stride_o_h, stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    head_dim, v_head_dim, num_splits, fold,
    GROUP: tl.constexpr, NUM_Q: tl.constexpr, HAS_TREE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, MERGE_UNROLL: tl.constexpr, PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # program (r, kv_head, split): rows m = (query i, head g) of request r's NUM_Q * GROUP
    # query heads sharing kv_head, against one split of r's positions (attention_split.py).
    stride_mo_t, stride_mo_h, stride_mo_s = (aligned(stride_mo_t), aligned(stride_mo_h),
                                             aligned(stride_mo_s))  # padded partials
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + r)
    row = tl.load(ReqPoolIdx + r).to(tl.int64)  # beside seq_len, not a round trip after it
    share = split_len(seq_len, num_splits, BLOCK_N)
    n_used = tl.cdiv(seq_len, share)
    start = split * share
    end = tl.minimum(start + share, seq_len)
    # empty splits read nothing and write nothing (the merge skips them); split 0 of a request
    # with seq_len 0 runs with no tile and writes the 0 the reference gives (nothing to attend)
    if (start < end) | (split == 0):
        offs_m = tl.arange(0, BLOCK_M)
        qi = offs_m // GROUP  # query index within the request
        qh = kvh * GROUP + offs_m % GROUP  # query head
        m_ok = offs_m < NUM_Q * GROUP
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < head_dim
        dv_ok = offs_dv < v_head_dim
        q_row = (r * NUM_Q + qi).to(tl.int64)
        q_at = Q + q_row[:, None] * stride_q_t + qh[:, None] * stride_q_h + offs_d[None, :]
        q_ok = m_ok[:, None] & d_ok[None, :]
        if not PDL:
            q = tl.load(q_at, mask=q_ok, other=0.0)  # [BLOCK_M, BLOCK_D]
        prefix = tl.maximum(seq_len - NUM_Q, 0)  # positions every query sees (tree mode)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: all-masked rows stay 0
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        idx = ReqToToken + row * stride_rt
        first = start + tl.arange(0, BLOCK_N)
        slot = tile_slots(idx, first, end)
        kv_k = kvh * stride_k_h
        kv_v = kvh * stride_v_h
        if PREFETCH:  # the split's first tile before the loop: each step issues the next one's
            if PDL:   # before the wait: only the positions the kernel before cannot write
                k, v = _kv_tile(K, V, slot, first < tl.minimum(end, prefix), kv_k, kv_v,
                                stride_k_s, stride_v_s, offs_d, d_ok, offs_dv, dv_ok)
            else:
                k, v = _kv_tile(K, V, slot, first < end, kv_k, kv_v, stride_k_s, stride_v_s,
                                offs_d, d_ok, offs_dv, dv_ok)
            slot_first = slot
            slot = tile_slots(idx, start + BLOCK_N + tl.arange(0, BLOCK_N), end)
        # with PDL: everything above read only metadata and past K / V; q and the last NUM_Q
        # positions' K / V (written by the kernel before: the qkv projection) come after
        wait_for_previous(PDL)
        if PDL:
            if PREFETCH:
                fresh = (first < end) & (first >= prefix)
                k_new, v_new = _kv_tile(K, V, slot_first, fresh, kv_k, kv_v, stride_k_s,
                                        stride_v_s, offs_d, d_ok, offs_dv, dv_ok)
                k = tl.where(fresh[None, :], k_new, k)
                v = tl.where(fresh[:, None], v_new, v)
            q = tl.load(q_at, mask=q_ok, other=0.0)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            if PREFETCH:
                # the next tile's K and V, and the slots after them, in flight while this one
                # computes (two tiles' registers: small tiles, few programs)
                k_nx, v_nx = _kv_tile(K, V, slot, (offs_n + BLOCK_N) < end, kv_k, kv_v,
                                      stride_k_s, stride_v_s, offs_d, d_ok, offs_dv, dv_ok)
                slot = tile_slots(idx, offs_n + 2 * BLOCK_N, end)
            else:
                k, v = _kv_tile(K, V, slot, n_ok, kv_k, kv_v, stride_k_s, stride_v_s, offs_d,
                                d_ok, offs_dv, dv_ok)
                # issue K, V and the next tile's slot indices together: one round trip a tile
                slot = tile_slots(idx, offs_n + BLOCK_N, end)
            s = (mma(q, k, UPCAST) * sm_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N]; inductor may pass a fp64 scale
            visible = n_ok[None, :] & m_ok[:, None]
            if HAS_TREE:
                j = offs_n - (seq_len - NUM_Q)  # draft index of key position (>= 0 in the tail)
                in_tail = (offs_n >= prefix)[None, :] & visible
                tm = tl.load(TreeMask + r * NUM_Q * NUM_Q + qi[:, None] * NUM_Q + j[None, :],
                             mask=in_tail, other=0)
                visible = visible & ((offs_n < prefix)[None, :] | (tm != 0))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
            m_i = m_new
            if PREFETCH:
                k = k_nx
                v = v_nx

        finish_split(acc, m_i, l_i, split, tl.maximum(n_used, 1), fold,
                     Counters + r * tl.num_programs(1) + kvh,
                     Out + q_row[:, None] * stride_o_t + qh[:, None] * stride_o_h
                     + offs_dv[None, :],
                     MidO + q_row[:, None] * stride_mo_t + qh[:, None] * stride_mo_h
                     + offs_dv[None, :],
                     MidLse + q_row * stride_ml_t + qh * stride_ml_h,
                     stride_mo_s, 1, m_ok, dv_ok, MERGE_UNROLL)


# ----------------------------------------------------------------------------- host side

@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(bs: int, n_kv_heads: int, max_context: int, n_sm: int,
                      num_q: int = 1, block_n: int | None = None) -> int:
    """Static split count from shapes only, bounded by MIN_SPLIT_TOKENS of the cache width:
    decode (num_q 1) the largest power of two <= DECODE_PROGRAMS_PER_SM programs an SM, at most
    DECODE_MAX_SPLITS, with splits down to DECODE_MIN_SPLIT_TOKENS while that keeps them folded
    (<= DECODE_FOLD_MAX_SPLITS); tree verify (num_q > 1) ~PROGRAMS_PER_SM an SM, at most
    MAX_SPLITS, or with 128-token tiles (`block_n`, as `plan_split` takes it) the largest
    power of two keeping <= TREE_WIDE_PROGRAMS_PER_SM programs an SM."""
    pairs = max(1, bs * n_kv_heads)
    cap = max(1, max_context // MIN_SPLIT_TOKENS)
    if num_q == 1:
        cap = max(cap, min(max_context // DECODE_MIN_SPLIT_TOKENS, DECODE_FOLD_MAX_SPLITS))
        want = max(1, DECODE_PROGRAMS_PER_SM * n_sm // pairs)
        want = 1 << (want.bit_length() - 1)
        return max(1, min(want, cap, DECODE_MAX_SPLITS))
    if block_n is not None and block_n >= 128:
        want = max(1, TREE_WIDE_PROGRAMS_PER_SM * n_sm // pairs)
        want = 1 << (want.bit_length() - 1)
    else:
        want = triton.cdiv(PROGRAMS_PER_SM * n_sm, pairs)
    return max(1, min(want, cap, MAX_SPLITS))


def choose_prefetch(num_q: int, bs: int, n_kv_heads: int, split_tokens: int | None = None) -> bool:
    """Decode (one query a request) with at most PREFETCH_MAX_PAIRS (request, kv head) pairs,
    each split covering at most PREFETCH_MAX_SPLIT_TOKENS of the cache row (`split_tokens`,
    cdiv(max_context, num_splits); None: not bounded): the double-buffered loop over
    PREFETCH_BLOCK_N-token tiles."""
    short = split_tokens is None or split_tokens <= PREFETCH_MAX_SPLIT_TOKENS
    return num_q == 1 and bs * n_kv_heads <= PREFETCH_MAX_PAIRS and short


def choose_fold(num_splits: int, num_q: int, group: int, v_head_dim: int) -> bool:
    """Fold the merge into the split pass: decode up to DECODE_FOLD_MAX_SPLITS splits, tree
    verify while the partials the last program reads stay small (`should_fold`)."""
    if num_q == 1 and num_splits > DECODE_FOLD_MAX_SPLITS:
        return False
    return should_fold(num_splits, num_q * group, v_head_dim)


def decode_block_n(head_dim: int, v_head_dim: int, num_q: int, prefetch: bool,
                   itemsize: int = 2) -> int | None:
    """The K / V tile's tokens of a decode launch (one query a request) when the policy names
    none: PREFETCH_BLOCK_N in the double-buffered loop; in the single-buffered one 128 at head
    dims <= NARROW_HEAD_DIM in a 2-byte dtype (fp16 / bf16: fp32 tiles of 128 keys spill on
    sm_90, at d 32 too), else None (`kernel_blocks`' tile, 64 up to d 128). Tree verify
    (num_q > 1): None."""
    if num_q != 1:
        return None
    if prefetch:
        return PREFETCH_BLOCK_N
    narrow = itemsize <= 2 and max(head_dim, v_head_dim) <= NARROW_HEAD_DIM
    return 128 if narrow else None


def kernel_blocks(head_dim: int, v_head_dim: int, n_rows: int, block_n: int | None = None):
    """Tile sizes: BLOCK_M >= 16 rows for tl.dot; BLOCK_D padded to a power of two (masked)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_head_dim))
    if block_n is None:
        block_n = 64 if max(block_d, block_dv) <= 128 else 32
    return dict(BLOCK_M=max(16, triton.next_power_of_2(n_rows)), BLOCK_N=block_n,
                BLOCK_D=block_d, BLOCK_DV=block_dv)


def tree_block_n(head_dim: int, v_head_dim: int, rows: int, itemsize: int = 2) -> int | None:
    """The K / V tile's tokens of a tree verify launch (`rows` = num_q * group query rows a
    program) when the policy names none: 128 at head dims in (64, 128] in a 2-byte dtype with
    rows <= TREE_WIDE_ROWS, else None (`kernel_blocks`' tile)."""
    wide = 64 < max(head_dim, v_head_dim) <= 128
    return 128 if itemsize <= 2 and wide and rows <= TREE_WIDE_ROWS else None


def check_paged_args(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs: int):
    """Shape and dtype checks shared by the paged kernels (no value reads: graph-safe)."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(f"q, k_cache, v_cache must be 3-d [tokens|slots, heads, dim]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    n_q_heads, head_dim = q.shape[1:]
    n_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"k_cache must be [n_slots, n_kv_heads, {head_dim}] and v_cache "
                         f"[n_slots, n_kv_heads, v_head_dim]; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"n_q_heads={n_q_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be [n_req_rows, max_context]; "
                         f"got {tuple(req_to_token.shape)}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if tuple(t.shape) != (bs,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be [bs={bs}] int32/int64; "
                             f"got {tuple(t.shape)} {t.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("req_to_token", req_to_token)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; strides {t.stride()}")


def check_tree_args(q, tree_mask, what: str = "q") -> tuple[int, int]:
    """tree_mask [bs, k, k] bool and q's bs * k request-major rows; returns (bs, k)."""
    bs, k = check_tree_mask(tree_mask)
    if q.shape[0] != bs * k:
        raise ValueError(f"{what} must have bs * k = {bs} * {k} = {bs * k} rows (request-major); "
                         f"got {q.shape[0]}")
    return bs, k


KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_kernel_dtypes(q, k_cache, v_cache):
    """The Triton kernels take q and the caches in one dtype among KERNEL_DTYPES."""
    if q.dtype not in KERNEL_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"impl='triton' needs q, k_cache, v_cache all of one dtype in "
                         f"{KERNEL_DTYPES}; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype} "
                         f"(impl='torch' accepts mixed dtypes and float64)")


@dataclass(frozen=True)
class SplitPolicy:
    """How `split_kv_attention` launches. num_splits / fold None: chosen from shapes
    (`choose_num_splits`, `choose_fold`); block_n None: `plan_split`'s tile; num_warps None:
    4; num_stages: the kernel's; prefetch None: `choose_prefetch` (each step issues the next
    tile's K and V before computing its own).
    Benchmarks set knobs to sweep them.
    pdl: launch with programmatic dependent launch where the GPU and Triton have it
    (`pdl.supported`): the kernel starts while the kernel before it still runs, reads the
    metadata (seq_lens, req_pool_indices, req_to_token) and, with prefetch, its first tile's K /
    V of the positions before each request's last num_q, then waits for that kernel, then reads
    q and the last num_q positions' K / V. So the kernel just before may write q and those
    positions' K / V (what a fused qkv projection does), and nothing else the attention reads:
    not the metadata, not older positions (docs/pdl.md). Off: a plain launch."""
    num_splits: int | None = None
    fold: bool | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int = 2
    prefetch: bool | None = None
    pdl: bool = False

    def __post_init__(self):
        if self.num_splits is not None and not 1 <= self.num_splits <= 2 * MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1 .. {2 * MAX_SPLITS}; "
                             f"got {self.num_splits}")
        for name in ("block_n", "num_warps"):  # Triton tiles and warps come in powers of two
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"{name} must be a power of two; got {value}")


@dataclass(frozen=True)
class SplitPlan:
    """What `split_kv_attention` launches (`plan_split`): num_splits programs a (request, kv
    head), the merge folded into them or a second kernel, the double-buffered loop or not, the
    tiles (BLOCK_M query rows, BLOCK_N keys a step, head dims padded) and warps / stages."""
    num_splits: int
    fold: bool
    prefetch: bool
    blocks: dict
    num_warps: int
    num_stages: int


def plan_split(bs: int, n_kv_heads: int, group: int, num_q: int, head_dim: int,
               v_head_dim: int, max_context: int, n_sm: int, itemsize: int = 2,
               policy: SplitPolicy = SplitPolicy()) -> SplitPlan:
    """The launch `split_kv_attention` makes for these shapes under `policy`: its knobs where
    set, else `choose_prefetch`, the tile of `decode_block_n` (decode) / `tree_block_n` (tree
    verify) / `kernel_blocks`, 4 warps, `choose_num_splits`, `choose_fold`. From shapes only
    (no tensor values), so one bucket captures one launch."""
    num_splits, fold = policy.num_splits, policy.fold
    if num_splits is None and num_q == 1:   # decode's splits do not depend on the tile
        num_splits = choose_num_splits(bs, n_kv_heads, max_context, n_sm, num_q)
    prefetch = policy.prefetch
    if prefetch is None:
        prefetch = choose_prefetch(num_q, bs, n_kv_heads, None if num_splits is None
                                   else triton.cdiv(max(1, max_context), num_splits))
    block_n = policy.block_n or (
        decode_block_n(head_dim, v_head_dim, num_q, prefetch, itemsize) if num_q == 1
        else tree_block_n(head_dim, v_head_dim, num_q * group, itemsize))
    blocks = kernel_blocks(head_dim, v_head_dim, num_q * group, block_n)
    num_warps = policy.num_warps or 4
    if num_splits is None:          # tree verify: from the tile
        num_splits = choose_num_splits(bs, n_kv_heads, max_context, n_sm, num_q,
                                       blocks["BLOCK_N"])
    if fold is None:
        fold = choose_fold(num_splits, num_q, group, v_head_dim)
    return SplitPlan(num_splits, bool(fold) and num_splits > 1, bool(prefetch), blocks,
                     num_warps, policy.num_stages)


def split_kv_attention(q, k_cache, v_cache, meta: PagedMeta, sm_scale: float,
                       policy: SplitPolicy = SplitPolicy()):
    """Launch the split-KV kernel (merge folded in, or + the merge kernel) for a DECODE or TREE
    `meta`: q [bs * num_q, n_q_heads, head_dim] -> o [bs * num_q, n_q_heads, v_head_dim]
    (callers check shapes). `policy`'s unset knobs are decided from shapes only."""
    check_kernel_dtypes(q, k_cache, v_cache)
    if meta.mode not in (DECODE, TREE):
        raise ValueError(f"split_kv_attention runs decode and tree metadata; got "
                         f"{MODE_NAMES[meta.mode]} (extend_attention runs causal)")
    num_q, tree_mask = meta.num_q, meta.tree_mask
    n_rows, n_q_heads, head_dim = q.shape
    bs, n_kv_heads, v_head_dim = n_rows // num_q, k_cache.shape[1], v_cache.shape[2]
    group = n_q_heads // n_kv_heads
    plan = plan_split(bs, n_kv_heads, group, num_q, head_dim, v_head_dim, meta.max_context,
                      sm_count(q.device), q.element_size(), policy)
    num_splits, fold, blocks, num_warps = plan.num_splits, plan.fold, plan.blocks, plan.num_warps
    # the kernels index 1-d metadata with unit stride (a no-op for the dense tensors runners pass)
    req_pool_indices, seq_lens = meta.req_pool_indices.contiguous(), meta.seq_lens.contiguous()
    req_to_token = meta.req_to_token
    o = q.new_empty(n_rows, n_q_heads, v_head_dim)
    if n_rows == 0:
        return o
    if num_splits > 1:
        mid_o, mid_lse = partials(n_rows, n_q_heads, num_splits, v_head_dim, q.device)
    else:  # every request is finished by its only program: no partials, no merge
        mid_o, mid_lse = partials(1, 1, 1, 1, q.device)
    # always an int32 counter buffer (one signature, one compile); only a folded merge uses it
    counters, fold = tickets(q.device, bs * n_kv_heads if fold else 0, fold)
    tree = tree_mask.contiguous().view(torch.uint8) if tree_mask is not None else req_pool_indices
    launch = launch_options(q.device, policy.pdl)
    # the kernel's PDL shape (loads split around the wait) where it launches with PDL, and on
    # the CPU interpreter, which runs that shape with the wait a no-op (tested there)
    pdl = bool(policy.pdl) and (bool(launch) or q.device.type == "cpu")
    _split_kv_kernel[(bs, n_kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, tree, o, mid_o, mid_lse,
        counters, sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        o.stride(0), o.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        head_dim, v_head_dim, num_splits, int(fold),
        GROUP=group, NUM_Q=num_q, HAS_TREE=tree_mask is not None,
        UPCAST=upcast_dots(q.dtype), num_warps=num_warps, num_stages=plan.num_stages,
        MERGE_UNROLL=merge_unroll(blocks["BLOCK_M"], blocks["BLOCK_DV"], num_warps),
        PREFETCH=plan.prefetch, PDL=pdl, **blocks, **launch,
    )
    if num_splits > 1 and not fold:
        launch_merge(mid_o, mid_lse, seq_lens, o, num_q, num_splits, blocks["BLOCK_N"])
    return o


def decode_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                     sm_scale=None, num_splits=None, impl="auto", pdl=False):
    """Paged decode attention: q [bs, n_q_heads, head_dim] -> [bs, n_q_heads, v_head_dim].

    Request r attends to positions 0 .. seq_lens[r]-1 of row req_pool_indices[r]; padded lanes
    (seq_lens 1, row 0) read only the sink slot. `num_splits` overrides the static split count.
    `pdl`: `SplitPolicy.pdl` (the kernel just before may write only q and the new token's K / V).
    """
    bs = q.shape[0]
    check_paged_args(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    sm_scale = default_sm_scale(q.shape[-1], sm_scale)
    if resolve_impl(impl, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens) \
            == "torch":
        return decode_attention_reference(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                          seq_lens, sm_scale)
    meta = PagedMeta.decode(req_to_token, req_pool_indices, seq_lens)
    return split_kv_attention(q, k_cache, v_cache, meta, sm_scale,
                              SplitPolicy(num_splits, pdl=pdl))
