"""The sampler in Triton, and the integer pieces it shares bit for bit with the torch
reference (`padgraph.llm.sampling`, whose module doc defines the distribution).

Why the pieces are integers: a sampler whose tokens must be the same in torch and in a kernel
cannot let the order of a floating-point sum decide anything. So the weights are fixed-point
integers (`fixed_exp`: floor(exp(d) * 2**40) from IEEE adds and multiplies only, no library
exp, whose last bit differs between implementations), every threshold compares integer sums
(exact in any order) in fp64, and the draw is an integer search (`mulhi62`). The random stream
(`random_bits`, splitmix64's finaliser over the key words) is int64 arithmetic with wrap-around
multiplies and logical shifts written as masked arithmetic shifts, the same in both.

Six launches a call, each row finding its own way through them (one batch mixes greedy,
temperature-only and filtered rows):

1. `_chunk_max_kernel`, grid (n, C chunks of CHUNK logits): each chunk's share of torch's
   argmax (greedy rows) and of max(x), x = l * (1 / temperature).
2. `_chunk_cand_kernel`, grid (n, C), rows with top-k or top-p: the chunk's CANDIDATES smallest
   keys (key = the fp32 bits of |d|, d = x - max: monotone, larger d first) with their weights,
   and the chunk's total weight.
3. `_threshold_kernel`, grid (n,): tau, the smallest of the chunks' last candidate keys; every
   key below tau is a candidate, so a top-k or top-p threshold below tau is found exactly on
   the candidates (a bisection in registers). A row whose threshold is not below tau (a wide
   nucleus) is marked for step 6.
4. `_chunk_weight_kernel`, grid (n, C): each chunk's kept weight (threshold and min-p applied).
5. `_finish_kernel`, grid (n,): greedy rows take the argmax; sampled rows r = floor(u * Z /
   2**62), the chunk whose cumulative kept weight passes r, the index in it.
6. `_sample_kernel`, grid (n,), only the marked rows: one program a row, in BLOCK-wide passes
   over the whole row: the maximum; the k-th largest d as a bisection over the keys, each pass
   counting the keys at or below a pivot and moving the bracket to the nearest keys present (at
   most ~31 passes); top-p by the same bisection on the weight above a key; the kept weight and
   a scan for the drawn index. Exact but slow at a 128k vocabulary (tens of passes on one SM).

There is no host work and no sync: graph-safe. The kernels are launched with fp contraction
off, so a*b+c is never an FMA and the fp32 steps round as torch's do.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .kv import resolve_impl

__all__ = ["PURPOSE_DECODE", "PURPOSE_ACCEPT", "PURPOSE_RESIDUAL", "PURPOSE_DRAFT",
           "FIXED_ONE", "V_MAX", "random_bits", "fixed_exp", "mulhi62", "sample_triton",
           "chunk_stages", "Stages", "resolve_impl"]

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
KEY_INF = 0x7F800000            # the key of d = -inf (larger than every other key)


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


GAMMA = _i64(0x9E3779B97F4A7C15)     # golden-ratio increment (SplittableRandom's)
MIX1 = _i64(0xBF58476D1CE4E5B9)      # splitmix64 finaliser multipliers
MIX2 = _i64(0x94D049BB133111EB)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


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
        h = _mix64((h ^ torch.as_tensor(word, dtype=torch.int64, device=h.device)) + GAMMA)
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
def _argmax_pass(l_ptr, V, inv_t, BLOCK: tl.constexpr):
    """torch's argmax of the raw row (first NaN, else first maximum) and the max of
    x = l * inv_t with NaN as -inf. Per-lane running values, one reduction at the end."""
    offs0 = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], V, tl.int32)
    nan_i = tl.full([BLOCK], V, tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + offs0
        valid = offs < V
        l = tl.load(l_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
        isnan = (l != l) & valid
        nan_i = tl.minimum(nan_i, tl.where(isnan, offs, V))
        take = (l > best_v) | ((l == best_v) & valid & (best_i == V))
        best_i = tl.where(take & ~isnan, offs, best_i)
        best_v = tl.where(take & ~isnan, l, best_v)
        x = l * inv_t
        m = tl.maximum(m, tl.where(x != x, float("-inf"), x))
    top = tl.max(best_v, axis=0)
    first = tl.min(tl.where((best_v == top) & (best_i < V), best_i, V), axis=0)
    first = tl.where(first == V, 0, first)              # an all -inf row: index 0, as torch
    first_nan = tl.min(nan_i, axis=0)
    return tl.where(first_nan < V, first_nan, first), tl.max(m, axis=0)


@triton.jit
def _count_pass(l_ptr, V, inv_t, m, pinf, K, KMAX, WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    """Over keys <= KMAX: the count (or the weight, WEIGHT) of keys <= K, the largest key
    <= K (-1 where none) and the smallest key > K (KEY_INF_K + 1 where none)."""
    offs0 = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    a = tl.full([BLOCK], -1, tl.int32)
    b = tl.full([BLOCK], KEY_INF_K + 1, tl.int32)
    for start in range(0, V, BLOCK):
        d, key, valid = _d_key(l_ptr, start + offs0, V, inv_t, m, pinf)
        live = valid & (key <= KMAX)
        le = live & (key <= K)
        if WEIGHT:
            acc += tl.where(le, _fixed_exp_t(d), 0)
        else:
            acc += le.to(tl.int64)
        a = tl.maximum(a, tl.where(le, key, -1))
        b = tl.minimum(b, tl.where(live & (key > K), key, KEY_INF_K + 1))
    return tl.sum(acc, axis=0), tl.max(a, axis=0), tl.min(b, axis=0)


@triton.jit
def _top_k_key(l_ptr, V, inv_t, m, pinf, k, BLOCK: tl.constexpr):
    """The key of the k-th largest d (KEY_INF_K when it lies below D_MIN_K: every weight stays)."""
    c, a, b = _count_pass(l_ptr, V, inv_t, m, pinf, KEY_CUT_K, KEY_INF_K, False, BLOCK)
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.where(c >= k, a, KEY_INF_K)
    done = c < k
    while (lo < hi) & (done == 0):
        K = lo + (hi - lo) // 2
        c, a, b = _count_pass(l_ptr, V, inv_t, m, pinf, K, KEY_INF_K, False, BLOCK)
        hi = tl.where(c >= k, a, hi)
        lo = tl.where(c >= k, lo, b)
    return hi


@triton.jit
def _top_p_key(l_ptr, V, inv_t, m, pinf, top_p, kk, BLOCK: tl.constexpr):
    """The largest key <= kk whose strictly-smaller keys weigh < top_p * the weight of keys
    <= kk (the smallest d top-p keeps)."""
    zk, a, b = _count_pass(l_ptr, V, inv_t, m, pinf, kk, kk, True, BLOCK)
    thr = zk.to(tl.float64) * top_p.to(tl.float64)
    lo = tl.zeros([], dtype=tl.int32)
    hi = a                                             # the largest key present <= kk
    while lo < hi:
        K = lo + (hi - lo) // 2
        below, a, b = _count_pass(l_ptr, V, inv_t, m, pinf, K, hi, True, BLOCK)
        ok = below.to(tl.float64) < thr                # the keys < b weigh `below`
        lo = tl.where(ok, b, lo)
        hi = tl.where(ok, hi, a)
    return lo


@triton.jit
def _weights(l_ptr, offs, V, inv_t, m, pinf, kf, min_w):
    d, key, valid = _d_key(l_ptr, offs, V, inv_t, m, pinf)
    w = _fixed_exp_t(d)
    keep = valid & (key <= kf) & (w.to(tl.float64) >= min_w)
    return tl.where(keep, w, 0)


@triton.jit
def _draw(l_ptr, V, inv_t, m, pinf, kf, min_w, u62, BLOCK: tl.constexpr):
    """The first index whose cumulative kept weight exceeds floor(u62 * Z / 2**62)."""
    offs0 = tl.arange(0, BLOCK)
    zv = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, V, BLOCK):
        zv += _weights(l_ptr, start + offs0, V, inv_t, m, pinf, kf, min_w)
    r = _mulhi62_t(u62, tl.sum(zv, axis=0))
    acc = tl.zeros([], dtype=tl.int64)
    token = tl.zeros([], dtype=tl.int64) + V - 1
    start = 0
    found = 0
    while (start < V) & (found == 0):
        offs = start + offs0
        cum = acc + tl.cumsum(_weights(l_ptr, offs, V, inv_t, m, pinf, kf, min_w), 0)
        hit = tl.min(tl.where((cum > r) & (offs < V), offs, V), axis=0)
        found = (hit < V).to(tl.int32)
        token = tl.where(hit < V, hit, token)
        acc = tl.max(cum, axis=0)
        start += BLOCK
    return token


@triton.jit
def _filtered(k, top_p, V):
    """Whether a row needs a threshold search (top-k or top-p on)."""
    return ((k > 0) & (k < V)) | (top_p < 1)


@triton.jit
def _sample_kernel(L, stride_l, Temp, TopK, TopP, MinP, Seed, Pos, Kf, Out, V, purpose,
                   FALLBACK_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    """One program a row, every pass over the whole row. FALLBACK_ONLY: only the rows whose
    thresholds the candidates could not settle (Kf < 0); the chunked kernels do the others."""
    row = tl.program_id(0)
    l_ptr = L + row.to(tl.int64) * stride_l
    temp = tl.load(Temp + row)
    k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    if (not FALLBACK_ONLY) | (tl.load(Kf + row) < 0):
        inv_t = tl.math.div_rn(1.0, tl.where(temp > 0, temp, 1.0))
        greedy, m = _argmax_pass(l_ptr, V, inv_t, BLOCK)
        token = greedy.to(tl.int64)
        if (temp > 0) & (m > float("-inf")):
            pinf = m == float("inf")
            m = tl.where(pinf, 0.0, m)
            kk = tl.full([], KEY_INF_K, tl.int32)
            if (k > 0) & (k < V):
                kk = _top_k_key(l_ptr, V, inv_t, m, pinf, k, BLOCK)
            if top_p < 1:
                kk = _top_p_key(l_ptr, V, inv_t, m, pinf, top_p, kk, BLOCK)
            min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0     # min_p * 2**40
            bits = _random_bits_t(tl.load(Seed + row), tl.load(Pos + row), purpose, 0)
            token = _draw(l_ptr, V, inv_t, m, pinf, kk, min_w, _lsr_t(bits, 2), BLOCK)
        tl.store(Out + row, token)


# --------------------------------------------------- the chunked path (no threshold search)

@triton.jit
def _chunk_max_kernel(L, stride_l, Temp, PartV, PartI, PartNan, PartM, V, C,
                      CHUNK: tl.constexpr):
    """Grid (n, C). Chunk c's share of torch's argmax (its largest non-NaN logit, the first
    index holding it, its first NaN) and of max(l * inv_t) with NaN as -inf."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
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


@triton.jit
def _row_max(PartM, row, C, CP: tl.constexpr):
    cs = tl.arange(0, CP)
    m = tl.max(tl.load(PartM + row * C + cs, mask=cs < C, other=float("-inf")), axis=0)
    pinf = m == float("inf")
    return tl.where(pinf, 0.0, m), pinf


@triton.jit
def _chunk_cand_kernel(L, stride_l, Temp, TopK, TopP, PartM, PartZ, CandKey, CandW, V, C,
                       M: tl.constexpr, CHUNK: tl.constexpr, CP: tl.constexpr):
    """Grid (n, C), rows with top-k or top-p: chunk c's M smallest keys (largest d; ties by
    index; KEY_INF + 1 past the chunk's end) with their weights, and the chunk's weight."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temp + row)
    m, pinf = _row_max(PartM, row, C, CP)
    if (temp > 0) & _filtered(tl.load(TopK + row), tl.load(TopP + row), V) & \
            (m > float("-inf")):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        d, key, valid = _d_key(L + row.to(tl.int64) * stride_l, offs, V,
                               tl.math.div_rn(1.0, temp), m, pinf)
        w = tl.where(valid, _fixed_exp_t(d), 0)
        tl.store(PartZ + row * C + c, tl.sum(w, axis=0))
        key = tl.where(valid, key, KEY_INF_K + 1)
        base = (row * C + c) * M
        for j in tl.static_range(M):
            v = tl.min(key, axis=0)
            i = tl.min(tl.where(key == v, offs, V + CHUNK), axis=0)
            tl.store(CandKey + base + j, v)
            tl.store(CandW + base + j, tl.sum(tl.where((offs == i) & (key == v), w, 0), axis=0))
            key = tl.where(offs == i, KEY_INF_K + 1, key)


@triton.jit
def _threshold_kernel(Temp, TopK, TopP, PartM, PartZ, CandKey, CandW, Kf, V, C,
                      M: tl.constexpr, CP: tl.constexpr, CM: tl.constexpr):
    """Grid (n,). The key threshold of rows with top-k or top-p from the candidates: every key
    below tau (the smallest of the chunks' M-th keys) is a candidate, so a threshold below tau
    is exact; Kf = -1 where it is not below tau (the one-program kernel settles the row).
    KEY_INF for the other rows."""
    row = tl.program_id(0)
    temp = tl.load(Temp + row)
    k = tl.load(TopK + row)
    top_p = tl.load(TopP + row)
    kf = tl.full([], KEY_INF_K, tl.int32)
    m, pinf = _row_max(PartM, row, C, CP)
    if (temp > 0) & _filtered(k, top_p, V) & (m > float("-inf")):
        e = tl.arange(0, CM)
        ok = e < C * M
        key = tl.load(CandKey + row * C * M + e, mask=ok, other=KEY_INF_K + 1)
        w = tl.load(CandW + row * C * M + e, mask=ok, other=0)
        tau = tl.min(tl.where(ok & (e % M == M - 1), key, KEY_INF_K + 1), axis=0)
        exact = key < tau
        if (k > 0) & (k < V):
            kf = tl.where(tl.sum(exact.to(tl.int32), axis=0) >= k,
                          _kth_key(key, exact, k), -1)
        if (top_p < 1) & (kf >= 0):
            cs = tl.arange(0, CP)
            z_all = tl.sum(tl.load(PartZ + row * C + cs, mask=cs < C, other=0), axis=0)
            zk = tl.where(kf == KEY_INF_K, z_all, tl.sum(tl.where(exact & (key <= kf), w, 0),
                                                         axis=0))
            thr = zk.to(tl.float64) * top_p.to(tl.float64)
            settled = tl.sum(tl.where(exact, w, 0), axis=0).to(tl.float64) >= thr
            kf = tl.where(settled, _mass_key(key, w, exact & (key <= kf), thr), -1)
    tl.store(Kf + row, kf)


@triton.jit
def _kth_key(key, live, k):
    """The smallest key v of the live entries with count(key <= v) >= k (bisection with the
    bracket moved to keys present, as `_top_k_key`, on registers)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.max(tl.where(live, key, -1), axis=0)
    while lo < hi:
        K = lo + (hi - lo) // 2
        le = live & (key <= K)
        c = tl.sum(le.to(tl.int32), axis=0)
        a = tl.max(tl.where(le, key, -1), axis=0)
        b = tl.min(tl.where(live & (key > K), key, KEY_INF_K + 1), axis=0)
        hi = tl.where(c >= k, a, hi)
        lo = tl.where(c >= k, lo, b)
    return hi


@triton.jit
def _mass_key(key, w, live, thr):
    """The largest live key whose strictly-smaller live keys weigh < thr (as `_top_p_key`)."""
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.max(tl.where(live, key, -1), axis=0)
    while lo < hi:
        K = lo + (hi - lo) // 2
        le = live & (key <= K)
        below = tl.sum(tl.where(le, w, 0), axis=0)
        a = tl.max(tl.where(le, key, -1), axis=0)
        b = tl.min(tl.where(live & (key > K), key, KEY_INF_K + 1), axis=0)
        ok = below.to(tl.float64) < thr
        lo = tl.where(ok, b, lo)
        hi = tl.where(ok, hi, a)
    return lo


@triton.jit
def _chunk_weight_kernel(L, stride_l, Temp, MinP, PartM, PartZ, Kf, V, C,
                         CHUNK: tl.constexpr, CP: tl.constexpr):
    """Grid (n, C). The kept weight of chunk c of a sampled row settled here (Kf >= 0)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    temp = tl.load(Temp + row)
    kf = tl.load(Kf + row)
    z = tl.zeros([], dtype=tl.int64)
    if (temp > 0) & (kf >= 0):
        m, pinf = _row_max(PartM, row, C, CP)
        if m > float("-inf"):
            min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0
            z = tl.sum(_weights(L + row.to(tl.int64) * stride_l, c * CHUNK +
                                tl.arange(0, CHUNK), V, tl.math.div_rn(1.0, temp), m, pinf,
                                kf, min_w), axis=0)
    tl.store(PartZ + row * C + c, z)


@triton.jit
def _finish_kernel(L, stride_l, Temp, MinP, Seed, Pos, Kf, PartV, PartI, PartNan,
                   PartM, PartZ, Out, V, C, purpose, CHUNK: tl.constexpr, CP: tl.constexpr):
    """Grid (n,), the rows settled here (greedy, massless, Kf >= 0). Greedy and massless rows:
    torch's argmax from the chunks' shares. Sampled rows: r from the stream, the chunk whose
    cumulative kept weight passes it, then the index within that chunk."""
    row = tl.program_id(0)
    temp = tl.load(Temp + row)
    kf = tl.load(Kf + row)
    if (temp <= 0) | (kf >= 0):
        cs = tl.arange(0, CP)
        ok = cs < C
        pv = tl.load(PartV + row * C + cs, mask=ok, other=float("-inf"))
        pi = tl.load(PartI + row * C + cs, mask=ok, other=V)
        first = tl.min(tl.where(ok & (pv == tl.max(pv, axis=0)), pi, V), axis=0)
        first = tl.where(first == V, 0, first)           # an all -inf row: index 0, as torch
        first_nan = tl.min(tl.load(PartNan + row * C + cs, mask=ok, other=V), axis=0)
        token = tl.where(first_nan < V, first_nan, first).to(tl.int64)
        m, pinf = _row_max(PartM, row, C, CP)
        if (temp > 0) & (m > float("-inf")):
            z = tl.load(PartZ + row * C + cs, mask=ok, other=0)
            cum = tl.cumsum(z, 0)
            bits = _random_bits_t(tl.load(Seed + row), tl.load(Pos + row), purpose, 0)
            r = _mulhi62_t(_lsr_t(bits, 2), tl.sum(z, axis=0))
            j = tl.min(tl.where(ok & (cum > r), cs, C), axis=0)
            below = tl.sum(tl.where(cs == j, cum - z, 0), axis=0)
            offs = j * CHUNK + tl.arange(0, CHUNK)
            min_w = tl.load(MinP + row).to(tl.float64) * 1099511627776.0
            w = _weights(L + row.to(tl.int64) * stride_l, offs, V, tl.math.div_rn(1.0, temp), m,
                         pinf, kf, min_w)
            hit = tl.min(tl.where((below + tl.cumsum(w, 0) > r) & (offs < V), offs, V), axis=0)
            token = tl.where(hit < V, hit, V - 1).to(tl.int64)
        tl.store(Out + row, token)


BLOCK = 1024
NUM_WARPS = 8
CHUNK = 2048
CHUNK_WARPS = 4
CANDIDATES = 16     # keys a chunk keeps for the threshold search: with 63 chunks (a 128k
                    # vocabulary) every key below ~the 500th largest is a candidate


class Stages(NamedTuple):
    """What the chunked kernels leave for the draws: each chunk's share of the argmax and of the
    maximum, its kept weight, and each row's key threshold (KEY_INF: none; -1: left to the
    one-program kernel)."""
    part_v: torch.Tensor      # [n, C] fp32 the chunk's largest non-NaN logit
    part_i: torch.Tensor      # [n, C] int32 its first index
    part_nan: torch.Tensor    # [n, C] int32 the chunk's first NaN (V: none)
    part_m: torch.Tensor      # [n, C] fp32 the chunk's max of l / temperature
    part_z: torch.Tensor      # [n, C] int64 the chunk's kept weight
    kf: torch.Tensor          # [n] int32


def chunk_stages(x, lanes, chunk: int = CHUNK, candidates: int = CANDIDATES) -> Stages:
    """The first four launches of `sample_triton` on contiguous-row logits x [n, V] and the
    lanes (temperature, top_k, top_p, min_p) [n]."""
    temp, k, tp, mp = lanes
    n, V = x.shape
    C, M = triton.cdiv(V, chunk), candidates
    CP = triton.next_power_of_2(C)
    dev = x.device
    st = Stages(*(torch.empty(n, C, dtype=t, device=dev) for t in (
        torch.float32, torch.int32, torch.int32, torch.float32, torch.int64)),
        torch.empty(n, dtype=torch.int32, device=dev))
    cand_key = torch.empty(n, C, M, dtype=torch.int32, device=dev)
    cand_w = torch.empty(n, C, M, dtype=torch.int64, device=dev)
    opts = dict(num_warps=CHUNK_WARPS, enable_fp_fusion=False)
    rows = x, x.stride(0)
    _chunk_max_kernel[(n, C)](*rows, temp, st.part_v, st.part_i, st.part_nan, st.part_m, V, C,
                              CHUNK=chunk, **opts)
    _chunk_cand_kernel[(n, C)](*rows, temp, k, tp, st.part_m, st.part_z, cand_key, cand_w, V, C,
                               M=M, CHUNK=chunk, CP=CP, **opts)
    _threshold_kernel[(n,)](temp, k, tp, st.part_m, st.part_z, cand_key, cand_w, st.kf, V, C,
                            M=M, CP=CP, CM=triton.next_power_of_2(C * M), **opts)
    _chunk_weight_kernel[(n, C)](*rows, temp, mp, st.part_m, st.part_z, st.kf, V, C,
                                 CHUNK=chunk, CP=CP, **opts)
    return st


def sample_triton(logits, temperature, top_k, top_p, min_p, seed, position, purpose: int,
                  block: int = BLOCK, chunk: int = CHUNK, candidates: int = CANDIDATES
                  ) -> torch.Tensor:
    """`padgraph.llm.sampling.sample` in Triton, the same tokens bit for bit (arguments as
    there, checked there). Six launches, no host work (see the module doc): `chunk_stages`,
    the draws, and the one-program kernel for the rows whose threshold the candidates could
    not settle."""
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n, V = x.shape
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    if not n:
        return out
    lanes = [t.contiguous() for t in (temperature, top_k, top_p, min_p, seed, position)]
    st = chunk_stages(x, lanes[:4], chunk, candidates)
    C = st.part_v.shape[1]
    _finish_kernel[(n,)](x, x.stride(0), lanes[0], lanes[3], lanes[4], lanes[5], st.kf,
                         st.part_v, st.part_i, st.part_nan, st.part_m, st.part_z, out, V, C,
                         purpose, CHUNK=chunk, CP=triton.next_power_of_2(C),
                         num_warps=CHUNK_WARPS, enable_fp_fusion=False)
    _sample_kernel[(n,)](x, x.stride(0), *lanes, st.kf, out, V, purpose, FALLBACK_ONLY=True,
                         BLOCK=block, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
