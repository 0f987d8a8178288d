"""The sampler in Triton, and the integer pieces it shares bit for bit with the torch
reference (`padgraph.llm.sampling`, whose module doc defines the distribution).

Why the pieces are integers: a sampler whose tokens must be the same in torch and in a kernel
cannot let the order of a floating-point sum decide anything. So the weights are fixed-point
integers (`fixed_exp`: floor(exp(d) * 2**40) from IEEE adds and multiplies only, no library
exp, whose last bit differs between implementations), every threshold compares integer sums
(exact in any order) in fp64, and the draw is an integer search (`mulhi62`). The random stream
(`random_bits`, splitmix64's finaliser over the key words) is int64 arithmetic with wrap-around
multiplies and logical shifts written as masked arithmetic shifts, the same in both.

The thresholds are keys: key = the fp32 bits of |d|, d = x - max(x) <= 0, monotone (a smaller
key is a larger d, ties share a key). top-k keeps the keys up to the k-th smallest; top-p keeps
the keys up to K, the smallest key whose kept-by-top-k keys at or below it weigh at least
top_p * their total (the reference's prefix rule, in fp64). Both are found by narrowing a
bracket of keys with counts and integer weights summed over chunks, so they are exact.

1 + PASSES launches a call, whatever the logits hold; each row finds its own way through them
(one batch mixes greedy, temperature-only and filtered rows):

1. `_chunk_max_kernel`, grid (n, C chunks of CHUNK logits): each chunk's share of torch's argmax
   (greedy rows) and of max(x), x = l * (1 / temperature), and how many of its x lie within
   NEAR of its own maximum; it also clears the row's counters.
2. `_select_kernel`, PASSES launches, grid (G row groups, X chunk groups): program (g, x) does
   chunks x, x + X, ... of rows g, g + G, ... (X = C: a chunk a program). In each pass a row
   is in one mode; every program of the row does its chunks' shares (reading the row's state
   once) and arrives once, and the last one to finish (a per-row counter, acq_rel) reads the
   chunks' shares and sets the row's next mode:
   - greedy (first launch only): torch's argmax from the chunk shares.
   - K_HIST, top-k's key by radix select: a 256-bin count histogram per chunk of one 8-bit
     digit of the keys in the bracket, the bin where the count reaches k becomes the bracket.
   - K_GATHER: at most CAP keys lie at or below the bracket: they are gathered, top-k's key and
     then top-p's are found among them in registers.
   - P_NEAR (first launch only), top-p's key where few keys lie near the maximum: a top-p
     row without top-k whose chunks hold at most CAP keys within NEAR = 8 of their own maxima
     (a bound on the row's keys with |d| < NEAR) gathers those keys while every chunk sums its
     whole weight Z from its keys as loaded. Where the gathered
     keys weigh at least top_p * Z, top-p's key is among them (every key below it was
     gathered) and is found as P_GATHER's is: a sharp row has its threshold, and with the
     draw in the gather its token, after one pass. Else the row starts P_SPLIT in the next
     pass. A flat row, whose bound exceeds CAP, starts in P_SPLIT. (Top-k rows start in
     K_HIST: weighing the whole row in that pass cost more than the pass it saves.)
   - P_SPLIT, top-p's key: the bracket is split into 16 intervals (on the first split a fixed
     table, fine where a flat row's nucleus ends: |d| in [1, 2), quarters of [2, 8), halves of
     [8, 16); then 16 equal parts); each chunk sums, below each interval's end, the count and
     the weight of its keys; the interval where the weight reaches top_p * total becomes the
     bracket, narrowed to the keys present.
   - P_GATHER: a bracket of at most CAP keys: gathered, top-p's key found among them.
   The searches over gathered keys run in registers as wide as the gather needs: [SMALL] for
   at most SMALL keys (a sharp row's nucleus), else [CAP].
   - P_HIST: a bracket at most 256 keys wide: a count per key, its weight count * fixed_exp.
   - WEIGHTS: each chunk's kept weight (threshold and min-p applied); the last program draws:
     r = floor(u * Z / 2**62), the chunk whose cumulative kept weight passes r, the index in it.
     A row whose threshold was found in a gather (K_GATHER, P_GATHER, P_NEAR) draws in that pass
     instead, when min-p is off and the launch asks for it (`SelectPolicy.gather_draw`): a
     chunk's kept weight is then its weight below the bracket (each P_SPLIT adds the chunk's
     weight below the new bracket to CBase) plus that of its gathered keys up to the
     threshold (one run of the buffer, whose span the chunk records).
   A chunk with no key in the new bracket skips the next pass. Top-k takes at most 4 passes
   (31 bits), top-p at most 7 (the table's intervals span at most 2**28 keys, five equal splits
   leave 256; a top-p row alone that tries P_NEAR and falls short takes one pass more, 8),
   the draw 1: PASSES = 12. A pass whose rows are all done costs its programs one
   load each. G, X, the warps of a program and whether a gather draws are
   `select_policy(n)`'s.

There is no host work and no sync: graph-safe. The result does not depend on the order in
which chunks finish (integer sums, the gathered keys searched as a set). The kernels are
launched with fp contraction off, so a*b+c is never an FMA and the fp32 steps round as torch's
do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import pdl as _pdl
from .kv import resolve_impl
from .pdl import wait_for_previous

__all__ = ["PURPOSE_DECODE", "PURPOSE_ACCEPT", "PURPOSE_RESIDUAL", "PURPOSE_DRAFT",
           "FIXED_ONE", "V_MAX", "PASSES", "random_bits", "fixed_exp", "mulhi62",
           "sample_triton", "sample_stages", "Stages", "node_mass", "NodeMass", "resolve_impl"]

# The stream's purposes: a token drawn for the same (seed, position) for another reason reads
# other bits.
PURPOSE_DECODE = 0      # a sampled next token (decode, prefill's first token, a bonus)
PURPOSE_ACCEPT = 1      # a speculative acceptance test
PURPOSE_RESIDUAL = 2    # a draw from the residual after a rejection (or the bonus)
PURPOSE_DRAFT = 3       # a draft model's own sampled proposal

FIXED_BITS = 40
FIXED_ONE = 1 << FIXED_BITS     # exp(0) in fixed point: the top token's weight
V_MAX = 1 << 18                 # V * 2**40 <= 2**58: sums and mulhi62 stay inside int64
D_MIN = -28.0                   # exp(-28) * 2**40 < 1: every d below weighs 0

KEY_CUT = 0x41E00000            # fp32 bits of 28.0: the key of d = -28
NEAR = 8.0                      # top-p's first pass gathers the keys with |d| < NEAR
KEY_INF = 0x7F800000            # the key of d = -inf (larger than every other key)


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


GAMMA = _i64(0x9E3779B97F4A7C15)     # golden-ratio increment (SplittableRandom's)
MIX1 = _i64(0xBF58476D1CE4E5B9)      # splitmix64 finaliser multipliers
MIX2 = _i64(0x94D049BB133111EB)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


KEY_NEAR = torch.tensor(NEAR, dtype=torch.float32).view(torch.int32).item()    # the key of -NEAR


# exp(d) = 2**n * exp(r): n = floor(d * log2(e) + 1/2), r = d - n * ln2 (Cody-Waite, ln2 split in
# a 15-bit head, exact times n, and a tail), exp(r) by Horner on Taylor's terms to r**7 (|r| <=
# 0.35: truncation < 6e-9, below fp32's rounding).
LOG2E = _f32(1.4426950408889634)
LN2_HI = _f32(0.693145751953125)
LN2_LO = _f32(1.4286067653302226e-06)
C7, C6, C5, C4, C3 = (_f32(1 / 5040), _f32(1 / 720), _f32(1 / 120), _f32(1 / 24), _f32(1 / 6))


# ------------------------------------------------------------------ torch (the reference)

def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lsr(z, 30)) * MIX1
    z = (z ^ _lsr(z, 27)) * MIX2
    return z ^ _lsr(z, 31)


def random_bits(seed, position, purpose, index=0) -> torch.Tensor:
    """64 random bits (int64, broadcast over the key tensors) for the key
    (seed, position, purpose, index): h <- mix64((h ^ word) + GAMMA) over the words."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    h = _mix64(seed + GAMMA)
    for word in (position, purpose, index):
        # a Python int goes in as a scalar operand: a tensor of it would be a host-to-device copy
        # (refused inside CUDA graph capture)
        w = word.to(h.device, torch.int64) if isinstance(word, torch.Tensor) else _i64(int(word))
        h = _mix64((h ^ w) + GAMMA)
    return h


def fixed_exp(d: torch.Tensor) -> torch.Tensor:
    """floor(exp(d) * 2**40) as int64 for fp32 d <= 0 (-inf and d < -28 give 0), from IEEE
    fp32 adds and multiplies only: the kernel's `_fixed_exp` gives the same integers."""
    d = d.float().clamp_min(D_MIN)
    n = torch.floor(d * LOG2E + 0.5)
    r = d - n * LN2_HI
    r = r - n * LN2_LO
    p = r * C7 + C6
    for c in (C5, C4, C3, 0.5, 1.0, 1.0):
        p = p * r + c
    scale = ((n.int() + (FIXED_BITS + 127)) << 23).view(torch.float32)   # 2**(n + 40), exact
    return torch.floor(p * scale).long()


def mulhi62(u: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """floor(u * z / 2**62) exactly, for int64 0 <= u < 2**62 and 0 <= z <= 2**58."""
    m31 = (1 << 31) - 1
    uh, ul, zh, zl = u >> 31, u & m31, z >> 31, z & m31
    mid = uh * zl + ul * zh + ((ul * zl) >> 31)
    return uh * zh + (mid >> 31)


# ------------------------------------------------------------------------------- the kernel

# The constants as the kernels see them (Triton reads only constexpr globals).
MIX1_K = tl.constexpr(MIX1)
MIX2_K = tl.constexpr(MIX2)
GAMMA_K = tl.constexpr(GAMMA)
D_MIN_K = tl.constexpr(D_MIN)
LOG2E_K = tl.constexpr(LOG2E)
LN2_HI_K = tl.constexpr(LN2_HI)
LN2_LO_K = tl.constexpr(LN2_LO)
C7_K = tl.constexpr(C7)
C6_K = tl.constexpr(C6)
C5_K = tl.constexpr(C5)
C4_K = tl.constexpr(C4)
C3_K = tl.constexpr(C3)
FIXED_BITS_K = tl.constexpr(FIXED_BITS)
KEY_INF_K = tl.constexpr(KEY_INF)
KEY_CUT_K = tl.constexpr(KEY_CUT)
NEAR_K = tl.constexpr(NEAR)
KEY_NEAR_K = tl.constexpr(KEY_NEAR)


@triton.jit
def _lsr_t(x, s: tl.constexpr):
    return (x >> s) & ((1 << (64 - s)) - 1)


@triton.jit
def _mix64_t(z):
    z = (z ^ _lsr_t(z, 30)) * MIX1_K
    z = (z ^ _lsr_t(z, 27)) * MIX2_K
    return z ^ _lsr_t(z, 31)


@triton.jit
def _random_bits_t(seed, position, purpose, index):
    h = _mix64_t(seed + GAMMA_K)
    h = _mix64_t((h ^ position) + GAMMA_K)
    h = _mix64_t((h ^ purpose) + GAMMA_K)
    return _mix64_t((h ^ index) + GAMMA_K)


@triton.jit
def _mulhi62_t(u, z):
    uh = u >> 31
    ul = u & 2147483647
    zh = z >> 31
    zl = z & 2147483647
    mid = uh * zl + ul * zh + ((ul * zl) >> 31)
    return uh * zh + (mid >> 31)


@triton.jit
def _fixed_exp_t(d):
    d = tl.maximum(d, D_MIN_K)
    n = tl.floor(d * LOG2E_K + 0.5)
    r = d - n * LN2_HI_K
    r = r - n * LN2_LO_K
    p = r * C7_K + C6_K
    p = p * r + C5_K
    p = p * r + C4_K
    p = p * r + C3_K
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    scale = ((n.to(tl.int32) + (FIXED_BITS_K + 127)) << 23).to(tl.float32, bitcast=True)
    return tl.floor(p * scale).to(tl.int64)


@triton.jit
def _d_key(l_ptr, offs, V, inv_t, m, pinf):
    """(d [BLOCK] fp32, key [BLOCK] int32, valid) of a chunk; padded lanes get d = -inf."""
    valid = offs < V
    x = tl.load(l_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(pinf, tl.where(x == float("inf"), 0.0, float("-inf")), x)
    d = x - m
    key = d.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return d, key, valid


@triton.jit
def _key_weight(key):
    """fixed_exp of the d a key stands for (d = minus the fp32 with bits key: key 0 is -0.0,
    which weighs as 0.0 does)."""
    return _fixed_exp_t(-(key.to(tl.float32, bitcast=True)))


@triton.jit
def _weights(l_ptr, offs, V, inv_t, m, pinf, kf, min_w):
    d, key, valid = _d_key(l_ptr, offs, V, inv_t, m, pinf)
    w = _fixed_exp_t(d)
    keep = valid & (key <= kf) & (w.to(tl.float64) >= min_w)
    return tl.where(keep, w, 0)


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


# ------------------------------------------------------------------------ the chunk maxima

@triton.jit
def _chunk_max_kernel(L, stride_l, Temp, PartV, PartI, PartNan, PartM, PartN, Count, Arrive,
                      CBase, V, C, S, CHUNK: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr):
    """Grid (n, C). Chunk c's share of torch's argmax (its largest non-NaN logit; its first
    NaN, else the first index holding that logit) and of max(l * inv_t) with NaN as -inf, and
    the number of its x within NEAR of its own maximum (`_near_bound`); it clears the chunk's
    weight below the splits' brackets (CBase). Chunk 0 clears the row's gather and arrival
    counters of the select passes."""
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
    inv_t = tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
    x = l * inv_t
    base = row * C + c
    tl.store(PartV + base, best)
    # one reduction for both indices: the first NaN (< V), else V + the first maximum; a chunk
    # with a NaN keeps no maximum index (the row's first NaN is its token then)
    idx = tl.min(tl.where(isnan, offs, tl.where((lv == best) & valid, V + offs, 2 * V)), axis=0)
    tl.store(PartI + base, tl.where(idx >= V, idx - V, V))
    tl.store(PartNan + base, tl.where(idx < V, idx, V))
    if inv_t < float("inf"):
        mc = best * inv_t        # x = l * inv_t rounds monotonically: the max of x, no NaN
    else:                        # a subnormal temperature: 0 * inf is NaN, so reduce x itself
        mc = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    tl.store(PartM + base, mc)
    same = x == mc
    d = tl.where(same, 0.0, x) - tl.where(same, 0.0, mc)          # no inf - inf
    tl.store(PartN + base, tl.sum((valid & (d > -NEAR_K)).to(tl.int32), axis=0))
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
def _near_bound(PartM, PartN, row, m, C, CP: tl.constexpr):
    """At least the number of the row's keys with |d| < NEAR (d = x - m, x <= m_c in chunk c,
    fp32 subtraction monotone): chunk c's x within NEAR of m_c, over the chunks where
    m_c - m > -NEAR (elsewhere none)."""
    cs = tl.arange(0, CP)
    ok = cs < C
    mc = tl.load(PartM + row * C + cs, mask=ok, other=float("-inf"))
    nc = tl.load(PartN + row * C + cs, mask=ok, other=0)
    same = mc == m
    gap = tl.where(same, 0.0, mc) - tl.where(same, 0.0, m)         # no inf - inf
    return tl.sum(tl.where(ok & (gap > -NEAR_K), nc, 0), axis=0)


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
MODES = ("done", "weights", "k_hist", "k_gather", "p_split", "p_gather", "p_hist", "greedy",
         "p_near")
DONE_K = tl.constexpr(0)
WEIGHTS_K = tl.constexpr(1)
K_HIST_K = tl.constexpr(2)
K_GATHER_K = tl.constexpr(3)
P_SPLIT_K = tl.constexpr(4)
P_GATHER_K = tl.constexpr(5)
P_HIST_K = tl.constexpr(6)
GREEDY_K = tl.constexpr(7)
P_NEAR_K = tl.constexpr(8)
WEIGHTS_BIT = tl.constexpr(1 << 1)
K_HIST_BIT = tl.constexpr(1 << 2)
K_GATHER_BIT = tl.constexpr(1 << 3)
P_SPLIT_BIT = tl.constexpr(1 << 4)
P_GATHER_BIT = tl.constexpr(1 << 5)
P_HIST_BIT = tl.constexpr(1 << 6)
GREEDY_BIT = tl.constexpr(1 << 7)
P_NEAR_BIT = tl.constexpr(1 << 8)
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
def _arrive(Arrive, row, s, S, X):
    """Whether this program is the last of the row's X to finish the pass (its writes, and
    every other program's, are then visible to it)."""
    tl.debug_barrier()
    return tl.atomic_add(Arrive + row * S + s, 1, sem="acq_rel", scope="gpu") == X - 1


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
def _pack(Pack, slot, key, flags, n, PACK: tl.constexpr):
    """(keys [PACK], live [PACK]): the chunk's n keys where flags, packed into its slot of Pack
    (in chunk order; the rest KEY_INF, past every bracket) and read back by every thread."""
    pack = Pack + slot.to(tl.int64) * PACK
    tl.store(pack + tl.cumsum(flags, axis=0) - 1, key, mask=flags > 0)
    tl.debug_barrier()                                   # the packed keys, for every thread
    live = tl.arange(0, PACK) < n
    return tl.load(pack + tl.arange(0, PACK), mask=live, other=KEY_INF_K,
                   cache_modifier=".cg"), live


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
        pk, live = _pack(Pack, slot, key, flags, n_act, PACK)
        cnt, mass = _split_sums(pk, tl.where(live, _key_weight(pk) + (1 << 44), 0), ends)
    else:
        cnt, mass = _split_block(l_ptr, first, V, inv_t, m, pinf, lo, hi, ends, CHUNK, SUB)
    return cnt, mass, kmin, kmax


@triton.jit
def _near_share(l_ptr, row, c, V, C, S, s, inv_t, m, pinf, ZPart, MassPart, Buf, Count, Span,
                slot, CHUNK: tl.constexpr, CAP: tl.constexpr):
    """P_NEAR: the chunk's whole weight (ZPart) and its keys with |d| < NEAR gathered (their
    weight to MassPart's first slot), from the chunk's keys as loaded: no pack, no reload.
    Packing a sharp chunk's few weighing keys first (as P_SPLIT does) spared the weights'
    arithmetic but added a round trip through memory a chunk; an H200 A/B (`bench_sampling
    --ab`, same process) without it: sharp top-p 114.1 against 123.6 us at 64 rows, 57.7
    against 65.1 at 16, 47.9 against 48.1 at 1, every other case within 2 %."""
    d, key, valid = _d_key(l_ptr, c * CHUNK + tl.arange(0, CHUNK), V, inv_t, m, pinf)
    act = valid & (key < KEY_CUT_K)
    near = act & (key < KEY_NEAR_K)
    _gather(Buf, Count, Span, row, c, C, s, S, key, near, CAP)
    w = tl.where(act, _fixed_exp_t(d), 0)
    tl.store(ZPart + slot, tl.sum(w, axis=0))
    tl.store(MassPart + slot * 16, tl.sum(tl.where(near, w, 0), axis=0))


@triton.jit
def _chunk_share(mode, l_ptr, row, c, V, C, S, s, inv_t, m, pinf, lo, hi, shift, fresh, kf,
                 sel, min_w, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count, Span,
                 Pack, FIRST: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                 CAP: tl.constexpr, PACK: tl.constexpr):
    """Chunk c's share of the row's pass in `mode` (written to the chunk's slots; P_NEAR only
    in the first pass)."""
    first = c * CHUNK
    offs = first + tl.arange(0, CHUNK)
    slot = row * C + c
    bins = tl.arange(0, 256)
    if FIRST:
        if mode == P_NEAR_K:
            _near_share(l_ptr, row, c, V, C, S, s, inv_t, m, pinf, ZPart, MassPart, Buf, Count,
                        Span, slot, CHUNK, CAP)
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


@triton.jit
def _row_gather_end(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos, purpose,
                    Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m, pinf, min_w,
                    CHUNK: tl.constexpr, CP: tl.constexpr, CAP: tl.constexpr, DRAW: tl.constexpr,
                    SMALL: tl.constexpr):
    """`_row_gathered` over registers [SMALL] where the n_g gathered keys fit (a sharp row's
    nucleus), else [CAP] (one compiled copy where SMALL == CAP)."""
    if SMALL == CAP:
        _row_gathered(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos, purpose,
                      Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m, pinf, min_w, CHUNK,
                      CP, CAP, DRAW, CAP)
    elif n_g <= SMALL:
        _row_gathered(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos, purpose,
                      Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m, pinf, min_w, CHUNK,
                      CP, CAP, DRAW, SMALL)
    else:
        _row_gathered(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos, purpose,
                      Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m, pinf, min_w, CHUNK,
                      CP, CAP, DRAW, CAP)


@triton.jit
def _row_near(st, Buf, Count, ZPart, MassPart, row, C, S, s, top_p, trace, Seed, Pos, purpose,
              Span, CBase, Pref, Out, l_ptr, V, inv_t, m, pinf, min_w, CHUNK: tl.constexpr,
              CP: tl.constexpr, CAP: tl.constexpr, DRAW: tl.constexpr, SMALL: tl.constexpr):
    """P_NEAR's end: Z, the row's whole weight, from the chunks' shares. The gathered keys are
    every key with |d| < NEAR, so where they weigh at least top_p * Z, top-p's key is among
    them and is found, and drawn, as a gather's (CBase is 0: no key lies below them) in
    [SMALL] registers; more than SMALL such keys are gathered again by the next pass, which
    ends as P_GATHER (so the first pass's kernel holds no [CAP] search). Where they weigh
    less, the row splits from the start in the next pass, as if this one had not been."""
    cs = tl.arange(0, CP)
    ok = cs < C
    z = tl.sum(tl.load(ZPart + row * C + cs, mask=ok, other=0, cache_modifier=".cg"), axis=0)
    near = tl.sum(tl.load(MassPart + (row * C + cs) * 16, mask=ok, other=0,
                          cache_modifier=".cg"), axis=0)
    thr = z.to(tl.float64) * top_p.to(tl.float64)
    n_g = tl.atomic_add(Count + row * S + s, 0, sem="acquire", scope="gpu")
    if thr <= 0:
        _resolve(st, 0, z, trace)                        # top_p <= 0: the top key alone
    elif (near.to(tl.float64) >= thr) & (n_g <= SMALL):
        _row_gathered(st, P_GATHER_K, Buf, n_g, row, 0, top_p, 0, z, trace, Seed, Pos, purpose,
                      Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m, pinf, min_w, CHUNK,
                      CP, CAP, DRAW, SMALL)
    elif near.to(tl.float64) >= thr:                     # P_GATHER's pass over the same keys
        _set_state(st, P_GATHER_K, 0, KEY_NEAR_K - 1, 0, 0, 0, z, KEY_INF_K, -1,
                   trace | P_GATHER_BIT)
    else:
        _set_state(st, P_SPLIT_K, 0, KEY_CUT_K, 23, 1, 0, 0, KEY_INF_K, -1,
                   trace | P_SPLIT_BIT)


@triton.jit(noinline=True)
def _select_row(row, x, X, L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, PartV, PartI, PartNan,
                PartM, PartN, State, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count, Span,
                CBase, Pref, Pack, Arrive, Out, V, C, S, purpose, s, FIRST: tl.constexpr,
                CHUNK: tl.constexpr, SUB: tl.constexpr, CP: tl.constexpr, CAP: tl.constexpr,
                SMALL: tl.constexpr, PACK: tl.constexpr, DRAW: tl.constexpr,
                ONE: tl.constexpr):
    """Chunks x, x + X, ... of the row's pass in the row's mode (the row's maximum, parameters
    and state read once), then one arrival: the last of the row's X programs to finish moves
    the row to its next mode (module doc)."""
    row = tl.cast(row, tl.int32)                      # the interpreter's loops give ints
    st = State + row * NSTATE_K
    m, pinf = _row_max(PartM, row, C, CP)
    temp = tl.load(Temp + row)
    k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    if FIRST:
        mode = _first_mode(temp, k, top_p, m, V)
        if (mode == P_SPLIT_K) & (pinf == 0):        # only a top-p row reads the bound
            mode = tl.where(_near_bound(PartM, PartN, row, m, C, CP) <= CAP, P_NEAR_K, mode)
    else:
        mode = tl.load(st).to(tl.int32)
    if mode == GREEDY_K:
        if x == 0:
            tl.store(Out + row, _greedy_token(PartV, PartI, PartNan, row, C, V, CP))
            _set_state(st, DONE_K, 0, 0, 0, 0, 0, 0, KEY_INF_K, -1, GREEDY_BIT + PASS_ONE)
    elif mode != DONE_K:
        lo, hi, shift, fresh, base, zk, kf, sel, trace = _row_state(st, mode, FIRST)
        l_ptr = L + row.to(tl.int64) * stride_l
        inv_t = tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
        min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0        # min_p * 2**40
        if ONE:                                          # X == C: chunk x alone, no loop
            _chunk_share(mode, l_ptr, row, x, V, C, S, s, inv_t, m, pinf, lo, hi, shift, fresh,
                         kf, sel, min_w, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf,
                         Count, Span, Pack, FIRST, CHUNK, SUB, CAP, PACK)
        else:
            for c in tl.range(x, C, X, num_stages=1):
                _chunk_share(mode, l_ptr, row, c, V, C, S, s, inv_t, m, pinf, lo, hi, shift,
                             fresh, kf, sel, min_w, HistPart, CntPart, MassPart, BoundPart,
                             ZPart, Buf, Count, Span, Pack, FIRST, CHUNK, SUB, CAP, PACK)
        if _arrive(Arrive, row, s, S, X):
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
                _row_gather_end(st, mode, Buf, n_g, row, k, top_p, base, zk, trace, Seed, Pos,
                                purpose, Span, CBase, Pref, ZPart, Out, l_ptr, C, V, inv_t, m,
                                pinf, min_w, CHUNK, CP, CAP, DRAW, SMALL)
            elif mode == P_SPLIT_K:
                _row_p_split(st, CntPart, MassPart, BoundPart, CBase, row, C, top_p, lo, hi,
                             fresh, base, zk, trace, CP, CAP)
            elif FIRST:                                  # the first pass's last mode: P_NEAR
                _row_near(st, Buf, Count, ZPart, MassPart, row, C, S, s, top_p, trace, Seed, Pos,
                          purpose, Span, CBase, Pref, Out, l_ptr, V, inv_t, m, pinf, min_w,
                          CHUNK, CP, CAP, DRAW, SMALL)
            else:                                        # a later pass's: P_HIST
                _row_p_hist(st, HistPart, row, C, top_p, lo, base, zk, trace, CP)


@triton.jit(do_not_specialize=["n", "s"])
def _select_kernel(L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, PartV, PartI, PartNan,
                   PartM, PartN, State, HistPart, CntPart, MassPart, BoundPart, ZPart, Buf, Count,
                   Span, CBase, Pref, Pack, Arrive, Out, n, V, C, S, purpose, s,
                   FIRST: tl.constexpr,
                   CHUNK: tl.constexpr, SUB: tl.constexpr, CP: tl.constexpr,
                   CAP: tl.constexpr, SMALL: tl.constexpr, PACK: tl.constexpr,
                   DRAW: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr):
    """Grid (G, X), pass s of S: program (g, x) does chunks x, x + X, ... of rows g, g + G, ...;
    it returns at once when all of them are done (one load for up to 16 rows). ONE: X == C,
    a program's one chunk without a loop around it (a row's registers then hold no loop
    state, which at 8 warps spared the later passes' kernel a spill). PDL: the pass
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
            _select_row(row, x, X, L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, PartV, PartI,
                        PartNan, PartM, PartN, State, HistPart, CntPart, MassPart, BoundPart, ZPart,
                        Buf, Count, Span, CBase, Pref, Pack, Arrive, Out, V, C, S, purpose, s,
                        FIRST, CHUNK, SUB, CP, CAP, SMALL, PACK, DRAW, ONE)


PASSES = 12         # top-k <= 4 passes, top-p <= 8, the draw 1 (module doc)
CHUNK = 2048
CAP = 4096          # keys a row may gather
SMALL = 256         # a gather of at most SMALL keys is searched in [SMALL] registers, not [CAP]
PACK = 128          # a chunk with at most PACK keys to split packs them before its 16 sums
PROGRAMS = 512      # a select pass launches about this many programs where the rows need more
SUB = 256           # keys a P_SPLIT step holds at once ([SUB, 16] sums)
CHUNK_WARPS = 4
SELECT_REGS = 128   # a select program's register cap (at 4 warps ptxas spills: sample_stages)
STATE_FIELDS = ("mode", "lo", "hi", "shift", "fresh", "base", "zk", "kf", "sel", "trace")


class Stages(NamedTuple):
    """What the kernels leave for a call: the tokens, and each row's final state (for tests):
    kf its key threshold (KEY_INF: none), mode (0, done, once every pass ran), its trace; from
    the trace, on access only (so a call that reads the tokens launches nothing more), the
    modes it went through (bit 1 << i for MODES[i]) and the number of passes it took."""
    tokens: torch.Tensor      # [n] int64
    kf: torch.Tensor          # [n] int64
    mode: torch.Tensor        # [n] int64
    trace: torch.Tensor       # [n] int64: the modes' bits, plus PASS_ONE a pass

    @property
    def modes(self) -> torch.Tensor:
        return self.trace & (PASS_ONE.value - 1)

    @property
    def passes(self) -> torch.Tensor:
        return self.trace // PASS_ONE.value


class SelectPolicy(NamedTuple):
    """How the select passes launch for a batch (`select_policy`)."""
    groups: int           # G: the grid is (G, C); program (g, c) works through rows g, g + G, ..
    warps: int            # num_warps of a select program
    gather_draw: bool     # a threshold found in a gather draws in that pass (min-p off)
    pdl: bool = True      # the launches with programmatic dependent launch (where supported)
    chunk_groups: int = 0  # X: the grid is (G, min(X, C)); program (g, x) does chunks x,
                           # x + X, .. of its rows (0: X = C, a chunk a program)
    first_groups: int = 0  # G of the first pass alone (0: groups). Rows keep no program
                           # between passes (state, counters and buffers are per row), so
                           # the first pass, where most rows do all their work, may spread
                           # them over more programs than the later ones, whose launches
                           # mostly find nothing to do


def select_policy(n: int) -> SelectPolicy:
    """The select passes' launch for n rows, from a sweep on an H200 at a 128256-token
    vocabulary (CUDA-graph replays; results/sampling.md, its launch sweep). A program
    works through its rows one after another, each a chain of dependent loads, atomics and
    reductions, so at 16 and 64 rows more programs of 4 warps beat fewer of 8:
    - 64 rows, sharp top-p: G 64 / 32 / 16 at 4 warps 216 / 223 / 243 µs; the launch before
      (four programs an SM: G 9, 8 warps) 384; greedy rows 83 / 65 / 56 against 65: G = n // 2
      above 16 rows;
    - 16 rows: G 16 at 4 warps 109 µs, G 8 128, the launch before 136;
    - 1 row: 4 warps 99 µs against 8 warps' 76.
    The draw in the gather saves a pass where rows wait on each other (16 rows: 118 against
    127 µs, 64 rows: 296 against 338, at G = n, 8 warps) and costs one row alone about 7 µs of
    serial work (76 against 69), so it is taken from 16 rows on.
    PDL on (an H100, the same sweep): 31.5 -> 23.7 µs greedy and 73.5 -> 66.0 sharp top-p at
    1 row, 43.1 -> 39.3 and 111.4 -> 107.3 at 16, within 1 µs either way at 64 (65.8 -> 66.8,
    224.8 -> 226.5): each pass's launch overlaps the tail of the one before.
    Chunk groups (an H100, `--sweep --fields chunk_groups`, 2026-12-06): at most PROGRAMS
    programs a pass (about four of 4 warps an SM on 132 SMs), each doing C / X chunks of its
    rows: a pass over rows that are all done then launches 512 programs instead of G * C (the
    12 passes cost that whatever the rows need). At 64 rows (G 32) X 16 / 32 / 63 gave
    greedy 41.1 / 48.5 / 63.9 µs, sharp top-p 156.7 / 162.5 / 176.2, flat 391.7 / 394.4 /
    404.0, and X 8 is slower (238 sharp, too few programs); at 16 rows (G 16) X 32 / 16 / 63
    gave 27.3 / 26.4 / 35.4 greedy, 75.6 / 94.0 / 82.7 sharp, 157.2 / 221.2 / 164.3 flat; one
    row keeps a program a chunk (63 programs).
    First groups (an H200, `--sweep --fields pack,first_groups`, 2026-12-06): above 16 rows
    the first pass, where most rows do all their work, runs a row group a row (G = n) while
    the later passes keep G = n // 2: at 64 rows sharp top-p 111.3 against 123.8 µs,
    temperature 67.7 against 70.7, flat top-p 364.4 against 368.5, greedy 35.3 against 33.4."""
    many = n >= 16
    groups = max(1, n if n <= 16 else n // 2)
    return SelectPolicy(groups=groups, warps=4 if many else 8, gather_draw=many,
                        chunk_groups=max(1, PROGRAMS // groups),
                        first_groups=n if n > 16 else 0)


def sample_stages(logits, temperature, top_k, top_p, min_p, seed, position, purpose: int,
                  chunk: int = CHUNK, cap: int = CAP, groups: int | None = None,
                  warps: int | None = None, gather_draw: bool | None = None,
                  pdl: bool | None = None, regs: int | None = None,
                  small: int | None = None, pack: int | None = None,
                  chunk_groups: int | None = None, first_groups: int | None = None) -> Stages:
    """`sample_triton`'s launches and the rows' final state. chunk and cap: powers of two;
    groups, warps, gather_draw, pdl, chunk_groups, first_groups: `SelectPolicy`'s fields
    (`select_policy(n)`'s where None; the tokens are the same whatever they are); regs: the
    select kernel's register cap (maxnreg, at most 255; SELECT_REGS where None). At 4 warps
    SELECT_REGS makes ptxas spill (504 bytes of stack a thread for Triton 3.9's sm_90 code,
    none at 8 warps), which a launch sweep weighs against the occupancy a higher cap costs.
    pdl: the 1 + PASSES launches with
    programmatic dependent launch where `pdl.supported` (each waits for the one before before
    any read), so a pass's launch overlaps the end of the one before. small: a gather of at
    most this many keys (a power of two; SMALL where None, at most cap) ends in registers of
    that size instead of cap's: the searches over the gathered keys cost in proportion to the
    registers they span, and a sharp row gathers a few keys. pack: a split of a chunk where at
    most this many keys can weigh packs them before its 16 sums (a power of two; PACK where
    None; 0: never), so a sharp row's split costs in proportion to its few such keys."""
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n, V = x.shape
    lanes = [t.contiguous() for t in (temperature, top_k, top_p, min_p, seed, position)]
    C = triton.cdiv(V, chunk)
    CP = triton.next_power_of_2(C)

    def buf(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, device=x.device)

    parts = (buf(n, C, dtype=torch.float32), buf(n, C, dtype=torch.int32),
             buf(n, C, dtype=torch.int32), buf(n, C, dtype=torch.float32),
             buf(n, C, dtype=torch.int32))
    state = buf(n, NSTATE_K.value, dtype=torch.int64)
    work = (buf(n, C, 256, dtype=torch.int32), buf(n, C, 16, dtype=torch.int32),
            buf(n, C, 16, dtype=torch.int64), buf(n, C, 2, dtype=torch.int32),
            buf(n, C, dtype=torch.int64), buf(n, cap, dtype=torch.int32))
    span, cbase, pref = (buf(n, C, 2, dtype=torch.int32), buf(n, C, dtype=torch.int64),
                         buf(n, cap, dtype=torch.int64))
    pack_size = PACK if pack is None else pack
    packs = buf(n, C, max(pack_size, 1), dtype=torch.int32)
    count, arrive = buf(n, PASSES, dtype=torch.int32), buf(n, PASSES, dtype=torch.int32)
    out = buf(n, dtype=torch.int64)
    policy = select_policy(n)
    on = (policy.pdl if pdl is None else pdl) and _pdl.supported(x.device)
    launch = dict(PDL=on, **_pdl.launch_options(x.device, on))
    if n:
        _chunk_max_kernel[(n, C)](x, x.stride(0), lanes[0], *parts, count, arrive, cbase, V, C,
                                  PASSES,
                                  CHUNK=chunk, SP=triton.next_power_of_2(PASSES),
                                  num_warps=CHUNK_WARPS, enable_fp_fusion=False, **launch)
    G = groups or policy.groups
    G0 = (policy.first_groups if first_groups is None else first_groups) or G
    X = min(C, (policy.chunk_groups if chunk_groups is None else chunk_groups) or C)
    for s in range(PASSES if n else 0):
        grid = (G0 if s == 0 else G, X)
        _select_kernel[grid](x, x.stride(0), *lanes, *parts, state, *work, count, span, cbase,
                             pref, packs, arrive, out,
                             n, V, C, PASSES, purpose, s, FIRST=s == 0, CHUNK=chunk,
                             SUB=max(min(chunk, SUB), chunk // 8), CP=CP, CAP=cap,
                             SMALL=min(cap, small or SMALL), PACK=min(pack_size, chunk),
                             DRAW=policy.gather_draw if gather_draw is None else gather_draw,
                             ONE=X == C,
                             num_warps=warps or policy.warps, maxnreg=regs or SELECT_REGS,
                             enable_fp_fusion=False, **launch)
    return Stages(out, *(state[:, STATE_FIELDS.index(f)] for f in ("kf", "mode", "trace")))


@triton.jit
def _node_mass_kernel(L, stride_l, Temp, Kf, MinP, M, Pinf, Z, Total, V,
                      BLOCK: tl.constexpr):
    """Grid (n,). One row's kept weight under its thresholds, in three passes over its logits:
    max(x) (x = l * (1 / temperature), NaN as -inf, as `_chunk_max_kernel`), Z = the sum of the
    kept integer weights (`_weights`: key <= kf, min-p), and the fp64 sum of the fp32
    probabilities w / Z (what `padgraph.llm.sampling.sampling_probs` writes, summed)."""
    row = tl.program_id(0)
    l_ptr = L + row.to(tl.int64) * stride_l
    temp = tl.load(Temp + row)
    inv_t = tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=1):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(l_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        mx = tl.maximum(mx, tl.where(x != x, float("-inf"), x))
    m = tl.max(mx, axis=0)
    pinf = m == float("inf")
    m = tl.where(pinf, 0.0, m)
    kf = tl.load(Kf + row).to(tl.int32)
    min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0        # min_p * 2**40
    z = tl.zeros([BLOCK], dtype=tl.int64)
    for start in tl.range(0, V, BLOCK, num_stages=1):
        z += _weights(l_ptr, start + tl.arange(0, BLOCK), V, inv_t, m, pinf, kf, min_w)
    zsum = tl.maximum(tl.sum(z, axis=0), 1)
    zf = zsum.to(tl.float64)
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for start in tl.range(0, V, BLOCK, num_stages=1):
        w = _weights(l_ptr, start + tl.arange(0, BLOCK), V, inv_t, m, pinf, kf, min_w)
        acc += (w.to(tl.float64) / zf).to(tl.float32).to(tl.float64)
    tl.store(M + row, m)
    tl.store(Pinf + row, pinf.to(tl.int8))
    tl.store(Z + row, zsum)
    tl.store(Total + row, tl.sum(acc, axis=0))


class NodeMass(NamedTuple):
    """`node_mass`'s per-row results."""
    m: torch.Tensor           # [n] fp32: max(x), 0 where it is +inf (as the kernels use it)
    pinf: torch.Tensor        # [n] bool: some x is +inf
    z: torch.Tensor           # [n] int64: the kept weights' sum, at least 1
    total: torch.Tensor       # [n] fp64: the sum of the fp32 probabilities w / z


def node_mass(logits, temperature, kf, min_p, block: int = 2048) -> NodeMass:
    """Per row, what a token's probability under the row's sampling distribution needs besides
    its own logit: the row's max, its kept weight and the fp64 sum of its fp32 probabilities.
    kf: the rows' key thresholds (`sample_stages(...).kf`). One launch, three reads of each
    row; no [n, V] tensor is written. The speculative rule's per-node mass (the alternative
    builds every node's whole distribution)."""
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n, V = x.shape
    dev = x.device
    out = NodeMass(torch.empty(n, dtype=torch.float32, device=dev),
                   torch.empty(n, dtype=torch.int8, device=dev),
                   torch.empty(n, dtype=torch.int64, device=dev),
                   torch.empty(n, dtype=torch.float64, device=dev))
    if n:
        _node_mass_kernel[(n,)](x, x.stride(0), temperature.contiguous(), kf.contiguous(),
                                min_p.contiguous(), *out, V, BLOCK=min(block, triton.next_power_of_2(V)),
                                num_warps=CHUNK_WARPS, enable_fp_fusion=False)
    return out._replace(pinf=out.pinf.bool())


def sample_triton(logits, temperature, top_k, top_p, min_p, seed, position, purpose: int,
                  chunk: int = CHUNK, cap: int = CAP) -> torch.Tensor:
    """`padgraph.llm.sampling.sample` in Triton, the same tokens bit for bit (arguments as
    there, checked there). 1 + PASSES launches whatever the logits hold, no host work (module
    doc). chunk: logits a program reads; cap: keys a row may gather; powers of two."""
    return sample_stages(logits, temperature, top_k, top_p, min_p, seed, position, purpose,
                         chunk, cap).tokens
