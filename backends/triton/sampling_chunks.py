"""The sampler's chunk side (`padgraph.backends.triton.sampling`'s module doc): the chunk-max
kernel, the row modes and state, and what a select program does for one chunk of a row in
each mode (its counts, sums and gathers, written to the chunk's slots)."""
from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_for_previous
from .sampling_ints import (KEY_CUT_K, KEY_INF_K, _d_key, _fixed_exp_t, _key_weight,
                            _weights)

# ------------------------------------------------------------------------ the chunk maxima

@triton.jit
def _chunk_max_kernel(L, stride_l, Temp, PartV, PartI, PartNan, PartM, Count, Arrive, CBase, V,
                      C, S, CHUNK: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """Grid (n, C). Chunk c's share of torch's argmax (its largest non-NaN logit, the first
    index holding it, its first NaN) and of max(l * inv_t) with NaN as -inf; it clears the
    chunk's weight below the splits' brackets (CBase). Chunk 0 clears the row's gather and
    arrival counters of the select passes."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    wait_for_previous(PDL)      # the logits are the kernel before's
    l = tl.load(L + row.to(tl.int64) * stride_l + offs, mask=valid,
                other=float("-inf")).to(tl.float32)
    isnan = (l != l) & valid
    lv = tl.where(isnan, float("-inf"), l)
    best = tl.max(lv, axis=0)
    temp = tl.load(Temp + row)
    x = l * tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
    base = row * C + c
    tl.store(PartV + base, best)
    tl.store(PartI + base, tl.min(tl.where((lv == best) & valid & ~isnan, offs, V), axis=0))
    tl.store(PartNan + base, tl.min(tl.where(isnan, offs, V), axis=0))
    tl.store(PartM + base, tl.max(tl.where(x != x, float("-inf"), x), axis=0))
    tl.store(CBase + base, tl.zeros([], dtype=tl.int64))
    if c == 0:
        ss = tl.arange(0, SP)
        tl.store(Count + row * S + ss, 0, mask=ss < S)
        tl.store(Arrive + row * S + ss, 0, mask=ss < S)


@triton.jit
def _row_max(PartM, row, C, CP: tl.constexpr):
    cs = tl.arange(0, CP)
    m = tl.max(tl.load(PartM + row * C + cs, mask=cs < C, other=float("-inf")), axis=0)
    pinf = m == float("inf")
    return tl.where(pinf, 0.0, m), pinf


@triton.jit
def _greedy_token(PartV, PartI, PartNan, row, C, V, CP: tl.constexpr):
    """torch's argmax of the raw row (the first NaN, else the first maximum) from the chunks'
    shares."""
    cs = tl.arange(0, CP)
    ok = cs < C
    pv = tl.load(PartV + row * C + cs, mask=ok, other=float("-inf"))
    pi = tl.load(PartI + row * C + cs, mask=ok, other=V)
    first = tl.min(tl.where(ok & (pv == tl.max(pv, axis=0)), pi, V), axis=0)
    first = tl.where(first == V, 0, first)               # an all -inf row: index 0, as torch
    first_nan = tl.min(tl.load(PartNan + row * C + cs, mask=ok, other=V), axis=0)
    return tl.where(first_nan < V, first_nan, first).to(tl.int64)


# ----------------------------------------------------------------------- the select passes

# A row's mode in one select pass (GREEDY only in the first), and its bit in the row's trace.
MODES = ("done", "weights", "k_hist", "k_gather", "p_split", "p_gather", "p_hist", "greedy")
DONE_K = tl.constexpr(0)
WEIGHTS_K = tl.constexpr(1)
K_HIST_K = tl.constexpr(2)
K_GATHER_K = tl.constexpr(3)
P_SPLIT_K = tl.constexpr(4)
P_GATHER_K = tl.constexpr(5)
P_HIST_K = tl.constexpr(6)
GREEDY_K = tl.constexpr(7)
WEIGHTS_BIT = tl.constexpr(1 << 1)
K_HIST_BIT = tl.constexpr(1 << 2)
K_GATHER_BIT = tl.constexpr(1 << 3)
P_SPLIT_BIT = tl.constexpr(1 << 4)
P_GATHER_BIT = tl.constexpr(1 << 5)
P_HIST_BIT = tl.constexpr(1 << 6)
GREEDY_BIT = tl.constexpr(1 << 7)
PASS_ONE = tl.constexpr(1 << 16)    # the trace counts the passes a row took above its mode bits
NSTATE_K = tl.constexpr(16)     # int64 fields a row: mode, lo, hi, shift, fresh, base, zk, kf,
                                # sel, trace (see `_set_state`)


@triton.jit
def _set_state(st, mode, lo, hi, shift, fresh, base, zk, kf, sel, trace):
    """The row's state for the next pass: its mode; the bracket of keys [lo, hi]; K_HIST's digit
    shift; whether P_SPLIT splits by the fixed table (fresh); base, the count (top-k) or weight
    (top-p) of the keys below lo; zk, the weight top-p's fraction is of; kf, the final key
    threshold; sel, the interval or bin of the last pass the bracket came from (-1: none); trace,
    the modes visited (1 << mode each) plus PASS_ONE for each pass taken."""
    tl.store(st + 0, mode)
    tl.store(st + 1, lo)
    tl.store(st + 2, hi)
    tl.store(st + 3, shift)
    tl.store(st + 4, fresh)
    tl.store(st + 5, base)
    tl.store(st + 6, zk)
    tl.store(st + 7, kf)
    tl.store(st + 8, sel)
    tl.store(st + 9, trace)


@triton.jit
def _resolve(st, kf, zk, trace):
    """The row's key threshold is kf: next the kept weights and the draw."""
    _set_state(st, WEIGHTS_K, 0, 0, 0, 0, 0, zk, kf, -1, trace | WEIGHTS_BIT)


@triton.jit
def _first_mode(temp, k, top_p, m, V):
    """A row's first mode: greedy (temperature 0, or no logit with mass), top-k's search, top-p's,
    or straight to the weights."""
    sampled = (temp > 0) & (m > float("-inf"))
    top_k = (k > 0) & (k < V)
    mode = tl.where(top_k, K_HIST_K, tl.where(top_p < 1, P_SPLIT_K, WEIGHTS_K))
    return tl.where(sampled, mode, GREEDY_K)


@triton.jit
def _split_bound(i, lo, hi, fresh):
    """Boundary i (int64, 0..16) of the 16 intervals [bound(i), bound(i + 1)) that split the
    keys [lo, hi]. fresh (lo = 0): a fixed table in units of 2**21 keys (a quarter of an octave
    of |d|): |d| below 2**-95, 2**-63, 2**-31 and 1 in four wide intervals (at most 2**28 keys
    each), then [1, 2), quarters of [2, 4) and [4, 8), halves of [8, 16), and [16, 28]. Else
    16 equal parts (the last ones possibly empty)."""
    top = hi + 1
    t = tl.where(i <= 3, 128 * i, tl.where(i == 4, 508, tl.where(i <= 12, 507 + i, 494 + 2 * i)))
    table = tl.where(i == 0, lo, tl.where(i >= 16, top, tl.minimum(t.to(tl.int64) << 21, top)))
    width = top - lo
    even = lo + tl.minimum(i * ((width + 15) // 16), width)
    return tl.where(fresh != 0, table, even)


@triton.jit
def _arrive(Arrive, row, s, S, C):
    """Whether this program is the row's last to finish the pass (its writes, and every other
    program's, are then visible to it)."""
    tl.debug_barrier()
    return tl.atomic_add(Arrive + row * S + s, 1, sem="acq_rel", scope="gpu") == C - 1


@triton.jit
def _gather(Buf, Count, Span, row, c, C, s, S, key, act, CAP: tl.constexpr):
    """Appends the keys where act to the row's buffer (in the order chunks arrive: the buffer
    is searched as a set); the chunk's keys are one run of it, whose start and length go to
    the chunk's span (read by `_row_gather_draw`)."""
    flags = act.to(tl.int32)
    n = tl.sum(flags, axis=0)
    at = tl.zeros([], dtype=tl.int32)
    if n > 0:
        at = tl.atomic_add(Count + row * S + s, n, sem="relaxed", scope="gpu")
        pos = at + tl.cumsum(flags, axis=0) - 1
        tl.store(Buf + row.to(tl.int64) * CAP + pos, key, mask=act & (pos < CAP))
    tl.store(Span + (row * C + c) * 2, at)
    tl.store(Span + (row * C + c) * 2 + 1, n)


@triton.jit
def _gathered(Buf, n, row, CAP: tl.constexpr, N: tl.constexpr):
    """(keys [N], live [N]) the row's gather of this pass left (n <= N keys of its buffer of
    CAP), read by its last program."""
    idx = tl.arange(0, N)
    live = idx < n
    key = tl.load(Buf + row.to(tl.int64) * CAP + idx, mask=live, other=KEY_INF_K,
                  cache_modifier=".cg")
    return key, live


@triton.jit
def _idle_bin(HistPart, row, c, C, sel):
    """Whether chunk c had no key in bin sel of the last K_HIST pass (sel < 0: unknown)."""
    j = tl.maximum(sel, 0)
    return (sel >= 0) & (tl.load(HistPart + (row * C + c) * 256 + j) == 0)


@triton.jit
def _idle_interval(CntPart, row, c, C, sel):
    """Whether chunk c had no key in interval sel of the last P_SPLIT pass (sel < 0: unknown)."""
    p = CntPart + (row * C + c) * 16
    below = tl.where(sel > 0, tl.load(p + tl.maximum(sel - 1, 0)), 0)
    return (sel >= 0) & (tl.load(p + tl.maximum(sel, 0)) - below == 0)


@triton.jit
def _split_sums(key, packed, ends):
    """For each interval end [16], the count and the weight of the keys below it (key
    0x7FFFFFFF: not counted; packed = count << 44 + weight)."""
    acc = tl.where(key[None, :] < ends[:, None], packed[None, :], 0)       # [16, block]
    return tl.sum((acc >> 44).to(tl.int32), axis=1), tl.sum(acc & ((1 << 44) - 1), axis=1)


@triton.jit
def _split_block(l_ptr, first, V, inv_t, m, pinf, lo, hi, ends, CHUNK: tl.constexpr,
                 SUB: tl.constexpr):
    """`_split_chunk`'s sums over the whole chunk, SUB keys at a time."""
    acc = tl.zeros([16, SUB], dtype=tl.int64)         # count << 44 + weight: a thread adds at
    for start in tl.range(0, CHUNK, SUB, num_stages=1, loop_unroll_factor=1):  # most 8
        d, key, valid = _d_key(l_ptr, first + start + tl.arange(0, SUB), V, inv_t, m, pinf)
        act = valid & (key >= lo) & (key <= hi) & (key < KEY_CUT_K)
        counted = tl.where(act, key, 0x7FFFFFFF)             # past every end when not counted
        packed = _fixed_exp_t(d) + (1 << 44)
        acc += tl.where(counted[None, :] < ends[:, None], packed[None, :], 0)      # [16, SUB]
    return tl.sum((acc >> 44).to(tl.int32), axis=1), tl.sum(acc & ((1 << 44) - 1), axis=1)


@triton.jit
def _split_chunk(l_ptr, first, V, inv_t, m, pinf, lo, hi, fresh, Pack, slot,
                 CHUNK: tl.constexpr, SUB: tl.constexpr, PACK: tl.constexpr):
    """Over the chunk's keys in [lo, hi] that can weigh (key < KEY_CUT): for each interval end
    of `_split_bound`, the count [16] and the weight [16] of those below it; their smallest
    and largest key. The sums cost 16 compares and adds a key, so where at most PACK of the
    chunk's keys count (a sharp row: most of its logits weigh 0), those keys are packed into
    the chunk's slot of Pack first and summed there; else the chunk is summed SUB keys at a
    time (PACK 0: always)."""
    tl.static_assert(CHUNK // SUB <= 8)
    ends = _split_bound(tl.arange(0, 16).to(tl.int64) + 1, lo, hi, fresh).to(tl.int32)
    d, key, valid = _d_key(l_ptr, first + tl.arange(0, CHUNK), V, inv_t, m, pinf)
    act = valid & (key >= lo) & (key <= hi) & (key < KEY_CUT_K)
    flags = act.to(tl.int32)
    n_act = tl.sum(flags, axis=0)
    kmin = tl.min(tl.where(act, key, KEY_INF_K + 1), axis=0)
    kmax = tl.max(tl.where(act, key, -1), axis=0)
    if PACK == 0:
        cnt, mass = _split_block(l_ptr, first, V, inv_t, m, pinf, lo, hi, ends, CHUNK, SUB)
    elif n_act <= PACK:
        pack = Pack + slot.to(tl.int64) * PACK
        tl.store(pack + tl.cumsum(flags, axis=0) - 1, key, mask=act)
        tl.debug_barrier()                               # the packed keys, for every thread
        live = tl.arange(0, PACK) < n_act
        pk = tl.load(pack + tl.arange(0, PACK), mask=live, other=0x7FFFFFFF,
                     cache_modifier=".cg")
        cnt, mass = _split_sums(pk, tl.where(live, _key_weight(pk) + (1 << 44), 0), ends)
    else:
        cnt, mass = _split_block(l_ptr, first, V, inv_t, m, pinf, lo, hi, ends, CHUNK, SUB)
    return cnt, mass, kmin, kmax


@triton.jit
def _chunk_share(mode, l_ptr, row, c, V, C, S, s, inv_t, m, pinf, lo, hi, shift, fresh, kf,
                 sel, min_w, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count, Span,
                 Pack, CHUNK: tl.constexpr, SUB: tl.constexpr, CAP: tl.constexpr,
                 PACK: tl.constexpr):
    """Chunk c's share of the row's pass in `mode` (written to the chunk's slots)."""
    first = c * CHUNK
    offs = first + tl.arange(0, CHUNK)
    slot = row * C + c
    bins = tl.arange(0, 256)
    if mode == WEIGHTS_K:
        z = tl.sum(_weights(l_ptr, offs, V, inv_t, m, pinf, kf.to(tl.int32), min_w), axis=0)
        tl.store(ZPart + slot, z)
    elif (mode == K_HIST_K) | (mode == P_HIST_K):
        h = tl.zeros([256], dtype=tl.int32)
        if mode == K_HIST_K:
            idle = _idle_bin(HistPart, row, c, C, sel)
        else:
            idle = _idle_interval(CntPart, row, c, C, sel)
        if idle == 0:
            d, key, valid = _d_key(l_ptr, offs, V, inv_t, m, pinf)
            act = valid & (key >= lo) & (key <= hi) & ((mode == K_HIST_K) | (key < KEY_CUT_K))
            h = tl.histogram(tl.where(act, (key - lo) >> shift, 0).to(tl.int32), 256, mask=act)
        tl.store(HistPart + slot * 256 + bins, h)
    elif mode == P_SPLIT_K:
        j = tl.arange(0, 16)
        cnt = tl.zeros([16], dtype=tl.int32)
        mass = tl.zeros([16], dtype=tl.int64)
        kmin = tl.full([], KEY_INF_K + 1, tl.int32)
        kmax = tl.full([], -1, tl.int32)
        if _idle_interval(CntPart, row, c, C, sel) == 0:
            cnt, mass, kmin, kmax = _split_chunk(l_ptr, first, V, inv_t, m, pinf, lo, hi, fresh,
                                                 Pack, slot, CHUNK, SUB, PACK)
        tl.store(CntPart + slot * 16 + j, cnt)
        tl.store(MassPart + slot * 16 + j, mass)
        tl.store(BoundPart + slot * 2, kmin)
        tl.store(BoundPart + slot * 2 + 1, kmax)
    elif mode == K_GATHER_K:
        d, key, valid = _d_key(l_ptr, offs, V, inv_t, m, pinf)
        _gather(Buf, Count, Span, row, c, C, s, S, key, valid & (key <= hi), CAP)
    elif mode == P_GATHER_K:
        if _idle_interval(CntPart, row, c, C, sel) == 0:
            d, key, valid = _d_key(l_ptr, offs, V, inv_t, m, pinf)
            act = valid & (key >= lo) & (key <= hi) & (key < KEY_CUT_K)
            _gather(Buf, Count, Span, row, c, C, s, S, key, act, CAP)
        else:
            tl.store(Span + slot * 2, 0)
            tl.store(Span + slot * 2 + 1, 0)
