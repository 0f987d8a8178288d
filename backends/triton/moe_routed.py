"""Routed MoE experts for decode-sized batches: only the experts the router picked are read;
the torch reference beside the kernels.

A dense masked MoE (`llm/models/deepseek.py`) runs every expert on every token and zeroes what
the router did not pick: graph-safe, but each step streams all n_experts weight slices. Here,
for T tokens with top-k experts each, the programs are indexed by (token, slot in the top-k,
output tile) and read the slice of the expert that `topk_ids[token, slot]` names, loaded on the
device: no host sync, no data-dependent shape (the grid is T * k * tiles, fixed for a given T),
so a CUDA graph captured at one T replays for any routing. Each grid is one axis, T * k (or T)
rows times their output tiles, a row's tiles adjacent: CUDA's second and third grid axes stop at
65535 rows, which a routed prefill's T * k passes. Three launches:

  1. `_gate_up_kernel`: act[t*k + j] = silu(x[t] @ Wg[e]) * (x[t] @ Wu[e]), e = topk_ids[t, j]
     (gate_up[e] is [hidden, 2F]: gate in its first F columns, up in the last F).
  2. `_down_kernel`: y[t*k + j] = act[t*k + j] @ down[e]   ([F, hidden] a slice).
  3. `_combine_kernel`: out[t] = sum over j = 0 .. k-1, in that order, of w[t, j] * y[t*k + j].

Each program owns its outputs and sums in one fixed order (no atomics, no split reductions), so
replays give the same bits. Rounding follows the dense masked path step for step: gate and up,
silu(gate), the product, each expert's output and each weight are rounded to the activation
dtype, sums accumulate in fp32, and the result is rounded once; only the order of the fp32 sums
differs (the dense path sums over all experts, zeros included), so the two agree within the
dtype's rounding.

Padded token rows route like any other (the router's own top-k gives in-range ids); ids are
clamped into [0, n_experts) before any address is formed, so no id can read out of bounds.
Expert offsets are computed in int64 (n_experts * hidden * 2F passes 2^31 at DeepSeek-V3 sizes).

Bytes: a step reads T * k expert slices (programs of tokens that share an expert read the same
slice, which L2 may serve once), against n_experts for the dense path; the caller chooses the
routed path only while T * k is small against n_experts (`MoePolicy` in the model).

Under torch.compile the function is the opaque custom op `padgraph::routed_experts`
(compile_ops.py): a traced decoder layer keeps the kernels (inductor would otherwise compile the
reference, whose gather copies every picked slice before its matmul).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from padgraph.errors import ContractTypeError, ContractValueError

from .compile_ops import opaque_under_compile
from .kv import resolve_impl

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class RoutedTiles:
    """How the kernels tile (powers of two). block_f: gate columns (and as many up columns) a
    kernel-1 program; block_h: output columns a kernel-2 program; block_k: the K step of both
    loops; combine_h: output columns a kernel-3 program; num_warps: every kernel's. The
    defaults compile for sm_90 without spills (ptxas, Triton 3.6: 72, 40 and 31 registers) and
    give the `lite` preset's one-token step 264 and 384 programs in kernels 1 and 2 (top-6, FFN
    1408, hidden 2048); `bench/bench_moe.py --tiles` times others."""
    block_f: int = 32
    block_h: int = 32
    block_k: int = 128
    combine_h: int = 256
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_f", "block_h", "block_k", "combine_h", "num_warps"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
                raise ContractValueError(f"RoutedTiles.{name} must be a power of two, got {v!r}")


TILES = RoutedTiles()


# ------------------------------------------------------------------------------ reference

def routed_experts_reference(x, topk_ids, topk_weights, gate_up, down):
    """out [T, hidden] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), slots in order.

    x [T, hidden]; topk_ids [T, k] int (clamped into [0, n_experts)); topk_weights [T, k]
    (rounded to x's dtype, as the dense path's combine matrix is); gate_up [E, hidden, 2F];
    down [E, F, hidden]. Each picked slice is gathered (a copy): the oracle, the CPU path and
    the path with autograd."""
    ids = topk_ids.long().clamp(0, gate_up.shape[0] - 1)                   # [T, k]
    xe = x[:, None, None, :].expand(-1, ids.shape[1], 1, -1)                # [T, k, 1, hidden]
    gate, up = torch.matmul(xe, gate_up[ids]).squeeze(2).chunk(2, dim=-1)   # [T, k, F] each
    act = F.silu(gate) * up
    y = torch.matmul(act[:, :, None, :], down[ids]).squeeze(2)              # [T, k, hidden]
    w = topk_weights.to(x.dtype).float()                                    # [T, k]
    out = y[:, 0].float() * w[:, 0, None]
    for j in range(1, ids.shape[1]):                                        # slot order
        out = out + y[:, j].float() * w[:, j, None]
    return out.to(x.dtype)


# -------------------------------------------------------------------------------- kernels

@triton.jit
def _expert(Ids, pid_s, K_TOP, N_EXPERTS, stride_it):
    """The expert of program row pid_s = token * K_TOP + slot, clamped into range, as int64."""
    e = tl.load(Ids + (pid_s // K_TOP) * stride_it + pid_s % K_TOP)
    return tl.minimum(tl.maximum(e, 0), N_EXPERTS - 1).to(tl.int64)


@triton.jit
def _gate_up_kernel(X, Ids, W, Act, F, H, K_TOP, N_EXPERTS, stride_xt, stride_it, stride_we,
                    stride_wh, stride_at, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr):
    """Act[pid_s, f tile] = silu(x @ Wg[e]) * (x @ Wu[e]) for row pid_s = token * K_TOP + slot
    (program pid_s * n_tiles + pid_f)."""
    n_tiles = tl.cdiv(F, BLOCK_F)
    pid = tl.program_id(0)
    pid_f = pid % n_tiles
    pid_s = (pid // n_tiles).to(tl.int64)           # row offsets in int64: T * k * F may pass 2**31
    e = _expert(Ids, pid_s, K_TOP, N_EXPERTS, stride_it)
    offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = offs_f < F
    x_row = X + (pid_s // K_TOP) * stride_xt
    w_gate = W + e * stride_we + offs_f[None, :]                        # up: F columns on
    acc_g = tl.zeros([BLOCK_F], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_F], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        ptr = w_gate + offs_k[:, None] * stride_wh                      # [BLOCK_K, BLOCK_F]
        ok = k_ok[:, None] & f_ok[None, :]
        wg = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
        wu = tl.load(ptr + F, mask=ok, other=0.0).to(tl.float32)
        acc_g += tl.sum(x[:, None] * wg, axis=0)
        acc_u += tl.sum(x[:, None] * wu, axis=0)
    dt = Act.dtype.element_ty                       # each step rounded as the dense path's
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(Act + pid_s * stride_at + offs_f, (silu * up).to(dt), mask=f_ok)


@triton.jit
def _down_kernel(Act, Ids, W, Y, F, H, K_TOP, N_EXPERTS, stride_at, stride_it, stride_we,
                 stride_wf, stride_ys, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[pid_s, h tile] = Act[pid_s] @ down[e] for row pid_s = token * K_TOP + slot (program
    pid_s * n_tiles + pid_h)."""
    n_tiles = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    pid_h = pid % n_tiles
    pid_s = (pid // n_tiles).to(tl.int64)
    e = _expert(Ids, pid_s, K_TOP, N_EXPERTS, stride_it)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    w_base = W + e * stride_we + offs_h[None, :]
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < F
        a = tl.load(Act + pid_s * stride_at + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_base + offs_k[:, None] * stride_wf, mask=k_ok[:, None] & h_ok[None, :],
                    other=0.0).to(tl.float32)                           # [BLOCK_K, BLOCK_H]
        acc += tl.sum(a[:, None] * w, axis=0)
    tl.store(Y + pid_s * stride_ys + offs_h, acc.to(Y.dtype.element_ty), mask=h_ok)


@triton.jit
def _combine_kernel(Y, Wt, Out, H, K_TOP, stride_ys, stride_wt, stride_ot,
                    BLOCK_H: tl.constexpr):
    """Out[t, h tile] = sum over slots j in order of round(w[t, j]) * Y[t * K_TOP + j] (program
    t * n_tiles + pid_h)."""
    n_tiles = tl.cdiv(H, BLOCK_H)
    pid = tl.program_id(0)
    pid_h = pid % n_tiles
    tok = (pid // n_tiles).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    dt = Out.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(0, K_TOP):
        w = tl.load(Wt + tok * stride_wt + j).to(dt).to(tl.float32)
        y = tl.load(Y + (tok * K_TOP + j) * stride_ys + offs_h, mask=h_ok, other=0.0)
        acc += w * y.to(tl.float32)
    tl.store(Out + tok * stride_ot + offs_h, acc.to(dt), mask=h_ok)


# ------------------------------------------------------------------------------ host side

def check_routed_args(x, topk_ids, topk_weights, gate_up, down) -> None:
    """x [T, hidden]; topk_ids, topk_weights [T, k]; gate_up [E, hidden, 2F]; down [E, F,
    hidden]; weights in x's dtype, ids an integer dtype."""
    if x.dim() != 2:
        raise ContractValueError(f"routed_experts: x must be [n_tokens, hidden], got {tuple(x.shape)}")
    n, hidden = x.shape
    if gate_up.dim() != 3 or gate_up.shape[1] != hidden or gate_up.shape[2] % 2:
        raise ContractValueError(f"routed_experts: gate_up must be [n_experts, hidden={hidden}, 2 * F], "
                                 f"got {tuple(gate_up.shape)}")
    n_exp, ffn = gate_up.shape[0], gate_up.shape[2] // 2
    if tuple(down.shape) != (n_exp, ffn, hidden):
        raise ContractValueError(f"routed_experts: down must be [n_experts, F, hidden] = "
                                 f"{(n_exp, ffn, hidden)} for gate_up {tuple(gate_up.shape)}, "
                                 f"got {tuple(down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or not 0 < topk_ids.shape[1] <= n_exp:
        raise ContractValueError(f"routed_experts: topk_ids must be [n_tokens={n}, k] with 1 <= k <= "
                                 f"n_experts={n_exp}, got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ContractValueError(f"routed_experts: topk_weights must be {tuple(topk_ids.shape)} (as "
                                 f"topk_ids), got {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ContractTypeError(f"routed_experts: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ContractTypeError(f"routed_experts: gate_up and down must be x's dtype {x.dtype}, got "
                                f"{gate_up.dtype} and {down.dtype}")


def kernel_takes(x, topk_ids, topk_weights, gate_up, down) -> bool:
    """Whether the kernels run these arguments (else the reference does): a kernel dtype, no
    autograd, rows with unit stride along their last dim (weights, x, the ids and weights)."""
    return (x.dtype in KERNEL_DTYPES and x.shape[0] > 0
            and all(t.stride(-1) == 1 for t in (x, topk_ids, topk_weights, gate_up, down)))


def _checked_reference(x, topk_ids, topk_weights, gate_up, down):
    """The reference after the kernels' argument checks: what runs where autograd records."""
    check_routed_args(x, topk_ids, topk_weights, gate_up, down)
    return routed_experts_reference(x, topk_ids, topk_weights, gate_up, down)


@opaque_under_compile(reference=_checked_reference)
def routed_experts(x, topk_ids, topk_weights, gate_up, down, impl="auto"):
    """Routed experts, only the picked slices read: x [T, hidden], topk_ids / topk_weights [T, k]
    (the router's picks and their combine weights), gate_up [E, hidden, 2F], down [E, F, hidden]
    -> [T, hidden] in x's dtype, equal to `routed_experts_reference` within the dtype's
    rounding. impl: "auto" (the kernels on CUDA, the reference elsewhere), "triton", "torch"."""
    check_routed_args(x, topk_ids, topk_weights, gate_up, down)
    if (resolve_impl(impl, x, topk_ids, topk_weights, gate_up, down) == "torch"
            or not kernel_takes(x, topk_ids, topk_weights, gate_up, down)):
        return routed_experts_reference(x, topk_ids, topk_weights, gate_up, down)
    return launch_routed(x, topk_ids, topk_weights, gate_up, down, TILES)


def launch_routed(x, topk_ids, topk_weights, gate_up, down, tiles: RoutedTiles = TILES):
    """The three kernels on arguments `kernel_takes` accepts (checked by the caller), tiled as
    `tiles` says: `routed_experts`' kernel path, public for a tile sweep."""
    (n, hidden), (n_exp, ffn), k = x.shape, down.shape[:2], topk_ids.shape[1]
    act = torch.empty(n * k, ffn, dtype=x.dtype, device=x.device)             # [T*k, F]
    y = torch.empty(n * k, hidden, dtype=x.dtype, device=x.device)            # [T*k, hidden]
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)              # [T, hidden]
    warps = tiles.num_warps
    _gate_up_kernel[(triton.cdiv(ffn, tiles.block_f) * n * k,)](
        x, topk_ids, gate_up, act, ffn, hidden, k, n_exp, x.stride(0), topk_ids.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0), BLOCK_F=tiles.block_f,
        BLOCK_K=tiles.block_k, num_warps=warps)
    _down_kernel[(triton.cdiv(hidden, tiles.block_h) * n * k,)](
        act, topk_ids, down, y, ffn, hidden, k, n_exp, act.stride(0), topk_ids.stride(0),
        down.stride(0), down.stride(1), y.stride(0), BLOCK_H=tiles.block_h,
        BLOCK_K=tiles.block_k, num_warps=warps)
    _combine_kernel[(triton.cdiv(hidden, tiles.combine_h) * n,)](
        y, topk_weights, out, hidden, k, y.stride(0), topk_weights.stride(0), out.stride(0),
        BLOCK_H=tiles.combine_h, num_warps=warps)
    return out
