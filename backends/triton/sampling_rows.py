"""The sampler's row side (`padgraph.backends.triton.sampling`'s module doc): what a row's last
program of a select pass does with its chunks' shares (the next bracket, the threshold found,
the draw), and the select kernel that runs a pass."""
from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_for_previous
from .sampling_chunks import (DONE_K, GREEDY_BIT, GREEDY_K, K_GATHER_BIT, K_GATHER_K,
                              K_HIST_BIT, K_HIST_K, NSTATE_K, P_GATHER_BIT, P_GATHER_K,
                              P_HIST_BIT, P_HIST_K, P_SPLIT_BIT, P_SPLIT_K, PASS_ONE,
                              WEIGHTS_K, _arrive, _chunk_share, _first_mode, _gathered,
                              _greedy_token, _resolve, _row_max, _set_state, _split_bound)
from .sampling_ints import (KEY_CUT_K, KEY_INF_K, _key_weight, _lsr_t, _mulhi62_t,
                            _random_bits_t, _weights)


@triton.jit
def _kth_key(key, live, k):
    """The smallest key v with count(live keys <= v) >= k, a live one: a bisection over the
    keys between the smallest and the largest live one (a reduction a step)."""
    lo = tl.min(tl.where(live, key, KEY_INF_K + 1), axis=0)
    hi = tl.max(tl.where(live, key, -1), axis=0)
    while lo < hi:
        K = lo + (hi - lo) // 2
        reached = tl.sum((live & (key <= K)).to(tl.int32), axis=0) >= k
        hi = tl.where(reached, K, hi)
        lo = tl.where(reached, lo, K + 1)
    return lo


@triton.jit
def _mass_key(key, w, live, thr, base):
    """The smallest key K with base + the weight of the live keys <= K >= thr (in fp64): top-p's
    key, a live one, when base < thr <= base + their total. Bisection as `_kth_key`."""
    lo = tl.min(tl.where(live, key, KEY_INF_K + 1), axis=0)
    hi = tl.max(tl.where(live, key, -1), axis=0)
    while lo < hi:
        K = lo + (hi - lo) // 2
        below = base + tl.sum(tl.where(live & (key <= K), w, 0), axis=0)
        reached = below.to(tl.float64) >= thr
        hi = tl.where(reached, K, hi)
        lo = tl.where(reached, lo, K + 1)
    return lo


@triton.jit
def _sum_hist(HistPart, row, C, CP: tl.constexpr):
    """[256] int64: the row's chunk histograms summed (16 chunks a load)."""
    b = tl.arange(0, 256)
    total = tl.zeros([256], dtype=tl.int64)
    for c0 in range(0, CP, 16):
        cs = c0 + tl.arange(0, 16)
        tile = tl.load(HistPart + (row * C + cs[:, None]) * 256 + b[None, :],
                       mask=(cs < C)[:, None], other=0, cache_modifier=".cg")
        total += tl.sum(tile, axis=0).to(tl.int64)
    return total


@triton.jit
def _row_k_hist(st, HistPart, row, C, k, top_p, lo, hi, shift, base, trace,
                CP: tl.constexpr, CAP: tl.constexpr):
    """Top-k's radix step: the bin where the count of keys reaches k becomes the bracket. The
    key is found when the bracket is one key (or holds only keys that weigh 0: every such key
    keeps the same weights); a bracket with at most CAP keys at or below it is gathered."""
    h = _sum_hist(HistPart, row, C, CP)
    cum = base + tl.cumsum(h, axis=0)
    b = tl.arange(0, 256)
    j = tl.min(tl.where(cum >= k, b, 256), axis=0)
    upto = tl.sum(tl.where(b == j, cum, 0), axis=0)          # keys <= the new bracket's end
    below = upto - tl.sum(tl.where(b == j, h, 0), axis=0)
    lo2 = lo + (j.to(tl.int64) << shift)
    hi2 = tl.minimum(hi, lo2 + (tl.full([], 1, tl.int64) << shift) - 1)
    found = (lo2 == hi2) | (lo2 >= KEY_CUT_K)
    if found & ((top_p < 1) == 0):                    # top-p off (NaN too, as the reference)
        _resolve(st, hi2, 0, trace)
    elif upto <= CAP:
        _set_state(st, K_GATHER_K, 0, hi2, 0, 0, 0, 0, KEY_INF_K, -1,
                   trace | K_GATHER_BIT)
    elif found:
        _set_state(st, P_SPLIT_K, 0, tl.minimum(hi2, KEY_CUT_K), 0, 1, 0, 0, KEY_INF_K, -1,
                   trace | P_SPLIT_BIT)
    else:
        _set_state(st, K_HIST_K, lo2, hi2, tl.maximum(shift - 8, 0), 0, below, 0, KEY_INF_K,
                   j, trace | K_HIST_BIT)


@triton.jit
def _row_k_gather(key, live, k, top_p):
    """Every key at or below the bracket was gathered (key, live): top-k's key is the k-th
    smallest, and top-p's is found among the keys up to it. Returns (kf, zk)."""
    kf = _kth_key(key, live, k)
    zk = tl.zeros([], dtype=tl.int64)
    if top_p < 1:
        w = tl.where(live, _key_weight(key), 0)
        keep = live & (key <= kf)
        zk = tl.sum(tl.where(keep, w, 0), axis=0)
        thr = zk.to(tl.float64) * top_p.to(tl.float64)
        kf = tl.where(thr > 0, _mass_key(key, w, keep, thr, 0), 0)
    return kf, zk


@triton.jit
def _row_p_split(st, CntPart, MassPart, BoundPart, CBase, row, C, top_p, lo, hi, fresh, base,
                 zk, trace, CP: tl.constexpr, CAP: tl.constexpr):
    """Top-p's step: the interval where base + the weight below its end first reaches top_p *
    zk (zk: the first split's total) becomes the bracket, narrowed to the keys present; the
    next pass gathers it (at most CAP keys), counts its keys one by one (at most 256 wide) or
    splits it again. Each chunk's weight below the new bracket is added to its CBase (base,
    chunk by chunk)."""
    j = tl.arange(0, 16)
    cs = tl.arange(0, CP)
    live = cs < C
    at = (row * C + cs[:, None]) * 16 + j[None, :]
    cnt = tl.sum(tl.load(CntPart + at, mask=live[:, None], other=0, cache_modifier=".cg"),
                 axis=0)
    chunk_mass = tl.load(MassPart + at, mask=live[:, None], other=0, cache_modifier=".cg")
    mass = tl.sum(chunk_mass, axis=0)
    bmin = tl.min(tl.load(BoundPart + (row * C + cs) * 2, mask=live, other=KEY_INF_K + 1,
                          cache_modifier=".cg"), axis=0)
    bmax = tl.max(tl.load(BoundPart + (row * C + cs) * 2 + 1, mask=live, other=-1,
                          cache_modifier=".cg"), axis=0)
    zk = tl.where(fresh != 0, tl.sum(tl.where(j == 15, mass, 0), axis=0), zk)
    thr = zk.to(tl.float64) * top_p.to(tl.float64)
    js = tl.min(tl.where((base + mass).to(tl.float64) >= thr, j, 15), axis=0)
    base2 = base + tl.sum(tl.where(j == js - 1, mass, 0), axis=0)
    below = tl.sum(tl.where(j[None, :] == js - 1, chunk_mass, 0), axis=1)           # [CP]
    cbase = CBase + row * C + cs
    tl.store(cbase, tl.load(cbase, mask=live, other=0) + below, mask=live)
    n_in = tl.sum(tl.where(j == js, cnt, 0) - tl.where(j == js - 1, cnt, 0), axis=0)
    lo2 = tl.maximum(_split_bound(js.to(tl.int64), lo, hi, fresh), bmin)
    hi2 = tl.minimum(_split_bound(js.to(tl.int64) + 1, lo, hi, fresh) - 1, bmax)
    if thr <= 0:
        _resolve(st, 0, zk, trace)                       # top_p <= 0: the top key alone
    elif lo2 >= hi2:
        _resolve(st, lo2, zk, trace)
    elif n_in <= CAP:
        _set_state(st, P_GATHER_K, lo2, hi2, 0, 0, base2, zk, KEY_INF_K, js,
                   trace | P_GATHER_BIT)
    elif hi2 - lo2 < 256:
        _set_state(st, P_HIST_K, lo2, hi2, 0, 0, base2, zk, KEY_INF_K, js,
                   trace | P_HIST_BIT)
    else:
        _set_state(st, P_SPLIT_K, lo2, hi2, 0, 0, base2, zk, KEY_INF_K, js,
                   trace | P_SPLIT_BIT)


@triton.jit
def _row_p_gather(key, live, top_p, base, zk):
    """The bracket's keys were gathered (key, live): top-p's key among them."""
    w = tl.where(live, _key_weight(key), 0)
    thr = zk.to(tl.float64) * top_p.to(tl.float64)
    return _mass_key(key, w, live, thr, base)


@triton.jit
def _row_gather_draw(st, key, live, kf, zk, trace, Span, CBase, Pref, ZPart, Out, l_ptr, row,
                     C, V, inv_t, m, pinf, min_w, u62, CHUNK: tl.constexpr, CP: tl.constexpr,
                     CAP: tl.constexpr, N: tl.constexpr):
    """The row's threshold kf was found among gathered keys: draw now, without a weights pass,
    where min-p is off. Chunk c's kept weight is CBase[c] (its keys below the gathered bracket,
    kept by the splits) plus its gathered keys at or below kf, one run of the buffer (its
    span): a prefix sum over the buffer, read at the runs' ends. Then `_row_draw`. With min-p,
    the row's next pass weighs every key (`_resolve`)."""
    if min_w == 0:
        w = tl.where(live & (key <= kf), _key_weight(key), 0)
        idx = tl.arange(0, N)
        pref = Pref + row.to(tl.int64) * CAP
        tl.store(pref + idx, tl.cumsum(w, axis=0))
        tl.debug_barrier()                                 # the prefix sums, for every thread
        cs = tl.arange(0, CP)
        ok = cs < C
        at = tl.load(Span + (row * C + cs) * 2, mask=ok, other=0, cache_modifier=".cg")
        n = tl.load(Span + (row * C + cs) * 2 + 1, mask=ok, other=0, cache_modifier=".cg")
        upto = tl.load(pref + at + n - 1, mask=ok & (n > 0), other=0, cache_modifier=".cg")
        before = tl.load(pref + at - 1, mask=ok & (n > 0) & (at > 0), other=0,
                         cache_modifier=".cg")
        base = tl.load(CBase + row * C + cs, mask=ok, other=0, cache_modifier=".cg")
        tl.store(ZPart + row * C + cs, base + upto - before, mask=ok)
        tl.debug_barrier()                                 # the chunks' weights, for the draw
        tl.store(Out + row, _row_draw(l_ptr, ZPart, row, C, V, inv_t, m, pinf, kf.to(tl.int32),
                                      min_w, u62, CHUNK, CP))
        _set_state(st, DONE_K, 0, 0, 0, 0, 0, zk, kf, -1, trace)
    else:
        _resolve(st, kf, zk, trace)


@triton.jit
def _row_p_hist(st, HistPart, row, C, top_p, lo, base, zk, trace, CP: tl.constexpr):
    """A count per key of the bracket: its weight is count * fixed_exp(key), exact; top-p's key
    is the first where base + the weight up to it reaches top_p * zk."""
    h = _sum_hist(HistPart, row, C, CP)
    b = tl.arange(0, 256)
    key = tl.minimum(lo + b, KEY_CUT_K).to(tl.int32)
    cum = base + tl.cumsum(h * _key_weight(key), axis=0)
    thr = zk.to(tl.float64) * top_p.to(tl.float64)
    j = tl.min(tl.where(cum.to(tl.float64) >= thr, b, 255), axis=0)
    _resolve(st, lo + j, zk, trace)


@triton.jit
def _row_draw(l_ptr, ZPart, row, C, V, inv_t, m, pinf, kf, min_w, u62, CHUNK: tl.constexpr,
              CP: tl.constexpr):
    """r = floor(u62 * Z / 2**62); the chunk whose cumulative kept weight passes r, then the
    first index in it whose cumulative kept weight does."""
    cs = tl.arange(0, CP)
    ok = cs < C
    z = tl.load(ZPart + row * C + cs, mask=ok, other=0, cache_modifier=".cg")
    cum = tl.cumsum(z, axis=0)
    r = _mulhi62_t(u62, tl.sum(z, axis=0))
    j = tl.min(tl.where(ok & (cum > r), cs, C), axis=0)
    below = tl.sum(tl.where(cs == j, cum - z, 0), axis=0)
    offs = j * CHUNK + tl.arange(0, CHUNK)
    w = _weights(l_ptr, offs, V, inv_t, m, pinf, kf, min_w)
    hit = tl.min(tl.where((below + tl.cumsum(w, axis=0) > r) & (offs < V), offs, V), axis=0)
    return tl.where(hit < V, hit, V - 1).to(tl.int64)


@triton.jit
def _row_state(st, mode, FIRST: tl.constexpr):
    """(lo, hi, shift, fresh, base, zk, kf, sel, trace), `_set_state`'s fields: as the first pass
    starts a row in `mode`, else as the last pass left them."""
    if FIRST:
        lo = tl.zeros([], dtype=tl.int64)
        hi = tl.where(mode == K_HIST_K, KEY_INF_K, KEY_CUT_K).to(tl.int64)
        shift = tl.full([], 23, tl.int64)
        fresh = tl.full([], 1, tl.int64)
        base = tl.zeros([], dtype=tl.int64)
        zk = tl.zeros([], dtype=tl.int64)
        kf = tl.full([], KEY_INF_K, tl.int64)
        sel = tl.full([], -1, tl.int64)
        trace = tl.full([], 1, tl.int64) << mode.to(tl.int64)
    else:
        lo = tl.load(st + 1)
        hi = tl.load(st + 2)
        shift = tl.load(st + 3)
        fresh = tl.load(st + 4)
        base = tl.load(st + 5)
        zk = tl.load(st + 6)
        kf = tl.load(st + 7)
        sel = tl.load(st + 8)
        trace = tl.load(st + 9)
    return lo, hi, shift, fresh, base, zk, kf, sel, trace


@triton.jit
def _row_gathered(st, mode, Buf, n, row, k, top_p, base, zk, trace, Seed, Pos, purpose, Span,
                  CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m, pinf, min_w,
                  CHUNK: tl.constexpr, CP: tl.constexpr, CAP: tl.constexpr, DRAW: tl.constexpr,
                  N: tl.constexpr):
    """A gather pass's end: the row's n gathered keys searched in registers [N] (N >= n), the
    threshold found, then the draw (DRAW) or the weights pass."""
    key, live = _gathered(Buf, n, row, CAP, N)
    if mode == K_GATHER_K:
        kg, zg = _row_k_gather(key, live, k, top_p)
    else:
        kg = _row_p_gather(key, live, top_p, base, zk)
        zg = zk
    if DRAW:
        bits = _random_bits_t(tl.load(Seed + row), tl.load(Pos + row), purpose, 0)
        _row_gather_draw(st, key, live, kg, zg, trace, Span, CBase, Pref, ZPart, Out, l_ptr,
                         row, C, V, inv_t, m, pinf, min_w, _lsr_t(bits, 2), CHUNK, CP, CAP, N)
    else:
        _resolve(st, kg, zg, trace)


@triton.jit(noinline=True)
def _select_row(row, c, L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, PartV, PartI, PartNan,
                PartM, State, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count, Span,
                CBase, Pref, Pack, Arrive, Out, V, C, S, purpose, s, FIRST: tl.constexpr,
                CHUNK: tl.constexpr, SUB: tl.constexpr, CP: tl.constexpr, CAP: tl.constexpr,
                SMALL: tl.constexpr, PACK: tl.constexpr, DRAW: tl.constexpr):
    """Chunk c's part of the row's pass in the row's mode; the row's last program to finish
    moves the row to its next mode (module doc)."""
    row = tl.cast(row, tl.int32)                      # the interpreter's loops give ints
    st = State + row * NSTATE_K
    m, pinf = _row_max(PartM, row, C, CP)
    temp = tl.load(Temp + row)
    k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    if FIRST:
        mode = _first_mode(temp, k, top_p, m, V)
    else:
        mode = tl.load(st).to(tl.int32)
    if mode == GREEDY_K:
        if c == 0:
            tl.store(Out + row, _greedy_token(PartV, PartI, PartNan, row, C, V, CP))
            _set_state(st, DONE_K, 0, 0, 0, 0, 0, 0, KEY_INF_K, -1, GREEDY_BIT + PASS_ONE)
    elif mode != DONE_K:
        lo, hi, shift, fresh, base, zk, kf, sel, trace = _row_state(st, mode, FIRST)
        l_ptr = L + row.to(tl.int64) * stride_l
        inv_t = tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
        min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0        # min_p * 2**40
        _chunk_share(mode, l_ptr, row, c, V, C, S, s, inv_t, m, pinf, lo, hi, shift, fresh, kf,
                     sel, min_w, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count, Span,
                     Pack, CHUNK, SUB, CAP, PACK)
        if _arrive(Arrive, row, s, S, C):
            trace += PASS_ONE
            if mode == WEIGHTS_K:
                bits = _random_bits_t(tl.load(Seed + row), tl.load(Pos + row), purpose, 0)
                tl.store(Out + row, _row_draw(l_ptr, ZPart, row, C, V, inv_t, m, pinf,
                                              kf.to(tl.int32), min_w, _lsr_t(bits, 2),
                                              CHUNK, CP))
                _set_state(st, DONE_K, 0, 0, 0, 0, 0, zk, kf, -1, trace)
            elif mode == K_HIST_K:
                _row_k_hist(st, HistPart, row, C, k, top_p, lo, hi, shift, base, trace, CP, CAP)
            elif (mode == K_GATHER_K) | (mode == P_GATHER_K):
                n_g = tl.atomic_add(Count + row * S + s, 0, sem="acquire", scope="gpu")
                if SMALL == CAP:
                    _row_gathered(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos,
                                  purpose, Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m,
                                  pinf, min_w, CHUNK, CP, CAP, DRAW, CAP)
                elif n_g <= SMALL:        # a few keys (a sharp row's nucleus): [SMALL] searches
                    _row_gathered(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos,
                                  purpose, Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m,
                                  pinf, min_w, CHUNK, CP, CAP, DRAW, SMALL)
                else:
                    _row_gathered(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos,
                                  purpose, Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m,
                                  pinf, min_w, CHUNK, CP, CAP, DRAW, CAP)
            elif mode == P_SPLIT_K:
                _row_p_split(st, CntPart, MassPart, BoundPart, CBase, row, C, top_p, lo, hi,
                             fresh, base, zk, trace, CP, CAP)
            else:
                _row_p_hist(st, HistPart, row, C, top_p, lo, base, zk, trace, CP)


@triton.jit(do_not_specialize=["n", "s"])
def _select_kernel(L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, PartV, PartI, PartNan,
                   PartM, State, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count,
                   Span, CBase, Pref, Pack, Arrive, Out, n, V, C, S, purpose, s,
                   FIRST: tl.constexpr,
                   CHUNK: tl.constexpr, SUB: tl.constexpr, CP: tl.constexpr,
                   CAP: tl.constexpr, SMALL: tl.constexpr, PACK: tl.constexpr,
                   DRAW: tl.constexpr, PDL: tl.constexpr):
    """Grid (G, X), pass s of S: program (g, x) does chunks x, x + X, ... of rows g, g + G, ...;
    it returns at once when all of them are done (one load for up to 16 rows). PDL: the pass
    launches while the one before runs and waits for it before its first read (everything it
    reads but the logits and the sampling lanes is the passes' own state)."""
    g = tl.program_id(0)
    G = tl.num_programs(0)
    x = tl.program_id(1)
    X = tl.num_programs(1)
    wait_for_previous(PDL)
    busy = FIRST
    if not FIRST:
        for r0 in tl.range(g, n, 16 * G, num_stages=1):
            rows = r0 + G * tl.arange(0, 16)
            modes = tl.load(State + rows * NSTATE_K, mask=rows < n, other=0)
            busy = busy | (tl.max(modes, axis=0) > 0)
    if busy:
        for row in tl.range(g, n, G, num_stages=1):
            for c in tl.range(x, C, X, num_stages=1):
                _select_row(row, c, L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, PartV, PartI,
                            PartNan, PartM, State, HistPart, CntPart, MassPart, BoundPart,
                            ZPart, Buf, Count, Span, CBase, Pref, Pack, Arrive, Out, V, C, S,
                            purpose, s, FIRST, CHUNK, SUB, CP, CAP, SMALL, PACK, DRAW)
