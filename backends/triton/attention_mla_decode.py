"""A dedicated absorbed-MLA kernel over the paged latent cache: decode, draft-tree verify and
causal extend, graph-safe. The oracle is the non-absorbed torch reference
(`attention_mla.mla_reference`); the absorbed torch form (the CPU path) is the paged references
of `attention_decode` / `_extend` / `_verify` over column views of the latent cache.

Latent row (one per slot): `[c_kv (kv_lora_rank) | k_rope (rope_dim)]`, e.g. 512 + 64. Keys are
the whole row, values its first kv_lora_rank columns. Per iteration a program gathers BLOCK_N
rows as two tiles, `kv [BLOCK_N, BLOCK_C]` (c_kv) and `kr [BLOCK_N, BLOCK_R]` (k_rope), from
one slot-index load; `kv` serves both products:

    s   = q_c @ kv^T + q_r @ kr^T        # [BLOCK_H, BLOCK_N]   scores
    acc = acc * alpha + p @ kv           # [BLOCK_H, BLOCK_C]   values

so each latent byte is read once (no padding of 576 to 1024, no second read of c_kv as V).

Rows of a program are BLOCK_H (query, head) pairs of one request, query-major (row m = query
m // n_heads, head m % n_heads): at decode with 16 heads one program holds every head, so a tile
is read once for all of them. Grid `(row blocks, bs, S)`: row blocks vary fastest, so the
programs that share a request's tiles run together (the second and later ones hit L2).
Splits (decode, verify) follow `attention_split.py`: S is a runtime argument, lengths are read on
the device, the merge is folded into the last split or done by a second small kernel. A causal
extend splits only when short (draft-extend: a few tokens per request), always with the folded
merge (a row block's splits follow its own causal range).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from padgraph.errors import ContractValueError, mismatch

from .attention_decode import check_kernel_dtypes, mma, sm_count, upcast_dots
from .attention_meta import CAUSAL, DECODE, TREE, PagedMeta
from .attention_split import (aligned, finish_split, launch_merge, merge_unroll, partials,
                              should_fold, split_len, tickets, tile_slots)

PROGRAMS_PER_SM = 2  # an MLA program keeps ~72 KB of tiles in flight: 2 per SM saturate HBM
MAX_SPLITS = 64
# Splits >= MIN_SPLIT_TOKENS of the cache width (256 -> 128, 4 tiles of 32, not measured). The cap
# binds at small batch (bs 1 at 8192: 64 splits, was 32, i.e. 64 of 132 SMs busy instead of 32):
# past 4 splits MLA merges in the merge kernel, which now spreads over bs * H * 8 programs of
# 64 columns, one L2 round trip per 32 splits (was bs * 8 programs reading the splits one by one).
MIN_SPLIT_TOKENS = 128
# Decode takes its own row-major tile (DECODE_TILE): c_kv as two column halves (SPLIT_C, so
# that the QK product runs as independent MMA chains instead of one 36-deep one), 32 latent rows
# an iteration in 3 stages (3 x 36 KB in flight) over 4 warps, at most DECODE_PROGRAMS_PER_SM
# programs an SM (floor: no partial second wave), splits of >= DECODE_MIN_SPLIT_TOKENS, merge
# folded up to DECODE_FOLD_MAX_BYTES of partials. In a graph-timed sweep on an H200
# (`bench.bench_mla --decode-only --keys-major`, DeepSeek-V2-Lite sizes; results/mla.md) it was
# best at every swept point - bs 1 ctx 8192 19.2 us at 128 splits (keys-major policy 22.2);
# bs 8 ctx 8192 42.6 at 33 splits + merge (the 32/2/4 policy 50.9; fold 72.6); bs 32 ctx 8192
# 110.2 at 8 splits folded (the 64-row 8-warp tile's policy 145.2; unfolded 113.6); the same
# tile without SPLIT_C 3-5% slower, at 2 stages 20-30% slower. It replaced the wide 64/2/8
# tile (one program an SM) and keys-major decode at bs 1.
DECODE_TILE = dict(BLOCK_N=32, num_warps=4, num_stages=3)
DECODE_PROGRAMS_PER_SM = 2
DECODE_MIN_SPLIT_TOKENS = 64   # 2 tiles of 32
DECODE_MAX_SPLITS = 128
DECODE_FOLD_MAX_BYTES = 256 << 10  # 16 rows x 512 columns fp32: folded up to 8 splits
# where the shared memory a block may opt into is unknown or smaller than 3 stages of tiles
# (+ q and the epilogue): 2 stages
SMEM_MARGIN = 32 << 10
KEYS_MAJOR_TILE = dict(BLOCK_N=64, num_warps=4)  # one warp group: 64 keys = one wgmma M tile
# >= 32 rows (verify: 8 drafts x 16 heads): 32 rows a program over two warp groups (sm_90 compile
# with Triton 3.6: 241 registers, no spills, 200 KB of shared memory; 64 rows do not fit)
KEYS_MAJOR_MANY_ROWS = dict(BLOCK_H=32, BLOCK_N=64, num_warps=8)
# Where the policy takes the keys-major kernel (sm_90+): bs * max_context (the cache width) at
# least this much (decode: bs 1 only). On an H200 (`bench.bench_mla --keys-major`,
# results/mla.md; two runs within 0.02 of each other) verify took 0.57-0.84 of the row-major
# time at bs 8 and 32 (ctx 1024, 8192), 0.90 at bs 1 ctx 8192, but 1.26 at bs 1 ctx 1024;
# extend 0.73-0.93 at bs 8 ctx 8192 and bs 32, but 1.18-1.51 below that;
# decode 0.80-0.90 at bs 1 ctx >= 8192, 1.08 at bs 1 ctx 1024, 0.98-1.20 at bs 8 and 32 (one
# program an SM, 168 KB of tiles: latency-bound, no second program to overlap with); decode
# now takes DECODE_TILE everywhere (faster than keys-major at every swept point, above).
KEYS_MAJOR_MIN_WORK = {TREE: 8192, CAUSAL: 32768}
KEYS_MAJOR_FOLD_MAX_BYTES = 512 << 10  # one program an SM: folded up to 8 splits of 32 rows
PARTIALS_MAX_BYTES = 64 << 20  # fp32 partials of a split causal extend


# ----------------------------------------------------------------------------- kernel

@triton.jit
def _mla_span(SeqLens, QoIndptr, r, blk, split, n_heads, num_splits, NUM_Q: tl.constexpr,
              MODE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row block blk, request r, split): (seq_len, q_start, n_q, n_rows, n_used, start,
    end), its request's length and queries and the key positions [start, end) it covers."""
    seq_len = tl.load(SeqLens + r)
    if MODE == 2:  # CAUSAL: request r's n_q new tokens are q[q_start : q_start + n_q]
        q_start = tl.load(QoIndptr + r)
        n_q = tl.load(QoIndptr + r + 1) - q_start
    else:
        q_start = r * NUM_Q
        n_q = NUM_Q
    n_rows = n_q * n_heads
    kv_len = seq_len
    if MODE == 2:  # this block's last query sees up to its own position
        last_q = tl.minimum((blk + 1) * BLOCK_H, n_rows) - 1
        kv_len = tl.minimum(seq_len, seq_len - n_q + last_q // n_heads + 1)
    share = split_len(seq_len, num_splits, BLOCK_N)
    n_used = tl.cdiv(kv_len, share)  # the same for every split of this (request, row block)
    start = split * share
    end = tl.minimum(start + share, kv_len)
    return seq_len, q_start, n_q, n_rows, n_used, start, end


@triton.jit
def _mla_queries(Q, blk, seq_len, q_start, n_q, n_rows, n_heads, kv_lora_rank, rope_dim,
                 stride_q_t, stride_q_h, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """The block's BLOCK_H (query, head) rows, query-major: (m_ok, qi, qh, pos_q, q_row, offs_c,
    c_ok, offs_r, r_ok, q_c [BLOCK_H, BLOCK_C], q_r [BLOCK_H, BLOCK_R])."""
    offs_m = blk * BLOCK_H + tl.arange(0, BLOCK_H)
    m_ok = offs_m < n_rows
    qi = offs_m // n_heads  # query index within the request
    qh = offs_m % n_heads  # head
    pos_q = seq_len - n_q + qi  # [BLOCK_H] position of each row's query
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < kv_lora_rank
    r_ok = offs_r < rope_dim
    q_row = (q_start + qi).to(tl.int64)
    q_base = Q + q_row[:, None] * stride_q_t + qh[:, None] * stride_q_h
    q_c = tl.load(q_base + offs_c[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
    q_r = tl.load(q_base + kv_lora_rank + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                  other=0.0)
    return m_ok, qi, qh, pos_q, q_row, offs_c, c_ok, offs_r, r_ok, q_c, q_r


@triton.jit
def _mla_finish(acc, m_i, l_i, r, blk, split, n_used, fold, Counters, Out, MidO, MidLse,
                q_row, qh, offs_c, m_ok, c_ok, stride_o_t, stride_o_h, stride_mo_t,
                stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
                MERGE_UNROLL: tl.constexpr):
    """acc [BLOCK_H, BLOCK_C]: this split's output or partial (attention_split.finish_split)."""
    finish_split(acc, m_i, l_i, split, tl.maximum(n_used, 1), fold,
                 Counters + r * tl.num_programs(0) + blk,
                 Out + q_row[:, None] * stride_o_t + qh[:, None] * stride_o_h + offs_c[None, :],
                 MidO + q_row[:, None] * stride_mo_t + qh[:, None] * stride_mo_h
                 + offs_c[None, :],
                 MidLse + q_row * stride_ml_t + qh * stride_ml_h,
                 stride_mo_s, 1, m_ok, c_ok, MERGE_UNROLL)


@triton.jit(do_not_specialize=["stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t",
                               "stride_ml_h", "num_splits", "fold"])
def _mla_kernel(
    Q, KV, ReqToToken, ReqPoolIdx, SeqLens, QoIndptr, TreeMask, Out, MidO, MidLse, Counters,
    sm_scale,
    stride_q_t, stride_q_h, stride_kv_s, stride_rt, stride_o_t, stride_o_h,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    n_heads, kv_lora_rank, rope_dim, num_splits, fold,
    NUM_Q: tl.constexpr, MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    MERGE_UNROLL: tl.constexpr, SLOTS_AHEAD: tl.constexpr, SPLIT_C: tl.constexpr = False,
):
    stride_mo_t, stride_mo_h, stride_mo_s = (aligned(stride_mo_t), aligned(stride_mo_h),
                                             aligned(stride_mo_s))  # padded partials
    blk = tl.program_id(0)
    r = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, q_start, n_q, n_rows, n_used, start, end = _mla_span(
        SeqLens, QoIndptr, r, blk, split, n_heads, num_splits, NUM_Q, MODE, BLOCK_H, BLOCK_N)
    # else nothing to read, nothing to write; split 0 of a request with seq_len 0 runs with no
    # tile and writes the 0 the reference gives
    if (blk * BLOCK_H < n_rows) & ((start < end) | (split == 0)):
        row = tl.load(ReqPoolIdx + r).to(tl.int64)
        m_ok, qi, qh, pos_q, q_row, offs_c, c_ok, offs_r, r_ok, q_c, q_r = _mla_queries(
            Q, blk, seq_len, q_start, n_q, n_rows, n_heads, kv_lora_rank, rope_dim,
            stride_q_t, stride_q_h, BLOCK_H, BLOCK_C, BLOCK_R)
        prefix = tl.maximum(seq_len - NUM_Q, 0)  # positions every draft sees (TREE)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: all-masked rows stay 0
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        if SPLIT_C:  # c_kv as two column halves: q, tiles and accumulator (DECODE_TILE)
            HALF: tl.constexpr = BLOCK_C // 2
            offs_lo = tl.arange(0, HALF)
            lo_ok = offs_lo < kv_lora_rank
            hi_ok = offs_lo + HALF < kv_lora_rank
            # q's two column halves loaded as such (splitting the loaded q_c in registers with
            # reshape / permute / split spilled at sm_90 and re-chained part of the product)
            q_base = Q + q_row[:, None] * stride_q_t + qh[:, None] * stride_q_h
            q_lo = tl.load(q_base + offs_lo[None, :], mask=m_ok[:, None] & lo_ok[None, :],
                           other=0.0)
            q_hi = tl.load(q_base + HALF + offs_lo[None, :],
                           mask=m_ok[:, None] & hi_ok[None, :], other=0.0)
            acc_lo = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
            acc_hi = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        idx = ReqToToken + row * stride_rt
        # SLOTS_AHEAD: a tile's slot indices are loaded one tile ahead (1) or in the loop (0)
        if SLOTS_AHEAD == 1:
            slot = tile_slots(idx, start + tl.arange(0, BLOCK_N), end)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            if SLOTS_AHEAD == 0:
                slot = tile_slots(idx, offs_n, end)
            kv_base = KV + slot[:, None] * stride_kv_s
            if SPLIT_C:  # two tiles of c_kv columns: the QK product as independent chains
                kv_lo = tl.load(kv_base + offs_lo[None, :], mask=n_ok[:, None] & lo_ok[None, :],
                                other=0.0)  # [BLOCK_N, HALF]
                kv_hi = tl.load(kv_base + HALF + offs_lo[None, :],
                                mask=n_ok[:, None] & hi_ok[None, :], other=0.0)
            else:
                kv = tl.load(kv_base + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :],
                             other=0.0)  # [BLOCK_N, BLOCK_C]: c_kv, keys and values
            kr = tl.load(kv_base + kv_lora_rank + offs_r[None, :],
                         mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
            if SLOTS_AHEAD == 1:  # the tile and the next tile's slots issue together
                slot = tile_slots(idx, offs_n + BLOCK_N, end)
            if SPLIT_C:  # each product scaled on its own: Triton would fold `dot + dot` into
                # one accumulation chain again (dot(a, b) + c -> dot(a, b, acc=c))
                s = (mma(q_lo, tl.trans(kv_lo), UPCAST) * sm_scale
                     + mma(q_hi, tl.trans(kv_hi), UPCAST) * sm_scale
                     + mma(q_r, tl.trans(kr), UPCAST) * sm_scale).to(tl.float32)
            else:
                s = mma(q_c, tl.trans(kv), UPCAST) + mma(q_r, tl.trans(kr), UPCAST)
                s = (s * sm_scale).to(tl.float32)  # [BLOCK_H, BLOCK_N]
            visible = n_ok[None, :] & m_ok[:, None]
            if MODE == 1:  # TREE: draft i sees the prefix and the drafts tree_mask[r, i, :]
                j = offs_n - (seq_len - NUM_Q)  # draft index of key position (>= 0 in the tail)
                in_tail = (offs_n >= prefix)[None, :] & visible
                tm = tl.load(TreeMask + r * NUM_Q * NUM_Q + qi[:, None] * NUM_Q + j[None, :],
                             mask=in_tail, other=0)
                visible = visible & ((offs_n < prefix)[None, :] | (tm != 0))
            if MODE == 2:
                visible = visible & (offs_n[None, :] <= pos_q[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if SPLIT_C:
                pk = p.to(kv_lo.dtype)
                acc_lo = acc_lo * alpha[:, None] + mma(pk, kv_lo, UPCAST)
                acc_hi = acc_hi * alpha[:, None] + mma(pk, kv_hi, UPCAST)
            else:
                acc = acc * alpha[:, None] + mma(p.to(kv.dtype), kv, UPCAST)
            m_i = m_new

        if SPLIT_C:  # [lo | hi] -> [BLOCK_H, BLOCK_C]
            acc = tl.reshape(tl.permute(tl.join(acc_lo, acc_hi), (0, 2, 1)), (BLOCK_H, BLOCK_C))
        _mla_finish(acc, m_i, l_i, r, blk, split, n_used, fold, Counters, Out, MidO, MidLse,
                    q_row, qh, offs_c, m_ok, c_ok, stride_o_t, stride_o_h, stride_mo_t,
                    stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, MERGE_UNROLL)


@triton.jit(do_not_specialize=["stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t",
                               "stride_ml_h", "num_splits", "fold"])
def _mla_keys_major_kernel(
    Q, KV, ReqToToken, ReqPoolIdx, SeqLens, QoIndptr, TreeMask, Out, MidO, MidLse, Counters,
    sm_scale,
    stride_q_t, stride_q_h, stride_kv_s, stride_rt, stride_o_t, stride_o_h,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    n_heads, kv_lora_rank, rope_dim, num_splits, fold,
    NUM_Q: tl.constexpr, MODE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    MERGE_UNROLL: tl.constexpr, SLOTS_AHEAD: tl.constexpr,
):
    # _mla_kernel with its products transposed: keys are the rows (the M side of the tensor-core
    # product), the BLOCK_H query rows its columns (N):
    #     s^T   = kv @ q_c^T + kr @ q_r^T      # [BLOCK_N, BLOCK_H]
    #     acc^T = acc^T * alpha + kv^T @ p^T   # [BLOCK_C, BLOCK_H]
    # With BLOCK_N = 64 and 4 warps both products are Hopper warp-group MMAs whose large operand
    # (the latent tile, read as is and transposed) stays in shared memory where the pipelined
    # load put it, and q sits in shared memory too: no long chain of dependent register MMAs
    # over the 576 columns (the row-major kernel's 36-deep chain a tile) and no q in registers.
    stride_mo_t, stride_mo_h, stride_mo_s = (aligned(stride_mo_t), aligned(stride_mo_h),
                                             aligned(stride_mo_s))
    blk = tl.program_id(0)
    r = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, q_start, n_q, n_rows, n_used, start, end = _mla_span(
        SeqLens, QoIndptr, r, blk, split, n_heads, num_splits, NUM_Q, MODE, BLOCK_H, BLOCK_N)
    # else nothing to read, nothing to write; split 0 of a request with seq_len 0 runs with no
    # tile and writes the 0 the reference gives
    if (blk * BLOCK_H < n_rows) & ((start < end) | (split == 0)):
        row = tl.load(ReqPoolIdx + r).to(tl.int64)
        m_ok, qi, qh, pos_q, q_row, offs_c, c_ok, offs_r, r_ok, q_c, q_r = _mla_queries(
            Q, blk, seq_len, q_start, n_q, n_rows, n_heads, kv_lora_rank, rope_dim,
            stride_q_t, stride_q_h, BLOCK_H, BLOCK_C, BLOCK_R)
        q_ct = tl.trans(q_c)  # [BLOCK_C, BLOCK_H]
        q_rt = tl.trans(q_r)  # [BLOCK_R, BLOCK_H]
        prefix = tl.maximum(seq_len - NUM_Q, 0)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)  # transposed
        idx = ReqToToken + row * stride_rt
        if SLOTS_AHEAD == 1:
            slot = tile_slots(idx, start + tl.arange(0, BLOCK_N), end)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            if SLOTS_AHEAD == 0:
                slot = tile_slots(idx, offs_n, end)
            kv_base = KV + slot[:, None] * stride_kv_s
            kv = tl.load(kv_base + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_C]
            kr = tl.load(kv_base + kv_lora_rank + offs_r[None, :],
                         mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
            if SLOTS_AHEAD == 1:  # the tile and the next tile's slots issue together
                slot = tile_slots(idx, offs_n + BLOCK_N, end)
            s = mma(kv, q_ct, UPCAST) + mma(kr, q_rt, UPCAST)
            s = (s * sm_scale).to(tl.float32)  # [BLOCK_N, BLOCK_H]
            visible = n_ok[:, None] & m_ok[None, :]
            if MODE == 1:
                j = offs_n - (seq_len - NUM_Q)
                in_tail = (offs_n >= prefix)[:, None] & visible
                tm = tl.load(TreeMask + r * NUM_Q * NUM_Q + qi[None, :] * NUM_Q + j[:, None],
                             mask=in_tail, other=0)
                visible = visible & ((offs_n < prefix)[:, None] | (tm != 0))
            if MODE == 2:
                visible = visible & (offs_n[:, None] <= pos_q[None, :])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha[None, :] + mma(tl.trans(kv), p.to(kv.dtype), UPCAST)
            m_i = m_new

        _mla_finish(tl.trans(acc), m_i, l_i, r, blk, split, n_used, fold, Counters, Out, MidO,
                    MidLse, q_row, qh, offs_c, m_ok, c_ok, stride_o_t, stride_o_h, stride_mo_t,
                    stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, MERGE_UNROLL)


# ----------------------------------------------------------------------------- host side

def mla_blocks(kv_lora_rank: int, rope_dim: int, rows: int) -> dict:
    """Tiles: BLOCK_H = 16 (query, head) rows per program, BLOCK_N = 32 latent rows per
    iteration, c_kv / rope widths padded to powers of 2, 4 warps. (sm_90 at 512 + 64: 4 warps use
    255 registers and spill ~0.1-0.2 KB a thread but fit 2 programs an SM, 72 KB of tiles in flight;
    8 warps don't spill but fit one; 32 rows spill 0.4-0.9 KB. `bench/bench_mla.py` sweeps.)
    `rows` (a request's query rows) is unused today: more rows are more row blocks."""
    return dict(BLOCK_H=16, BLOCK_N=32,
                BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
                BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), num_warps=4)


def choose_keys_major(mode: int, bs: int, max_context: int, device: torch.device) -> bool:
    """The keys-major kernel where it measured faster (KEYS_MAJOR_MIN_WORK), on GPUs with
    warp-group MMAs and the shared memory its 64-key tiles take (sm_90 and later)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    if mode == DECODE:
        return False
    return bs * max_context >= KEYS_MAJOR_MIN_WORK[mode]


def choose_mla_splits(bs: int, n_blocks: int, max_context: int, n_sm: int,
                      one_per_sm: bool = False, decode: bool = False) -> int:
    """Static split count from shapes only, bounded: ~PROGRAMS_PER_SM programs per SM (verify,
    extend), at most one an SM (`one_per_sm`: the keys-major tile), or with the decode tile at
    most DECODE_PROGRAMS_PER_SM an SM with splits of >= DECODE_MIN_SPLIT_TOKENS."""
    pairs = max(1, bs * n_blocks)
    if decode and not one_per_sm:
        want = max(1, DECODE_PROGRAMS_PER_SM * n_sm // pairs)
        cap = min(max_context // DECODE_MIN_SPLIT_TOKENS, DECODE_MAX_SPLITS)
    else:
        want = max(1, n_sm // pairs) if one_per_sm else triton.cdiv(PROGRAMS_PER_SM * n_sm, pairs)
        cap = min(max_context // MIN_SPLIT_TOKENS, MAX_SPLITS)
    return max(1, min(want, cap))


def decode_stages(blocks: dict, device: torch.device) -> int:
    """DECODE_TILE's 3 stages where 3 stages of bf16 tiles (+ SMEM_MARGIN) fit the shared memory
    a block may opt into (sm_80: 163 KB, sm_90: 227 KB), else 2 (sm_86 / sm_89: 99 KB)."""
    if device.type != "cuda":
        return DECODE_TILE["num_stages"]  # the interpreter has no stages
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    stage = blocks["BLOCK_N"] * (blocks["BLOCK_C"] + blocks["BLOCK_R"]) * 2
    return DECODE_TILE["num_stages"] if 3 * stage + SMEM_MARGIN <= optin else 2


def choose_mla_extend_splits(bs: int, n_tok: int, n_heads: int, block_h: int,
                             max_context: int, kv_lora_rank: int, width: int, n_sm: int) -> int:
    """Splits of a causal extend, from shapes only: as decode for short extends (draft-extend),
    bounded so that the folded merge (the only one a causal tile has) reads at most half of what
    a split reads, and the fp32 partials stay <= PARTIALS_MAX_BYTES; 1 for long extends."""
    rows = triton.cdiv(n_tok, max(bs, 1)) * n_heads  # rows of an average request
    splits = choose_mla_splits(bs, triton.cdiv(rows, block_h), max_context, n_sm)
    while splits > 1 and (
            splits * min(rows, block_h) * kv_lora_rank * 4 > (max_context // splits) * width
            or n_tok * n_heads * splits * kv_lora_rank * 4 > PARTIALS_MAX_BYTES):
        splits -= 1
    return splits


@dataclass(frozen=True)
class MlaPolicy:
    """How `mla_paged_attention` launches: each knob None is decided by `plan_mla` from shapes
    (the policy); benchmarks set knobs to sweep them.

    num_splits: splits of a request's positions (1 .. 4 * MAX_SPLITS). fold: merge the splits
    in the last split to finish (True) or in the merge kernel (False); a causal extend always
    folds. block_n / block_h / num_warps / num_stages: the tile (latent rows an iteration,
    (query, head) rows a program, warps, pipeline stages); a tile knob starts from the
    row-major kernel's base tile (`mla_blocks`, 2 stages, no SPLIT_C), not from DECODE_TILE,
    and keeps the row-major kernel unless keys_major is set. keys_major: `_mla_keys_major_kernel`
    (None: `choose_keys_major`). split_c: the row-major kernel with c_kv as two column halves,
    so that its QK product runs as independent MMA chains (DECODE_TILE's choice).
    slots_ahead: a tile's slot indices are loaded one tile ahead (1) or in the loop (0)."""
    num_splits: int | None = None
    fold: bool | None = None
    block_n: int | None = None
    block_h: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    keys_major: bool | None = None
    split_c: bool | None = None
    slots_ahead: int = 1

    def __post_init__(self):
        if self.slots_ahead not in (0, 1):
            raise ContractValueError(mismatch("mla_paged_attention", None, "policy.slots_ahead",
                                              "0 or 1", self.slots_ahead))
        if self.num_splits is not None and not 1 <= self.num_splits <= 4 * MAX_SPLITS:
            raise ContractValueError(mismatch("mla_paged_attention", None, "policy.num_splits",
                                              f"in 1 .. {4 * MAX_SPLITS}", self.num_splits))

    @property
    def tile_knob(self) -> bool:
        """Whether a tile knob (block_n, num_warps, block_h) is set."""
        return any(k is not None for k in (self.block_n, self.num_warps, self.block_h))


@dataclass(frozen=True)
class MlaShape:
    """What `plan_mla` decides from, shapes only: n_tok query tokens of n_heads heads over
    latent rows of width = kv_lora_rank + rope_dim columns; bs requests in rows of max_context
    positions; mode and num_q as in `PagedMeta`; the device the kernel runs on."""
    n_tok: int
    n_heads: int
    width: int
    bs: int
    max_context: int
    kv_lora_rank: int
    mode: int
    num_q: int
    device: torch.device

    @classmethod
    def of(cls, q_latent, meta: PagedMeta, kv_lora_rank: int) -> "MlaShape":
        """The shape of a call: q_latent [n_tok, n_heads, width] over `meta`'s requests."""
        n_tok, n_heads, width = q_latent.shape
        return cls(n_tok, n_heads, width, meta.bs, meta.max_context, kv_lora_rank, meta.mode,
                   meta.num_q, q_latent.device)

    @property
    def rows(self) -> int:
        """(query, head) rows of a request (CAUSAL: counted as 2 queries, a short extend)."""
        return self.n_heads * (self.num_q if self.mode != CAUSAL else 2)


@dataclass(frozen=True)
class MlaPlan:
    """What `mla_paged_attention` launches: keys_major (the kernel), blocks (tile constexprs,
    SPLIT_C for the row-major kernel, num_warps, num_stages), n_blocks (row blocks a request),
    num_splits and fold (before the capture-time fallbacks of a causal extend)."""
    keys_major: bool
    blocks: dict
    n_blocks: int
    num_splits: int
    fold: bool


def mla_tile(shape: MlaShape, policy: MlaPolicy, keys_major: bool) -> dict:
    """The tile of `plan_mla`: the base tile (`mla_blocks`, 2 stages), the keys-major tile, or
    DECODE_TILE at a decode without tile knobs; then the policy's tile knobs."""
    blocks = dict(mla_blocks(shape.kv_lora_rank, shape.width - shape.kv_lora_rank, shape.rows),
                  num_stages=2)
    if not keys_major:
        blocks["SPLIT_C"] = False
    if keys_major:
        blocks.update(KEYS_MAJOR_TILE if shape.rows < 32 else KEYS_MAJOR_MANY_ROWS)
    if policy.block_h is not None:
        blocks["BLOCK_H"] = policy.block_h
    if decode_tile(shape, policy, keys_major):
        blocks.update(DECODE_TILE, SPLIT_C=blocks["BLOCK_C"] >= 32)
        blocks["num_stages"] = decode_stages(blocks, shape.device)
    for knob, key in (("block_n", "BLOCK_N"), ("num_warps", "num_warps"),
                      ("num_stages", "num_stages")):
        if getattr(policy, knob) is not None:
            blocks[key] = getattr(policy, knob)
    if policy.split_c is not None:
        if policy.split_c and (keys_major or blocks["BLOCK_C"] < 32):
            raise ValueError("split_c needs the row-major kernel and a latent of >= 17 columns")
        if not keys_major:
            blocks["SPLIT_C"] = policy.split_c
    return blocks


def decode_tile(shape: MlaShape, policy: MlaPolicy, keys_major: bool) -> bool:
    """Whether the launch takes DECODE_TILE: the row-major kernel at a decode, no tile knob."""
    return not keys_major and shape.mode == DECODE and not policy.tile_knob


def plan_mla(shape: MlaShape, policy: MlaPolicy = MlaPolicy()) -> MlaPlan:
    """What `mla_paged_attention` launches for `shape` under `policy`: its knobs where set,
    else the choices made from shapes only (`choose_keys_major`, `mla_tile`,
    `choose_mla_splits` / `choose_mla_extend_splits`, `should_fold`)."""
    keys_major = policy.keys_major
    if keys_major is None:
        keys_major = not policy.tile_knob and choose_keys_major(shape.mode, shape.bs,
                                                                 shape.max_context, shape.device)
    blocks = mla_tile(shape, policy, keys_major)
    block_h = blocks["BLOCK_H"]
    # CAUSAL: enough row blocks for the longest possible request (all n_tok tokens)
    n_blocks = triton.cdiv((shape.num_q if shape.mode != CAUSAL else shape.n_tok)
                           * shape.n_heads, block_h)
    on_decode_tile = decode_tile(shape, policy, keys_major)
    num_splits = policy.num_splits
    if num_splits is None and shape.mode == CAUSAL:
        num_splits = choose_mla_extend_splits(shape.bs, shape.n_tok, shape.n_heads, block_h,
                                              shape.max_context, shape.kv_lora_rank,
                                              shape.width, sm_count(shape.device))
    elif num_splits is None:
        num_splits = choose_mla_splits(shape.bs, n_blocks, shape.max_context,
                                       sm_count(shape.device), keys_major, on_decode_tile)
    fold = policy.fold
    if shape.mode == CAUSAL:  # a causal block's splits depend on its range: only the folded merge
        fold = True
    elif fold is None:
        limit = (DECODE_FOLD_MAX_BYTES if on_decode_tile
                 else KEYS_MAJOR_FOLD_MAX_BYTES if keys_major else None)
        fold = should_fold(num_splits, min(block_h, shape.rows), shape.kv_lora_rank, limit)
    return MlaPlan(keys_major, blocks, n_blocks, num_splits, fold and num_splits > 1)


GRID_YZ_MAX = 65535     # CUDA's limit on a launch grid's second and third axes


def mla_paged_attention(q_latent, latent_cache, meta: PagedMeta, kv_lora_rank: int,
                        sm_scale: float, policy: MlaPolicy = MlaPolicy()):
    """Launch the MLA kernel: q_latent [n, H, r + rope] -> o_latent [n, H, r] (callers check
    shapes). meta DECODE / TREE: n = bs * num_q, request-major; CAUSAL: packed by qo_indptr,
    padding tokens give 0. `plan_mla` decides what `policy` leaves unset, from shapes."""
    check_kernel_dtypes(q_latent, latent_cache, latent_cache)
    n_tok, n_heads, width = q_latent.shape
    bs, mode = meta.bs, meta.mode
    plan = plan_mla(MlaShape.of(q_latent, meta, kv_lora_rank), policy)
    blocks, n_blocks, num_splits = plan.blocks, plan.n_blocks, plan.num_splits
    if bs > GRID_YZ_MAX or num_splits > GRID_YZ_MAX:
        # the grid's second and third axes stop at 65535 on CUDA: a clear refusal, not a failed launch
        raise ContractValueError(mismatch(
            "mla_paged_attention", None, "requests (meta.bs) and splits",
            f"at most {GRID_YZ_MAX} each (the kernel's grid puts them on CUDA's second and third axes; a "
            f"causal prefill runner pads its requests to its token bucket: use prefill buckets of at most "
            f"{GRID_YZ_MAX} tokens)", f"bs {bs}, splits {num_splits}"))
    alloc = torch.zeros if mode == CAUSAL else torch.empty  # CAUSAL: padding tokens stay 0
    o = alloc(n_tok, n_heads, kv_lora_rank, dtype=q_latent.dtype, device=q_latent.device)
    if n_tok == 0 or bs == 0:
        return o
    counters, fold = tickets(q_latent.device, bs * n_blocks if plan.fold else 0, plan.fold)
    if mode == CAUSAL and num_splits > 1 and not fold:  # no zeroed counters yet (in a capture)
        num_splits = 1
    if num_splits > 1:
        mid_o, mid_lse = partials(n_tok, n_heads, num_splits, kv_lora_rank, q_latent.device)
    else:  # every request is finished by its only program
        mid_o, mid_lse = partials(1, 1, 1, 1, q_latent.device)
    # the kernel indexes 1-d metadata with unit stride (a no-op for dense tensors)
    req_to_token = meta.req_to_token
    req_pool_indices, seq_lens = meta.req_pool_indices.contiguous(), meta.seq_lens.contiguous()
    tree = (meta.tree_mask.contiguous().view(torch.uint8) if meta.tree_mask is not None
            else req_pool_indices)
    indptr = meta.qo_indptr.contiguous() if meta.qo_indptr is not None else req_pool_indices
    kernel = _mla_keys_major_kernel if plan.keys_major else _mla_kernel
    kernel[(n_blocks, bs, num_splits)](
        q_latent, latent_cache, req_to_token, req_pool_indices, seq_lens, indptr, tree, o,
        mid_o, mid_lse, counters, sm_scale,
        q_latent.stride(0), q_latent.stride(1), latent_cache.stride(0), req_to_token.stride(0),
        o.stride(0), o.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        n_heads, kv_lora_rank, width - kv_lora_rank, num_splits, int(fold),
        NUM_Q=meta.num_q, MODE=mode, UPCAST=upcast_dots(q_latent.dtype),
        MERGE_UNROLL=merge_unroll(blocks["BLOCK_H"], blocks["BLOCK_C"], blocks["num_warps"]),
        SLOTS_AHEAD=policy.slots_ahead, **blocks,
    )
    if num_splits > 1 and not fold:
        launch_merge(mid_o, mid_lse, seq_lens, o, meta.num_q, num_splits, blocks["BLOCK_N"])
    return o
