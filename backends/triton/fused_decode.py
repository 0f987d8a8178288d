"""A Llama decoder layer's decode step at small batch (bs <= MAX_M, 64) in fused kernels, plus the
paged decode attention kernel as it is; torch references beside them. Two kernel families,
picked per row count (`FusedDecodePolicy.tc_min_rows`): row-loop GEMVs on the CUDA cores for
one row, tensor-core GEMMs (`tl.dot`, the rows padded to 16, 32 or 64) from two rows up.

At bs 1-16 a decode layer reads its weights once and does little arithmetic; the unfused
layer spends most of its time on ~15 launches of small kernels (norms, RoPE, the KV store,
SiLU-mul, GEMVs below bandwidth) and the gaps between them. The one-row layer is:

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

One-row GEMV shape: a program loads its whole weight tile (all of K, or its split's share, one
load, no K loop: [4, 2048] bf16 at the 1B shape), then waits for the kernel before it
(programmatic dependent launch, where available), then loops over the M rows: loads the row
(L2), reduces it against the tile held in registers, stores. The product is a multiply-reduce
on the CUDA cores, not `tl.dot`: a whole-K dot keeps x and the tile in dot layouts and spills
(ptxas for sm_90: 1-14 KB of stack a thread at 16 rows), while the row loop at the default
tiles and 8 warps compiles without spills (62-234 registers). Its arithmetic grows with the
rows: at 16 it is what bounds the step.

The tensor-core layer (2..64 rows, `decode_layer_tc`) streams each weight once through a K
loop of `tl.dot` (weights as the dot's M side, the rows padded to BM = 16, 32 or 64,
`row_block`, and masked as its N side, fp32 accumulation, the loop software-pipelined by
Triton): the arithmetic of 16 rows costs the tensor cores a few percent of the
weight-streaming time. Wider rows take more registers and shared memory a program: from 33
rows the kernels run 8 warps (`tc_wide_warps`), and a K loop keeps fewer stages where the
policy's would not fit (`stages_for`); at 64-row dots the rows go on the dot's M side
(`tc_rows_as_m`: sm_90's wgmma). At 64 rows each program still re-reads the rows' chunk for
its few weight rows: on an H100 the fused step there is slower than inductor's code (2504
against 2124 µs), while it is faster at 32 rows (1674 against 1812) and far faster than the
model's own uncompiled body at both (results/bench_runner.md). Its down projection runs
the whole of K in each program, so every projection back into the residual stream ends in the
same epilogue (`proj_residual_tc`): out = resid + product, written with each row's sum of
squares over the program's columns, [P, M] fp32 (P programs). The kernel that normalizes
that output next (qkv, gate/up, the final norm in `fused_tail`) sums the P partials in a fixed
order to get the row's RMS: no separate norm pass, no down partials, no atomics. A layer is
`norm_qkv_rope_store_tc`, the attention, `proj_residual_tc` (o), `norm_gate_up_silu_tc`,
`proj_residual_tc` (down): five launches, as the one-row layer at M <= fold_max_m. A policy
may split the o and down projections' K (`tc_o_splits`, `tc_down_splits`) and the qkv
kernel's (`tc_qkv_splits`): S times as many programs write fp32 partials, and each tile's last
split to finish (a ticket counter a tile) sums them in split order into the same epilogue, in
the same launch (`tc_fold`; off: a small second kernel sums the projections' partials), for
shapes whose N alone gives too few programs to keep the memory busy; at the 1B shape (N = 2048,
128 programs) two or four splits with the second kernel were slower on an H100, so the default
is unsplit.

PDL: a program issues its weight loads first (the one-row kernels their whole tile, the
tensor-core kernels the first BLOCK_K chunk of theirs), then waits for the kernel before
(`pdl.wait_for_previous`; docs/pdl.md), then reads activations: the wait comes before any
loop that reads one, so no load of an activation can be hoisted above it. With PDL the weight
loads of kernel n+1 overlap kernel n's tail; every read of an activation and every write
happen after the wait, and a kernel passes its wait only once the kernel before has finished
(which passed its own wait), so results and buffer reuse follow stream order, with or without
PDL.

Rounding follows the unfused model step for step (each projection's output, the residual
adds, the normed input, silu(gate) and the product rounded to the activation dtype); only the
order of the fp32 sums differs, so results match it within the dtype's rounding, and a
kernel's sums have one order, so replays give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from padgraph.errors import ContractValueError, mismatch

from . import pdl as _pdl
from .attention_split import last_to_arrive, tickets
from .kv import resolve_impl
from .pdl import wait_for_previous
from .store import store_kv_reference

MAX_M = 64              # rows (requests) the tensor-core kernels take: the decode steps
ONE_ROW_MAX_M = 16      # rows the one-row kernels take (their arithmetic grows with the rows)
ROW_BLOCK = 16          # the fewest rows of a tensor-core dot's N side (masked past M)
SMEM_STAGE_BYTES = 160 * 1024   # a K loop's pipeline stages take at most this shared memory
PROGRAM = "fused_decode"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FusedDecodePolicy:
    """How the fused kernels launch (defaults: no register spills at the 1B shape, sm_90).
    pdl: programmatic dependent launch where the GPU and Triton have it (sm_90+, Triton >= 3.4),
    else plain launches; `PADGRAPH_PDL=0` in the environment turns it off everywhere.
    tc_pdl: PDL for the tensor-core kernels of steps of tc_min_rows rows or more too (with pdl);
    off by default: on an H100 at the 1B shape those steps ran 5 % slower with it (1730 against
    1648 µs at 4 rows, 1845 against 1765 at 16), where one-row steps ran 3 % faster (1204
    against 1248 µs; results/fused_decode.md).
    max_rows: the most decode rows the fused path takes (`takes`; at most MAX_M). 64 by
    default: past it the model's own body runs, which on an H100 at the 1B shape took 3399 /
    3852 µs a greedy step at 32 / 64 rows uncompiled, against 1706 / 2815 in the fused kernels
    (one process, results/bench_runner.md). A later run, with today's defaults: fused 1674 /
    2504 µs, the layers compiled by inductor (pg.compile's torch_compile regions, as
    padgraph.llm's engine compiles them on a GPU) 1812 / 2124. Where the layers are compiled,
    `max_rows=32` gives 32-row steps the fused kernels and 64-row steps inductor's code, the
    faster of each there.
    tc_min_rows: from this many rows up, the tensor-core kernels run (`decode_layer_tc`); below
    it, the one-row kernels (`decode_layer`).

    One-row kernels. down_splits: fp32 partials of the down projection (each program loads
    K / down_splits of its K, the FFN width). half_n: the qkv tile is two half_n-row slices of
    one head, the pairs RoPE mixes (`qkv_tile`). block_n: rows of a weight per program in the
    o, gate/up and down kernels. num_warps: theirs. fold_max_m: up to this many rows, the next
    layer's qkv kernel sums the partials into the residual itself (each of its programs reads
    all of them: S*M*H*4 bytes of L2 a program); above it a small reduce kernel
    (`residual_norm`) sums them first, one launch more a layer. block_n 4 and down_splits 2
    (from 8 and 4): on an H100 at the 1B shape the one-row step took 1037 µs back to back
    against 1073 (`bench.bench_fused_decode --sizes 1`, one process; bn 4 alone 1045, down
    splits 8 with bn 4 1046): half the rows a program halve its registers (gate/up 206 -> 118,
    o 113 -> 62 on sm_90), so twice as many programs of 8 warps fit an SM (gate/up 2 where
    1, o 4 where 2).

    Tensor-core kernels (powers of two). tc_block_n: weight rows a program in the o and down
    projections (>= 16: the dot's M side). tc_half_n: the qkv half-tile (as half_n; a tile
    under 16 rows is padded with masked rows). tc_ffn_n: gate rows and as many up rows a program
    (>= 16). tc_block_k: the K step of the loops that normalize their input (qkv, gate/up, the
    lm_head of `fused_tail`); tc_proj_block_k: that of the o and down projections (one dot a
    step: a longer step fits in registers, and their 128 programs at the 1B shape need more
    bytes in flight each). tc_stages: software-pipeline stages of the K loop (Triton's
    num_stages: stages - 1 steps of weights in flight a program); tc_ffn_stages: the gate/up
    kernel's (two weight tiles a step). tc_warps: warps a program up to 32 rows;
    tc_wide_warps: from 33 rows (the dots 64 rows wide: at 4 warps the gate/up and lm_head
    tiles spill, ptxas for sm_90). tc_rows_as_m: at 64-row dots, the rows on the dot's M side
    and the weights on its N side (`mma_rows`), the shape sm_90's wgmma takes (with the
    weights as M, Triton emits mma.sync). On by default: on an H100 at the 1B shape the greedy
    step at 64 rows took 2504 µs back to back against 2596 with the weights as M, one
    process (results/bench_runner.md); it changes no kernel below 33 rows.
    tail_block_v: lm_head rows a program in `fused_tail` (128: against 64, the greedy step
    took 1116 / 1462 / 1663 / 2615 µs at 1 / 16 / 32 / 64 rows against 1132 / 1480 / 1706 /
    2815 on an H100, one process; the wider tile re-reads the rows' chunk half as often).
    tc_o_splits, tc_down_splits: K splits of the o and the down projection
    (`proj_residual_tc`): 1 runs the whole of K in each of cdiv(N, tc_block_n) programs; S > 1
    runs S times as many, each streaming its share of K into fp32 partials [S, M, N], summed in
    split order into the residual. tc_fold: by each tile's
    last split, in the same launch (a ticket counter a tile, as tc_qkv_splits below); off: by a
    small second kernel (one launch more a projection), tc_sum_block columns a program.
    tc_qkv_splits: K splits of the qkv kernel (whole K steps each): S times as many programs
    stream their share of H into fp32 partials; each takes a ticket of its tile's counter
    (`attention_split.tickets`, left zeroed, one stream at a time), and the tile's last split
    sums the partials in split order (fixed: replays give the same bits) and runs the RoPE and
    the stores, in the same launch; 1, or no zeroed counters yet (a first call inside a
    capture), runs the whole of H a program.
    attn_pdl: the attention between the qkv and the o projection launches with PDL (where the
    GPU has it), in every layer, whatever pdl and tc_pdl say of the projections: it reads the
    paged metadata and the past K / V before waiting on the qkv kernel, and then lets the o
    projection start (`attention_decode.SplitPolicy.pdl`); `attend` must then take a `pdl`
    keyword, as padgraph's decode and tree attention do (set it off for an `attend` without
    one). On by default: on an H100 at the 1B shape (`bench_runner`, same process) the greedy
    step at one row took 1095 us back to back against 1157 without it, and 1494 against 1488 at
    16 rows, where the tensor-core projections launch without PDL. The
    defaults compile for sm_90 without spills at the 1B shape (Triton 3.6 and 3.9), in <= 145 /
    161 / 200 KB of shared memory a program at 16 / 32 / 64 rows (the lm_head's 128-row tile at
    16 and 32, the o / down projections with the rows as M at 64).

    At 16 rows the one-row kernels' arithmetic bounds them (results/fused_decode.md: on an
    H100, 1.8x slower than the eager-captured path at the 1B shape); the tensor-core kernels
    read the same weight bytes with ~16x2 flops a weight on the tensor cores. Measured on an
    H100 at the 1B shape (results/bench_runner.md): against a body compiled by inductor, the
    fused step wins at one row (1231 against 1458 us), at 4 rows (1441 against 1521) and at 16
    (1543 against 1651, 1.66x the floor). tc_half_n 16 and unsplit projections are from a
    per-kernel sweep there (results/fused_decode.md): qkv 11.1 us at 16 against 16.6 at 8; two
    or four K splits slower than one for both projections; gate/up at 3 stages 26.4 and 26.6 us
    against 28.5 and 28.7 at 6 (two runs)."""
    pdl: bool = True
    tc_pdl: bool = False
    max_rows: int = 64
    tc_min_rows: int = 2
    down_splits: int = 2
    half_n: int = 8
    block_n: int = 4
    num_warps: int = 8
    fold_max_m: int = 4
    tc_block_n: int = 16
    tc_half_n: int = 16
    tc_ffn_n: int = 32
    tc_block_k: int = 128
    tc_proj_block_k: int = 256
    tc_stages: int = 6
    tc_ffn_stages: int = 3
    tc_warps: int = 4
    tail_block_v: int = 128
    tc_o_splits: int = 1
    tc_down_splits: int = 1
    tc_sum_block: int = 256
    tc_qkv_splits: int = 1
    tc_fold: bool = True
    attn_pdl: bool = True
    tc_wide_warps: int = 8
    tc_rows_as_m: bool = True


_DEFAULT_POLICY = FusedDecodePolicy()


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL (`pdl.supported`: sm_90+, a Triton with
    it, `PADGRAPH_PDL` not "0"); the policy may still turn it off."""
    return _pdl.supported(device)


def _pdl_on(policy: FusedDecodePolicy, device: torch.device) -> bool:
    return policy.pdl and _pdl.supported(device)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _refuse(field: str, value, allowed: str) -> None:
    raise ContractValueError(mismatch(PROGRAM, None, f"policy.{field}", allowed, value))


def _launch(policy: FusedDecodePolicy, device: torch.device) -> dict:
    """The launch options of a one-row kernel call; refuses a policy the kernels cannot compile."""
    for field in ("block_n", "half_n", "num_warps"):
        if not _pow2(getattr(policy, field)):
            _refuse(field, getattr(policy, field), "a power of two")
    pdl = _pdl_on(policy, device)
    return dict(PDL=pdl, num_warps=policy.num_warps, num_stages=1,
                **_pdl.launch_options(device, pdl))


def row_block(m: int) -> int:
    """BM, the tensor-core dots' N side for m rows: the next power of two >= m, at least
    ROW_BLOCK (a tl.dot side), at most MAX_M (the tail's lm_head takes more rows in blocks)."""
    return max(ROW_BLOCK, min(MAX_M, triton.next_power_of_2(max(1, m))))


def stages_for(stages: int, bm: int, bk: int, w_rows: int, elt: int = 2) -> int:
    """A K loop's pipeline stages: the policy's, fewer where each stage's weight chunk [w_rows,
    bk] and rows chunk [bm, bk] (elt bytes an element) would take more than SMEM_STAGE_BYTES
    of shared memory in all (more rows take more of it a stage; at 16 rows every default
    fits as it is)."""
    return max(1, min(stages, SMEM_STAGE_BYTES // ((w_rows + bm) * bk * elt)))


def norm_rep(num_warps: int) -> int:
    """How many times over a kernel that normalizes its rows on the fly loads the norm weight's
    [BK] chunk (`rows_chunk`): enough rows that each thread copies >= 4 bytes at BK 128, so
    the copy is pipelined (2 at 4 warps, 4 at 8)."""
    return max(2, num_warps // 2)


def launch_tc(policy: FusedDecodePolicy, device: torch.device, one_row: bool = False,
              bm: int = ROW_BLOCK, w_rows: int = 0, bk: int | None = None,
              stages: int | None = None) -> dict:
    """The launch options of a tensor-core kernel call at BM rows (the K loop's BK: bk, else
    tc_block_k; its stages: `stages_for` of stages, else tc_stages, with w_rows weight rows a
    stage; warps: tc_warps up to 32 rows, tc_wide_warps above; ROWS_M: tc_rows_as_m at 64-row
    dots; PDL, and
    F32: the dot's operands upcast on the CPU interpreter, whose `tl.dot` reads bf16 storage as
    integers; exact there, since a bf16 / fp16 product fits fp32). Refuses a policy the kernels
    cannot compile. one_row: a step below tc_min_rows (the tail's lm_head), PDL as `pdl` says;
    otherwise only with `tc_pdl` too."""
    for field in ("tc_block_n", "tc_ffn_n", "tc_block_k", "tc_proj_block_k", "tail_block_v"):
        if not (_pow2(getattr(policy, field)) and getattr(policy, field) >= 16):
            _refuse(field, getattr(policy, field), "a power of two >= 16 (a tl.dot side)")
    for field in ("tc_half_n", "tc_warps", "tc_wide_warps"):
        if not _pow2(getattr(policy, field)):
            _refuse(field, getattr(policy, field), "a power of two")
    for field in ("tc_stages", "tc_ffn_stages"):
        if getattr(policy, field) < 1:
            _refuse(field, getattr(policy, field), ">= 1")
    for field in ("tc_o_splits", "tc_down_splits", "tc_qkv_splits"):
        if getattr(policy, field) < 1:
            _refuse(field, getattr(policy, field), ">= 1")
    if not _pow2(policy.tc_sum_block):
        _refuse("tc_sum_block", policy.tc_sum_block, "a power of two")
    pdl = _pdl_on(policy, device) and (one_row or policy.tc_pdl)
    bk = policy.tc_block_k if bk is None else bk
    stages = stages_for(policy.tc_stages if stages is None else stages, bm, bk, w_rows)
    return dict(PDL=pdl, F32=device.type == "cpu", BK=bk,
                num_warps=policy.tc_warps if bm <= 32 else policy.tc_wide_warps,
                num_stages=stages, ROWS_M=policy.tc_rows_as_m and bm >= 64,
                **_pdl.launch_options(device, pdl))


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
    """(resid = h + parts summed, RMSNorm(resid), each row's sum of squares of resid [1, M]
    fp32): the tail after the last layer."""
    resid = add_partials_reference(h, parts)
    return resid, rms_norm_reference(resid, norm_w, eps), resid.float().pow(2).sum(-1)[None]


def ssq_partials_reference(x, block_n: int):
    """[P, M] fp32: each row's sum of squares of x [M, N] over each block_n columns
    (P = cdiv(N, block_n)): what `proj_residual_tc` writes beside its output."""
    m, n = x.shape
    p = triton.cdiv(n, block_n)
    xf = F.pad(x.float(), (0, p * block_n - n)).view(m, p, block_n)
    return xf.pow(2).sum(-1).T.contiguous()


def proj_residual_reference(a, weight, resid, block_n: int):
    """(out = resid + a @ weight.T, `ssq_partials_reference(out, block_n)`)."""
    out = resid + F.linear(a, weight)
    return out, ssq_partials_reference(out, block_n)


# ---------------------------------------------------------------------------------- kernels

@triton.jit
def _row_times(x, w):
    """x [BLOCK_K] @ w [N, BLOCK_K].T -> [N] fp32: a multiply-reduce on the CUDA cores (a
    whole-K `tl.dot` keeps x and w in dot layouts and spills at these tile sizes)."""
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)


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
    wait_for_previous(PDL)

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
    wait_for_previous(PDL)

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
    wait_for_previous(PDL)

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
    wait_for_previous(PDL)

    for m in range(M):
        a = tl.load(A + m * stride_a + offs_k, mask=k_ok, other=0.0)
        tl.store(Parts + (s * M + m) * N + offs_n, _row_times(a, w), mask=n_ok)


@triton.jit
def _residual_norm_kernel(X, Parts, Resid, Out, Ssq, NormW, M, H, stride_x, eps,
                          N_PARTS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Row m: Resid = X + Parts summed, Out = RMSNorm(Resid), Ssq[m] = the sum of Resid^2."""
    m = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_H)
    k_ok = offs_k < H
    norm_w = tl.load(NormW + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    wait_for_previous(PDL)

    x = _residual_row(X, stride_x, Parts, m, M, offs_k, H, N_PARTS)         # [BLOCK_H]
    dtype = Out.dtype.element_ty
    tl.store(Resid + m * H + offs_k, x.to(dtype), mask=k_ok)
    tl.store(Out + m * H + offs_k, _rms_norm_row(x, norm_w, H, eps).to(dtype), mask=k_ok)
    tl.store(Ssq + m, tl.sum(x * x, axis=0))


# ------------------------------------------------------------------- tensor-core kernels

@triton.jit
def acc_zeros(N: tl.constexpr, BM: tl.constexpr, ROWS_M: tl.constexpr):
    """A zero fp32 accumulator of N weight rows by BM rows for `mma_rows`: [N, BM], or [BM, N]
    where the rows are the dot's M side (ROWS_M)."""
    if ROWS_M:
        acc = tl.zeros([BM, N], dtype=tl.float32)
    else:
        acc = tl.zeros([N, BM], dtype=tl.float32)
    return acc


@triton.jit
def mma_rows(acc, w, x, F32: tl.constexpr, ROWS_M: tl.constexpr = False):
    """acc [N, BM] + w [N, BK] @ x [BM, BK].T on the tensor cores, accumulated in fp32 (the
    weights on the dot's M side, the rows on its N side); ROWS_M: acc [BM, N] + x @ w.T, the
    rows on the M side (at BM 64 the shape of sm_90's wgmma; weights as M run mma.sync).
    F32: both operands upcast first, for the CPU interpreter (see `launch_tc`)."""
    if F32:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    if ROWS_M:
        acc = tl.dot(x, tl.trans(w), acc)
    else:
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit
def by_weight_rows(acc, ROWS_M: tl.constexpr):
    """`mma_rows`' accumulator as [N, BM] (the epilogues' layout) either way."""
    if ROWS_M:
        acc = tl.trans(acc)
    return acc


@triton.jit
def weight_chunk(W, stride_w, rows, row_ok, ks, K):
    """W[rows, ks] [N, BK], 0 where masked (int64 row offsets: an lm_head passes 2**31)."""
    return tl.load(W + rows.to(tl.int64)[:, None] * stride_w + ks[None, :],
                   mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def rows_chunk(X, stride_x, m, m_ok, ks, K, rstd, NormW, NORM: tl.constexpr,
               REP: tl.constexpr = 2):
    """X[m, ks] [BM, BK] in X's dtype, 0 where masked; NORM: RMSNormed with the rows' rstd [BM]
    and NormW[ks] ((x * rstd) * weight in fp32, rounded back: `_rms_norm_row`'s order), the
    weight's chunk loaded REP times over (`norm_rep`)."""
    k_ok = ks < K
    x = tl.load(X + m[:, None] * stride_x + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                other=0.0)
    if NORM:
        # the weight's chunk loaded REP times over ([REP, BK], one row kept): a [BK] load is
        # 2 bytes a thread, below the 4 of an async copy, so Triton would leave it a
        # synchronous load inside the K loop, its L2 latency paid every step; REP rows are
        # pipelined with the weights (a [BM, BK] broadcast would be too, at 4-16 KB more
        # shared memory a stage)
        twice = tl.zeros([REP, 1], dtype=tl.int32)
        nw = tl.load(NormW + twice + ks[None, :], mask=(twice == 0) & k_ok[None, :], other=0.0)
        nw = tl.max(nw.to(tl.float32), axis=0)                      # [BK]: the rows are equal
        x = ((x.to(tl.float32) * rstd[:, None]) * nw[None, :]).to(X.dtype.element_ty)
    return x


@triton.jit
def rows_rstd(Ssq, n_ssq, M, m, m_ok, K, eps, BLOCK_P: tl.constexpr):
    """[BM] rsqrt(mean square + eps) of rows m, from their sums of squares as n_ssq partials
    Ssq [n_ssq, M] fp32 (BLOCK_P >= n_ssq), summed in one fixed order."""
    p = tl.arange(0, BLOCK_P)
    s = tl.load(Ssq + p[:, None] * M + m[None, :], mask=(p < n_ssq)[:, None] & m_ok[None, :],
                other=0.0)
    return tl.rsqrt(tl.sum(s, axis=0) / K + eps)


@triton.jit
def product_tc(A, W, stride_a, stride_w, n, n_ok, M, lo, hi, BLOCK_N: tl.constexpr,
               BM: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr,
               ROWS_M: tl.constexpr):
    """[BLOCK_N, BM] fp32: W[n, lo:hi] @ A[:M, lo:hi].T, K steps of BK from lo. The first
    weight chunk is loaded before the wait for the kernel before (PDL), the rest in the
    pipelined K loop after it."""
    ks = lo + tl.arange(0, BK)
    w = weight_chunk(W, stride_w, n, n_ok, ks, hi)                  # [BLOCK_N, BK]
    wait_for_previous(PDL)

    m = tl.arange(0, BM)
    m_ok = m < M
    acc = acc_zeros(BLOCK_N, BM, ROWS_M)
    acc = mma_rows(acc, w, rows_chunk(A, stride_a, m, m_ok, ks, hi, None, None, False), F32,
                   ROWS_M)
    for k0 in range(lo + BK, hi, BK):
        acc = mma_rows(acc, weight_chunk(W, stride_w, n, n_ok, k0 + ks - lo, hi),
                       rows_chunk(A, stride_a, m, m_ok, k0 + ks - lo, hi, None, None, False),
                       F32, ROWS_M)
    return by_weight_rows(acc, ROWS_M)


@triton.jit
def _residual_epilogue(acc, Resid, Out, Ssq, pid, n, n_ok, m, m_ok, M, N):
    """Out[:, tile] = Resid[:, tile] + acc [BLOCK_N, BM] (fp32, rounded to the dtype first);
    Ssq[pid, m] = the sum over the tile of Out[m, :]^2 (the rounded values)."""
    dtype = Out.dtype.element_ty
    ok = n_ok[:, None] & m_ok[None, :]
    offs = m[None, :] * N + n[:, None]                              # [BLOCK_N, BM]
    r = tl.load(Resid + offs, mask=ok, other=0.0).to(tl.float32)
    out = (r + acc.to(dtype).to(tl.float32)).to(dtype)
    tl.store(Out + offs, out, mask=ok)
    of = tl.where(ok, out.to(tl.float32), 0.0)
    tl.store(Ssq + pid * M + m, tl.sum(of * of, axis=0), mask=m_ok)


@triton.jit
def _proj_residual_tc_kernel(A, W, Resid, Out, Ssq, M, N, K, stride_a, stride_w,
                             BLOCK_N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                             F32: tl.constexpr, PDL: tl.constexpr, ROWS_M: tl.constexpr = False):
    """Out[:, tile] = Resid[:, tile] + A @ W[tile].T over the whole of K, BLOCK_N rows of W a
    program; Ssq[pid, m] = the sum over the tile of Out[m, :]^2 (the rounded values)."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = product_tc(A, W, stride_a, stride_w, n, n_ok, M, 0, K, BLOCK_N, BM, BK, F32, PDL,
                     ROWS_M)
    m = tl.arange(0, BM)
    _residual_epilogue(acc, Resid, Out, Ssq, pid, n, n_ok, m, m < M, M, N)


@triton.jit
def _proj_partials_tc_kernel(A, W, Parts, Resid, Out, Ssq, Counter, M, N, K, k_per_split,
                             stride_a, stride_w, BLOCK_N: tl.constexpr, BM: tl.constexpr,
                             BK: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr,
                             F32: tl.constexpr, PDL: tl.constexpr, ROWS_M: tl.constexpr = False):
    """Program (tile, s): Parts[s, :, tile] = A[:, K_s] @ W[tile, K_s].T in fp32, K_s the s-th
    k_per_split columns (a multiple of BK; the last split shorter, or empty: zeros). FOLD: each
    program then takes a ticket of Counter[tile]; the tile's last split to finish sums the S
    partials in split order and writes `_proj_residual_tc_kernel`'s Out and Ssq for the tile
    (else `_sum_residual_kernel` does, in a second launch)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    lo = s * k_per_split
    acc = product_tc(A, W, stride_a, stride_w, n, n_ok, M, lo, tl.minimum(lo + k_per_split, K),
                     BLOCK_N, BM, BK, F32, PDL, ROWS_M)
    m = tl.arange(0, BM)
    m_ok = m < M
    ok = n_ok[:, None] & m_ok[None, :]
    tl.store(Parts + (s * M + m[None, :]) * N + n[:, None], acc, mask=ok)
    if FOLD:
        if last_to_arrive(Counter + pid, S):    # the tile's last split to finish
            offs = m[None, :] * N + n[:, None]
            acc = tl.load(Parts + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for t in tl.static_range(1, S):
                acc += tl.load(Parts + t * M * N + offs, mask=ok, other=0.0,
                               cache_modifier=".cg")
            _residual_epilogue(acc, Resid, Out, Ssq, pid, n, n_ok, m, m_ok, M, N)


@triton.jit
def _sum_residual_kernel(Parts, Resid, Out, Ssq, M, N, S: tl.constexpr, BLOCK_N: tl.constexpr,
                         BM: tl.constexpr, PDL: tl.constexpr):
    """Out[:, tile] = Resid[:, tile] + (Parts[0] + Parts[1] + ... in split order) rounded to the
    dtype; Ssq[pid, m] = the sum over the tile of Out[m, :]^2 (as `_proj_residual_tc_kernel`)."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BM)
    ok = (m < M)[:, None] & (n < N)[None, :]
    offs = m[:, None] * N + n[None, :]                              # [BM, BLOCK_N]
    wait_for_previous(PDL)

    acc = tl.load(Parts + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(Parts + s * M * N + offs, mask=ok, other=0.0)
    dtype = Out.dtype.element_ty
    r = tl.load(Resid + offs, mask=ok, other=0.0).to(tl.float32)
    out = (r + acc.to(dtype).to(tl.float32)).to(dtype)
    tl.store(Out + offs, out, mask=ok)
    of = tl.where(ok, out.to(tl.float32), 0.0)
    tl.store(Ssq + pid * M + m, tl.sum(of * of, axis=1), mask=m < M)


@triton.jit
def _norm_qkv_tc_kernel(X, Ssq, NormW, Wq, Wk, Wv, Cos, Sin, Pos, Q, KCache, VCache, Loc,
                        Parts, Counter, M, H, n_ssq, n_q_heads, n_kv_heads, k_per_split,
                        stride_x, stride_wq, stride_wk, stride_wv, stride_cos, stride_q,
                        stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, eps,
                        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, TILE: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr, BLOCK_P: tl.constexpr,
                        SPLITS: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr,
                        REP: tl.constexpr = 2, ROWS_M: tl.constexpr = False):
    """`_norm_qkv_kernel`'s tiles (columns c and c + D/2 of one head for HALF consecutive c) on
    the tensor cores: two dots of TILE = max(16, HALF) weight rows (lanes past HALF masked),
    X RMSNormed on the fly with the rows' rstd from Ssq [n_ssq, M]. SPLITS > 1: program
    (tile, s) streams the s-th k_per_split columns of H into fp32 partials Parts [S, tiles, 2,
    TILE, BM] and takes a ticket of Counter[tile]; the tile's last split to finish sums the
    partials in split order (fixed, so replays give the same bits) and writes the tile."""
    pid = tl.program_id(0)
    tiles = HEAD_DIM // 2 // HALF
    t_q = n_q_heads * tiles
    t_k = t_q + n_kv_heads * tiles
    local = tl.where(pid < t_q, pid, tl.where(pid < t_k, pid - t_q, pid - t_k))
    head = local // tiles
    lane = tl.arange(0, TILE)
    c_ok = lane < HALF
    offs_c = (local % tiles) * HALF + lane                          # [TILE] first-half columns
    rows = head * HEAD_DIM + offs_c
    if pid < t_q:
        W = Wq
        stride_w = stride_wq
    elif pid < t_k:
        W = Wk
        stride_w = stride_wk
    else:
        W = Wv
        stride_w = stride_wv
    if SPLITS == 1:
        lo = 0
        hi = H
    else:
        lo = tl.program_id(1) * k_per_split
        hi = tl.minimum(lo + k_per_split, H)
    ks = lo + tl.arange(0, BK)
    w1 = weight_chunk(W, stride_w, rows, c_ok, ks, hi)              # [TILE, BK] each
    w2 = weight_chunk(W, stride_w, rows + HEAD_DIM // 2, c_ok, ks, hi)
    wait_for_previous(PDL)

    m = tl.arange(0, BM)
    m_ok = m < M
    rstd = rows_rstd(Ssq, n_ssq, M, m, m_ok, H, eps, BLOCK_P)
    x = rows_chunk(X, stride_x, m, m_ok, ks, hi, rstd, NormW, True, REP)
    acc1 = mma_rows(acc_zeros(TILE, BM, ROWS_M), w1, x, F32, ROWS_M)
    acc2 = mma_rows(acc_zeros(TILE, BM, ROWS_M), w2, x, F32, ROWS_M)
    for k0 in range(lo + BK, hi, BK):
        kk = k0 - lo + ks
        x = rows_chunk(X, stride_x, m, m_ok, kk, hi, rstd, NormW, True, REP)
        acc1 = mma_rows(acc1, weight_chunk(W, stride_w, rows, c_ok, kk, hi), x, F32, ROWS_M)
        acc2 = mma_rows(acc2, weight_chunk(W, stride_w, rows + HEAD_DIM // 2, c_ok, kk, hi),
                        x, F32, ROWS_M)
    acc1 = by_weight_rows(acc1, ROWS_M)                             # [TILE, BM] either way
    acc2 = by_weight_rows(acc2, ROWS_M)
    if SPLITS > 1:
        n_tiles = tl.num_programs(0)
        tile = (lane[:, None] * BM + m[None, :]).to(tl.int64)       # [TILE, BM]
        mine = Parts + ((tl.program_id(1) * n_tiles + pid) * 2).to(tl.int64) * TILE * BM
        tl.store(mine + tile, acc1)
        tl.store(mine + TILE * BM + tile, acc2)
        if last_to_arrive(Counter + pid, SPLITS):   # the tile's last split to finish
            first = Parts + (pid * 2).to(tl.int64) * TILE * BM
            step = (n_tiles * 2).to(tl.int64) * TILE * BM
            acc1 = tl.load(first + tile, cache_modifier=".cg")
            acc2 = tl.load(first + TILE * BM + tile, cache_modifier=".cg")
            for s in tl.static_range(1, SPLITS):
                acc1 += tl.load(first + s * step + tile, cache_modifier=".cg")
                acc2 += tl.load(first + s * step + TILE * BM + tile, cache_modifier=".cg")
            _qkv_tc_epilogue(acc1, acc2, pid, t_q, t_k, head, offs_c, c_ok, m, m_ok, Cos, Sin,
                             Pos, Q, KCache, VCache, Loc, stride_cos, stride_q, stride_kc_s,
                             stride_kc_h, stride_vc_s, stride_vc_h, HEAD_DIM)
    else:
        _qkv_tc_epilogue(acc1, acc2, pid, t_q, t_k, head, offs_c, c_ok, m, m_ok, Cos, Sin, Pos,
                         Q, KCache, VCache, Loc, stride_cos, stride_q, stride_kc_s, stride_kc_h,
                         stride_vc_s, stride_vc_h, HEAD_DIM)


@triton.jit
def _qkv_tc_epilogue(acc1, acc2, pid, t_q, t_k, head, offs_c, c_ok, m, m_ok, Cos, Sin, Pos, Q,
                     KCache, VCache, Loc, stride_cos, stride_q, stride_kc_s, stride_kc_h,
                     stride_vc_s, stride_vc_h, HEAD_DIM: tl.constexpr):
    """A qkv tile's products acc1, acc2 [TILE, BM] fp32 (columns c and c + D/2) rounded, roped
    (q and k) and stored (q to Q, k and v at each row's cache slot)."""
    dtype = Q.dtype.element_ty
    y1 = acc1.to(dtype).to(tl.float32)                              # [TILE, BM]
    y2 = acc2.to(dtype).to(tl.float32)
    ok = c_ok[:, None] & m_ok[None, :]
    if pid < t_k:               # q and k: rotate-half RoPE at each row's position
        at = tl.load(Pos + m, mask=m_ok, other=0)[None, :] * stride_cos + offs_c[:, None]
        cos = tl.load(Cos + at, mask=ok, other=0.0)
        sin = tl.load(Sin + at, mask=ok, other=0.0)
        y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
    if pid < t_q:
        dst = Q + m[None, :] * stride_q + head * HEAD_DIM + offs_c[:, None]
    else:                       # a padded lane carries slot 0: it writes the sink
        slot = tl.load(Loc + m, mask=m_ok, other=0).to(tl.int64)[None, :]
        if pid < t_k:
            dst = KCache + slot * stride_kc_s + head * stride_kc_h + offs_c[:, None]
        else:
            dst = VCache + slot * stride_vc_s + head * stride_vc_h + offs_c[:, None]
    tl.store(dst, y1.to(dtype), mask=ok)
    tl.store(dst + HEAD_DIM // 2, y2.to(dtype), mask=ok)


@triton.jit
def _norm_gate_up_tc_kernel(X, Ssq, NormW, Wg, Wu, Act, M, N, H, n_ssq, stride_x, stride_wg,
                            stride_wu, eps, BLOCK_N: tl.constexpr, BM: tl.constexpr,
                            BK: tl.constexpr, BLOCK_P: tl.constexpr, F32: tl.constexpr,
                            PDL: tl.constexpr, REP: tl.constexpr = 2,
                            ROWS_M: tl.constexpr = False):
    """Act[:, tile] = silu(xn @ Wg[tile].T) * (xn @ Wu[tile].T), xn = RMSNorm(X) on the fly
    with the rows' rstd from Ssq [n_ssq, M]; BLOCK_N rows of each weight a program."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    ks = tl.arange(0, BK)
    wg = weight_chunk(Wg, stride_wg, n, n_ok, ks, H)                # [BLOCK_N, BK] each
    wu = weight_chunk(Wu, stride_wu, n, n_ok, ks, H)
    wait_for_previous(PDL)

    m = tl.arange(0, BM)
    m_ok = m < M
    rstd = rows_rstd(Ssq, n_ssq, M, m, m_ok, H, eps, BLOCK_P)
    x = rows_chunk(X, stride_x, m, m_ok, ks, H, rstd, NormW, True, REP)
    acc_g = mma_rows(acc_zeros(BLOCK_N, BM, ROWS_M), wg, x, F32, ROWS_M)
    acc_u = mma_rows(acc_zeros(BLOCK_N, BM, ROWS_M), wu, x, F32, ROWS_M)
    for k0 in range(BK, H, BK):
        x = rows_chunk(X, stride_x, m, m_ok, k0 + ks, H, rstd, NormW, True, REP)
        acc_g = mma_rows(acc_g, weight_chunk(Wg, stride_wg, n, n_ok, k0 + ks, H), x, F32,
                         ROWS_M)
        acc_u = mma_rows(acc_u, weight_chunk(Wu, stride_wu, n, n_ok, k0 + ks, H), x, F32,
                         ROWS_M)
    acc_g = by_weight_rows(acc_g, ROWS_M)                           # [BLOCK_N, BM] either way
    acc_u = by_weight_rows(acc_u, ROWS_M)
    dtype = Act.dtype.element_ty
    g = acc_g.to(dtype).to(tl.float32)                              # [BLOCK_N, BM]
    u = acc_u.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(Act + m[None, :] * N + n[:, None], (silu * u).to(dtype),
             mask=n_ok[:, None] & m_ok[None, :])


# ---------------------------------------------------------------------------------- wrappers

def check_rows(what: str, x: torch.Tensor, kernel: bool, most: int = MAX_M) -> None:
    """x [M, K] with rows contiguous; for the kernels also 1 <= M <= most in fp16 / bf16
    (MAX_M for the tensor-core kernels, ONE_ROW_MAX_M for the one-row ones; the references take
    any M and dtype)."""
    if x.dim() != 2 or x.stride(1) != 1 or (kernel and not 1 <= x.shape[0] <= most):
        raise ContractValueError(mismatch(PROGRAM, what, "shape", f"[M, K] with 1 <= M <= "
                                          f"{most} and rows contiguous", tuple(x.shape)))
    if kernel and x.dtype not in KERNEL_DTYPES:
        raise ContractValueError(mismatch(PROGRAM, what, "dtype", KERNEL_DTYPES, x.dtype))


def check_weight(what: str, w: torch.Tensor, n: int | None, k: int, dtype) -> None:
    """w [n, k] (any n where None) in dtype with rows contiguous."""
    want = (n if n is not None else w.shape[0], k)
    if w.dim() != 2 or tuple(w.shape) != want or w.stride(1) != 1 or w.dtype != dtype:
        raise ContractValueError(mismatch(PROGRAM, what, "weight", f"{want} {dtype} with rows "
                                          "contiguous", f"{tuple(w.shape)} {w.dtype} strides "
                                          f"{w.stride()}"))


def unit_vector(what: str, t: torch.Tensor, n: int) -> torch.Tensor:
    """t [n] at unit stride (a copy where it is strided: the kernels read it densely); a norm
    weight, positions or slots of another shape is refused."""
    if t.dim() != 1 or t.shape[0] != n:
        raise ContractValueError(mismatch(PROGRAM, what, "shape", f"[{n}]", tuple(t.shape)))
    return t.contiguous()


def unit_rope(rope: RopeTables, half: int) -> RopeTables:
    """cos / sin [max_position, half] of one shape, each at unit strides (the kernels address
    both with cos's row stride)."""
    for name, t in (("rope.cos", rope.cos), ("rope.sin", rope.sin)):
        if t.dim() != 2 or t.shape[1] != half or t.shape != rope.cos.shape:
            raise ContractValueError(mismatch(PROGRAM, name, "table", f"[max_position, {half}], "
                                              "cos and sin of one shape", tuple(t.shape)))
    return RopeTables(rope.cos.contiguous(), rope.sin.contiguous())


def check_caches(k_cache, v_cache) -> None:
    """k_cache / v_cache [n_slots, Hkv, D] of one shape with each slot's head rows at unit
    stride (the kernels write K / V there in place: a strided cache cannot be copied)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 3 or t.shape != k_cache.shape or t.stride(-1) != 1:
            raise ContractValueError(mismatch(PROGRAM, name, "cache", "[n_slots, Hkv, D] "
                                              "like k_cache, head rows at unit stride",
                                              f"{tuple(t.shape)} strides {t.stride()}"))


def check_ssq(ssq, m: int) -> None:
    """ssq [P >= 1, m] fp32 contiguous: m rows' sums of squares as P partials."""
    if ssq.dim() != 2 or ssq.shape[0] < 1 or ssq.shape[1] != m or ssq.dtype != torch.float32 \
            or not ssq.is_contiguous():
        raise ContractValueError(mismatch(PROGRAM, "ssq", "row sums of squares", f"[P >= 1, {m}] "
                                          "fp32 contiguous", f"{tuple(ssq.shape)} {ssq.dtype}"))


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
    check_rows("x", x, kernel, ONE_ROW_MAX_M)
    m, h = x.shape
    _check_parts(parts, m, h)
    check_caches(k_cache, v_cache)
    d = k_cache.shape[-1]
    positions, loc = unit_vector("positions", positions, m), unit_vector("loc", loc, m)
    norm, rope = unit_vector("input_norm", w.input_norm, h), unit_rope(rope, d // 2)
    n_q, n_kv = w.wq.shape[0] // d, k_cache.shape[1]
    for name, wt, n in (("wq", w.wq, n_q * d), ("wk", w.wk, n_kv * d), ("wv", w.wv, n_kv * d)):
        check_weight(name, wt, n, h, x.dtype)
    if not kernel:
        return norm_qkv_rope_store_reference(x, parts, w, rope, positions, loc, k_cache, v_cache)
    half = qkv_tile(d, policy.half_n)
    q = torch.empty(m, n_q, d, dtype=x.dtype, device=x.device)
    resid = x if parts is None else torch.empty_like(x)
    grid = ((n_q + 2 * n_kv) * (d // 2 // half),)
    _norm_qkv_kernel[grid](
        x, parts if parts is not None else x, resid, norm, w.wq, w.wk, w.wv, rope.cos,
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
    check_rows("attn", attn, kernel, ONE_ROW_MAX_M)
    m, k = attn.shape
    check_weight("wo", wo, None, k, attn.dtype)
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
    check_rows("h", h, kernel, ONE_ROW_MAX_M)
    m, k = h.shape
    norm = unit_vector("post_norm", w.post_norm, k)
    check_weight("w_gate", w.w_gate, None, k, h.dtype)
    check_weight("w_up", w.w_up, w.w_gate.shape[0], k, h.dtype)
    if not kernel:
        return norm_gate_up_silu_reference(h, w)
    n = w.w_gate.shape[0]
    act = torch.empty(m, n, dtype=h.dtype, device=h.device)
    _norm_gate_up_kernel[(triton.cdiv(n, policy.block_n),)](
        h.contiguous(), norm, w.w_gate, w.w_up, act, m, n, k, w.w_gate.stride(0),
        w.w_up.stride(0), w.eps, BLOCK_N=policy.block_n, BLOCK_H=triton.next_power_of_2(k),
        **_launch(policy, h.device))
    return act


def down_partials(act, w_down, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                  impl: str = "auto"):
    """act [M, F] @ w_down [H, F].T as policy.down_splits fp32 partials [S, M, H] (the sum in
    split order is the projection; `split_bounds` gives each split's K range)."""
    kernel = resolve_impl(impl, act, w_down) != "torch"
    check_rows("act", act, kernel, ONE_ROW_MAX_M)
    m, k = act.shape
    check_weight("w_down", w_down, None, k, act.dtype)
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
    """(resid = h [M, H] + parts [S, M, H] (or None) summed in order, RMSNorm(resid) with
    norm_w, each row's sum of squares of resid as [1, M] fp32: the `ssq` the tensor-core
    kernels and `fused_tail` normalize with)."""
    kernel = resolve_impl(impl, h, norm_w) != "torch"
    check_rows("h", h, kernel)
    m, k = h.shape
    _check_parts(parts, m, k)
    norm_w = unit_vector("norm_w", norm_w, k)
    if not kernel:
        return residual_norm_reference(h, parts, norm_w, eps)
    resid, out = (torch.empty(m, k, dtype=h.dtype, device=h.device) for _ in range(2))
    ssq = torch.empty(1, m, dtype=torch.float32, device=h.device)
    _residual_norm_kernel[(m,)](
        h, parts if parts is not None else h, resid, out, ssq, norm_w, m, k, h.stride(0), eps,
        N_PARTS=0 if parts is None else parts.shape[0], BLOCK_H=triton.next_power_of_2(k),
        **_launch(policy, h.device))
    return resid, out, ssq


def norm_qkv_rope_store_tc(x, ssq, w: LayerWeights, rope: RopeTables, positions, loc, k_cache,
                           v_cache, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                           impl: str = "auto"):
    """`norm_qkv_rope_store` on the tensor cores: x [M, H] the residual, ssq [P, M] fp32 its
    rows' sums of squares as fixed-order partials (`proj_residual_tc`, `residual_norm`) -> q
    [M, Hq, D] roped; k (roped) and v written at slots loc [M]."""
    kernel = resolve_impl(impl, x, k_cache, v_cache, loc) != "torch"
    check_rows("x", x, kernel)
    m, h = x.shape
    check_ssq(ssq, m)
    check_caches(k_cache, v_cache)
    d = k_cache.shape[-1]
    positions, loc = unit_vector("positions", positions, m), unit_vector("loc", loc, m)
    norm, rope = unit_vector("input_norm", w.input_norm, h), unit_rope(rope, d // 2)
    n_q, n_kv = w.wq.shape[0] // d, k_cache.shape[1]
    for name, wt, n in (("wq", w.wq, n_q * d), ("wk", w.wk, n_kv * d), ("wv", w.wv, n_kv * d)):
        check_weight(name, wt, n, h, x.dtype)
    if not kernel:
        return norm_qkv_rope_store_reference(x, None, w, rope, positions, loc, k_cache,
                                             v_cache)[0]
    half = qkv_tile(d, policy.tc_half_n)
    tile = max(16, half)
    bm = row_block(m)
    opts = launch_tc(policy, x.device, bm=bm, w_rows=2 * tile)
    n_tiles = (n_q + 2 * n_kv) * (d // 2 // half)
    # K splits: each a whole number of K steps, none empty
    per = triton.cdiv(triton.cdiv(h, policy.tc_qkv_splits), opts["BK"]) * opts["BK"]
    splits = triton.cdiv(h, per)
    counter, ok = (tickets(x.device, n_tiles, True) if splits > 1 else (None, False))
    if not ok:                  # one split, or no zeroed counters yet (a first call in a capture)
        splits, per = 1, h
    q = torch.empty(m, n_q, d, dtype=x.dtype, device=x.device)
    parts = (torch.empty(splits, n_tiles, 2, tile, bm, dtype=torch.float32,
                         device=x.device) if splits > 1 else q)
    _norm_qkv_tc_kernel[(n_tiles, splits)](
        x, ssq, norm, w.wq, w.wk, w.wv, rope.cos, rope.sin, positions, q, k_cache,
        v_cache, loc, parts, counter if splits > 1 else loc, m, h, ssq.shape[0], n_q, n_kv, per,
        x.stride(0), w.wq.stride(0), w.wk.stride(0), w.wv.stride(0), rope.cos.stride(0),
        q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        w.eps, HEAD_DIM=d, HALF=half, TILE=tile, BM=bm,
        BLOCK_P=triton.next_power_of_2(ssq.shape[0]), SPLITS=splits,
        REP=norm_rep(opts["num_warps"]), **opts)
    return q


def proj_residual_tc(a, weight, resid, *, splits: int = 1,
                     policy: FusedDecodePolicy = FusedDecodePolicy(), impl: str = "auto"):
    """(out = resid [M, N] + a [M, K] @ weight [N, K].T, ssq [P, M] fp32: each row's sum of
    squares of out over each B columns, P = cdiv(N, B)): the o and the down projection of
    `decode_layer_tc`. splits 1: the whole of K in each program, B = policy.tc_block_n; more:
    K in `splits` fp32 partials summed in split order (the policy's tc_o_splits /
    tc_down_splits): with policy.tc_fold by the tile's last split in the same launch, B =
    policy.tc_block_n (a ticket of `attention_split.tickets`' counters; a first call inside a
    capture, before they are zeroed, takes the second kernel); else by a second kernel, B =
    policy.tc_sum_block."""
    kernel = resolve_impl(impl, a, weight, resid) != "torch"
    check_rows("a", a, kernel)
    m, k = a.shape
    check_weight("weight", weight, None, k, a.dtype)
    n = weight.shape[0]
    if tuple(resid.shape) != (m, n) or not resid.is_contiguous() or resid.dtype != a.dtype:
        raise ContractValueError(mismatch(PROGRAM, "resid", "residual", f"[{m}, {n}] "
                                          f"{a.dtype} contiguous", tuple(resid.shape)))
    if splits < 1:
        raise ContractValueError(mismatch(PROGRAM, "splits", "K splits", ">= 1", splits))
    if not kernel:
        return proj_residual_reference(a, weight, resid, policy.tc_block_n
                                       if splits == 1 or policy.tc_fold else policy.tc_sum_block)
    bm = row_block(m)
    opts = launch_tc(policy, a.device, bm=bm, w_rows=policy.tc_block_n,
                     bk=policy.tc_proj_block_k)
    out = torch.empty_like(resid)
    tiles = triton.cdiv(n, policy.tc_block_n)
    if splits == 1:
        ssq = torch.empty(tiles, m, dtype=torch.float32, device=a.device)
        _proj_residual_tc_kernel[(tiles,)](a, weight, resid, out, ssq, m, n, k, a.stride(0),
                                           weight.stride(0), BLOCK_N=policy.tc_block_n,
                                           BM=bm, **opts)
        return out, ssq
    # each split a whole number of K steps, so no step straddles two splits
    per = triton.cdiv(triton.cdiv(k, splits), opts["BK"]) * opts["BK"]
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    counter, fold = tickets(a.device, tiles, True) if policy.tc_fold else (None, False)
    if fold:                    # the tile's last split writes out and ssq: one launch
        ssq = torch.empty(tiles, m, dtype=torch.float32, device=a.device)
        _proj_partials_tc_kernel[(tiles, splits)](
            a, weight, parts, resid, out, ssq, counter, m, n, k, per, a.stride(0),
            weight.stride(0), BLOCK_N=policy.tc_block_n, BM=bm, S=splits, FOLD=True,
            **opts)
        return out, ssq
    _proj_partials_tc_kernel[(tiles, splits)](a, weight, parts, resid, out, parts, parts, m, n,
                                              k, per, a.stride(0), weight.stride(0),
                                              BLOCK_N=policy.tc_block_n, BM=bm,
                                              S=splits, FOLD=False, **opts)
    p = triton.cdiv(n, policy.tc_sum_block)
    ssq = torch.empty(p, m, dtype=torch.float32, device=a.device)
    _sum_residual_kernel[(p,)](parts, resid, out, ssq, m, n, S=splits,
                               BLOCK_N=policy.tc_sum_block, BM=bm,
                               **_launch_sum(policy, a.device))
    return out, ssq


def _launch_sum(policy: FusedDecodePolicy, device: torch.device) -> dict:
    """`_sum_residual_kernel`'s launch: 4 warps, PDL as the tensor-core kernels'."""
    pdl = _pdl_on(policy, device) and policy.tc_pdl
    return dict(PDL=pdl, num_warps=4, **_pdl.launch_options(device, pdl))


def norm_gate_up_silu_tc(h, ssq, w: LayerWeights, *,
                         policy: FusedDecodePolicy = FusedDecodePolicy(), impl: str = "auto"):
    """`norm_gate_up_silu` on the tensor cores, h [M, H] normalized with its rows' sums of
    squares ssq [P, M] (`proj_residual_tc`) -> act [M, F]."""
    kernel = resolve_impl(impl, h, w.w_gate, w.w_up) != "torch"
    check_rows("h", h, kernel)
    m, k = h.shape
    check_ssq(ssq, m)
    norm = unit_vector("post_norm", w.post_norm, k)
    check_weight("w_gate", w.w_gate, None, k, h.dtype)
    check_weight("w_up", w.w_up, w.w_gate.shape[0], k, h.dtype)
    if not kernel:
        return norm_gate_up_silu_reference(h, w)
    bm = row_block(m)
    opts = launch_tc(policy, h.device, bm=bm, w_rows=2 * policy.tc_ffn_n,
                     stages=policy.tc_ffn_stages)
    n = w.w_gate.shape[0]
    act = torch.empty(m, n, dtype=h.dtype, device=h.device)
    _norm_gate_up_tc_kernel[(triton.cdiv(n, policy.tc_ffn_n),)](
        h, ssq, norm, w.w_gate, w.w_up, act, m, n, k, ssq.shape[0], h.stride(0),
        w.w_gate.stride(0), w.w_up.stride(0), w.eps, BLOCK_N=policy.tc_ffn_n, BM=bm,
        BLOCK_P=triton.next_power_of_2(ssq.shape[0]), REP=norm_rep(opts["num_warps"]), **opts)
    return act


# ------------------------------------------------------------------------------- the layers

AttendFn = Callable[..., torch.Tensor]      # (q [M, Hq, D], k_cache, v_cache) -> [M, Hq, D]


def takes(model, input_ids: torch.Tensor, kv, policy: FusedDecodePolicy | None = None) -> bool:
    """Whether `decode_residual` runs `model`'s decode step of these tokens in the fused kernels:
    1..MAX_M tokens, at most the policy's max_rows (the default policy's where none is
    given), and at most ONE_ROW_MAX_M below its tc_min_rows (the one-row kernels), fp16 / bf16
    weights with the caches in the same dtype, an even head_dim. Elsewhere (more rows, fp32)
    the caller keeps its own path."""
    dtype = model.embed.weight.dtype
    policy = _DEFAULT_POLICY if policy is None else policy
    rows = input_ids.shape[0]
    one_row = rows < policy.tc_min_rows
    most = min(MAX_M, policy.max_rows, ONE_ROW_MAX_M if one_row else MAX_M)
    return (1 <= rows <= most and dtype in KERNEL_DTYPES
            and kv.k[0].dtype == dtype and kv.v[0].dtype == dtype and model.cfg.head_dim % 2 == 0)


def attend_options(policy: FusedDecodePolicy) -> dict:
    """The keywords a layer passes `attend`: {"pdl": True} where policy.attn_pdl, else none (any
    `AttendFn` takes that). The attention decides on the device (`pdl.supported`)."""
    return {"pdl": True} if policy.attn_pdl else {}


def decode_layer(x, parts, w: LayerWeights, rope: RopeTables, positions, loc, k_cache, v_cache,
                 attend: AttendFn, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                 impl: str = "auto"):
    """One decoder layer in the one-row kernels: (x [M, H], the previous layer's down partials
    or None) -> (h [M, H], this layer's down partials [S, M, H]); the layer's output is h + the
    partials summed."""
    if parts is not None and x.shape[0] > policy.fold_max_m:
        x, parts = residual_norm(x, parts, w.input_norm, w.eps, policy=policy, impl=impl)[0], None
    q, resid = norm_qkv_rope_store(x, parts, w, rope, positions, loc, k_cache, v_cache,
                                   policy=policy, impl=impl)
    o = attend(q, k_cache, v_cache, **attend_options(policy))                # [M, Hq, D]
    h = o_proj_residual(o.reshape(o.shape[0], -1), w.wo, resid, policy=policy, impl=impl)
    act = norm_gate_up_silu(h, w, policy=policy, impl=impl)                  # [M, F]
    return h, down_partials(act, w.w_down, policy=policy, impl=impl)


def decode_layer_tc(x, ssq, w: LayerWeights, rope: RopeTables, positions, loc, k_cache,
                    v_cache, attend: AttendFn, *, policy: FusedDecodePolicy = FusedDecodePolicy(),
                    impl: str = "auto"):
    """One decoder layer in the tensor-core kernels: (x [M, H] the residual stream, ssq [P, M]
    its rows' sums of squares) -> the layer's output and its ssq, the same way."""
    q = norm_qkv_rope_store_tc(x, ssq, w, rope, positions, loc, k_cache, v_cache,
                               policy=policy, impl=impl)
    o = attend(q, k_cache, v_cache, **attend_options(policy))                # [M, Hq, D]
    h, ssq_h = proj_residual_tc(o.reshape(o.shape[0], -1), w.wo, x, splits=policy.tc_o_splits,
                                policy=policy, impl=impl)
    act = norm_gate_up_silu_tc(h, ssq_h, w, policy=policy, impl=impl)        # [M, F]
    return proj_residual_tc(act, w.w_down, h, splits=policy.tc_down_splits, policy=policy,
                            impl=impl)


def layer_weights(model) -> list[LayerWeights]:
    """The fused kernels' views of every layer of a `LlamaModel`-shaped model."""
    cfg = model.cfg
    return [LayerWeights.of(layer, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
            for layer in model.layers]


def decode_residual(model, input_ids, positions, out_cache_loc, kv, attend: AttendFn, *,
                    policy: FusedDecodePolicy = FusedDecodePolicy(), impl: str = "auto"):
    """(x [M, H], ssq [P, M] fp32): the residual stream after the last layer of a decode step
    (the final norm's input) and its rows' sums of squares as fixed-order partials, every layer
    in `decode_layer_tc` from policy.tc_min_rows rows up, else in `decode_layer`; K/V written at
    out_cache_loc of kv.k/kv.v."""
    rope = RopeTables(model.rope.cos, model.rope.sin)
    x = model.embed(input_ids)                                               # [M, H]
    norm = model.norm.weight, model.norm.eps
    if input_ids.shape[0] >= policy.tc_min_rows:
        ssq = residual_norm(x, None, *norm, policy=policy, impl=impl)[2]
        for i, w in enumerate(layer_weights(model)):
            x, ssq = decode_layer_tc(x, ssq, w, rope, positions, out_cache_loc, kv.k[i],
                                     kv.v[i], attend, policy=policy, impl=impl)
        return x, ssq
    parts = None
    for i, w in enumerate(layer_weights(model)):
        x, parts = decode_layer(x, parts, w, rope, positions, out_cache_loc, kv.k[i], kv.v[i],
                                attend, policy=policy, impl=impl)
    resid, _, ssq = residual_norm(x, parts, *norm, policy=policy, impl=impl)
    return resid, ssq


def decode_hidden(model, input_ids, positions, out_cache_loc, kv, attend: AttendFn, *,
                  policy: FusedDecodePolicy = FusedDecodePolicy(), impl: str = "auto"):
    """The final-normed hidden [M, H] of a decode step (what `LlamaModel._run` returns for a
    decode batch): `decode_residual`, then the final RMSNorm (`fused_tail` fuses that norm into
    the lm_head instead)."""
    x, _ = decode_residual(model, input_ids, positions, out_cache_loc, kv, attend,
                           policy=policy, impl=impl)
    return residual_norm(x, None, model.norm.weight, model.norm.eps, policy=policy,
                         impl=impl)[1]
