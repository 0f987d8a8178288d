"""y = x @ w.T for a few rows of x: the small-batch linear layers of a decode step.

At bs 1-16 a decode step's linear layers are matrix-vector products: each reads its whole
weight once and does almost no arithmetic, so they should stream at the GPU's memory bandwidth.
cuBLAS does that for the large ones and not for the small ones: on an H200 the 1B model's qkv
(3072 x 2048) and o (2048 x 2048) projections read at about a third to a half of copy bandwidth
at bs 1 and the down projection (2048 x 8192) at about 0.6 of it, while gate_up and the lm_head
come near it (`results/gemv.md`).

`gemv` is a candidate for those: grid (cdiv(N, BLOCK_N), SPLIT_K). A program takes BLOCK_N rows
of w (output columns) and a 1 / SPLIT_K share of K, loads a [BLOCK_N, BLOCK_K] tile of w and the
[BLOCK_M, BLOCK_K] tile of x per step (x's rows past M masked to 0), accumulates x @ w_tile.T in
fp32 (`tl.dot`, BLOCK_M = 16, the smallest dot; bf16 operands are upcast only under the CPU
interpreter, whose bf16 dot is wrong) and either stores the result (SPLIT_K = 1) or
adds it into an fp32 workspace with atomics, which a second pass casts to the output dtype. More
splits put more programs on the SMs for the small matrices (2048 output columns at BLOCK_N 16
are 128 programs, fewer than an H200's 132 SMs can hide latency with).

Not wired into the models as such: `grouped_linear.py` takes its tiles for one launch over
several weights that read one input, which is where the gain is. Alone (`bench.bench_gemv`,
`results/gemv.md`) it is slower than F.linear on qkv and level with it (within 3%) on o,
gate_up, down and the lm_head; the 1B step's GEMMs as one CUDA graph gain 3% with each shape's
faster kernel at bs 1, not worth a custom op in the compiled bodies. Both stop at ~6 us for the
8-12 MB qkv / o weights: a kernel's ramp and tail, not its tile. `pdl=True` (programmatic
dependent launch, the first weight tile requested before waiting for the kernel before, the
next kernel released at the start) made the chain of one-split calls about 1.5x slower, not
faster (which of its two changes costs that, the early release or the hand prefetch in place
of Triton's pipelined loads, was not separated).
The torch reference (`impl="torch"`, and the CPU) is `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl as _pdl
from .attention_decode import mma, upcast_dots
from .kv import resolve_impl

MAX_M = 16  # rows of x a call takes: one BLOCK_M tile


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
                 PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # this split's share of K, whole BLOCK_K tiles (the last split may get fewer or none)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_lo = pid_k * per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PREFETCH:  # w one tile ahead; the first tile is requested before the wait below
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        w_next = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                         mask=n_ok[:, None] & (offs_k < k_hi)[None, :], other=0.0)
    if PDL:
        # launched as a programmatic dependent of the kernel before: the weight does not depend
        # on it, so its first tile is in flight while this waits for that kernel's results (x);
        # the kernel after may start its own weight loads once every program here has begun
        _pdl.launch_dependents()
        _pdl.wait()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if PREFETCH:  # the tile requested one step ahead; request the next
            w = w_next
            offs_k2 = offs_k + BLOCK_K
            w_next = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k2[None, :],
                             mask=n_ok[:, None] & (offs_k2 < k_hi)[None, :], other=0.0)
        else:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += mma(x, tl.trans(w), UPCAST)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ws_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


def gemv(x: torch.Tensor, w: torch.Tensor, *, block_n: int = 16, block_k: int = 256,
         split_k: int = 1, num_warps: int = 4, num_stages: int = 4, pdl: bool = False,
         impl: str = "auto") -> torch.Tensor:
    """x [M, K] (M <= MAX_M) @ w [N, K].T -> [M, N] in x's dtype, fp32 accumulation.

    w's rows must be contiguous (stride(1) == 1), as an nn.Linear weight's are. split_k > 1
    accumulates through an fp32 workspace (atomics: the sum's order, hence its last bits, may
    differ between calls). pdl: the kernel requests its first weight tile before it waits for
    the kernel before it, and lets the kernel after it start early, launched as a programmatic
    dependent launch where `pdl.supported(x.device)` (else a plain launch, the prefetch kept;
    split_k 1 only: a split call's workspace is zeroed and copied by kernels of its own;
    measured slower than without it in the 1B chain, see above).
    impl: "auto" (Triton on CUDA tensors), "triton", "torch"."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv takes x [M, K] and w [N, K]; got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"gemv takes at most {MAX_M} rows of x; got {x.shape[0]}")
    if w.stride(1) != 1:
        raise ValueError("gemv needs w's rows contiguous (w.stride(1) == 1)")
    pow2 = not (block_n & (block_n - 1) or block_k & (block_k - 1))
    if split_k < 1 or block_n < 16 or block_k < 16 or not pow2:
        raise ValueError(f"split_k >= 1, block_n and block_k powers of two >= 16; got {split_k}, "
                         f"{block_n}, {block_k}")
    if pdl and split_k != 1:
        raise ValueError("gemv(pdl=True) takes split_k 1")
    if resolve_impl(impl, x, w) == "torch":
        return F.linear(x, w)
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    grid = (triton.cdiv(n, block_n), split_k)
    on = pdl and _pdl.supported(x.device)
    _gemv_kernel[grid](x, w, y, ws, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                       BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                       UPCAST=upcast_dots(x.dtype), PREFETCH=pdl, PDL=on,
                       num_warps=num_warps, num_stages=num_stages,
                       **_pdl.launch_options(x.device, on))
    if split_k > 1:
        y.copy_(ws)
    return y
