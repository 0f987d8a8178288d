"""The sampler's integer pieces, in torch (the reference, `padgraph.llm.sampling`) and as Triton
functions that give the same bits: the random stream (`random_bits`), the fixed-point weight
(`fixed_exp`), the draw's scaled product (`mulhi62`), and a chunk's keys and weights. Why
integers: `padgraph.backends.triton.sampling`'s module doc."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["PURPOSE_DECODE", "PURPOSE_ACCEPT", "PURPOSE_RESIDUAL", "PURPOSE_DRAFT",
           "FIXED_ONE", "V_MAX", "random_bits", "fixed_exp", "mulhi62"]

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
