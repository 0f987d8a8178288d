"""A Llama decoder layer's decode step at small batch (bs <= MAX_M) in four fused kernels, plus
the paged decode attention kernel as it is; torch references beside them.

At bs 1-16 a decode layer reads its weights once and does almost no arithmetic; the unfused
layer spends most of its time on ~15 launches of small kernels (norms, RoPE, the KV store,
SiLU-mul, GEMVs below bandwidth) and the gaps between them. Here a layer is:

  1. `norm_qkv_rope_store`: the previous layer's down-projection partials summed into the
     residual (fixed order), RMSNorm, q/k/v from the three weights (row views of the model's
     qkv matrix, never concatenated or copied), rotate-half RoPE on q and k, k and v written to
     the paged cache at `out_cache_loc` (padded lanes carry slot 0, the sink, as `store.py`).
  2. the paged decode attention (`attention_decode.py`, unchanged).
  3. `o_proj_residual`: h = resid + o @ wo.T.
  4. `norm_gate_up_silu`: RMSNorm of h, gate and up (row views of the gate_up matrix),
     silu(gate) * up.
  5. `down_partials`: act @ w_down.T as SPLITS fixed fp32 partials [S, M, H], no atomics: the
     next layer's kernel 1 (or `residual_norm` after the last layer) sums them in split order,
     so a replay gives the same bits every time.

GEMV shape: a program loads its whole weight tile (all of K, or its split's share, one load,
no K loop: [8, 2048] bf16 at the 1B shape), then waits for the kernel before it (programmatic
dependent launch, where available), then loops over the M rows: loads the row (L2), reduces it
against the tile held in registers, stores. The wait comes before that loop, so no load of an
activation can be hoisted above it. With PDL the weight loads of kernel n+1 overlap kernel n's
tail; every read of an activation and every write happen after the wait, and a kernel passes
its wait only once the kernel before has finished (which passed its own wait), so results and
buffer reuse follow stream order, with or without PDL. The product is a multiply-reduce on the
CUDA cores, not `tl.dot`: a whole-K dot keeps x and the tile in dot layouts and spills (ptxas
for sm_90: 1-14 KB of stack a thread at 16 rows), while the row loop at the default tiles and
8 warps compiles without spills (113-234 registers).

Rounding follows the unfused model step for step (each projection's output, the residual
adds, the normed input, silu(gate) and the product rounded to the activation dtype); only the
order of the fp32 sums differs, so results match it within the dtype's rounding.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from padgraph.errors import ContractValueError, mismatch

from .kv import resolve_impl
from .store import store_kv_reference

try:  # programmatic dependent launch: Triton >= 3.4 on CUDA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: the kernels run without PDL
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False

MAX_M = 16              # rows (requests) the kernels take: the small-batch decode steps
PROGRAM = "fused_decode"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FusedDecodePolicy:
    """How the fused kernels launch (defaults: no register spills at the 1B shape, sm_90).
    pdl: programmatic dependent launch where the GPU and Triton have it (sm_90+, Triton >= 3.4),
    else plain launches; `PADGRAPH_PDL=0` in the environment turns it off everywhere.
    down_splits: fp32 partials of the down projection (each program loads K / down_splits of
    its K, the FFN width). half_n: the qkv tile is two half_n-row slices of one head, the pairs
    RoPE mixes (`qkv_tile`). block_n: rows of a weight per program in the o, gate/up and down
    kernels. fold_max_m: up to this many rows, the next layer's qkv kernel sums the partials
    into the residual itself (each of its programs reads all of them: S*M*H*4 bytes of L2 a
    program); above it a small reduce kernel (`residual_norm`) sums them first, one launch more
    a layer. max_rows: the most decode rows the fused path takes (`takes`): on an H100 it ran a
    1B step at 1 row 2.2x faster than the eager-captured path and at 16 rows 1.8x slower (its
    GEMVs are compute-bound there; results/fused_decode.md); rows between were not measured."""
    pdl: bool = True
    max_rows: int = 1
    down_splits: int = 4
    half_n: int = 8
    block_n: int = 8
    num_warps: int = 8
    fold_max_m: int = 4


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL (the policy may still turn it off)."""
    if not _HAS_GDC or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _pdl_on(policy: FusedDecodePolicy, device: torch.device) -> bool:
    return policy.pdl and os.environ.get("PADGRAPH_PDL", "1") != "0" and pdl_supported(device)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _launch(policy: FusedDecodePolicy, device: torch.device) -> dict:
    """The launch options of a kernel call; refuses a policy the kernels cannot compile."""
    for field in ("block_n", "half_n", "num_warps"):
        if not _pow2(getattr(policy, field)):
            raise ContractValueError(mismatch(PROGRAM, None, f"policy.{field}",
                                              "a power of two", getattr(policy, field)))
    pdl = _pdl_on(policy, device)
    return dict(PDL=pdl, num_warps=policy.num_warps, num_stages=1,
                **({"launch_pdl": True} if pdl else {}))


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the fused kernels read them: views of the model's own
    tensors (q/k/v are row slices of its [Hq*D + 2*Hkv*D, H] qkv matrix, gate/up of its
    [2F, H] gate_up matrix), so nothing is copied and a weight update is seen."""
    input_norm: torch.Tensor    # [H]
    wq: torch.Tensor            # [Hq*D, H]
    wk: torch.Tensor            # [Hkv*D, H]
    wv: torch.Tensor            # [Hkv*D, H]
    wo: torch.Tensor            # [H, Hq*D]
    post_norm: torch.Tensor     # [H]
    w_gate: torch.Tensor        # [F, H]
    w_up: torch.Tensor          # [F, H]
    w_down: torch.Tensor        # [H, F]
    eps: float                  # both norms'

    @classmethod
    def of(cls, layer, n_heads: int, n_kv_heads: int, head_dim: int) -> "LayerWeights":
        """The views of a `DecoderLayer` (input_norm, attn.qkv_proj/o_proj, post_norm,
        mlp.gate_up/down)."""
        q, kv = n_heads * head_dim, n_kv_heads * head_dim
        wq, wk, wv = layer.attn.qkv_proj.weight.split((q, kv, kv))
        w_gate, w_up = layer.mlp.gate_up.weight.chunk(2)
        return cls(layer.input_norm.weight, wq, wk, wv, layer.attn.o_proj.weight,
                   layer.post_norm.weight, w_gate, w_up, layer.mlp.down.weight,
                   layer.input_norm.eps)


@dataclass(frozen=True)
class RopeTables:
    """Rotate-half RoPE tables [max_position, head_dim / 2] fp32 (the model's `Rotary`)."""
    cos: torch.Tensor
    sin: torch.Tensor


# ------------------------------------------------------------------------------ references

def rms_norm_reference(x, weight, eps: float):
    """The model's RMSNorm: fp32 math, the result in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_reference(x, rope: RopeTables, positions):
    """x [n, heads, D] rotated at positions [n] (the model's `Rotary`)."""
    cos, sin = rope.cos[positions][:, None], rope.sin[positions][:, None]   # [n, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def add_partials_reference(x, parts):
    """x + (the sum of parts [S, M, H] fp32 in split order, in x's dtype): a residual add of
    the down projection's output, rounded as the unfused layer rounds it."""
    if parts is None:
        return x
    total = parts[0].clone()
    for s in range(1, parts.shape[0]):
        total += parts[s]
    return x + total.to(x.dtype)


def norm_qkv_rope_store_reference(x, parts, w: LayerWeights, rope: RopeTables, positions, loc,
                                  k_cache, v_cache):
    """(q [M, Hq, D] roped, resid [M, H]); k (roped) and v written at slots loc."""
    resid = add_partials_reference(x, parts)
    xn = rms_norm_reference(resid, w.input_norm, w.eps)
    d = k_cache.shape[-1]
    q, k, v = (F.linear(xn, wt).view(x.shape[0], -1, d) for wt in (w.wq, w.wk, w.wv))
    store_kv_reference(k_cache, v_cache, loc, rope_reference(k, rope, positions), v)
    return rope_reference(q, rope, positions), resid


def o_proj_residual_reference(attn, wo, resid):
    """resid + attn [M, Hq*D] @ wo.T."""
    return resid + F.linear(attn, wo)


def norm_gate_up_silu_reference(h, w: LayerWeights):
    """silu(gate) * up of the RMSNormed h: [M, F]."""
    xn = rms_norm_reference(h, w.post_norm, w.eps)
    return F.silu(F.linear(xn, w.w_gate)) * F.linear(xn, w.w_up)


def split_bounds(k: int, splits: int) -> list[tuple[int, int]]:
    """The K range of each split: equal shares of cdiv(k, splits), the last one shorter."""
    per = triton.cdiv(k, splits)
    return [(s * per, min(k, (s + 1) * per)) for s in range(splits)]


def down_partials_reference(act, w_down, splits: int):
    """[S, M, H] fp32: split s is act[:, K_s] @ w_down[:, K_s].T (an empty split is zeros)."""
    out = act.new_zeros(splits, act.shape[0], w_down.shape[0], dtype=torch.float32)
    for s, (lo, hi) in enumerate(split_bounds(act.shape[1], splits)):
        if hi > lo:
            out[s] = F.linear(act[:, lo:hi].float(), w_down[:, lo:hi].float())
    return out


def residual_norm_reference(h, parts, norm_w, eps: float):
    """(resid = h + parts summed, RMSNorm(resid)): the tail after the last layer."""
    resid = add_partials_reference(h, parts)
    return resid, rms_norm_reference(resid, norm_w, eps)


# ---------------------------------------------------------------------------------- kernels

@triton.jit
def _row_times(x, w):
    """x [BLOCK_K] @ w [N, BLOCK_K].T -> [N] fp32: a multiply-reduce on the CUDA cores (a
    whole-K `tl.dot` keeps x and w in dot layouts and spills at these tile sizes)."""
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _wait_for_previous(PDL: tl.constexpr):
    """Everything above it reads weights only; everything below may read what the kernel before
    wrote. The kernel after may start its own weight loads from here on."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _residual_row(X, stride_x, Parts, m, M, offs_k, K, N_PARTS: tl.constexpr):
    """Row m [BLOCK_K] fp32 of x + (the N_PARTS fp32 partials [S, M, K] summed in order,
    rounded to x's dtype), rounded to x's dtype: the unfused residual add."""
    k_ok = offs_k < K
    x = tl.load(X + m * stride_x + offs_k, mask=k_ok, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if N_PARTS > 0:
        down = tl.zeros_like(x)
        for s in tl.static_range(N_PARTS):
            down += tl.load(Parts + (s * M + m) * K + offs_k, mask=k_ok, other=0.0)
        x = (x + down.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return x


@triton.jit
def _rms_norm_row(x, weight, K, eps):
    """x [BLOCK_K] fp32 (zero past K) * rsqrt(mean(x^2) + eps) * weight, fp32."""
    return (x * tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)) * weight


@triton.jit
def _pair_tile(W, stride_w, rows, offs_k, k_ok, HEAD_DIM: tl.constexpr):
    """(W[rows], W[rows + D/2]) [HALF, BLOCK_H] each: the row pairs RoPE mixes."""
    w1 = tl.load(W + rows[:, None] * stride_w + offs_k[None, :], mask=k_ok[None, :], other=0.0)
    w2 = tl.load(W + (rows + HEAD_DIM // 2)[:, None] * stride_w + offs_k[None, :],
                 mask=k_ok[None, :], other=0.0)
    return w1, w2


@triton.jit
def _rope_row(y1, y2, Cos, Sin, offs):
    """Rotate-half RoPE of one row's column pairs (y1, y2) [HALF] by the table entries at offs."""
    cos = tl.load(Cos + offs)
    sin = tl.load(Sin + offs)
    return y1 * cos - y2 * sin, y2 * cos + y1 * sin


@triton.jit
def _norm_qkv_kernel(X, Parts, Resid, NormW, Wq, Wk, Wv, Cos, Sin, Pos, Q, KCache, VCache, Loc,
                     M, H, n_q_heads, n_kv_heads, stride_x, stride_wq, stride_wk, stride_wv,
                     stride_cos, stride_q, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
                     eps, N_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, t_q) take q's tiles, [t_q, t_k) k's, the rest v's. A tile is columns c and
    c + D/2 of one head for HALF consecutive c: the pairs rotate-half RoPE mixes."""
    pid = tl.program_id(0)
    tiles = HEAD_DIM // 2 // HALF                                   # tiles a head
    t_q = n_q_heads * tiles
    t_k = t_q + n_kv_heads * tiles
    local = tl.where(pid < t_q, pid, tl.where(pid < t_k, pid - t_q, pid - t_k))
    head = local // tiles
    offs_c = (local % tiles) * HALF + tl.arange(0, HALF)            # [HALF] first-half columns
    offs_k = tl.arange(0, BLOCK_H)
    k_ok = offs_k < H
    rows = head * HEAD_DIM + offs_c
    if pid < t_q:                                                   # [HALF, BLOCK_H] each
        w1, w2 = _pair_tile(Wq, stride_wq, rows, offs_k, k_ok, HEAD_DIM)
    elif pid < t_k:
        w1, w2 = _pair_tile(Wk, stride_wk, rows, offs_k, k_ok, HEAD_DIM)
    else:
        w1, w2 = _pair_tile(Wv, stride_wv, rows, offs_k, k_ok, HEAD_DIM)
    norm_w = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    _wait_for_previous(PDL)

    dtype = Q.dtype.element_ty
    for m in range(M):
        x = _residual_row(X, stride_x, Parts, m, M, offs_k, H, N_PARTS)        # [BLOCK_H]
        if N_PARTS > 0:
            if pid == 0:        # one program writes the summed residual for the o kernel
                tl.store(Resid + m * H + offs_k, x.to(dtype), mask=k_ok)
        xn = _rms_norm_row(x, norm_w, H, eps).to(dtype)
        y1 = _row_times(xn, w1).to(dtype).to(tl.float32)                     # [HALF]
        y2 = _row_times(xn, w2).to(dtype).to(tl.float32)
        if pid < t_k:           # q and k: rotate-half RoPE at the row's position
            y1, y2 = _rope_row(y1, y2, Cos, Sin, tl.load(Pos + m) * stride_cos + offs_c)
        if pid < t_q:
            dst = Q + m * stride_q + head * HEAD_DIM + offs_c
        else:                   # a padded lane carries slot 0: it writes the sink
            slot = tl.load(Loc + m).to(tl.int64)
            if pid < t_k:
                dst = KCache + slot * stride_kc_s + head * stride_kc_h + offs_c
            else:
                dst = VCache + slot * stride_vc_s + head * stride_vc_h + offs_c
        tl.store(dst, y1.to(dtype))
        tl.store(dst + HEAD_DIM // 2, y2.to(dtype))


@triton.jit
def _o_residual_kernel(A, Wo, Resid, Out, M, N, K, stride_a, stride_w, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Out[:, tile] = Resid[:, tile] + A @ Wo[tile].T, BLOCK_N rows of Wo a program."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    w = tl.load(Wo + offs_n[:, None] * stride_w + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :], other=0.0)     # [BLOCK_N, BLOCK_K]
    _wait_for_previous(PDL)

    dtype = Out.dtype.element_ty
    for m in range(M):
        a = tl.load(A + m * stride_a + offs_k, mask=k_ok, other=0.0)
        y = _row_times(a, w).to(dtype).to(tl.float32)                        # [BLOCK_N]
        r = tl.load(Resid + m * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(Out + m * N + offs_n, (r + y).to(dtype), mask=n_ok)


@triton.jit
def _norm_gate_up_kernel(X, NormW, Wg, Wu, Act, M, N, H, stride_wg, stride_wu, eps,
                         BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Act[:, tile] = silu(xn @ Wg[tile].T) * (xn @ Wu[tile].T), xn = RMSNorm(X)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_H)
    n_ok, k_ok = offs_n < N, offs_k < H
    w_mask = n_ok[:, None] & k_ok[None, :]
    wg = tl.load(Wg + offs_n[:, None] * stride_wg + offs_k[None, :], mask=w_mask, other=0.0)
    wu = tl.load(Wu + offs_n[:, None] * stride_wu + offs_k[None, :], mask=w_mask, other=0.0)
    norm_w = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    _wait_for_previous(PDL)

    dtype = Act.dtype.element_ty
    for m in range(M):
        x = tl.load(X + m * H + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        xn = _rms_norm_row(x, norm_w, H, eps).to(dtype)
        g = _row_times(xn, wg).to(dtype).to(tl.float32)                      # [BLOCK_N]
        u = _row_times(xn, wu).to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        tl.store(Act + m * N + offs_n, (silu * u).to(dtype), mask=n_ok)


@triton.jit
def _down_partials_kernel(A, Wd, Parts, M, N, K, k_per_split, stride_a, stride_w,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Parts[s, :, tile] = A[:, K_s] @ Wd[tile, K_s].T in fp32: program (tile, s)."""
    s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = s * k_per_split + tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    k_ok = (offs_k < K) & (offs_k < (s + 1) * k_per_split)
    w = tl.load(Wd + offs_n[:, None] * stride_w + offs_k[None, :],
                mask=n_ok[:, None] & k_ok[None, :], other=0.0)      # [BLOCK_N, BLOCK_K]
    _wait_for_previous(PDL)

    for m in range(M):
        a = tl.load(A + m * stride_a + offs_k, mask=k_ok, other=0.0)
        tl.store(Parts + (s * M + m) * N + offs_n, _row_times(a, w), mask=n_ok)


@triton.jit
def _residual_norm_kernel(X, Parts, Resid, Out, NormW, M, H, stride_x, eps,
                          N_PARTS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Row m: Resid = X + Parts summed, Out = RMSNorm(Resid) (the tail after the last layer)."""
    m = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_H)
    k_ok = offs_k < H
    norm_w = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    _wait_for_previous(PDL)

    x = _residual_row(X, stride_x, Parts, m, M, offs_k, H, N_PARTS)         # [BLOCK_H]
    dtype = Out.dtype.element_ty
    tl.store(Resid + m * H + offs_k, x.to(dtype), mask=k_ok)
    tl.store(Out + m * H + offs_k, _rms_norm_row(x, norm_w, H, eps).to(dtype), mask=k_ok)


# ---------------------------------------------------------------------------------- wrappers

def _check_rows(what: str, x: torch.Tensor, kernel: bool) -> None:
    """x [M, K] with rows contiguous; for the kernels also 1 <= M <= MAX_M in fp16 / bf16 (the
    references take any M and dtype)."""
    if x.dim() != 2 or x.stride(1) != 1 or (kernel and not 1 <= x.shape[0] <= MAX_M):
        raise ContractValueError(mismatch(PROGRAM, what, "shape", f"[M, K] with 1 <= M <= "
                                          f"{MAX_M} and rows contiguous", tuple(x.shape)))
    if kernel and x.dtype not in KERNEL_DTYPES:
        raise ContractValueError(mismatch(PROGRAM, what, "dtype", KERNEL_DTYPES, x.dtype))


def _check_weight(what: str, w: torch.Tensor, n: int | None, k: int, dtype) -> None:
    want = (n if n is not None else w.shape[0], k)
    if w.dim() != 2 or tuple(w.shape) != want or w.stride(1) != 1 or w.dtype != dtype:
        raise ContractValueError(mismatch(PROGRAM, what, "weight", f"{want} {dtype} with rows "
                                          "contiguous", f"{tuple(w.shape)} {w.dtype} strides "
                                          f"{w.stride()}"))


def _check_parts(parts, m: int, h: int) -> None:
    if parts is not None and (parts.dim() != 3 or tuple(parts.shape[1:]) != (m, h)
                              or parts.dtype != torch.float32 or not parts.is_contiguous()):
        raise ContractValueError(mismatch(PROGRAM, "parts", "partials", f"[S, {m}, {h}] fp32 "
                                          "contiguous", f"{tuple(parts.shape)} {parts.dtype}"))


def qkv_tile(head_dim: int, half_n: int) -> int:
    """The qkv kernel's half-tile: the largest power of two <= half_n that divides head_dim / 2
    (a tile never straddles two heads, so RoPE's pairs stay in one program)."""
    if head_dim < 2 or head_dim % 2:
        raise ContractValueError(mismatch(PROGRAM, "k_cache", "head_dim", "even (rotate-half "
                                          "RoPE pairs column c with c + head_dim / 2)", head_dim))
    half = 1
    while half * 2 <= half_n and (head_dim // 2) % (half * 2) == 0:
        half *= 2
    return half


def norm_qkv_rope_store(x, parts, w: LayerWeights, rope: RopeTables, positions, loc, k_cache,
                        v_cache, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                        impl: str = "auto"):
    """x [M, H] (+ parts [S, M, H] fp32, the previous layer's down projection, or None) ->
    (q [M, Hq, D] roped, resid [M, H]); k (roped) and v written at slots loc [M] of
    k_cache / v_cache [n_slots, Hkv, D]."""
    kernel = resolve_impl(impl, x, k_cache, v_cache, loc) != "torch"
    _check_rows("x", x, kernel)
    m, h = x.shape
    _check_parts(parts, m, h)
    d = k_cache.shape[-1]
    n_q, n_kv = w.wq.shape[0] // d, k_cache.shape[1]
    for name, wt, n in (("wq", w.wq, n_q * d), ("wk", w.wk, n_kv * d), ("wv", w.wv, n_kv * d)):
        _check_weight(name, wt, n, h, x.dtype)
    if not kernel:
        return norm_qkv_rope_store_reference(x, parts, w, rope, positions, loc, k_cache, v_cache)
    half = qkv_tile(d, policy.half_n)
    q = torch.empty(m, n_q, d, dtype=x.dtype, device=x.device)
    resid = x if parts is None else torch.empty_like(x)
    grid = ((n_q + 2 * n_kv) * (d // 2 // half),)
    _norm_qkv_kernel[grid](
        x, parts if parts is not None else x, resid, w.input_norm, w.wq, w.wk, w.wv, rope.cos,
        rope.sin, positions, q, k_cache, v_cache, loc, m, h, n_q, n_kv, x.stride(0),
        w.wq.stride(0), w.wk.stride(0), w.wv.stride(0), rope.cos.stride(0), q.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), w.eps,
        N_PARTS=0 if parts is None else parts.shape[0], HEAD_DIM=d, HALF=half,
        BLOCK_H=triton.next_power_of_2(h), **_launch(policy, x.device))
    return q, resid


def o_proj_residual(attn, wo, resid, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                    impl: str = "auto"):
    """resid [M, H] + attn [M, Hq*D] @ wo [H, Hq*D].T -> h [M, H]."""
    kernel = resolve_impl(impl, attn, wo, resid) != "torch"
    _check_rows("attn", attn, kernel)
    m, k = attn.shape
    _check_weight("wo", wo, None, k, attn.dtype)
    n = wo.shape[0]
    if tuple(resid.shape) != (m, n) or not resid.is_contiguous() or resid.dtype != attn.dtype:
        raise ContractValueError(mismatch(PROGRAM, "resid", "residual", f"[{m}, {n}] "
                                          f"{attn.dtype} contiguous", tuple(resid.shape)))
    if not kernel:
        return o_proj_residual_reference(attn, wo, resid)
    out = torch.empty_like(resid)
    _o_residual_kernel[(triton.cdiv(n, policy.block_n),)](
        attn, wo, resid, out, m, n, k, attn.stride(0), wo.stride(0), BLOCK_N=policy.block_n,
        BLOCK_K=triton.next_power_of_2(k), **_launch(policy, attn.device))
    return out


def norm_gate_up_silu(h, w: LayerWeights, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                      impl: str = "auto"):
    """silu(gate) * up of RMSNorm(h [M, H]) -> act [M, F]."""
    kernel = resolve_impl(impl, h, w.w_gate, w.w_up) != "torch"
    _check_rows("h", h, kernel)
    m, k = h.shape
    _check_weight("w_gate", w.w_gate, None, k, h.dtype)
    _check_weight("w_up", w.w_up, w.w_gate.shape[0], k, h.dtype)
    if not kernel:
        return norm_gate_up_silu_reference(h, w)
    n = w.w_gate.shape[0]
    act = torch.empty(m, n, dtype=h.dtype, device=h.device)
    _norm_gate_up_kernel[(triton.cdiv(n, policy.block_n),)](
        h.contiguous(), w.post_norm, w.w_gate, w.w_up, act, m, n, k, w.w_gate.stride(0),
        w.w_up.stride(0), w.eps, BLOCK_N=policy.block_n, BLOCK_H=triton.next_power_of_2(k),
        **_launch(policy, h.device))
    return act


def down_partials(act, w_down, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                  impl: str = "auto"):
    """act [M, F] @ w_down [H, F].T as policy.down_splits fp32 partials [S, M, H] (the sum in
    split order is the projection; `split_bounds` gives each split's K range)."""
    kernel = resolve_impl(impl, act, w_down) != "torch"
    _check_rows("act", act, kernel)
    m, k = act.shape
    _check_weight("w_down", w_down, None, k, act.dtype)
    splits = policy.down_splits
    if splits < 1:
        raise ContractValueError(mismatch(PROGRAM, None, "policy.down_splits", ">= 1", splits))
    if not kernel:
        return down_partials_reference(act, w_down, splits)
    n = w_down.shape[0]
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=act.device)
    per = triton.cdiv(k, splits)
    _down_partials_kernel[(triton.cdiv(n, policy.block_n), splits)](
        act, w_down, parts, m, n, k, per, act.stride(0), w_down.stride(0),
        BLOCK_N=policy.block_n, BLOCK_K=triton.next_power_of_2(per), **_launch(policy, act.device))
    return parts


def residual_norm(h, parts, norm_w, eps: float, *,
                  policy: FusedDecodePolicy = FusedDecodePolicy(), impl: str = "auto"):
    """(resid = h [M, H] + parts [S, M, H] summed in order, RMSNorm(resid) with norm_w)."""
    kernel = resolve_impl(impl, h, norm_w) != "torch"
    _check_rows("h", h, kernel)
    m, k = h.shape
    _check_parts(parts, m, k)
    if not kernel:
        return residual_norm_reference(h, parts, norm_w, eps)
    resid, out = (torch.empty(m, k, dtype=h.dtype, device=h.device) for _ in range(2))
    _residual_norm_kernel[(m,)](
        h, parts if parts is not None else h, resid, out, norm_w, m, k, h.stride(0), eps,
        N_PARTS=0 if parts is None else parts.shape[0], BLOCK_H=triton.next_power_of_2(k),
        **_launch(policy, h.device))
    return resid, out


# ------------------------------------------------------------------------------- the layers

AttendFn = Callable[..., torch.Tensor]      # (q [M, Hq, D], k_cache, v_cache) -> [M, Hq, D]


def takes(model, input_ids: torch.Tensor, kv, policy: FusedDecodePolicy | None = None) -> bool:
    """Whether `decode_hidden` runs `model`'s decode step of these tokens in the fused kernels:
    1..MAX_M tokens (and at most `policy.max_rows` where a policy is given), fp16 / bf16 weights
    with the caches in the same dtype, an even head_dim. Elsewhere (more rows, fp32) the caller
    keeps its own path."""
    dtype = model.embed.weight.dtype
    most = MAX_M if policy is None else min(MAX_M, policy.max_rows)
    return (1 <= input_ids.shape[0] <= most and dtype in KERNEL_DTYPES
            and kv.k[0].dtype == dtype and kv.v[0].dtype == dtype and model.cfg.head_dim % 2 == 0)


def decode_layer(x, parts, w: LayerWeights, rope: RopeTables, positions, loc, k_cache, v_cache,
                 attend: AttendFn, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                 impl: str = "auto"):
    """One decoder layer: (x [M, H], the previous layer's down partials or None) -> (h [M, H],
    this layer's down partials [S, M, H]); the layer's output is h + the partials summed."""
    if parts is not None and x.shape[0] > policy.fold_max_m:
        x, parts = residual_norm(x, parts, w.input_norm, w.eps, policy=policy, impl=impl)[0], None
    q, resid = norm_qkv_rope_store(x, parts, w, rope, positions, loc, k_cache, v_cache,
                                   policy=policy, impl=impl)
    o = attend(q, k_cache, v_cache)                                          # [M, Hq, D]
    h = o_proj_residual(o.reshape(o.shape[0], -1), w.wo, resid, policy=policy, impl=impl)
    act = norm_gate_up_silu(h, w, policy=policy, impl=impl)                  # [M, F]
    return h, down_partials(act, w.w_down, policy=policy, impl=impl)


def layer_weights(model) -> list[LayerWeights]:
    """The fused kernels' views of every layer of a `LlamaModel`-shaped model."""
    cfg = model.cfg
    return [LayerWeights.of(layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
            for layer in model.layers]


def decode_hidden(model, input_ids, positions, out_cache_loc, kv, attend: AttendFn, *,
                  policy: FusedDecodePolicy = FusedDecodePolicy(), impl: str = "auto"):
    """The final-normed hidden [M, H] of a decode step (what `LlamaModel._run` returns for a
    decode batch), every layer in `decode_layer`; K/V written at out_cache_loc of kv.k/kv.v."""
    rope = RopeTables(model.rope.cos, model.rope.sin)
    x, parts = model.embed(input_ids), None                                  # [M, H]
    for i, w in enumerate(layer_weights(model)):
        x, parts = decode_layer(x, parts, w, rope, positions, out_cache_loc, kv.k[i], kv.v[i],
                                attend, policy=policy, impl=impl)
    return residual_norm(x, parts, model.norm.weight, model.norm.eps, policy=policy,
                         impl=impl)[1]
