"""Top-k and log-sum-exp of a row of logits in one read: the draft distribution of a speculative
step.

A draft step needs the k best tokens of each row of [n, V] logits and their probabilities
under a temperature t > 0: p = exp(t * l - logsumexp(t * l)). torch does this in two passes
over the row (`topk`, a multi-block radix select of four kernels for a 128k vocabulary, then
`logsumexp`), each reading all n * V logits. Here it is one read:

1. `_chunk_kernel`, grid (n, C): a program loads one BLOCK-wide chunk of a row, keeps its k
   largest values with their indices (k rounds of max + lowest index at that max) and its
   partial log-sum-exp (max and sum of exp, temperature applied), and writes them:
   [n, C, k] candidates and [n, C] partials.
2. `_merge_kernel`, grid (n,): a program merges a row's C * k candidates the same way and its C
   partial sums into the row's log-sum-exp.

Ties go to the lower vocabulary index, so the result is deterministic (torch's order among equal
values is unspecified). The temperature is a device scalar (`scale`, a 0-d tensor, e.g. a learned
parameter's exp), read by the kernel, so a captured graph follows it. Shapes fix the grid; there is
no host work and no sync, so the op is graph-safe.

`topk_logsumexp` is an opaque custom op under torch.compile (as the attention kernels are,
compile_ops.py): inductor sees its output shapes and the kernels launch at replay.
`Partials` holds what a chunk kernel leaves for the merge; the fused fp8 lm_head kernel
(lm_head_topk.py) writes the same and merges the same way.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .compile_ops import opaque_under_compile
from .kv import resolve_impl

# A chunk is this many logits, one warp a chunk (16 a thread): the k rounds of reductions are
# then warp shuffles, with no cross-warp step. 128256 / 512 gives 251 chunks a row, so the merge
# reads 251 * k candidates. It was the fastest block of `bench.bench_topk`'s sweep at 16 and 64
# rows, ahead of 4096 logits over 4 warps (results/topk.md).
BLOCK = 512
NUM_WARPS = 1
MERGE_WARPS = 4
K_MAX = 64          # the k rounds are unrolled; past this, torch.topk does better


@triton.jit
def _chunk_kernel(x_ptr, scale_ptr, cand_v_ptr, cand_i_ptr, part_m_ptr, part_s_ptr,
                  V, stride_x, C,
                  K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=valid,
                other=float("-inf")).to(tl.float32)
    t = tl.load(scale_ptr).to(tl.float32)
    # partial log-sum-exp of t * x over the chunk: (max, sum exp(t * x - max)); an infinite max
    # is not subtracted (a chunk of -inf sums to 0, one holding +inf to +inf, as torch's)
    m = tl.max(x, axis=0)
    m_safe = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    s = tl.sum(tl.where(valid, tl.exp(t * (x - m_safe)), 0.0), axis=0)
    base = (row * C + c).to(tl.int64)
    tl.store(part_m_ptr + base, t * m)
    tl.store(part_s_ptr + base, s)
    # top-k of the chunk: k rounds of (max, the lowest index holding it), that lane then masked
    big = V + BLOCK
    for j in tl.static_range(K):
        v = tl.max(x, axis=0)
        i = tl.min(tl.where((x == v) & valid, offs, big), axis=0)
        tl.store(cand_v_ptr + base * K + j, v)
        tl.store(cand_i_ptr + base * K + j, i)
        valid = valid & (offs != i)
        x = tl.where(offs == i, float("-inf"), x)


@triton.jit
def _merge_kernel(cand_v_ptr, cand_i_ptr, part_m_ptr, part_s_ptr,
                  out_v_ptr, out_i_ptr, out_lse_ptr, C, V,
                  K: tl.constexpr, CK: tl.constexpr, CP: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CK)
    n = C * K
    ok = offs < n
    base = row.to(tl.int64) * n
    v = tl.load(cand_v_ptr + base + offs, mask=ok, other=float("-inf"))
    idx = tl.load(cand_i_ptr + base + offs, mask=ok, other=0)
    big = V + 2 * n + 1
    # candidates that are not real logits (a chunk with fewer than K of them) carry index >= V
    live = ok & (idx < V)
    for j in tl.static_range(K):
        best = tl.max(tl.where(live, v, float("-inf")), axis=0)
        i = tl.min(tl.where(live & (v == best), idx, big), axis=0)
        tl.store(out_v_ptr + row * K + j, best)
        # in range whatever the logits hold: a row of NaN leaves no live candidate (the index
        # feeds an embedding lookup, where an id >= V would read out of bounds)
        tl.store(out_i_ptr + row * K + j, tl.minimum(i, V - 1).to(tl.int64))
        live = live & (idx != i)
    cs = tl.arange(0, CP)
    cok = cs < C
    pm = tl.load(part_m_ptr + row.to(tl.int64) * C + cs, mask=cok, other=float("-inf"))
    ps = tl.load(part_s_ptr + row.to(tl.int64) * C + cs, mask=cok, other=0.0)
    M = tl.max(pm, axis=0)
    M_safe = tl.where(tl.abs(M) == float("inf"), 0.0, M)
    # a chunk with no finite logit adds nothing, unless it held a NaN (its sum is NaN then):
    # a NaN anywhere in the row makes the row's log-sum-exp NaN, as torch's
    S = tl.sum(tl.where((pm == float("-inf")) & (ps == ps), 0.0, ps * tl.exp(pm - M_safe)),
               axis=0)
    tl.store(out_lse_ptr + row, M_safe + tl.log(S))


class Partials(NamedTuple):
    """Per-chunk results the merge reduces: a row's k best (value, index) of each of its C
    chunks and each chunk's partial log-sum-exp (max, sum), as the chunk kernels write them."""
    cand_v: torch.Tensor   # [n, C, k] fp32
    cand_i: torch.Tensor   # [n, C, k] int32
    part_m: torch.Tensor   # [n, C] fp32 temperature x chunk max
    part_s: torch.Tensor   # [n, C] fp32 sum of exp(t * (x - max))

    @classmethod
    def empty(cls, n: int, C: int, k: int, device) -> "Partials":
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(n, C, k, **f32), torch.empty(n, C, k, dtype=torch.int32,
                                                             device=device),
                   torch.empty(n, C, **f32), torch.empty(n, C, **f32))

    @property
    def C(self) -> int:
        return self.part_m.shape[1]

    def merge(self, V: int):
        """(values [n, k] fp32, indices [n, k] int64, lse [n] fp32): `_merge_kernel` per row."""
        n, C, k = self.cand_v.shape
        dev = self.cand_v.device
        out_v = torch.empty(n, k, dtype=torch.float32, device=dev)
        out_i = torch.empty(n, k, dtype=torch.int64, device=dev)
        out_lse = torch.empty(n, dtype=torch.float32, device=dev)
        if n:
            _merge_kernel[(n,)](*self, out_v, out_i, out_lse, C, V, K=k,
                                CK=triton.next_power_of_2(C * k), CP=triton.next_power_of_2(C),
                                num_warps=MERGE_WARPS)
        return out_v, out_i, out_lse


def _check(logits: torch.Tensor, k: int, scale: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V]; got shape {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in [1, V={logits.shape[1]}]; got {k}")
    if scale.numel() != 1:
        raise ValueError(f"scale must be one value (a 0-d tensor); got shape {tuple(scale.shape)}")


def topk_logsumexp_torch(logits: torch.Tensor, k: int, scale: torch.Tensor):
    """The oracle: (values [n, k] fp32, indices [n, k] int64, logsumexp(scale * logits) [n] fp32)."""
    _check(logits, k, scale)
    x = logits.float()
    v, i = x.topk(k, dim=-1)
    return v, i, torch.logsumexp(x * scale.float(), dim=-1)


def topk_logsumexp_triton(logits: torch.Tensor, k: int, scale: torch.Tensor,
                          block: int = BLOCK, num_warps: int = NUM_WARPS):
    """The kernels; `block` (a power of two) and `num_warps` are tuning knobs
    (bench/bench_topk.py sweeps them)."""
    _check(logits, k, scale)
    if block & (block - 1) or block < 16:
        raise ValueError(f"block must be a power of two >= 16; got {block}")
    if k > K_MAX:
        return topk_logsumexp_torch(logits, k, scale)
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    n, V = x.shape
    parts = Partials.empty(n, triton.cdiv(V, block), k, x.device)
    if n:
        _chunk_kernel[(n, parts.C)](x, scale.reshape(()).to(device=x.device), *parts, V,
                                    x.stride(0), parts.C, K=k, BLOCK=block, num_warps=num_warps)
    return parts.merge(V)


@opaque_under_compile(reference=topk_logsumexp_torch)
def topk_logsumexp(logits: torch.Tensor, k: int, scale: torch.Tensor, impl: str = "auto"):
    """(values [n, k] fp32, indices [n, k] int64, logsumexp(scale * logits, -1) [n] fp32) of
    [n, V] logits (bf16 or fp32) and a positive temperature `scale` (0-d tensor).

    `values` are the logits themselves (no temperature), largest first; ties go to the lower
    index on the Triton path, and indices are in [0, V) even for NaN logits (which NaN entries
    rank where is unspecified; torch ranks them first). impl: "auto" (Triton on CUDA tensors,
    else torch), "triton", "torch". Under torch.compile: an opaque op whose kernels run at
    replay. While dynamo traces, `resolve_impl` would pick torch for a traced call, so the op
    keeps the choice to run time (`compile_ops.opaque_under_compile`).

    The kernels have no backward: where autograd records (grad mode on and logits or scale
    requiring grad), the differentiable torch reference runs instead, eager or traced."""
    if resolve_impl(impl, logits, scale) == "triton":
        return topk_logsumexp_triton(logits, k, scale)
    return topk_logsumexp_torch(logits, k, scale)
