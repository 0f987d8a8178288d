"""Split-KV bookkeeping shared by the paged decode kernels (GQA and MLA): who covers which
positions, how a split's partial result is finished, and the two ways partials are merged.

Program (request r, row block b, split s) of a split kernel covers positions
`[s·L_r, min((s+1)·L_r, seq_len_r))`, `L_r = roundup(cdiv(seq_len_r, S), BLOCK_N)`: each request
is divided by its *own* length (read on the device), so the grid (fixed by shapes) serves every
length. Of the S splits, `n_used = cdiv(seq_len_r, L_r)` are non-empty; the others exit at once.

Finishing a split (`finish_split`, called at the end of a split kernel):
- `n_used == 1`: the only split writes the normalized output (no partials, no merge).
- otherwise it writes its partial `(o_s, lse_s)` to `mid_o [n_rows, H, S, DV]` fp32 and
  `mid_lse [n_rows, H, S]`, and then either
  - fold: bumps a per-(request, row block) counter; the program that draws the last ticket merges
    all `n_used` partials and writes the output, then resets the counter to 0 itself, so the next
    launch (a graph replay) finds it zeroed: one launch per decode step; or
  - a second, small kernel (`_merge_kernel`, grid (row, head block, DV chunk)) merges after: two
    launches, but the merge is spread over many programs (chosen when the partials one program
    would have to read are large: MLA's 512-wide rows, many splits).

`num_splits`, `fold` and `block_n` are runtime arguments of every kernel here (not specialized), so
every split count of a bucket ladder runs the same compiled kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# fold the merge into the split pass when the partials the last program reads are at most this
# many bytes (128 KB: ~2 µs for one SM, about what a second launch costs in a graph).
FOLD_MAX_BYTES_TUNED = 128 * 1024
FOLD_MAX_BYTES = FOLD_MAX_BYTES_TUNED
# counters per device, allocated once (a captured graph binds the address); more raises
N_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}


# ----------------------------------------------------------------------------- device side

@triton.jit
def split_len(seq_len, num_splits, block_n):
    """Tokens per split for a request of seq_len: an equal share rounded up to block_n."""
    share = tl.cdiv(tl.cdiv(seq_len, num_splits), block_n) * block_n
    return tl.maximum(share, block_n)


@triton.jit
def merge_partials(mid_ptrs, lse_ptrs, stride_mid_s, stride_lse_s, n_used, row_ok, col_ok):
    """Log-sum-exp merge of splits 0 .. n_used-1: mid_ptrs [R, C] / lse_ptrs [R] point at
    split 0 -> [R, C] fp32. Rows whose splits all saw nothing (lse -inf) give 0."""
    m_run = tl.full(lse_ptrs.shape, float("-inf"), dtype=tl.float32)
    l_run = tl.zeros(lse_ptrs.shape, dtype=tl.float32)
    acc = tl.zeros(mid_ptrs.shape, dtype=tl.float32)
    for s in range(0, n_used):
        # .cg: read through L2, never a stale L1 line of another program's writes
        lse = tl.load(lse_ptrs + s * stride_lse_s, mask=row_ok, other=float("-inf"),
                      cache_modifier=".cg")
        o_s = tl.load(mid_ptrs + s * stride_mid_s, mask=row_ok[:, None] & col_ok[None, :],
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, lse)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # no -inf - -inf
        alpha = tl.exp(m_run - m_safe)
        w = tl.exp(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * o_s
        l_run = l_run * alpha + w
        m_run = m_new
    return acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]


@triton.jit
def finish_split(acc, m_i, l_i, split, n_used, fold, Counter, out_ptrs, mid_ptrs, lse_ptrs,
                 stride_mid_s, stride_lse_s, row_ok, col_ok):
    """End of split `split` of one (request, row block): acc [R, C] fp32 (unnormalized),
    running max m_i [R] and sum l_i [R]; out_ptrs [R, C], mid_ptrs [R, C] and lse_ptrs [R]
    point at the output and at split 0's partials. See the module docstring."""
    has_any = l_i > 0.0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    if n_used == 1:
        tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        lse = tl.where(has_any, m_i + tl.log(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(mid_ptrs + split * stride_mid_s, o, mask=mask)
        tl.store(lse_ptrs + split * stride_lse_s, lse, mask=row_ok)
        if fold != 0:
            tl.debug_barrier()  # every thread's partial stores precede the (release) ticket
            ticket = tl.atomic_add(Counter, 1, sem="acq_rel")
            if ticket == n_used - 1:  # the last split of this (request, row block) to finish
                tl.store(Counter, 0)  # reset for the next launch: graph replays find it zeroed
                o = merge_partials(mid_ptrs, lse_ptrs, stride_mid_s, stride_lse_s, n_used,
                                   row_ok, col_ok)
                tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t",
                               "stride_ml_h", "num_q", "num_splits", "block_n"])
def _merge_kernel(
    MidO, MidLse, SeqLens, Out,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_o_t, stride_o_h,
    n_heads, v_head_dim, num_q, num_splits, block_n,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # program (query row t, head block, column chunk): merge of t's non-empty splits
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    seq_len = tl.load(SeqLens + t // num_q)
    n_used = tl.cdiv(seq_len, split_len(seq_len, num_splits, block_n))
    if n_used > 1:  # one split: the split kernel wrote the output itself
        h_ok = offs_h < n_heads
        dv_ok = offs_dv < v_head_dim
        o = merge_partials(MidO + t * stride_mo_t + offs_h[:, None] * stride_mo_h
                           + offs_dv[None, :],
                           MidLse + t * stride_ml_t + offs_h * stride_ml_h,
                           stride_mo_s, 1, n_used, h_ok, dv_ok)  # [BLOCK_H, BLOCK_DV]
        tl.store(Out + t * stride_o_t + offs_h[:, None] * stride_o_h + offs_dv[None, :],
                 o.to(Out.dtype.element_ty), mask=h_ok[:, None] & dv_ok[None, :])


# ----------------------------------------------------------------------------- host side

def tickets(device: torch.device, n: int, fold: bool) -> tuple[torch.Tensor, bool]:
    """(the device's ticket counters, fold): n zeroed int32 counters for a folded merge, which the
    kernels leave zeroed. Allocated once, at the first eager call, so every captured graph binds
    the same live buffer; one stream at a time may run a folded launch. A first call during a
    graph capture cannot zero them: it gets fold=False (the merge kernel) and an unused buffer."""
    if n > N_COUNTERS:
        raise ValueError(f"a folded merge needs one counter per (request, row block): {n} > "
                         f"N_COUNTERS={N_COUNTERS}; raise N_COUNTERS or pass fold=False")
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.empty(1, dtype=torch.int32, device=device), False
        _COUNTERS[device] = torch.zeros(N_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[device], fold


def should_fold(num_splits: int, rows_per_program: int, v_head_dim: int, limit: int | None = None) -> bool:
    """Fold the merge into the split pass when the last program's read of all partials is small
    (at most `limit` bytes; default FOLD_MAX_BYTES)."""
    return num_splits * rows_per_program * v_head_dim * 4 <= (FOLD_MAX_BYTES if limit is None else limit)


def partials(n_rows: int, n_heads: int, num_splits: int, v_head_dim: int, device):
    """(mid_o [n_rows, H, S, DV], mid_lse [n_rows, H, S]) fp32; never read before written."""
    mid_o = torch.empty(n_rows, n_heads, num_splits, v_head_dim, dtype=torch.float32,
                        device=device)
    mid_lse = torch.empty(n_rows, n_heads, num_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def launch_merge(mid_o, mid_lse, seq_lens, o, num_q: int, num_splits: int, block_n: int):
    """The separate merge pass: o [n_rows, H, DV] from the partials of the non-empty splits."""
    n_rows, n_heads, v_head_dim = o.shape
    block_h, block_dv = 16, min(64, max(16, triton.next_power_of_2(v_head_dim)))
    grid = (n_rows, triton.cdiv(n_heads, block_h), triton.cdiv(v_head_dim, block_dv))
    _merge_kernel[grid](
        mid_o, mid_lse, seq_lens, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1), n_heads, v_head_dim, num_q, num_splits, block_n,
        BLOCK_H=block_h, BLOCK_DV=block_dv, num_warps=4,
    )
