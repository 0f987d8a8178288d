"""MLA over a latent cache (interpreted on CPU): the absorbed kernels against the non-absorbed
reference (per-head K/V up-projected from the latent cache), at non-power-of-two latent widths
(kv_lora_rank 96 + rope 32 = 128 columns of which V uses 96; 48 + 16 = 64 of which V uses 48),
with padded lanes (seq_lens 1, row 0) and a NaN-poisoned sink slot 0 and past-the-end slot.
"""
from types import SimpleNamespace

import pytest
import torch

from attention_cases import K_DRAFT, tree_masks

from padgraph.backends.triton.attention_mla import (
    absorb_query, mla_decode_attention, mla_extend_attention, mla_reference, mla_sm_scale,
    mla_tree_verify_attention, project_output, store_latent)
from padgraph.backends.triton.attention_meta import PagedMeta
from padgraph.backends.triton.attention_mla_decode import (
    CAUSAL, DECODE, TREE, MlaPolicy, MlaShape, choose_mla_extend_splits, choose_mla_splits,
    mla_blocks, mla_paged_attention)
from padgraph.backends.triton.attention_split import _COUNTERS

N_HEADS, NOPE, V_DIM = 4, 16, 24
MAX_CONTEXT = 96
PAD = None  # a padded lane in a list of lengths: seq_len 1, row 0
WIDTHS = [(96, 32), (48, 16)]  # (kv_lora_rank, rope_dim)


class MLACase:
    """Random latent cache, weights and request rows for `lens` (slots shuffled)."""

    def __init__(self, lens, kv_lora_rank, rope_dim, n_heads=N_HEADS, dtype=torch.float32,
                 poison=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.n_heads, self.dtype = gen, n_heads, dtype
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        n_real = sum(n for n in lens if n is not PAD)
        n_slots = n_real + 2  # + sink slot 0 + the past-the-end slot
        latent = torch.randn(n_slots, 1, kv_lora_rank + rope_dim, generator=gen)
        past_end = n_slots - 1
        width = max([MAX_CONTEXT] + [n for n in lens if n is not PAD])
        self.req_to_token = torch.full((len(lens) + 1, width), past_end, dtype=torch.int32)
        self.req_to_token[0] = 0
        free = (torch.randperm(n_real, generator=gen) + 1).tolist()
        rows, seq_lens = [], []
        for r, n in enumerate(lens):
            if n is PAD:
                rows.append(0)
                seq_lens.append(1)
                continue
            self.req_to_token[r + 1, :n] = torch.tensor(free[:n], dtype=torch.int32)
            free = free[n:]
            rows.append(r + 1)
            seq_lens.append(n)
        self.rows = torch.tensor(rows, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.clean = latent.to(dtype)
        if poison:
            latent[0] = float("nan")
            latent[past_end] = float("nan")
        self.latent = latent.to(dtype)
        # [H, nope, r], [H, r, v]: scaled so up-projected K and V have unit variance
        self.W_UK = torch.randn(n_heads, NOPE, kv_lora_rank, generator=gen) / kv_lora_rank ** 0.5
        self.W_UV = torch.randn(n_heads, kv_lora_rank, V_DIM, generator=gen) / kv_lora_rank ** 0.5
        self.sm_scale = mla_sm_scale(NOPE, rope_dim)

    def queries(self, n):
        """(q_nope [n, H, nope], q_rope [n, H, rope], q_latent [n, H, r + rope])."""
        q_nope = torch.randn(n, self.n_heads, NOPE, generator=self.gen).to(self.dtype)
        q_rope = torch.randn(n, self.n_heads, self.rope_dim, generator=self.gen).to(self.dtype)
        return q_nope, q_rope, absorb_query(q_nope, q_rope, self.W_UK.to(self.dtype))

    def paged(self):
        return self.latent, self.req_to_token, self.rows, self.seq_lens

    def meta(self, tree_mask=None, qo_indptr=None) -> PagedMeta:
        """The requests' metadata: decode, tree (tree_mask) or causal extend (qo_indptr)."""
        paged = (self.req_to_token, self.rows, self.seq_lens)
        if tree_mask is not None:
            return PagedMeta.tree(*paged, tree_mask)
        if qo_indptr is not None:
            return PagedMeta.causal(*paged, qo_indptr)
        return PagedMeta.decode(*paged)

    def reference(self, q_nope, q_rope, **kw):
        """Non-absorbed MLA on the unpoisoned cache, in fp64."""
        return mla_reference(q_nope.double(), q_rope.double(), self.clean.double(),
                             self.W_UK.double(), self.W_UV.double(), self.req_to_token,
                             self.rows, self.seq_lens, self.sm_scale, **kw)

    def output(self, o_latent):
        return project_output(o_latent, self.W_UV.to(o_latent.dtype))


def assert_close(out, ref, dtype=torch.float32):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), ref.double(), **tol)


# ----------------------------------------------------------------------------- reference

def test_absorbed_torch_equals_non_absorbed_fp64():
    case = MLACase([40, PAD, 1, 17], 48, 16, dtype=torch.float64)
    q_nope, q_rope, q_latent = case.queries(4)
    o_latent = mla_decode_attention(q_latent, *case.paged(), case.kv_lora_rank, case.sm_scale,
                                    impl="torch")
    assert o_latent.shape == (4, N_HEADS, case.kv_lora_rank)
    torch.testing.assert_close(case.output(o_latent), case.reference(q_nope, q_rope),
                               rtol=1e-10, atol=1e-10)


def test_mla_policy_uses_shapes_only():
    # DeepSeek-V2-Lite on an H200: 16 heads in one 16-row block. Verify / extend: ~2 programs an
    # SM (cdiv), splits >= 128 tokens, <= 64
    assert mla_blocks(512, 64, 16)["BLOCK_H"] == 16
    assert mla_blocks(512, 64, 8 * 16)["BLOCK_H"] == 16  # verify, k=8: 8 blocks of 1 draft
    assert choose_mla_splits(1, 1, 8192, 132) == 64
    assert choose_mla_splits(8, 1, 8192, 132) == 33
    assert choose_mla_splits(32, 1, 8192, 132) == 9
    assert choose_mla_splits(32, 1, 1024, 132) == 8
    assert choose_mla_splits(256, 1, 8192, 132) == 2
    assert choose_mla_splits(1, 1, 100, 132) == 1
    # the keys-major tile: at most one program an SM
    assert choose_mla_splits(8, 1, 8192, 132, one_per_sm=True) == 16
    assert choose_mla_splits(32, 1, 8192, 132, one_per_sm=True) == 4
    assert choose_mla_splits(256, 1, 8192, 132, one_per_sm=True) == 1
    # the decode tile: at most 2 an SM (floor: no partial second wave), splits >= 64 tokens,
    # <= 128
    assert choose_mla_splits(1, 1, 8192, 132, decode=True) == 128
    assert choose_mla_splits(1, 1, 1024, 132, decode=True) == 16
    assert choose_mla_splits(8, 1, 8192, 132, decode=True) == 33
    assert choose_mla_splits(32, 1, 8192, 132, decode=True) == 8
    assert choose_mla_splits(16, 1, 256, 132, decode=True) == 4
    assert choose_mla_splits(300, 1, 8192, 132, decode=True) == 1
    assert choose_mla_splits(1, 1, 100, 132, decode=True) == 1
    for bs in range(1, 300):
        assert bs * choose_mla_splits(bs, 1, 1 << 20, 132, decode=True) <= max(264, bs)
    # draft-extend, 6 tokens x 16 heads: split while the folded merge stays small; prefill: 1
    assert choose_mla_extend_splits(1, 6, 16, 16, 8192, 512, 576, 132) == 11
    assert choose_mla_extend_splits(1, 2048, 16, 16, 8192, 512, 576, 132) == 1


def test_mla_plan_picks_the_kernel_from_shapes(monkeypatch):
    # an H200 as the policy sees it (capability 9.0, 132 SMs, 227 KB of opt-in shared memory),
    # without one: the keys-major kernel for verify (bs x cache width >= 8192) and extend
    # (>= 32768); decode takes the row-major decode tile (c_kv halves, 32 rows, 3 stages)
    import padgraph.backends.triton.attention_mla_decode as am
    smem = {"optin": 227 << 10}
    monkeypatch.setattr(am.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(am.torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(
        shared_memory_per_block_optin=smem["optin"]))
    monkeypatch.setattr(am, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")

    def plan(mode, bs, ctx, num_q=1, n_tok=None, **knobs):
        n_tok = bs * num_q if n_tok is None else n_tok
        return am.plan_mla(MlaShape(n_tok, 16, 576, bs, ctx, 512, mode, num_q, gpu),
                           MlaPolicy(**knobs))

    for bs, ctx, splits, fold in ((1, 8192, 128, False), (8, 8192, 33, False),
                                  (32, 8192, 8, True), (32, 32768, 8, True), (16, 256, 4, True)):
        p = plan(DECODE, bs, ctx)
        assert not p.keys_major and p.n_blocks == 1
        assert p.blocks["SPLIT_C"] and p.blocks["BLOCK_N"] == 32
        assert p.blocks["num_stages"] == 3 and p.blocks["num_warps"] == 4
        assert (p.num_splits, p.fold) == (splits, fold), (bs, ctx, p)
    # a tile knob starts from the base tile: 2 stages, no c_kv halves unless asked for
    p = plan(DECODE, 32, 8192, block_n=64, num_warps=8)
    assert not p.blocks["SPLIT_C"] and p.blocks["num_stages"] == 2
    assert p.num_splits == 9
    p = plan(DECODE, 32, 8192, block_n=32, num_warps=4, num_stages=3, split_c=True)
    assert p.blocks["SPLIT_C"] and p.blocks["num_stages"] == 3
    with pytest.raises(ValueError, match="split_c"):
        plan(DECODE, 1, 8192, keys_major=True, split_c=True)
    p = plan(TREE, 32, 1024, num_q=8)  # 128 rows: 32 a program over two warp groups
    assert p.keys_major and p.blocks["BLOCK_H"] == 32 and p.n_blocks == 4
    assert p.blocks["num_warps"] == 8 and p.num_splits == 1
    assert "SPLIT_C" not in p.blocks and p.blocks["num_stages"] == 2
    assert not plan(TREE, 1, 4096, num_q=8).keys_major
    assert plan(CAUSAL, 32, 1024, n_tok=6 * 32).keys_major
    assert not plan(CAUSAL, 8, 1024, n_tok=6 * 8).keys_major
    # a tile knob keeps the row-major kernel unless keys_major is asked for
    assert not plan(TREE, 32, 1024, num_q=8, block_n=16).keys_major
    p = plan(DECODE, 32, 8192, keys_major=True)  # one program an SM, folded up to 8 splits
    assert p.keys_major and p.num_splits == 4 and p.fold
    # 99 KB of shared memory (sm_86 / sm_89): the decode tile at 2 stages
    smem["optin"] = 99 << 10
    assert plan(DECODE, 8, 8192).blocks["num_stages"] == 2
    # no warp-group MMAs (sm_80) or no GPU: the row-major kernel everywhere
    monkeypatch.setattr(am.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not plan(TREE, 32, 1024, num_q=8).keys_major
    assert not am.choose_keys_major(TREE, 32, 1024, torch.device("cpu"))
    assert plan(DECODE, 8, 8192).blocks["SPLIT_C"]


def test_mla_policy_is_checked():
    with pytest.raises(ValueError, match="policy.slots_ahead must be 0 or 1, got 2"):
        MlaPolicy(slots_ahead=2)
    with pytest.raises(ValueError, match=r"policy.num_splits must be in 1 \.\. 256, got 0"):
        MlaPolicy(num_splits=0)
    assert MlaPolicy(block_h=32).tile_knob and not MlaPolicy(num_splits=3).tile_knob


# ----------------------------------------------------------------------------- decode

DECODE_LENS = [70, PAD, 1, 33, 32]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kv_lora_rank,rope_dim", WIDTHS)
def test_decode_matches_non_absorbed(kv_lora_rank, rope_dim, num_splits):
    case = MLACase(DECODE_LENS, kv_lora_rank, rope_dim)
    q_nope, q_rope, q_latent = case.queries(len(DECODE_LENS))
    o_latent = mla_decode_attention(q_latent, *case.paged(), kv_lora_rank, case.sm_scale,
                                    num_splits=num_splits, impl="triton")
    assert o_latent.shape == (len(DECODE_LENS), N_HEADS, kv_lora_rank)
    assert_close(case.output(o_latent), case.reference(q_nope, q_rope))


@pytest.mark.parametrize("knobs", [dict(), dict(num_splits=3),
                                   dict(block_n=64, num_warps=8, num_splits=3, fold=True)])
def test_many_requests_decode_matches_non_absorbed(knobs):
    """32 requests (the decode tile at its policy splits, or 3 forced; the 64-row 8-warp tile
    with a folded merge), padded lanes and lengths 1 / 64 / 65 among them."""
    lens = ([70, PAD, 1, 64, 65, 33] * 6)[:32]
    case = MLACase(lens, 96, 32)
    q_nope, q_rope, q_latent = case.queries(len(lens))
    o_latent = mla_paged_attention(q_latent, case.latent, case.meta(), 96, case.sm_scale,
                                   MlaPolicy(**knobs))
    assert_close(case.output(o_latent), case.reference(q_nope, q_rope))


def test_decode_sinks_and_past_the_end_are_never_read():
    case = MLACase(DECODE_LENS, 96, 32, poison=True)
    q_nope, q_rope, q_latent = case.queries(len(DECODE_LENS))
    real = [i for i, n in enumerate(DECODE_LENS) if n is not PAD]
    ref = case.reference(q_nope, q_rope)
    for num_splits in (1, 4, 70):
        o_latent = mla_decode_attention(q_latent, *case.paged(), 96, case.sm_scale,
                                        num_splits=num_splits, impl="triton")
        assert torch.isfinite(o_latent[real]).all(), f"a real lane read a poisoned slot " \
                                                     f"({num_splits=})"
        assert_close(case.output(o_latent)[real], ref[real])


@pytest.mark.parametrize("fold", [True, False])
def test_decode_merge_folded_or_separate(fold):
    # 3 splits: the last split to finish merges (fold) or the merge kernel does; the folded
    # path's counters are left zeroed for the next launch (a graph replay)
    case = MLACase(DECODE_LENS, 48, 16, poison=True)
    q_nope, q_rope, q_latent = case.queries(len(DECODE_LENS))
    real = [i for i, n in enumerate(DECODE_LENS) if n is not PAD]
    ref = case.reference(q_nope, q_rope)
    for _ in range(2):  # a second launch reuses the counters
        o_latent = mla_paged_attention(q_latent, case.latent, case.meta(), 48, case.sm_scale,
                                       MlaPolicy(num_splits=3, fold=fold))
        assert torch.isfinite(o_latent[real]).all()
        assert_close(case.output(o_latent)[real], ref[real])
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


# long requests and a padded lane; BLOCK_N 16 so that most splits are used: 37 splits ->
# (19, 1, 19) non-empty, merged 4 splits a step when folded
MANY_SPLIT_LENS = [600, PAD, 300]


@pytest.mark.parametrize("kv_lora_rank,rope_dim,fold", [(48, 16, True), (48, 16, False),
                                                        (96, 32, True)])
def test_decode_many_splits(kv_lora_rank, rope_dim, fold):
    case = MLACase(MANY_SPLIT_LENS, kv_lora_rank, rope_dim, poison=True)
    q_nope, q_rope, q_latent = case.queries(len(MANY_SPLIT_LENS))
    real = [i for i, n in enumerate(MANY_SPLIT_LENS) if n is not PAD]
    o_latent = mla_paged_attention(q_latent, case.latent, case.meta(), kv_lora_rank,
                                   case.sm_scale, MlaPolicy(num_splits=37, fold=fold, block_n=16))
    assert torch.isfinite(o_latent[real]).all()
    assert_close(case.output(o_latent)[real], case.reference(q_nope, q_rope)[real])
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def test_decode_bf16_three_row_blocks():
    # 40 heads: rows 0..15, 16..31 and 32..39 of each request in three programs (the last one
    # half masked)
    case = MLACase([50, PAD, 3], 48, 16, n_heads=40, dtype=torch.bfloat16)
    q_nope, q_rope, q_latent = case.queries(3)
    o_latent = mla_decode_attention(q_latent, *case.paged(), 48, case.sm_scale, num_splits=2,
                                    impl="triton")
    assert o_latent.dtype == torch.bfloat16
    assert_close(case.output(o_latent), case.reference(q_nope, q_rope), torch.bfloat16)


def test_decode_auto_on_cpu_is_torch():
    case = MLACase([9, PAD], 48, 16)
    _, _, q_latent = case.queries(2)
    args = (q_latent, *case.paged(), 48, case.sm_scale)
    assert torch.equal(mla_decode_attention(*args), mla_decode_attention(*args, impl="torch"))


def test_checks():
    case = MLACase([5, 3], 48, 16)
    _, _, q_latent = case.queries(2)
    with pytest.raises(ValueError, match="kv_lora_rank must be"):
        mla_decode_attention(q_latent, *case.paged(), 64, case.sm_scale)
    with pytest.raises(ValueError, match="q_latent must be"):
        mla_decode_attention(q_latent[..., :48], *case.paged(), 48, case.sm_scale)
    two_heads = case.latent.expand(-1, 2, -1)
    with pytest.raises(ValueError, match="one latent head"):
        mla_decode_attention(q_latent, two_heads, *case.paged()[1:], 48, case.sm_scale)
    with pytest.raises(ValueError, match="tree_mask must be"):
        mla_tree_verify_attention(q_latent, *case.paged(), torch.ones(2, 1, 2, dtype=torch.bool),
                                  48, case.sm_scale)


# ----------------------------------------------------------------------------- extend

EXTEND_REQS = [(70, 40), (PAD, 0), (9, 9), (33, 0), (1, 1), (40, 3)]  # (seq_len, new tokens)
N_PAD_TOKENS = 3


def extend_case(kv_lora_rank, rope_dim, poison=False):
    case = MLACase([n for n, _ in EXTEND_REQS], kv_lora_rank, rope_dim, poison=poison)
    qo_indptr = torch.zeros(len(EXTEND_REQS) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor([m for _, m in EXTEND_REQS]), 0)
    return case, qo_indptr, case.queries(int(qo_indptr[-1]) + N_PAD_TOKENS)


@pytest.mark.parametrize("num_splits", [None, 3])  # 3: draft-extend style, merge folded
@pytest.mark.parametrize("kv_lora_rank,rope_dim", WIDTHS)
def test_extend_matches_non_absorbed(kv_lora_rank, rope_dim, num_splits):
    case, qo_indptr, (q_nope, q_rope, q_latent) = extend_case(kv_lora_rank, rope_dim,
                                                              poison=True)
    latent, r2t, rows, seq_lens = case.paged()
    if num_splits is None:  # the public function, the policy's split count
        o_latent = mla_extend_attention(q_latent, latent, r2t, rows, seq_lens, qo_indptr,
                                        kv_lora_rank, case.sm_scale, impl="triton")
    else:
        o_latent = mla_paged_attention(q_latent, latent, case.meta(qo_indptr=qo_indptr),
                                       kv_lora_rank, case.sm_scale,
                                       MlaPolicy(num_splits=num_splits))
    assert torch.isfinite(o_latent).all()
    assert o_latent[-N_PAD_TOKENS:].abs().sum() == 0  # padding tokens give 0
    assert_close(case.output(o_latent), case.reference(q_nope, q_rope, qo_indptr=qo_indptr))


def test_causal_extend_with_more_row_blocks_than_counters_runs_unsplit(monkeypatch):
    """A causal extend always folds its merge; where (request, row block) pairs outnumber the
    ticket counters (hundreds of short extends at many heads) it runs unsplit instead of
    raising, with the reference's outputs."""
    from padgraph.backends.triton import attention_split
    monkeypatch.setattr(attention_split, "N_COUNTERS", 2)
    case, qo_indptr, (q_nope, q_rope, q_latent) = extend_case(48, 16, poison=True)
    o_latent = mla_paged_attention(q_latent, case.latent, case.meta(qo_indptr=qo_indptr), 48,
                                   case.sm_scale, MlaPolicy(num_splits=3))
    assert torch.isfinite(o_latent).all()
    assert_close(case.output(o_latent), case.reference(q_nope, q_rope, qo_indptr=qo_indptr))


def test_extend_many_splits():
    # 9 splits of 80 positions, always folded: a row block's rows see different split counts
    reqs = [(600, 5), (PAD, 0), (300, 2)]
    case = MLACase([n for n, _ in reqs], 48, 16, poison=True)
    qo_indptr = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor([m for _, m in reqs]), 0)
    q_nope, q_rope, q_latent = case.queries(int(qo_indptr[-1]) + N_PAD_TOKENS)
    o_latent = mla_paged_attention(q_latent, case.latent, case.meta(qo_indptr=qo_indptr), 48,
                                   case.sm_scale, MlaPolicy(num_splits=9, block_n=16))
    assert torch.isfinite(o_latent).all()
    assert o_latent[-N_PAD_TOKENS:].abs().sum() == 0
    assert_close(case.output(o_latent), case.reference(q_nope, q_rope, qo_indptr=qo_indptr))
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


# ----------------------------------------------------------------------------- tree verify

VERIFY_LENS = [40 + K_DRAFT, PAD, K_DRAFT, 1 + K_DRAFT]


@pytest.mark.parametrize("n_heads", [4, 16])  # 16 heads x 4 drafts = 64 rows: 2 row blocks
@pytest.mark.parametrize("kv_lora_rank,rope_dim", WIDTHS)
def test_tree_verify_matches_non_absorbed(kv_lora_rank, rope_dim, n_heads):
    case = MLACase(VERIFY_LENS, kv_lora_rank, rope_dim, n_heads=n_heads, poison=True)
    mask = tree_masks(len(VERIFY_LENS), pad_rows=[1])
    q_nope, q_rope, q_latent = case.queries(len(VERIFY_LENS) * K_DRAFT)
    real = [r * K_DRAFT + i for r, n in enumerate(VERIFY_LENS) if n is not PAD
            for i in range(K_DRAFT)]
    o_latent = mla_tree_verify_attention(q_latent, *case.paged(), mask, kv_lora_rank,
                                         case.sm_scale, num_splits=2, impl="triton")
    assert torch.isfinite(o_latent[real]).all()
    ref = case.reference(q_nope, q_rope, tree_mask=mask)
    assert_close(case.output(o_latent)[real], ref[real])


# ----------------------------------------------------------------------------- store

@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_store_latent(impl):
    latent = torch.zeros(10, 1, 96 + 32)
    loc = torch.tensor([3, 7, 0, 0], dtype=torch.int32)  # two padded lanes write the sink
    c_kv, k_rope = torch.randn(4, 96), torch.randn(4, 32)
    store_latent(latent, loc, c_kv, k_rope, impl=impl)
    assert torch.equal(latent[3, 0], torch.cat([c_kv[0], k_rope[0]]))
    assert torch.equal(latent[7, 0], torch.cat([c_kv[1], k_rope[1]]))
    untouched = [s for s in range(10) if s not in (0, 3, 7)]
    assert latent[untouched].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_absorbed_projections_one_rounding(dtype):
    """absorb_query / project_output run one GEMM in the operands' dtype (no fp32 upcast of the
    weights per call): against the fp64 product, each output is within one rounding of its dtype
    (plus the fp32 accumulation's error), q_rope passes through bit-exact, and the shapes and
    dtypes are the callers'."""
    gen = torch.Generator().manual_seed(7)
    n, H, nope, rope, r, v = 5, 3, 16, 8, 40, 24
    q_nope = torch.randn(n, H, nope, generator=gen).to(dtype)
    q_rope = torch.randn(n, H, rope, generator=gen).to(dtype)
    W_UK = (torch.randn(H, nope, r, generator=gen) / nope ** 0.5).to(dtype)
    W_UV = (torch.randn(H, r, v, generator=gen) / r ** 0.5).to(dtype)
    eps = torch.finfo(dtype).eps
    q_lat = absorb_query(q_nope, q_rope, W_UK)
    assert q_lat.shape == (n, H, r + rope) and q_lat.dtype == dtype
    assert torch.equal(q_lat[..., r:], q_rope)
    want = torch.einsum("nhd,hdc->nhc", q_nope.double(), W_UK.double())
    # one rounding of the result (eps/2 relative) + fp32 accumulation of nope terms
    tol = want.abs() * eps + nope * 2 ** -23 * (q_nope.double().abs() ** 2).sum(-1, True) ** 0.5
    assert ((q_lat[..., :r].double() - want).abs() <= tol + 1e-30).all()
    o_lat = torch.randn(n, H, r, generator=gen).to(dtype)
    out = project_output(o_lat, W_UV)
    assert out.shape == (n, H, v) and out.dtype == dtype
    want = torch.einsum("nhc,hcv->nhv", o_lat.double(), W_UV.double())
    tol = want.abs() * eps + r * 2 ** -23 * (o_lat.double().abs() ** 2).sum(-1, True) ** 0.5
    assert ((out.double() - want).abs() <= tol + 1e-30).all()


# ----------------------------------------------------------------------------- kernel forms

FORMS = [dict(keys_major=keys, slots_ahead=ahead) for keys in (False, True) for ahead in (1, 0)]
FORMS.append(dict(keys_major=False, split_c=True))  # c_kv as two column halves


@pytest.mark.parametrize("mode", ["decode", "tree", "causal"])
def test_kernel_forms_give_the_same_outputs(mode):
    # the row-major and the keys-major kernel with each tile's slot indices loaded one tile
    # ahead (the default) or in the loop: every mode, several splits, BLOCK_N 16 over poisoned
    # slots
    if mode == "causal":
        case, qo_indptr, (q_nope, q_rope, q_latent) = extend_case(48, 16, poison=True)
        kw = dict(qo_indptr=qo_indptr)
        ref = case.reference(q_nope, q_rope, qo_indptr=qo_indptr)
        real = slice(None)
    else:
        lens = MANY_SPLIT_LENS if mode == "decode" else VERIFY_LENS
        case = MLACase(lens, 48, 16, poison=True)
        num_q = 1 if mode == "decode" else K_DRAFT
        q_nope, q_rope, q_latent = case.queries(len(lens) * num_q)
        real = [r * num_q + i for r, n in enumerate(lens) if n is not PAD for i in range(num_q)]
        kw = {}
        if mode == "tree":
            mask = tree_masks(len(lens), pad_rows=[1])
            kw = dict(tree_mask=mask)
            ref = case.reference(q_nope, q_rope, tree_mask=mask)
        else:
            ref = case.reference(q_nope, q_rope)
    meta = case.meta(**kw)
    assert meta.mode == {"decode": DECODE, "tree": TREE, "causal": CAUSAL}[mode]
    outs = [mla_paged_attention(q_latent, case.latent, meta, 48, case.sm_scale,
                                MlaPolicy(num_splits=3, block_n=16, **form)) for form in FORMS]
    for o in outs:
        assert torch.isfinite(o[real]).all()
        assert_close(case.output(o)[real], ref[real])
    for o in outs[1:]:
        torch.testing.assert_close(o[real], outs[0][real], rtol=1e-5, atol=1e-5)


def test_more_requests_than_cudas_second_grid_axis_are_refused_before_launch():
    """The kernel's grid puts requests on CUDA's second axis (at most 65535): a larger call (a
    causal prefill runner pads its requests to its token bucket) is refused with the limit named,
    never launched to fail at capture."""
    from padgraph.backends.triton.attention_mla_decode import GRID_YZ_MAX, mla_paged_attention
    bs, rank, rope = GRID_YZ_MAX + 1, 16, 8
    meta = PagedMeta(torch.zeros(1, 4, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32),
                     torch.ones(bs, dtype=torch.int32))
    q = torch.zeros(bs, 1, rank + rope)
    with pytest.raises(ValueError, match="at most 65535"):
        mla_paged_attention(q, torch.zeros(4, 1, rank + rope), meta, rank, 1.0)
