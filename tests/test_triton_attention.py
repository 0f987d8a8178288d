"""Paged attention kernels (interpreted on CPU) against their torch references, at awkward sizes.

Sizes exercise the masks: head_dim 96 (BLOCK_D 128), lengths not multiples of BLOCK_N (64),
batches mixing length-1 and long requests, padded lanes (seq_lens 1, row 0 -> sink slot 0), GQA
ratios 1 and 4. The sink tests poison slot 0 and every slot past each request's length with NaN:
a kernel that reads outside a real lane's own positions turns its output NaN.
"""
import pytest
import torch
import triton
import triton.language as tl

from attention_cases import K_DRAFT, merge_case, merge_reference, n_used_of, tree_masks

from padgraph.backends.triton.attention import (
    choose_num_splits, decode_attention, decode_attention_reference, extend_attention,
    extend_attention_reference, tree_verify_attention, tree_verify_attention_reference)
from padgraph.backends.triton.attention_decode import (SplitPolicy, choose_fold,
                                                       split_kv_attention)
from padgraph.backends.triton.attention_meta import CAUSAL, DECODE, TREE, PagedMeta
from padgraph.backends.triton.attention_extend import choose_extend_splits
from padgraph.backends.triton.attention_split import (
    _COUNTERS, FOLD_MAX_BYTES_TUNED, launch_merge, merge_partials, merge_unroll, partials,
    should_fold)

N_KV_HEADS = 2
MAX_CONTEXT = 160
PAD = None  # marks a padded lane in a list of lengths


def make_paged(lens, head_dim, v_head_dim=None, dtype=torch.float32, seed=0, poison=False):
    """Random paged cache for requests of `lens` (PAD = padded lane: length 1, row 0).

    Slots are shuffled. With poison, slot 0 and a dedicated slot that every position past a
    request's length maps to hold NaN. Returns (k_cache, v_cache, req_to_token, rows, seq_lens).
    """
    gen = torch.Generator().manual_seed(seed)
    v_head_dim = v_head_dim or head_dim
    n_real = sum(n for n in lens if n is not PAD)
    n_slots = n_real + 2  # + sink slot 0 + the past-the-end slot
    k_cache = torch.randn(n_slots, N_KV_HEADS, head_dim, generator=gen)
    v_cache = torch.randn(n_slots, N_KV_HEADS, v_head_dim, generator=gen)
    past_end = n_slots - 1
    width = max([MAX_CONTEXT] + [n for n in lens if n is not PAD])
    req_to_token = torch.full((len(lens) + 1, width), past_end, dtype=torch.int32)
    req_to_token[0] = 0  # the sink row maps everything to the sink slot
    free = (torch.randperm(n_real, generator=gen) + 1).tolist()
    rows, seq_lens = [], []
    for r, n in enumerate(lens):
        if n is PAD:
            rows.append(0)
            seq_lens.append(1)
            continue
        req_to_token[r + 1, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        rows.append(r + 1)
        seq_lens.append(n)
    if poison:
        for cache in (k_cache, v_cache):
            cache[0] = float("nan")
            cache[past_end] = float("nan")
    return (k_cache.to(dtype), v_cache.to(dtype), req_to_token,
            torch.tensor(rows, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32))


def unpoisoned(cache):
    return torch.nan_to_num(cache, nan=0.0)


def rand_q(n, n_q_heads, head_dim, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, n_q_heads, head_dim, generator=gen).to(dtype)


def assert_close(out, ref, dtype):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


# ----------------------------------------------------------------------------- decode

DECODE_LENS = [130, PAD, 1, 67, 64]


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_decode_matches_reference(head_dim, group, num_splits):
    k_cache, v_cache, r2t, rows, lens = make_paged(DECODE_LENS, head_dim)
    q = rand_q(len(DECODE_LENS), N_KV_HEADS * group, head_dim)
    out = decode_attention(q, k_cache, v_cache, r2t, rows, lens, num_splits=num_splits,
                           impl="triton")
    ref = decode_attention_reference(q, k_cache, v_cache, r2t, rows, lens)
    assert out.shape == (len(DECODE_LENS), N_KV_HEADS * group, head_dim)
    assert_close(out, ref, torch.float32)


def test_decode_bf16_and_v_head_dim():
    lens = [100, PAD, 3]
    k_cache, v_cache, r2t, rows, lens = make_paged(lens, 96, v_head_dim=64, dtype=torch.bfloat16)
    q = rand_q(3, 8, 96, torch.bfloat16)
    out = decode_attention(q, k_cache, v_cache, r2t, rows, lens, num_splits=2, impl="triton")
    ref = decode_attention_reference(q, k_cache, v_cache, r2t, rows, lens)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 8, 64)
    assert_close(out, ref, torch.bfloat16)


def test_decode_sinks_and_past_the_end_are_never_read():
    k_cache, v_cache, r2t, rows, lens = make_paged(DECODE_LENS, 64, poison=True)
    q = rand_q(len(DECODE_LENS), 8, 64)
    real = [i for i, n in enumerate(DECODE_LENS) if n is not PAD]
    ref = decode_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     lens)
    for num_splits in (1, 4, 130):  # 130: most splits empty, 256-wide merge
        out = decode_attention(q, k_cache, v_cache, r2t, rows, lens, num_splits=num_splits,
                               impl="triton")
        assert torch.isfinite(out[real]).all(), f"a real lane read a poisoned slot ({num_splits=})"
        assert_close(out[real], ref[real], torch.float32)


@pytest.mark.parametrize("fold", [True, False])
def test_decode_merge_folded_or_separate(fold):
    # the last split to finish merges (fold, one launch) or the merge kernel does; either way the
    # counters are zero afterwards, so a second launch (a graph replay) starts clean
    k_cache, v_cache, r2t, rows, lens = make_paged(DECODE_LENS, 64, poison=True)
    q = rand_q(len(DECODE_LENS), 8, 64)
    real = [i for i, n in enumerate(DECODE_LENS) if n is not PAD]
    ref = decode_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     lens)
    for _ in range(2):
        out = split_kv_attention(q, k_cache, v_cache, PagedMeta.decode(r2t, rows, lens),
                                 64 ** -0.5, SplitPolicy(num_splits=3, fold=fold))
        assert torch.isfinite(out[real]).all()
        assert_close(out[real], ref[real], torch.float32)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_decode_auto_on_cpu_is_the_reference():
    k_cache, v_cache, r2t, rows, lens = make_paged([5, PAD], 64)
    q = rand_q(2, 4, 64)
    out = decode_attention(q, k_cache, v_cache, r2t, rows, lens, sm_scale=0.3)
    ref = decode_attention_reference(q, k_cache, v_cache, r2t, rows, lens, sm_scale=0.3)
    assert torch.equal(out, ref)


def test_choose_num_splits_uses_shapes_only():
    # splits >= 128 tokens of the cache width (decode: >= 64 while <= 8 splits, folded); decode:
    # the largest power of two <= 4 programs an SM (132 SMs: 528 programs), <= 64 splits
    assert choose_num_splits(1, 8, 4096, 132) == 32          # capped by the width
    assert choose_num_splits(1, 8, 32768, 132) == 64         # capped by DECODE_MAX_SPLITS
    assert choose_num_splits(8, 8, 4096, 132) == 8
    assert choose_num_splits(8, 8, 32768, 132) == 8
    assert choose_num_splits(32, 8, 4096, 132) == 2
    assert choose_num_splits(32, 8, 32768, 132) == 2
    assert choose_num_splits(128, 8, 512, 132) == 1
    assert choose_num_splits(128, 8, 32768, 132) == 1
    assert choose_num_splits(1024, 8, 32768, 132) == 1
    assert choose_num_splits(1, 8, 512, 132) == 8            # 64-token splits while folded
    assert choose_num_splits(8, 8, 512, 132) == 8
    assert choose_num_splits(1, 8, 1024, 132) == 8           # 128 tokens give 8 already
    assert choose_num_splits(1, 8, 2048, 132) == 16          # 128 tokens: beyond the fold
    assert choose_num_splits(1, 8, 256, 132) == 4            # 64-token splits
    assert choose_num_splits(1, 8, 100, 132) == 1
    assert choose_num_splits(3, 2, 32768, 100) == 64         # 400 // 6 = 66 -> 64
    for bs in range(1, 300):
        s = choose_num_splits(bs, 8, 32768, 132)
        assert s & (s - 1) == 0 and bs * 8 * s <= max(528, bs * 8)
    # tree verify (k = 8 query rows a request): ~16 an SM, <= 128 splits, as before
    assert choose_num_splits(1, 8, 32768, 132, num_q=8) == 128
    assert choose_num_splits(8, 8, 4096, 132, num_q=8) == 32
    assert choose_num_splits(32, 8, 4096, 132, num_q=8) == 9
    # with 128-token tiles: the largest power of two keeping <= 2 programs an SM
    assert choose_num_splits(1, 8, 4096, 132, num_q=8, block_n=128) == 32
    assert choose_num_splits(8, 8, 4096, 132, num_q=8, block_n=128) == 4
    assert choose_num_splits(32, 8, 4096, 132, num_q=8, block_n=128) == 1
    assert choose_num_splits(1, 8, 512, 132, num_q=8, block_n=128) == 4      # the width's cap
    assert choose_num_splits(1, 8, 32768, 132, num_q=8, block_n=128) == 32
    assert choose_num_splits(8, 8, 4096, 132, num_q=8, block_n=64) == 32    # 64: as before
    assert choose_num_splits(8, 8, 4096, 132, block_n=128) == 8             # decode: as before


def test_choose_fold_by_split_count_for_decode_by_bytes_for_verify():
    # decode: folded up to 8 splits (a serial pass over the splits in the last program), then
    # the merge kernel; verify: while the partials stay <= FOLD_MAX_BYTES (128 KB)
    assert choose_fold(8, 1, 4, 128) and not choose_fold(16, 1, 4, 128)
    assert not choose_fold(64, 1, 1, 128)
    assert choose_fold(8, 8, 4, 128) and not choose_fold(9, 8, 4, 128)


def test_merge_is_folded_when_the_partials_are_small():
    lim = FOLD_MAX_BYTES_TUNED
    assert should_fold(33, 4, 128, lim)  # GQA 4 rows x 128: 33 splits = 66 KB, one launch
    assert not should_fold(128, 4, 128, lim)  # 256 KB: the merge kernel spreads the read
    assert should_fold(4, 16, 512, lim) and not should_fold(5, 16, 512, lim)  # MLA rows: 32 KB a split
    assert should_fold(33, 4, 128)       # the default threshold


def test_decode_checks_shapes():
    k_cache, v_cache, r2t, rows, lens = make_paged([5, 3], 64)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        decode_attention(rand_q(2, 3, 64), k_cache, v_cache, r2t, rows, lens)
    with pytest.raises(ValueError, match="seq_lens must be"):
        decode_attention(rand_q(2, 4, 64), k_cache, v_cache, r2t, rows, lens[:1])
    with pytest.raises(ValueError, match="one dtype"):
        decode_attention(rand_q(2, 4, 64, torch.bfloat16), k_cache, v_cache, r2t, rows, lens,
                         impl="triton")


def test_paged_meta_checks_what_its_mode_needs():
    """Each mode's constructor takes its own metadata; a value missing it, carrying another
    mode's, or with the wrong num_q, bs or dtype is refused when built, not at launch."""
    _, _, r2t, rows, lens = make_paged([5, PAD, 3], 64)
    mask, indptr = tree_masks(3, pad_rows=[1]), torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    assert (PagedMeta.decode(r2t, rows, lens).mode, PagedMeta.decode(r2t, rows, lens).num_q) \
        == (DECODE, 1)
    tree = PagedMeta.tree(r2t, rows, lens, mask)
    assert (tree.mode, tree.num_q, tree.bs, tree.max_context) == (TREE, K_DRAFT, 3, MAX_CONTEXT)
    assert PagedMeta.causal(r2t, rows, lens, indptr).mode == CAUSAL
    with pytest.raises(ValueError, match="tree_mask must be \\[bs, k, k\\] bool"):
        PagedMeta.tree(r2t, rows, lens, mask.int())
    with pytest.raises(ValueError, match=r"tree_mask.*shape must be \[bs=3, k, k\]"):
        PagedMeta.tree(r2t, rows, lens, mask[:2])
    with pytest.raises(ValueError, match=r"qo_indptr must be \[bs\+1=4\]"):
        PagedMeta.causal(r2t, rows, lens, indptr[:3])
    with pytest.raises(ValueError, match="tree_mask.*given in tree mode only, got None"):
        PagedMeta(r2t, rows, lens, TREE, K_DRAFT)
    with pytest.raises(ValueError, match="qo_indptr.*given in causal mode only, got a tensor"):
        PagedMeta(r2t, rows, lens, qo_indptr=indptr)
    with pytest.raises(ValueError, match="num_q in tree mode must be 4, got 2"):
        PagedMeta(r2t, rows, lens, TREE, 2, tree_mask=mask)
    with pytest.raises(ValueError, match="num_q in decode mode must be 1, got 2"):
        PagedMeta(r2t, rows, lens, DECODE, 2)
    with pytest.raises(ValueError, match=r"'seq_lens': shape must be \[bs=3\], got \(2,\)"):
        PagedMeta.decode(r2t, rows, lens[:2])
    with pytest.raises(TypeError, match="'req_pool_indices': dtype must be int32 or int64"):
        PagedMeta.decode(r2t, rows.float(), lens)
    with pytest.raises(ValueError, match="mode must be"):
        PagedMeta(r2t, rows, lens, 3)


def test_split_kv_policy_and_mode_are_checked():
    k_cache, v_cache, r2t, rows, lens = make_paged([5, 3], 64)
    with pytest.raises(ValueError, match="num_splits must be in 1 .. 256; got 0"):
        SplitPolicy(num_splits=0)
    with pytest.raises(ValueError, match="block_n must be a power of two; got 48"):
        SplitPolicy(block_n=48)
    with pytest.raises(ValueError, match="num_warps must be a power of two; got 0"):
        SplitPolicy(num_warps=0)
    causal = PagedMeta.causal(r2t, rows, lens, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="decode and tree metadata; got causal"):
        split_kv_attention(rand_q(2, 4, 64), k_cache, v_cache, causal, 0.125)


# ----------------------------------------------------------------------------- merge

@triton.jit
def _merge_partials_kernel(MidO, MidLse, Out, n_used, n_rows, n_cols, stride_mo_r, stride_mo_s,
                           stride_ml_r, R: tl.constexpr, C: tl.constexpr, UNROLL: tl.constexpr):
    # one program: the folded merge of rows 0 .. n_rows-1 (padded to R), columns to C
    offs_r = tl.arange(0, R)
    offs_c = tl.arange(0, C)
    row_ok = offs_r < n_rows
    col_ok = offs_c < n_cols
    o = merge_partials(MidO + offs_r[:, None] * stride_mo_r + offs_c[None, :],
                       MidLse + offs_r * stride_ml_r, stride_mo_s, 1, n_used, row_ok, col_ok,
                       UNROLL)
    tl.store(Out + offs_r[:, None] * n_cols + offs_c[None, :], o,
             mask=row_ok[:, None] & col_ok[None, :])


# (n_used, UNROLL): one split; n_used below, at and off a multiple of UNROLL; the most splits
@pytest.mark.parametrize("n_used,unroll", [(1, 4), (3, 4), (8, 8), (37, 8), (130, 1), (256, 8)])
def test_folded_merge_partials(n_used, unroll):
    # rows: 5 of a 16-row tile, one whose every split saw nothing (-> 0, not NaN), one with
    # empty splits among full ones; 24 of 32 columns; partials past n_used are NaN (never read)
    mid_o, mid_lse = merge_case(5, 1, n_used + 3, 24, n_used, seed=n_used)
    mid_o, mid_lse = mid_o[:, 0], mid_lse[:, 0]  # [rows, S, DV], [rows, S]
    out = torch.full((5, 24), float("nan"))
    _merge_partials_kernel[(1,)](mid_o, mid_lse, out, n_used, 5, 24, mid_o.stride(0),
                                 mid_o.stride(1), mid_lse.stride(0), R=16, C=32, UNROLL=unroll)
    ref = merge_reference(mid_o[:, None], mid_lse[:, None], torch.full((5,), n_used))[:, 0]
    assert torch.isfinite(out).all() and out[1].abs().sum() == 0
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits,block_n", [(130, 16), (256, 16), (3, 64)])
def test_merge_kernel(num_splits, block_n):
    # the separate merge over rows of requests whose lengths use 1 .. num_splits splits
    # (n_used > MERGE_S_TILE: several steps); rows of one-split requests are left untouched
    num_q, n_heads, v_head_dim = 2, 3, 80  # 2 column chunks, the second one masked
    lens = torch.tensor([4096, 1, 2100, 40, 150], dtype=torch.int32)
    n_used = n_used_of(lens, num_splits, block_n).repeat_interleave(num_q)
    mid_o, mid_lse = merge_case(len(lens) * num_q, n_heads, num_splits, v_head_dim, n_used)
    o = torch.full((len(lens) * num_q, n_heads, v_head_dim), 7.0)
    launch_merge(mid_o, mid_lse, lens, o, num_q, num_splits, block_n)
    ref = merge_reference(mid_o, mid_lse, n_used)
    merged = n_used > 1
    assert torch.isfinite(o).all()
    assert (o[~merged] == 7.0).all()  # the split kernel writes these itself
    torch.testing.assert_close(o[merged], ref[merged].float(), rtol=1e-5, atol=1e-5)


def test_merge_unroll_depends_on_tiles_only():
    assert merge_unroll(16, 128, 4) == 4  # GQA decode d 128: 16 fp32 a thread a split
    assert merge_unroll(32, 128, 4) == 2  # verify k 8
    assert merge_unroll(16, 512, 4) == 1  # MLA rows
    assert merge_unroll(64, 128, 8) == 2  # extend
    assert merge_unroll(16, 64, 4) == merge_unroll(16, 16, 4) == 4  # capped
    mid_o, _ = partials(2, 3, 5, 24, "cpu")
    assert mid_o.shape == (2, 3, 5, 24) and mid_o.stride() == (3 * 5 * 32, 5 * 32, 32, 1)


def check_poisoned_decode(lens_list, policy, dtype=torch.float32):
    """`split_kv_attention` under `policy` on a cache whose sink and past-the-end slots hold NaN:
    the real lanes are finite and the reference's, and the ticket counters end zeroed."""
    k_cache, v_cache, r2t, rows, lens = make_paged(lens_list, 64, dtype=dtype, poison=True)
    q = rand_q(len(lens_list), 8, 64, dtype=dtype)
    real = [i for i, n in enumerate(lens_list) if n is not PAD]
    ref = decode_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     lens)
    out = split_kv_attention(q, k_cache, v_cache, PagedMeta.decode(r2t, rows, lens), 64 ** -0.5,
                             policy)
    assert torch.isfinite(out[real]).all(), "a real lane read a poisoned slot"
    assert_close(out[real], ref[real], dtype)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


PREFETCH_LENS = [130, PAD, 1, 31, 32, 33, 64, 97]


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("num_splits,block_n,fold", [(1, 16, True), (3, 16, True), (3, 32, False),
                                                     (8, 32, True), (130, 16, True)])
def test_decode_prefetch_reads_only_its_tiles(prefetch, num_splits, block_n, fold):
    """The double-buffered loop (each step issues the next tile's K / V) gives the reference's
    output at every split count and tile width, lengths at and around the tile edges, and never
    reads a poisoned sink or past-the-end slot (the next tile's loads are masked to the split)."""
    check_poisoned_decode(PREFETCH_LENS, SplitPolicy(num_splits=num_splits, block_n=block_n,
                                                     fold=fold, prefetch=prefetch))


def test_choose_prefetch_for_decode_with_few_pairs():
    from padgraph.backends.triton.attention_decode import PREFETCH_MAX_PAIRS, choose_prefetch
    assert choose_prefetch(1, 1, 8) and PREFETCH_MAX_PAIRS == 8       # bs 1 at 8 kv heads
    assert not choose_prefetch(1, 2, 8) and not choose_prefetch(1, 8, 8)
    assert not choose_prefetch(4, 1, 2)                               # tree verify keeps its loop
    # a split's share of the row: up to PREFETCH_MAX_SPLIT_TOKENS double-buffered, past it not
    assert choose_prefetch(1, 1, 8, 128) and not choose_prefetch(1, 1, 8, 129)


def test_long_rows_at_bs_1_take_the_single_buffered_loop():
    """bs 1 decode runs the double-buffered loop while each split covers <= 128 tokens of the
    cache row, and the single-buffered loop's tile past it (the plan's splits unchanged)."""
    from padgraph.backends.triton import attention_decode as ad
    cases = {512: (8, True, 32), 4096: (32, True, 32), 8192: (64, True, 32),
             16384: (64, False, 64), 32768: (64, False, 64)}
    for ctx, want in cases.items():
        plan = ad.plan_split(1, 8, 4, 1, 128, 128, ctx, 132)
        assert (plan.num_splits, plan.prefetch, plan.blocks["BLOCK_N"]) == want, ctx
    assert ad.plan_split(1, 8, 4, 1, 64, 64, 32768, 132).blocks["BLOCK_N"] == 128  # narrow
    # a policy's own splits decide it too: 4 splits of a 4096 row are 1024 tokens each
    assert not ad.plan_split(1, 8, 4, 1, 128, 128, 4096, 132, itemsize=2,
                             policy=SplitPolicy(num_splits=4)).prefetch
    assert ad.plan_split(1, 8, 4, 1, 128, 128, 4096, 132, policy=SplitPolicy(
        num_splits=4, prefetch=True)).prefetch                        # a set knob stays


NARROW_LENS = [300, PAD, 1, 63, 64, 65, 127, 128, 129, 257]


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("num_splits,fold", [(1, True), (3, True), (3, False), (12, False)])
def test_decode_default_tiles_at_head_dim_64(prefetch, num_splits, fold):
    """At head dim 64 in bf16 decode takes the default tiles (128 tokens single-buffered, 32
    double-buffered): lengths at and around the tile edges, split or not, folded or merged by
    the second kernel, give the reference's output and read no poisoned slot."""
    check_poisoned_decode(NARROW_LENS, SplitPolicy(num_splits=num_splits, fold=fold,
                                                   prefetch=prefetch), torch.bfloat16)


WIDE_TREE_LENS = [300, PAD, K_DRAFT, 127, 128, 129, 128 + K_DRAFT, 257]


@pytest.mark.parametrize("num_splits,fold", [(1, True), (3, True), (3, False)])
def test_tree_verify_default_tiles_at_head_dim_128(num_splits, fold):
    """Tree verify at head dim 128 in bf16, 4 q heads a kv head (32 query rows a program),
    takes the default 128-token tiles (`tree_block_n`): drafts at and around the tile edges,
    split or not, folded or merged, give the reference's output and read no poisoned slot."""
    from padgraph.backends.triton.attention_decode import plan_split
    assert plan_split(8, N_KV_HEADS, 4, K_DRAFT, 128, 128, 512, 4).blocks["BLOCK_N"] == 128
    dtype, group = torch.bfloat16, 4
    k_cache, v_cache, r2t, rows, lens = make_paged(WIDE_TREE_LENS, 128, dtype=dtype, poison=True)
    mask = tree_masks(len(WIDE_TREE_LENS), pad_rows=[1])
    q = rand_q(len(WIDE_TREE_LENS) * K_DRAFT, N_KV_HEADS * group, 128, dtype)
    real = [r * K_DRAFT + i for r, n in enumerate(WIDE_TREE_LENS) if n is not PAD
            for i in range(K_DRAFT)]
    ref = tree_verify_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t,
                                          rows, lens, mask)
    out = split_kv_attention(q, k_cache, v_cache, PagedMeta.tree(r2t, rows, lens, mask),
                             128 ** -0.5, SplitPolicy(num_splits=num_splits, fold=fold))
    assert torch.isfinite(out[real]).all(), "a real lane read a poisoned slot"
    assert_close(out[real], ref[real], dtype)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_tree_verify_tiles_by_head_dim_and_rows():
    from padgraph.backends.triton.attention_decode import plan_split, tree_block_n
    assert tree_block_n(128, 128, 32) == 128 and tree_block_n(96, 96, 8) == 128
    assert tree_block_n(64, 64, 32) is None                          # d 64: kernel_blocks' 64
    assert tree_block_n(128, 128, 64) is None                        # 64 query rows
    assert tree_block_n(256, 256, 16) is None                        # kernel_blocks' 32
    assert tree_block_n(128, 128, 32, itemsize=4) is None            # fp32 keeps its tile
    def tile(d, num_q, group, **policy):      # 16 requests: decode's single-buffered loop
        plan = plan_split(16, 8, group, num_q, d, d, 4096, 132, policy=SplitPolicy(**policy))
        return plan.blocks["BLOCK_N"], plan.num_warps
    assert tile(128, 8, 4) == (128, 4)                               # 8 drafts at group 4
    assert tile(128, 8, 8) == (64, 4)                                # at group 8: 64 rows
    assert tile(64, 8, 4) == (64, 4)
    assert tile(128, 1, 4) == (64, 4)                                # decode keeps its tile
    assert tile(128, 8, 4, block_n=32, num_warps=8) == (32, 8)       # a policy's


def test_decode_tiles_by_head_dim():
    from padgraph.backends.triton.attention_decode import decode_block_n
    assert decode_block_n(64, 64, 1, False) == 128 and decode_block_n(64, 64, 1, True) == 32
    assert decode_block_n(32, 32, 1, False) == 128
    assert decode_block_n(128, 128, 1, False) is None                # kernel_blocks' 64
    assert decode_block_n(128, 128, 1, True) == 32
    assert decode_block_n(64, 128, 1, False) is None                 # the wider of the two
    assert decode_block_n(64, 64, 4, False) is None                  # tree verify keeps its tile
    assert decode_block_n(64, 64, 1, False, itemsize=4) is None      # fp32 keeps its tile
    assert decode_block_n(32, 32, 1, False, itemsize=4) is None


# long requests, a short one and a padded lane; BLOCK_N 16 so that most of the splits are used:
# 37 splits -> (19, 1, 19, 3) non-empty, 130 -> (38, 1, 19, 3) (MERGE_UNROLL 4 here)
MANY_SPLIT_LENS = [600, PAD, 300, 37]
MANY_SPLIT_REQS = [(600, 5), (PAD, 0), (300, 2)]  # extend: (seq_len, new tokens)


@pytest.mark.parametrize("num_splits,fold", [(37, True), (37, False), (130, True)])
def test_decode_many_splits(num_splits, fold):
    check_poisoned_decode(MANY_SPLIT_LENS, SplitPolicy(num_splits=num_splits, block_n=16,
                                                       fold=fold))


# ----------------------------------------------------------------------------- extend

# (seq_len, new tokens) per request; PAD requests have seq_len 1, row 0 and no new tokens
EXTEND_REQS = [(130, 70), (PAD, 0), (9, 9), (67, 0), (1, 1), (40, 3)]
N_PAD_TOKENS = 5


def test_more_folds_than_counters_run_unfolded(monkeypatch):
    """A launch whose folded merge needs more ticket counters than there are (a very large batch
    with an explicit split count) runs its unfolded form instead of raising: decode with the
    merge kernel, extend unsplit, with the reference's outputs."""
    from padgraph.backends.triton import attention_split
    monkeypatch.setattr(attention_split, "N_COUNTERS", 3)   # 5 requests x 2 kv heads need 10
    k_cache, v_cache, r2t, rows, lens = make_paged(DECODE_LENS, 64, poison=True)
    q = rand_q(len(DECODE_LENS), 8, 64)
    real = [i for i, n in enumerate(DECODE_LENS) if n is not PAD]
    ref = decode_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     lens)
    out = decode_attention(q, k_cache, v_cache, r2t, rows, lens, num_splits=2, impl="triton")
    assert_close(out[real], ref[real], torch.float32)
    args = extend_case(64, group=4)
    assert_close(extend_attention(*args, impl="triton", num_splits=3),
                 extend_attention_reference(*args), torch.float32)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def extend_case(head_dim, dtype=torch.float32, poison=False, group=1, reqs=EXTEND_REQS):
    lens = [n for n, _ in reqs]
    k_cache, v_cache, r2t, rows, seq_lens = make_paged(lens, head_dim, dtype=dtype,
                                                       poison=poison)
    n_new = torch.tensor([m for _, m in reqs])
    qo_indptr = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(n_new, 0)
    q = rand_q(int(qo_indptr[-1]) + N_PAD_TOKENS, N_KV_HEADS * group, head_dim, dtype)
    return q, k_cache, v_cache, r2t, rows, seq_lens, qo_indptr


@pytest.mark.parametrize("num_splits", [None, 3])  # 3: draft-extend style, merge folded
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_extend_matches_reference(head_dim, group, num_splits):
    args = extend_case(head_dim, group=group)
    out = extend_attention(*args, impl="triton", num_splits=num_splits)
    ref = extend_attention_reference(*args)
    assert_close(out, ref, torch.float32)
    assert out[-N_PAD_TOKENS:].abs().sum() == 0  # padding tokens give 0


def test_extend_bf16():
    args = extend_case(96, dtype=torch.bfloat16, group=4)
    out = extend_attention(*args, impl="triton")
    ref = extend_attention_reference(*args)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_extend_sinks_and_past_the_end_are_never_read(num_splits):
    q, k_cache, v_cache, r2t, rows, seq_lens, qo_indptr = extend_case(64, poison=True, group=4)
    ref = extend_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     seq_lens, qo_indptr)
    for _ in range(2):  # a second launch finds the folded merge's counters zeroed
        out = extend_attention(q, k_cache, v_cache, r2t, rows, seq_lens, qo_indptr,
                               impl="triton", num_splits=num_splits)
        assert torch.isfinite(out).all()
        assert_close(out, ref, torch.float32)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_extend_many_splits():
    # 9 splits of 128 positions: the folded merge of up to 5 splits over 64-row tiles
    # (MERGE_UNROLL 4); the new tokens' rows see different numbers of splits
    q, k_cache, v_cache, r2t, rows, seq_lens, qo_indptr = extend_case(
        64, poison=True, group=4, reqs=MANY_SPLIT_REQS)
    ref = extend_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     seq_lens, qo_indptr)
    out = extend_attention(q, k_cache, v_cache, r2t, rows, seq_lens, qo_indptr, impl="triton",
                           num_splits=9)
    assert torch.isfinite(out).all()
    assert_close(out, ref, torch.float32)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_choose_extend_splits_uses_shapes_only(monkeypatch):
    # draft-extend (6 tokens x 4 heads per request) at bs 1 splits a 4096 context; a prefill not
    import padgraph.backends.triton.attention_split as split
    monkeypatch.setattr(split, "FOLD_MAX_BYTES", 0)
    assert choose_extend_splits(1, 6, 8, 4, 4096, 128, 132, 64) == 1   # fold off: extend splits need it
    monkeypatch.setattr(split, "FOLD_MAX_BYTES", FOLD_MAX_BYTES_TUNED)
    assert choose_extend_splits(1, 6, 8, 4, 4096, 128, 132, 64) == 8  # 16: fold past 128 KB
    assert choose_extend_splits(32, 192, 8, 4, 4096, 128, 132, 64) == 9
    assert choose_extend_splits(1, 2048, 8, 4, 4096, 128, 132, 64) == 1
    assert choose_extend_splits(1, 6, 8, 4, 200, 128, 132, 64) == 1


# ----------------------------------------------------------------------------- tree verify

VERIFY_LENS = [70 + K_DRAFT, PAD, K_DRAFT, 1 + K_DRAFT]


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("group,head_dim", [(1, 96), (4, 64)])
def test_tree_verify_matches_reference(group, head_dim, num_splits):
    k_cache, v_cache, r2t, rows, lens = make_paged(VERIFY_LENS, head_dim)
    mask = tree_masks(len(VERIFY_LENS), pad_rows=[1])
    q = rand_q(len(VERIFY_LENS) * K_DRAFT, N_KV_HEADS * group, head_dim)
    out = tree_verify_attention(q, k_cache, v_cache, r2t, rows, lens, mask,
                                num_splits=num_splits, impl="triton")
    ref = tree_verify_attention_reference(q, k_cache, v_cache, r2t, rows, lens, mask)
    assert torch.isfinite(out).all()
    assert_close(out, ref, torch.float32)


def test_tree_verify_chain_equals_extend():
    # a chain mask is causal attention of the k drafts: the same as extend with n_r = k
    k_cache, v_cache, r2t, rows, lens = make_paged([20 + K_DRAFT, 7 + K_DRAFT], 64)
    mask = torch.tril(torch.ones(2, K_DRAFT, K_DRAFT, dtype=torch.bool))
    q = rand_q(2 * K_DRAFT, 8, 64)
    qo_indptr = torch.tensor([0, K_DRAFT, 2 * K_DRAFT], dtype=torch.int32)
    out = tree_verify_attention(q, k_cache, v_cache, r2t, rows, lens, mask, impl="triton")
    ext = extend_attention_reference(q, k_cache, v_cache, r2t, rows, lens, qo_indptr)
    assert_close(out, ext, torch.float32)


def test_tree_verify_sinks_and_past_the_end_are_never_read():
    k_cache, v_cache, r2t, rows, lens = make_paged(VERIFY_LENS, 64, poison=True)
    mask = tree_masks(len(VERIFY_LENS), pad_rows=[1])
    q = rand_q(len(VERIFY_LENS) * K_DRAFT, 8, 64)
    real = [r * K_DRAFT + i for r, n in enumerate(VERIFY_LENS) if n is not PAD
            for i in range(K_DRAFT)]
    ref = tree_verify_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t,
                                          rows, lens, mask)
    out = tree_verify_attention(q, k_cache, v_cache, r2t, rows, lens, mask, num_splits=2,
                                impl="triton")
    assert torch.isfinite(out[real]).all()
    assert_close(out[real], ref[real], torch.float32)


def test_tree_verify_bf16():
    k_cache, v_cache, r2t, rows, lens = make_paged(VERIFY_LENS, 96, dtype=torch.bfloat16)
    mask = tree_masks(len(VERIFY_LENS), pad_rows=[1])
    q = rand_q(len(VERIFY_LENS) * K_DRAFT, 8, 96, torch.bfloat16)
    out = tree_verify_attention(q, k_cache, v_cache, r2t, rows, lens, mask, num_splits=2,
                                impl="triton")
    ref = tree_verify_attention_reference(q, k_cache, v_cache, r2t, rows, lens, mask)
    assert_close(out, ref, torch.bfloat16)


def test_extend_tiles_bound_every_split_of_the_tokens():
    # the grid's row tiles cover sum_r cdiv(n_r * group, block_m) for any n_r summing to <= n_tok
    from padgraph.backends.triton.attention_extend import extend_tiles
    gen = torch.Generator().manual_seed(0)
    for bs, n_tok, group, block_m in [(1, 6, 4, 64), (32, 192, 4, 64), (5, 7, 1, 16),
                                      (64, 64, 8, 64), (3, 300, 2, 32)]:
        bound = extend_tiles(bs, n_tok, group, block_m)
        assert bound <= bs * -(-n_tok * group // block_m)
        for _ in range(50):
            cuts = torch.randint(0, n_tok + 1, (bs - 1,), generator=gen).sort().values.tolist()
            n = [b - a for a, b in zip([0] + cuts, cuts + [n_tok])]
            assert sum(-(-m * group // block_m) for m in n) <= bound, (bs, n_tok, n)
    assert extend_tiles(32, 192, 4, 64) == 44  # was 32 requests x 12 tiles = 384


@pytest.mark.parametrize("owner_block", [2, 64])  # 2: the prefix sum in several chunks
def test_extend_packed_tiles_match_reference(monkeypatch, owner_block):
    # many requests, most with a few tokens, some with none, one spanning several row tiles:
    # every (request, row tile) is found by the device-side prefix sum
    from padgraph.backends.triton import attention_extend
    monkeypatch.setattr(attention_extend, "TILE_OWNER_BLOCK", owner_block)
    reqs = [(20, 3), (PAD, 0), (5, 5), (33, 1), (12, 0), (70, 40), (8, 2), (PAD, 0), (3, 3)]
    args = extend_case(32, group=4, reqs=reqs, poison=True)
    q, k_cache, v_cache, r2t, rows, seq_lens, qo_indptr = args
    ref = extend_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                     seq_lens, qo_indptr)
    for num_splits in (None, 2):
        out = extend_attention(*args, impl="triton", num_splits=num_splits)
        assert torch.isfinite(out).all()
        assert_close(out, ref, torch.float32)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


# ----------------------------------------------------------------------------- PDL

PDL_LENS = [130, PAD, 1, 33, 64, 97]


@pytest.mark.parametrize("num_q", [1, K_DRAFT])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("num_splits,block_n,fold", [(1, 16, True), (3, 16, True),
                                                     (3, 32, False), (8, 16, True)])
def test_pdl_reads_q_and_new_kv_only_after_its_wait(monkeypatch, num_q, prefetch, num_splits,
                                                    block_n, fold):
    """`SplitPolicy.pdl`: before its wait the kernel reads only what the kernel before it (a
    fused qkv projection) cannot write. Here the wait stands for that kernel finishing: q and
    the K / V of each request's last num_q positions hold NaN until a program waits, the wait
    writes them, and each program's end puts the NaN back for the next program (the interpreter
    runs them one after another). The output is the reference's, so no program read q or a new
    position before its wait, and none missed the new values after it."""
    from padgraph.backends.triton import attention_decode as ad
    lens_list = [n if n is PAD else n + num_q - 1 for n in PDL_LENS]
    k_cache, v_cache, r2t, rows, lens = make_paged(lens_list, 64, poison=True)
    n_req = len(lens_list)
    q = rand_q(n_req * num_q, 8, 64)
    real_req = [r for r, n in enumerate(lens_list) if n is not PAD]
    new = torch.cat([r2t[rows[r], lens[r] - num_q:lens[r]].long() for r in real_req])
    k_new, v_new, q_true = k_cache[new].clone(), v_cache[new].clone(), q.clone()
    if num_q == 1:
        mask, meta = None, PagedMeta.decode(r2t, rows, lens)
        ref = decode_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t, rows,
                                         lens)
    else:
        mask = tree_masks(n_req, pad_rows=[1])
        meta = PagedMeta.tree(r2t, rows, lens, mask)
        ref = tree_verify_attention_reference(q, unpoisoned(k_cache), unpoisoned(v_cache), r2t,
                                              rows, lens, mask)

    def poison():
        k_cache[new], v_cache[new], q[:] = float("nan"), float("nan"), float("nan")
    waits = []

    def wait_for_previous(PDL):  # noqa: N803 - the jit helper's constexpr
        assert PDL
        k_cache[new], v_cache[new], q[:] = k_new, v_new, q_true
        waits.append(1)
    finish = ad.finish_split

    def finish_split(*args):
        finish(*args)
        poison()
    monkeypatch.setattr(ad, "wait_for_previous", wait_for_previous)
    monkeypatch.setattr(ad, "finish_split", finish_split)
    poison()
    out = split_kv_attention(q, k_cache, v_cache, meta, 64 ** -0.5,
                             SplitPolicy(num_splits=num_splits, block_n=block_n, fold=fold,
                                         prefetch=prefetch, pdl=True))
    real = [r * num_q + i for r in real_req for i in range(num_q)]
    assert waits, "the kernel never waited"
    assert torch.isfinite(out[real]).all(), "a program read q or a new K / V before its wait"
    assert_close(out[real], ref[real], torch.float32)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_pdl_off_the_gpu_launches_plainly():
    """On the CPU `pdl` changes no launch (no PDL there) and no result: the same bits as off."""
    k_cache, v_cache, r2t, rows, lens = make_paged([70, PAD, 5], 64, dtype=torch.bfloat16)
    q = rand_q(3, 8, 64, torch.bfloat16)
    a = decode_attention(q, k_cache, v_cache, r2t, rows, lens, impl="triton")
    b = decode_attention(q, k_cache, v_cache, r2t, rows, lens, impl="triton", pdl=True)
    assert torch.equal(a, b)


def test_plan_split_is_what_the_launcher_takes(monkeypatch):
    """`plan_split` decides every launch knob from shapes (the policy's where set), and
    `split_kv_attention` launches what it plans: benchmarks report the same plan."""
    from padgraph.backends.triton import attention_decode as ad
    plan = ad.plan_split(8, 8, 4, 8, 128, 128, 4096, 132)              # 8 drafts, d 128
    assert (plan.num_splits, plan.prefetch, plan.blocks["BLOCK_N"], plan.num_warps) == \
        (4, False, 128, 4)
    assert plan.blocks["BLOCK_M"] == 32 and plan.num_stages == 2
    one = ad.plan_split(32, 8, 4, 8, 128, 128, 4096, 132)
    assert one.num_splits == 1 and not one.fold                        # no merge at one split
    dec = ad.plan_split(1, 8, 4, 1, 128, 128, 4096, 132)               # decode, 8 pairs
    assert (dec.prefetch, dec.blocks["BLOCK_N"], dec.num_splits) == (True, 32, 32)
    mine = ad.plan_split(1, 8, 4, 1, 128, 128, 4096, 132,
                         policy=SplitPolicy(num_splits=3, fold=False, block_n=16, num_warps=2,
                                            prefetch=False, num_stages=1))
    assert (mine.num_splits, mine.fold, mine.prefetch, mine.blocks["BLOCK_N"], mine.num_warps,
            mine.num_stages) == (3, False, False, 16, 2, 1)
    seen = []
    real = ad.plan_split
    monkeypatch.setattr(ad, "plan_split", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    k_cache, v_cache, r2t, rows, lens = make_paged(VERIFY_LENS, 64)
    q = rand_q(len(VERIFY_LENS) * K_DRAFT, N_KV_HEADS * 4, 64)
    mask = tree_masks(len(VERIFY_LENS), pad_rows=[1])
    ad.split_kv_attention(q, k_cache, v_cache, PagedMeta.tree(r2t, rows, lens, mask), 0.125)
    assert seen == [real(len(VERIFY_LENS), N_KV_HEADS, 4, K_DRAFT, 64, 64, r2t.shape[1],
                         ad.CPU_SM_COUNT, 4)]
