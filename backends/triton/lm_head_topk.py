"""The draft's fp8 lm_head GEMM with top-k and log-sum-exp in its epilogue: the [n, V] logits
are never written.

Unfused, a draft step runs `torch._scaled_mm` (writes [n, V] bf16 logits) and then
`topk_logsumexp` (reads them back). Here one kernel does both:

`_fused_kernel`, grid (C = cdiv(V, BLOCK_V), row blocks): a program computes a [BLOCK_M,
BLOCK_V] tile of logits, acc = x8 @ w8[cols].T over the hidden in BLOCK_H steps (e4m3 inputs,
fp32 accumulator), scaled by the rows' and columns' fp32 scales; then, as `topk._chunk_kernel`
does for one row, each row's partial log-sum-exp (temperature applied) and its k best columns
(k rounds of max + lowest index). Candidates and partials have `topk`'s layout ([n, C, k],
[n, C], `topk.Partials`), so the same merge finishes the rows.

The partial products of each BLOCK_H step are promoted to the fp32 accumulator (on sm90 Triton
would otherwise let the whole hidden accumulate in the tensor cores' narrower fp8 accumulator,
0.35% off at H = 2048 on the H200). The logits stay fp32 (the unfused path rounds them to bf16
first), so a near-tie can rank the other way; the draft's proposals are all that depends on it.
The torch reference beside it is the oracle. An opaque custom op under torch.compile, like the
other kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compile_ops import opaque_under_compile
from .kv import resolve_impl
from .topk import K_MAX, Partials, topk_logsumexp_torch

BLOCK_V = 128     # vocabulary columns a program (C = 1002 programs for 128256)
BLOCK_H = 128     # hidden a dot step
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _fused_kernel(X, SX, W, SW, Scale, CandV, CandI, PartM, PartS,
                  n, V, H, stride_x, stride_w, C,
                  K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_H: tl.constexpr, PRECISE: tl.constexpr):
    c = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)          # [BLOCK_M]
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)                          # [BLOCK_V]
    rok, cok = rows < n, cols < V
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hok = hs < H
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + hs[None, :],
                    mask=rok[:, None] & hok[None, :], other=0.0)           # [BLOCK_M, BLOCK_H]
        w = tl.load(W + cols[None, :].to(tl.int64) * stride_w + hs[:, None],
                    mask=cok[None, :] & hok[:, None], other=0.0)           # [BLOCK_H, BLOCK_V]
        # Hopper's fp8 tensor cores accumulate with fewer mantissa bits than fp32 (Triton's
        # sm90 default lets the whole hidden accumulate that way: 0.35% off at H = 2048);
        # promote to the fp32 accumulator after every BLOCK_H step, as cuBLAS does.
        # (PRECISE=False keeps Triton's default, for the benchmark to show what promotion costs.)
        if PRECISE:
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_H)
        else:
            acc = tl.dot(x, w, acc)
    sx = tl.load(SX + rows, mask=rok, other=0.0)
    sw = tl.load(SW + cols, mask=cok, other=0.0)
    valid = cok[None, :] & rok[:, None]                                   # [BLOCK_M, BLOCK_V]
    logit = tl.where(valid, acc * sx[:, None] * sw[None, :], float("-inf"))
    t = tl.load(Scale).to(tl.float32)
    # each row's partial log-sum-exp over the chunk (an infinite max is not subtracted)
    m = tl.max(logit, axis=1)                                             # [BLOCK_M]
    m_safe = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    s = tl.sum(tl.where(valid, tl.exp(t * (logit - m_safe[:, None])), 0.0), axis=1)
    base = rows.to(tl.int64) * C + c
    tl.store(PartM + base, t * m, mask=rok)
    tl.store(PartS + base, s, mask=rok)
    big = V + BLOCK_V
    for j in tl.static_range(K):
        v = tl.max(logit, axis=1)
        i = tl.min(tl.where(valid & (logit == v[:, None]), cols[None, :], big), axis=1)
        tl.store(CandV + base * K + j, v, mask=rok)
        tl.store(CandI + base * K + j, i, mask=rok)
        hit = cols[None, :] == i[:, None]
        valid = valid & ~hit
        logit = tl.where(hit, float("-inf"), logit)


def _check(x8, sx, w8, sw, k, scale) -> None:
    if x8.dtype != torch.float8_e4m3fn or w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x8 and w8 must be float8_e4m3fn; got {x8.dtype} and {w8.dtype}")
    if x8.dim() != 2 or w8.dim() != 2 or x8.shape[1] != w8.shape[1]:
        raise ValueError(f"x8 must be [n, H] and w8 [V, H]; got {tuple(x8.shape)} and "
                         f"{tuple(w8.shape)}")
    n, V = x8.shape[0], w8.shape[0]
    if sx.numel() != n or sw.numel() != V:
        raise ValueError(f"scales must hold one value a row: sx {n}, sw {V}; got "
                         f"{sx.numel()} and {sw.numel()}")
    if not 1 <= k <= V:
        raise ValueError(f"k must be in [1, V={V}]; got {k}")
    if scale.numel() != 1:
        raise ValueError(f"scale must be one value (a 0-d tensor); got shape {tuple(scale.shape)}")


def fp8_lm_head_topk_torch(x8, sx, w8, sw, k: int, scale: torch.Tensor):
    """The oracle: logits = (x8 @ w8.T) * sx * sw in fp32, then `topk_logsumexp_torch`."""
    _check(x8, sx, w8, sw, k, scale)
    logits = (x8.float() @ w8.float().t()) * sx.reshape(-1, 1).float() * sw.reshape(1, -1).float()
    return topk_logsumexp_torch(logits, k, scale)


def fp8_lm_head_topk_triton(x8, sx, w8, sw, k: int, scale: torch.Tensor, block_v: int = BLOCK_V,
                            block_h: int = BLOCK_H, num_warps: int = NUM_WARPS,
                            num_stages: int = NUM_STAGES, precise: bool = True):
    """The kernels; block_v / block_h / num_warps / num_stages are tuning knobs. precise=False
    lets each dot accumulate the whole hidden in the fp8 tensor cores' narrower accumulator
    (Triton's sm90 default; measured, not used)."""
    _check(x8, sx, w8, sw, k, scale)
    if k > K_MAX:
        return fp8_lm_head_topk_torch(x8, sx, w8, sw, k, scale)
    x8 = x8 if x8.stride(1) == 1 else x8.contiguous()
    w8 = w8 if w8.stride(1) == 1 else w8.contiguous()
    (n, H), V = x8.shape, w8.shape[0]
    parts = Partials.empty(n, triton.cdiv(V, block_v), k, x8.device)
    if n:
        block_m = min(64, max(16, triton.next_power_of_2(n)))
        sx = sx.reshape(-1).float().contiguous()                     # [n]
        sw = sw.reshape(-1).float().contiguous()                     # [V]
        _fused_kernel[(parts.C, triton.cdiv(n, block_m))](
            x8, sx, w8, sw, scale.reshape(()).to(device=x8.device), *parts, n, V, H,
            x8.stride(0), w8.stride(0), parts.C, K=k, BLOCK_M=block_m, BLOCK_V=block_v,
            BLOCK_H=block_h, PRECISE=precise, num_warps=num_warps, num_stages=num_stages)
    return parts.merge(V)


@opaque_under_compile(reference=fp8_lm_head_topk_torch)
def fp8_lm_head_topk(x8, sx, w8, sw, k: int, scale: torch.Tensor, impl: str = "auto"):
    """(values [n, k] fp32, indices [n, k] int64, logsumexp(scale * logits) [n] fp32) of the
    logits (x8 @ w8.T) * sx * sw, never written: x8 [n, H] and w8 [V, H] e4m3, sx [n, 1] and
    sw [1, V] fp32 row scales (`fp8_rows`), `scale` a 0-d temperature. Ties go to the lower
    index; indices are in [0, V). impl as `topk_logsumexp`; under torch.compile an opaque op.
    With autograd recording, the torch reference runs (the kernels have no backward)."""
    if resolve_impl(impl, x8, w8) == "triton":
        return fp8_lm_head_topk_triton(x8, sx, w8, sw, k, scale)
    return fp8_lm_head_topk_torch(x8, sx, w8, sw, k, scale)
