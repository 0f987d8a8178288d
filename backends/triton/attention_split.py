"""Split-KV bookkeeping shared by the paged split kernels (GQA decode / verify / extend, MLA): who
covers which positions, how a split's partial result is finished, and the two ways partials are
merged.

Program (request r, row block b, split s) of a split kernel covers positions
`[s·L_r, min((s+1)·L_r, seq_len_r))`, `L_r = roundup(cdiv(seq_len_r, S), BLOCK_N)`: each request
is divided by its *own* length (read on the device), so the grid (fixed by shapes) serves every
length. Of the S splits, `n_used = cdiv(seq_len_r, L_r)` are non-empty; the others exit at once.

Finishing a split (`finish_split`, called at the end of a split kernel):
- `n_used == 1`: the only split writes the normalized output (no partials, no merge).
- otherwise it writes its partial `(o_s, lse_s)` to `mid_o [n_rows, H, S, DV]` fp32 (rows padded
  to PARTIALS_ALIGN columns, so its strides are known multiples of 16: `aligned`, 16-byte
  accesses) and `mid_lse [n_rows, H, S]`, and then either
  - fold: bumps a per-(request, row block) counter; the program that draws the last ticket merges
    all `n_used` partials (`merge_partials`) and writes the output, then resets the counter to 0
    itself, so the next launch (a graph replay) finds it zeroed: one launch per decode step; or
  - a second, small kernel (`_merge_kernel`, grid (row, head, DV chunk of 64)) merges after: two
    launches, but the merge is spread over many programs (chosen when the partials one program
    would have to read are large, `should_fold`: MLA's 512-wide rows, many splits).

Both merges are latency-bound reads of L2-resident partials, so both keep many splits' loads in
flight at once instead of one split per round trip: the folded merge takes MERGE_UNROLL splits a
step ([R, C] tiles of the split kernel, all loads issued before the step's online-softmax
update; MERGE_UNROLL from the tile shape, `merge_unroll`), the merge kernel one
[MERGE_S_TILE splits, 64 columns] tile a step (each split lane keeps its own running max and sum;
the lanes are combined once at the end). Rows whose splits all saw nothing (lse -inf) give 0.

`num_splits`, `fold` and `block_n` are runtime arguments of every kernel here (not specialized),
and no constexpr depends on the split count, so every split count of a bucket ladder runs the
same compiled kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fold the merge into the split pass when the partials the last program reads are at most this
# many bytes (128 KB). The folded merge is latency-bound: it costs ~cdiv(n_used, UNROLL) L2 round
# trips (~0.2-0.3 µs each, estimated, not measured) plus the bytes one SM can pull from L2; the
# merge kernel costs a second launch in the graph (~2-3 µs) plus 1-2 round trips spread over
# bs * H * DV/64 programs. At GQA decode (4 rows x 128, UNROLL 4) 128 KB = 64 splits = 16 round
# trips, about the break-even; MLA's 16 x 512 rows (UNROLL 1, 32 KB a split) are limited by one
# SM's L2 bandwidth rather than by round trips, so a bytes bound still fits them. The faster
# merge therefore did not clearly move the break-even: kept at 128 KB (sweep: bench_attention's
# fold column; 256 KB would fold GQA decode at 128 splits).
FOLD_MAX_BYTES_TUNED = 128 * 1024
FOLD_MAX_BYTES = FOLD_MAX_BYTES_TUNED
# Folded merge: fp32 registers a thread for one step's MERGE_UNROLL partial tiles
# (`merge_unroll`), and the most splits a step, so that the epilogue does not raise the split
# kernels' register peak much. Ahead-of-time sm_90a compiles (Triton 3.6 with the JIT's
# divisibility specialization, no GPU; registers before -> after this merge): GQA decode d 128
# ([16, 128] tiles, 16 fp32 a thread a split) UNROLL 4: 86 -> 102 (5 -> 4 programs an SM by
# registers; 6 by shared memory); d 64 UNROLL 4: 67 -> 72 (UNROLL 8 gave 113, 7 -> 4 programs
# an SM: hence the cap of 4); verify k 8 UNROLL 2: 168 -> 168; MLA [16, 512] UNROLL 1:
# 203 -> 180 (16-byte partial accesses); extend [64, 128] at 8 warps UNROLL 2: 163 -> 162.
# ptxas issues all loads of a 4-split step before their uses; at 8 it sinks half of them.
MERGE_TILE_REGS = 64
MERGE_MAX_UNROLL = 4
# merge kernel: a program merges one (row, head) x MERGE_BLOCK_DV columns, MERGE_S_TILE splits a
# round trip ([32, 64] fp32 = 8 KB in flight, 16 + 16 registers a thread at 4 warps); bs = 1,
# 32 heads, DV 128 gives 64 programs (was 4 at 16 heads x 64 columns a program), 128 splits = 4
# round trips each.
MERGE_S_TILE = 32
MERGE_BLOCK_DV = 64
MERGE_NUM_WARPS = 4
# mid_o rows are padded to a multiple of this many fp32 (see `aligned`, which hard-codes it)
PARTIALS_ALIGN = 16
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
def tile_slots(idx, offs, end):
    """Cache slots (int64) of key positions `offs` from a request's row `idx` of req_to_token;
    0 (the sink slot) at and past `end`."""
    return tl.load(idx + offs, mask=offs < end, other=0).to(tl.int64)


@triton.jit
def aligned(stride):
    """A stride of the partials (`partials`: a multiple of PARTIALS_ALIGN = 16 elements), known as
    such to the compiler. The strides are unspecialized runtime arguments (one compile for every
    split count), so without this the partials' loads and stores are scalar, 1 element each."""
    return (stride // 16) * 16


@triton.jit
def merge_partials(mid_ptrs, lse_ptrs, stride_mid_s, stride_lse_s, n_used, row_ok, col_ok,
                   UNROLL: tl.constexpr):
    """Log-sum-exp merge of splits 0 .. n_used-1: mid_ptrs [R, C] / lse_ptrs [R] point at
    split 0 -> [R, C] fp32. Rows whose splits all saw nothing (lse -inf) give 0.

    UNROLL splits a step: their loads are independent of each other and of the running update,
    so they are all in flight together: ~cdiv(n_used, UNROLL) L2 round trips, not n_used. Each
    step holds UNROLL [R, C] fp32 tiles (`merge_unroll` sizes it from R, C and the warps)."""
    mask = row_ok[:, None] & col_ok[None, :]
    m_run = tl.full(lse_ptrs.shape, float("-inf"), dtype=tl.float32)
    l_run = tl.zeros(lse_ptrs.shape, dtype=tl.float32)
    acc = tl.zeros(mid_ptrs.shape, dtype=tl.float32)
    for s0 in range(0, n_used, UNROLL):
        # issue the step's loads first (program order: ptxas keeps them ahead of their uses)
        lses = ()
        tiles = ()
        for j in tl.static_range(UNROLL):
            # past n_used: lse -inf, weight 0 (tl.where: the interpreter mistypes block & scalar)
            ok = s0 + j < n_used
            # .cg: read through L2, never a stale L1 line of another program's writes
            lses = lses + (tl.load(lse_ptrs + (s0 + j) * stride_lse_s,
                                   mask=tl.where(ok, row_ok, False), other=float("-inf"),
                                   cache_modifier=".cg"),)
            tiles = tiles + (tl.load(mid_ptrs + (s0 + j) * stride_mid_s,
                                     mask=tl.where(ok, mask, False), other=0.0,
                                     cache_modifier=".cg"),)
        m_new = m_run
        for j in tl.static_range(UNROLL):
            m_new = tl.maximum(m_new, lses[j])
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # no -inf - -inf
        alpha = tl.exp(m_run - m_safe)
        acc = acc * alpha[:, None]
        l_run = l_run * alpha
        for j in tl.static_range(UNROLL):
            w = tl.exp(lses[j] - m_safe)
            acc += w[:, None] * tiles[j]
            l_run += w
        m_run = m_new
    return acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]


@triton.jit
def last_to_arrive(counter, n):
    """After this program's stores: a ticket of *counter (release / acquire: every store before
    it, this program's and the others', is visible to the program that takes the last). True
    for the n-th program to take one, which resets the counter for the next launch (graph
    replays find it zeroed)."""
    tl.debug_barrier()      # every thread's stores precede the (release) ticket
    last = tl.atomic_add(counter, 1, sem="acq_rel") == n - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def finish_split(acc, m_i, l_i, split, n_used, fold, Counter, out_ptrs, mid_ptrs, lse_ptrs,
                 stride_mid_s, stride_lse_s, row_ok, col_ok, MERGE_UNROLL: tl.constexpr):
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
            if last_to_arrive(Counter, n_used):  # the last split of this (request, row block)
                o = merge_partials(mid_ptrs, lse_ptrs, stride_mid_s, stride_lse_s, n_used,
                                   row_ok, col_ok, MERGE_UNROLL)
                tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_mo_t", "stride_mo_h", "stride_mo_s", "stride_ml_t",
                               "stride_ml_h", "num_q", "num_splits", "block_n"])
def _merge_kernel(
    MidO, MidLse, SeqLens, Out,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h, stride_o_t, stride_o_h,
    v_head_dim, num_q, num_splits, block_n,
    S_TILE: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # program (query row t, head h, column chunk): merge of (t, h)'s non-empty splits. The
    # [S_TILE splits, BLOCK_DV columns] tile is one load (a split's row of partials is
    # contiguous); each of its S_TILE lanes keeps its own running max / sum / accumulator over
    # the s0 steps (elementwise, no reduction in the loop); the lanes are combined once at the end.
    stride_mo_t, stride_mo_h, stride_mo_s = (aligned(stride_mo_t), aligned(stride_mo_h),
                                             aligned(stride_mo_s))
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    seq_len = tl.load(SeqLens + t // num_q)
    n_used = tl.cdiv(seq_len, split_len(seq_len, num_splits, block_n))
    if n_used > 1:  # one split: the split kernel wrote the output itself
        dv_ok = offs_dv < v_head_dim
        mid = MidO + t * stride_mo_t + h * stride_mo_h + offs_dv[None, :]
        lse_row = MidLse + t * stride_ml_t + h * stride_ml_h
        m_lane = tl.full([S_TILE], float("-inf"), dtype=tl.float32)
        l_lane = tl.zeros([S_TILE], dtype=tl.float32)
        acc = tl.zeros([S_TILE, BLOCK_DV], dtype=tl.float32)
        for s0 in range(0, n_used, S_TILE):
            offs_s = s0 + tl.arange(0, S_TILE)
            s_ok = offs_s < n_used
            lse = tl.load(lse_row + offs_s, mask=s_ok, other=float("-inf"))
            o_s = tl.load(mid + offs_s[:, None] * stride_mo_s,
                          mask=s_ok[:, None] & dv_ok[None, :], other=0.0)  # [S_TILE, BLOCK_DV]
            m_new = tl.maximum(m_lane, lse)
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m_lane - m_safe)
            w = tl.exp(lse - m_safe)
            acc = acc * alpha[:, None] + w[:, None] * o_s
            l_lane = l_lane * alpha + w
            m_lane = m_new
        m = tl.max(m_lane, 0)
        f = tl.exp(m_lane - tl.where(m > float("-inf"), m, 0.0))  # [S_TILE]; empty lanes: 0
        l_sum = tl.sum(l_lane * f, 0)
        o = tl.sum(acc * f[:, None], 0) / tl.where(l_sum > 0.0, l_sum, 1.0)  # [BLOCK_DV]
        tl.store(Out + t * stride_o_t + h * stride_o_h + offs_dv, o.to(Out.dtype.element_ty),
                 mask=dv_ok)


# ----------------------------------------------------------------------------- host side

def tickets(device: torch.device, n: int, fold: bool) -> tuple[torch.Tensor, bool]:
    """(the device's ticket counters, fold): n zeroed int32 counters for a folded merge (or for
    the K-split tiles of `fused_decode`'s tensor-core kernels), which the kernels leave zeroed.
    Allocated once, at the first eager call, so every captured graph binds the same live buffer;
    one stream at a time may run a folded launch (launches in stream order share them: each
    takes its tickets after the kernel before it has finished). A first call during a graph
    capture cannot zero them: it gets fold=False (the merge kernel, or unsplit tiles) and an
    unused buffer. So does a launch that would need more than N_COUNTERS counters (a very large
    batch): every caller then runs its unfolded form, the same result."""
    if n > N_COUNTERS:
        return torch.empty(1, dtype=torch.int32, device=device), False
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
    """(mid_o [n_rows, H, S, DV], mid_lse [n_rows, H, S]) fp32; never read before written.
    mid_o is a view of a buffer padded to PARTIALS_ALIGN columns: every stride is a multiple of
    PARTIALS_ALIGN, which the kernels assert to the compiler (`aligned`) for 16-byte accesses."""
    padded = triton.cdiv(v_head_dim, PARTIALS_ALIGN) * PARTIALS_ALIGN
    mid_o = torch.empty(n_rows, n_heads, num_splits, padded, dtype=torch.float32,
                        device=device)[..., :v_head_dim]
    mid_lse = torch.empty(n_rows, n_heads, num_splits, dtype=torch.float32, device=device)
    return mid_o, mid_lse


def merge_unroll(rows: int, cols: int, num_warps: int) -> int:
    """Splits per step of a folded merge (`merge_partials`) over [rows, cols] fp32 tiles (the
    split kernel's padded tile): as many as fit MERGE_TILE_REGS registers a thread, a power of
    two in 1 .. MERGE_MAX_UNROLL. From tile shapes only, never the split count (one compile)."""
    per_thread = max(1, rows * cols // (32 * num_warps))
    unroll = max(1, min(MERGE_MAX_UNROLL, MERGE_TILE_REGS // per_thread))
    return 1 << (unroll.bit_length() - 1)


def launch_merge(mid_o, mid_lse, seq_lens, o, num_q: int, num_splits: int, block_n: int):
    """The separate merge pass: o [n_rows, H, DV] from the partials of the non-empty splits.
    One program per (row, head, MERGE_BLOCK_DV columns): bs * H * cdiv(DV, 64) programs, each
    reading MERGE_S_TILE splits a round trip."""
    n_rows, n_heads, v_head_dim = o.shape
    block_dv = min(MERGE_BLOCK_DV, max(16, triton.next_power_of_2(v_head_dim)))
    grid = (n_rows, n_heads, triton.cdiv(v_head_dim, block_dv))
    _merge_kernel[grid](
        mid_o, mid_lse, seq_lens, o,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1), v_head_dim, num_q, num_splits, block_n,
        S_TILE=MERGE_S_TILE, BLOCK_DV=block_dv, num_warps=MERGE_NUM_WARPS,
    )
