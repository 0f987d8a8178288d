"""The fused decode step's tail: final RMSNorm + lm_head + argmax in two launches, and the
whole step (`decode_step`) as the model runs it; torch references beside them.

Unfused, a greedy step's tail is the final norm, the lm_head GEMM (writes [M, V] bf16), the
fp32 upcast (writes [M, V] fp32), the argmax and the top-2 (read them back). Here:

  1. `_lm_head_kernel`, grid (C = cdiv(V, BLOCK_V), row blocks of BM rows: 16, 32 or 64,
     `fused_decode.row_block`): a program normalizes the rows on the fly (x and its rows' sums
     of squares as fixed-order partials, as `fused_decode`'s tensor-core kernels do), streams
     its BLOCK_V rows of the lm_head through the tensor-core K loop (`fused_decode.mma_rows`;
     weights loaded before the PDL wait, the wait before the loop), rounds the logits to the
     weight dtype (the model's lm_head output) and writes, per row, its chunk's (max, index of
     the first max, second value): NaN ranks above everything, as in torch.argmax. Chunk 0
     also writes the normed hidden. With `logits=True` (the sampling path) it writes the fp32
     logits instead and nothing else.
  2. `_argmax_reduce_kernel`, one program a row: the C partials merged in chunk order (the
     first NaN, else the first maximum), so the id is `logits.argmax(-1)` of the same logits,
     and top-1 minus top-2 is `logits.topk(2)`'s gap.

No atomics, every sum in one order: replays give the same bits. The sampler (`padgraph.llm.
sampling.sample`) is not reimplemented: a sampled step takes the logits of `logits=True`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from padgraph.errors import ContractValueError, mismatch

from . import fused_decode as fd
from . import pdl
from .kv import resolve_impl

PROGRAM = "fused_tail"


@dataclass(frozen=True)
class TailOut:
    """What a fused step's tail gives: hidden [M, H] (final-normed, the draft heads' input);
    with logits=True, logits [M, V] fp32 (ids and gap None); else ids [M] int64 (argmax of the
    logits) and gap [M] fp32 (their top-1 minus top-2 value), logits None."""
    hidden: torch.Tensor
    logits: torch.Tensor | None
    ids: torch.Tensor | None
    gap: torch.Tensor | None


# ------------------------------------------------------------------------------ references

def greedy_reference(logits: torch.Tensor):
    """(logits.argmax(-1), top-1 minus top-2 of each row): what the greedy decode body reads."""
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(-1), top2[:, 0] - top2[:, 1]


def lm_head_tail_reference(x, norm_w, eps: float, weight, *, logits: bool) -> TailOut:
    """The model's tail on the residual x [M, H]: hidden = RMSNorm(x), logits = (hidden @
    weight.T).float() (`LlamaModel.logits`), and the greedy ids and gap of them."""
    hidden = fd.rms_norm_reference(x, norm_w, eps)
    out = F.linear(hidden, weight).float()
    if logits:
        return TailOut(hidden, out, None, None)
    return TailOut(hidden, None, *greedy_reference(out))


# ---------------------------------------------------------------------------------- kernels

@triton.jit
def _chunk_top2(logit, cols, valid):
    """Per column m of logit [BLOCK_V, BM] (rows: vocab ids cols, valid where < V): (the
    maximum, the first id holding it, the largest value at any other id); NaN is the maximum
    (the first NaN's id), as torch.argmax ranks it."""
    big = 2147483647
    nan = (logit != logit) & valid
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0                           # [BM]
    clean = tl.where(nan | ~valid, float("-inf"), logit)
    top = tl.max(clean, axis=0)
    first = tl.min(tl.where(valid & (clean == top[None, :]), cols, big), axis=0)
    first_nan = tl.min(tl.where(nan, cols, big), axis=0)
    idx = tl.where(has_nan, first_nan, first)
    second = tl.max(tl.where(cols == idx[None, :], float("-inf"), clean), axis=0)
    return tl.where(has_nan, float("nan"), top), idx, second


@triton.jit
def _lm_head_kernel(X, Ssq, NormW, W, Hidden, Logits, Top, Idx, Second, M, V, H, n_ssq, C,
                    stride_x, stride_w, eps, BLOCK_V: tl.constexpr, BM: tl.constexpr,
                    BK: tl.constexpr, BLOCK_P: tl.constexpr, LOGITS: tl.constexpr,
                    F32: tl.constexpr, PDL: tl.constexpr, REP: tl.constexpr = 2,
                    ROWS_M: tl.constexpr = False):
    """Program (c, rb): logits of vocab rows [c*BLOCK_V, ...) for rows rb*BM..; LOGITS: written
    as fp32, else each row's chunk partials Top/Idx/Second [M, C]. Chunk 0 writes Hidden."""
    c = tl.program_id(0)
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = cols < V
    ks = tl.arange(0, BK)
    w = fd.weight_chunk(W, stride_w, cols, v_ok, ks, H)                     # [BLOCK_V, BK]
    pdl.wait_for_previous(PDL)

    m = tl.program_id(1) * BM + tl.arange(0, BM)
    m_ok = m < M
    rstd = fd.rows_rstd(Ssq, n_ssq, M, m, m_ok, H, eps, BLOCK_P)
    x = fd.rows_chunk(X, stride_x, m, m_ok, ks, H, rstd, NormW, True, REP)       # [BM, BK]
    if c == 0:
        tl.store(Hidden + m[:, None] * H + ks[None, :], x, mask=m_ok[:, None] & (ks < H)[None, :])
    acc = fd.mma_rows(fd.acc_zeros(BLOCK_V, BM, ROWS_M), w, x, F32, ROWS_M)
    for k0 in range(BK, H, BK):
        x = fd.rows_chunk(X, stride_x, m, m_ok, k0 + ks, H, rstd, NormW, True, REP)
        if c == 0:
            tl.store(Hidden + m[:, None] * H + (k0 + ks)[None, :], x,
                     mask=m_ok[:, None] & (k0 + ks < H)[None, :])
        acc = fd.mma_rows(acc, fd.weight_chunk(W, stride_w, cols, v_ok, k0 + ks, H), x, F32,
                          ROWS_M)
    acc = fd.by_weight_rows(acc, ROWS_M)                                    # [BLOCK_V, BM]
    logit = acc.to(W.dtype.element_ty).to(tl.float32)                      # [BLOCK_V, BM]
    if LOGITS:
        tl.store(Logits + m[None, :].to(tl.int64) * V + cols[:, None], logit,
                 mask=v_ok[:, None] & m_ok[None, :])
    else:
        top, idx, second = _chunk_top2(logit, cols[:, None], v_ok[:, None])
        tl.store(Top + m * C + c, top, mask=m_ok)
        tl.store(Idx + m * C + c, idx, mask=m_ok)
        tl.store(Second + m * C + c, second, mask=m_ok)


@triton.jit
def _argmax_reduce_kernel(Top, Idx, Second, Ids, Gap, C, BLOCK_C: tl.constexpr,
                          PDL: tl.constexpr):
    """Row m: its C chunk partials merged in chunk order -> Ids[m] (the first NaN, else the
    first maximum) and Gap[m] (top-1 minus the largest value at any other id)."""
    pdl.wait_for_previous(PDL)
    m = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    ok = cs < C
    top = tl.load(Top + m * C + cs, mask=ok, other=float("-inf"))
    second = tl.load(Second + m * C + cs, mask=ok, other=float("-inf"))
    nan = (top != top) & ok
    clean = tl.where(nan | ~ok, float("-inf"), top)
    best = tl.max(clean, axis=0)
    first_nan = tl.min(tl.where(nan, cs, BLOCK_C), axis=0)
    first_best = tl.min(tl.where(ok & (clean == best), cs, BLOCK_C), axis=0)
    chunk = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, first_nan, first_best)
    here = cs == chunk
    ids = tl.sum(tl.where(here, tl.load(Idx + m * C + cs, mask=ok, other=0), 0), axis=0)
    first = tl.sum(tl.where(here, top, 0.0), axis=0)     # the chunk's top: NaN stays NaN
    runner_up = tl.maximum(tl.max(tl.where(here, float("-inf"), clean), axis=0),
                           tl.max(tl.where(here, second, float("-inf")), axis=0))
    tl.store(Ids + m, ids.to(tl.int64))
    tl.store(Gap + m, first - runner_up)


# ---------------------------------------------------------------------------------- wrappers

def lm_head_tail(x, ssq, norm_w, eps: float, weight, *, logits: bool,
                 policy: fd.FusedDecodePolicy = fd.FusedDecodePolicy(),
                 impl: str = "auto") -> TailOut:
    """The final RMSNorm of x [M, H] (ssq [P, M] fp32: its rows' sums of squares as
    fixed-order partials, `fused_decode.decode_residual`) and the lm_head weight [V, H]:
    `TailOut` with logits [M, V] fp32 (logits=True: one launch) or the greedy ids and top-2
    gap (two launches, the [M, V] logits never written)."""
    kernel = resolve_impl(impl, x, weight) != "torch"
    fd.check_rows("x", x, False)
    m, h = x.shape
    fd.check_ssq(ssq, m)
    fd.check_weight("lm_head", weight, None, h, x.dtype)
    norm_w = fd.unit_vector("norm_w", norm_w, h)
    if kernel and x.dtype not in fd.KERNEL_DTYPES:
        raise ContractValueError(mismatch(PROGRAM, "x", "dtype", fd.KERNEL_DTYPES, x.dtype))
    v = weight.shape[0]
    if v < 2:
        raise ContractValueError(mismatch(PROGRAM, "lm_head", "vocabulary", ">= 2 rows (a "
                                          "top-2 gap)", v))
    if not kernel:
        return lm_head_tail_reference(x, norm_w, eps, weight, logits=logits)
    bm, block_v = fd.row_block(m), policy.tail_block_v
    opts = fd.launch_tc(policy, x.device, one_row=m < policy.tc_min_rows, bm=bm, w_rows=block_v)
    c = triton.cdiv(v, block_v)
    hidden = torch.empty(m, h, dtype=x.dtype, device=x.device)
    out = torch.empty(m, v, dtype=torch.float32, device=x.device) if logits else None
    f32 = lambda: torch.empty(m, c, dtype=torch.float32, device=x.device)  # noqa: E731
    top, second = (None, None) if logits else (f32(), f32())
    idx = None if logits else torch.empty(m, c, dtype=torch.int32, device=x.device)
    _lm_head_kernel[(c, triton.cdiv(m, bm))](
        x, ssq, norm_w, weight, hidden, out if logits else x, top if top is not None else x,
        idx if idx is not None else x, second if second is not None else x, m, v, h,
        ssq.shape[0], c, x.stride(0), weight.stride(0), eps, BLOCK_V=block_v,
        BM=bm, BLOCK_P=triton.next_power_of_2(ssq.shape[0]), LOGITS=logits,
        REP=fd.norm_rep(opts["num_warps"]), **opts)
    if logits:
        return TailOut(hidden, out, None, None)
    ids = torch.empty(m, dtype=torch.int64, device=x.device)
    gap = torch.empty(m, dtype=torch.float32, device=x.device)
    _argmax_reduce_kernel[(m,)](top, idx, second, ids, gap, c,
                                BLOCK_C=triton.next_power_of_2(c), PDL=opts["PDL"],
                                num_warps=4, **pdl.launch_options(x.device, opts["PDL"]))
    return TailOut(hidden, None, ids, gap)


def decode_step(model, input_ids, positions, out_cache_loc, kv, attend: fd.AttendFn, *,
                logits: bool, policy: fd.FusedDecodePolicy = fd.FusedDecodePolicy(),
                impl: str = "auto") -> TailOut:
    """A whole decode step of `model` in the fused kernels (`fused_decode.decode_residual`,
    then `lm_head_tail`): logits=True gives the fp32 logits (`LlamaModel.forward_decode`'s, for
    the sampler), False the greedy ids and top-2 gap without them."""
    x, ssq = fd.decode_residual(model, input_ids, positions, out_cache_loc, kv, attend,
                                policy=policy, impl=impl)
    return lm_head_tail(x, ssq, model.norm.weight, model.norm.eps, model.lm_head.weight,
                        logits=logits, policy=policy, impl=impl)
