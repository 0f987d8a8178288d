"""Slot-indexed recurrent-state kernels (Mamba2 SSM update and scan, causal conv window) against
their torch references, on awkward sizes (Triton interpreted on CPU), and at a Mamba2-1B-like
shape on a GPU, replayed from CUDA graphs.

Besides the values, every case checks the pool contract the kernels keep: padded lanes (slot 0,
the sink) write only slot 0, rows no lane owns are bitwise untouched, raw lanes' rows equal an
unpadded run's, and a new request in a reused slot never reads the leftovers (filled with nan).
"""
import pytest
import torch
import torch.nn.functional as F

from padgraph.backends.triton.conv_state import (conv_state_prefill, conv_state_prefill_reference,
                                                 conv_state_update, conv_state_update_reference, conv_tree_update,
                                                 conv_tree_update_reference)
from padgraph.backends.triton import ssm
from padgraph.backends.triton.ssm import (ssm_chunked_scan, ssm_chunked_scan_reference, ssm_decode_update,
                                          ssm_decode_update_reference, ssm_tree_update, ssm_tree_update_reference)
from recurrent_cases import packed as _packed, replay_with_new_data as _replay_with_new_data

N_SLOTS = 9


def _ssm_params(n_heads, head_dim, d_state, n_groups, n, seed, device="cpu", dtype=torch.float32, extras=True):
    """Per-token inputs [n, ...] and per-head parameters of a Mamba2 mixer, seeded."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    p = {"x": r(n, n_heads, head_dim), "dt": r(n, n_heads) - 1.0, "A": -torch.rand(n_heads, generator=g) * 4,
         "B": r(n, n_groups, d_state), "C": r(n, n_groups, d_state)}
    if extras:
        p.update(D=r(n_heads), z=r(n, n_heads, head_dim), dt_bias=r(n_heads) * 0.5)
    return {k: (v.to(dtype) if k in ("x", "B", "C", "z") else v).to(device) for k, v in p.items()}


def _pool(shape, seed, device="cpu", dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _slots(n_raw, n_pad, seed, device="cpu"):
    """Distinct live slots in 1..N_SLOTS-1 for the raw lanes, the sink 0 for the padded ones."""
    live = torch.randperm(N_SLOTS - 1, generator=torch.Generator().manual_seed(seed))[:n_raw] + 1
    return torch.cat([live, torch.zeros(n_pad, dtype=torch.int64)]).to(device)


def _assert_pool(after, before, owned, want_owned, case, tol=None):
    """Owned rows equal `want_owned` (within `tol`, default by dtype), the sink is free, every other
    row is bitwise untouched."""
    owned = owned.tolist()
    others = [r for r in range(1, after.shape[0]) if r not in owned]
    assert torch.equal(after[others], before[others]), f"rows no lane owns were written [{case}]"
    torch.testing.assert_close(after[owned].float(), want_owned.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{m} [{case}]")


# ---- ssm_decode_update --------------------------------------------------------------------------
DECODE_SIZES = [  # n_heads, head_dim, d_state, n_groups, raw lanes, padded lanes
    (1, 3, 5, 1, 1, 0), (2, 7, 16, 1, 3, 2), (3, 37, 9, 3, 5, 3), (4, 5, 13, 2, 3, 1), (2, 16, 8, 2, 1, 4)]


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-z-bias"])
@pytest.mark.parametrize("size", DECODE_SIZES, ids=lambda s: "h{}p{}n{}g{}-raw{}pad{}".format(*s))
def test_ssm_decode_matches_reference_and_pads_write_only_the_sink(size, extras):
    n_heads, head_dim, d_state, n_groups, n_raw, n_pad = size
    n = n_raw + n_pad
    p = _ssm_params(n_heads, head_dim, d_state, n_groups, n, seed=n * 7 + head_dim, extras=extras)
    slot = _slots(n_raw, n_pad, seed=head_dim)
    pool = _pool((N_SLOTS, n_heads, head_dim, d_state), seed=d_state)
    got_pool, ref_pool = pool.clone(), pool.clone()
    y = ssm_decode_update(got_pool, slot, impl="triton", **p)
    y_ref = ssm_decode_update_reference(ref_pool, slot, **p)
    case = f"size={size} extras={extras}"
    torch.testing.assert_close(y[:n_raw], y_ref[:n_raw], msg=lambda m: f"{m} [{case}]")
    _assert_pool(got_pool, pool, slot[:n_raw], ref_pool[slot[:n_raw]], case)
    # the raw lanes' rows are bitwise those of the same call without its padded lanes
    exact_pool = pool.clone()
    y_exact = ssm_decode_update(exact_pool, slot[:n_raw], impl="triton", **{k: v[:n_raw] if v.shape[0] == n and
                                                                             v.dim() > 1 else v for k, v in p.items()})
    assert torch.equal(got_pool[slot[:n_raw]], exact_pool[slot[:n_raw]]), case
    assert torch.equal(y[:n_raw], y_exact), case


def test_ssm_decode_softplus_limits_and_low_precision_state():
    """dt through softplus (large values take the identity) then a clamp; a bf16 pool and bf16 x."""
    p = _ssm_params(3, 6, 10, 1, 4, seed=1, dtype=torch.bfloat16)
    p["dt"] = torch.tensor([[-30.0, 0.1, 25.0]] * 4)
    slot = _slots(4, 0, seed=2)
    pool = _pool((N_SLOTS, 3, 6, 10), seed=3, dtype=torch.bfloat16)
    for lim in ((0.0, float("inf")), (0.01, 0.5)):
        got_pool, ref_pool = pool.clone(), pool.clone()
        y = ssm_decode_update(got_pool, slot, dt_limit=lim, impl="triton", **p)
        y_ref = ssm_decode_update_reference(ref_pool, slot, dt_limit=lim, **p)
        assert y.dtype == torch.bfloat16 and got_pool.dtype == torch.bfloat16
        torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_pool.float(), ref_pool.float(), rtol=2e-2, atol=2e-2)


def test_ssm_decode_reference_is_the_mamba2_recurrence():
    """The reference against the formula written out for one lane, head by head (no broadcasting)."""
    p = _ssm_params(4, 3, 5, 2, 1, seed=4)
    pool = _pool((N_SLOTS, 4, 3, 5), seed=5)
    h0 = pool[6].clone()
    y = ssm_decode_update_reference(pool, torch.tensor([6]), **p)
    for h in range(4):
        g = h // 2
        dt = F.softplus(p["dt"][0, h] + p["dt_bias"][h])
        new = h0[h] * torch.exp(dt * p["A"][h]) + dt * torch.outer(p["x"][0, h], p["B"][0, g])
        torch.testing.assert_close(pool[6, h], new)
        want = (new @ p["C"][0, g] + p["D"][h] * p["x"][0, h]) * F.silu(p["z"][0, h])
        torch.testing.assert_close(y[0, h], want)


def test_mamba1_a_per_state_decode_and_scan_match_the_reference_and_the_formula():
    """Mamba1 (Jamba): a channel per head (head_dim 1), A [channels, d_state], B / C one group."""
    n_ch, d_state, n = 11, 16, 5
    p = _ssm_params(n_ch, 1, d_state, 1, n, seed=21)
    p["A"] = -torch.rand(n_ch, d_state, generator=torch.Generator().manual_seed(22)) * 3
    slot, pool = _slots(3, 2, seed=23), _pool((N_SLOTS, n_ch, 1, d_state), seed=24)
    got, ref = pool.clone(), pool.clone()
    y = ssm_decode_update(got, slot, impl="triton", **p)
    torch.testing.assert_close(y[:3], ssm_decode_update_reference(ref, slot, **p)[:3])
    _assert_pool(got, pool, slot[:3], ref[slot[:3]], "mamba1 decode")
    dt = F.softplus(p["dt"][0] + p["dt_bias"])                                    # [n_ch]
    new = pool[slot[0], :, 0] * torch.exp(dt[:, None] * p["A"]) + (dt * p["x"][0, :, 0])[:, None] * p["B"][0]
    torch.testing.assert_close(got[slot[0], :, 0], new)
    cu, has_init = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([True, False])
    got, ref = pool.clone(), pool.clone()
    torch.testing.assert_close(ssm_chunked_scan(got, slot[:2], cu, has_init, impl="triton", **p),
                               ssm_chunked_scan_reference(ref, slot[:2], cu, has_init, **p))
    _assert_pool(got, pool, slot[:2], ref[slot[:2]], "mamba1 scan")
    with pytest.raises(ValueError, match="method='chunked' needs one A per head"):
        ssm_chunked_scan(got, slot[:2], cu, has_init, method="chunked", **p)


# ---- ssm_chunked_scan ---------------------------------------------------------------------------
SCAN_CASES = [  # n_heads, head_dim, d_state, n_groups, lengths, has_initial_state, padded seqs, padded tokens
    (1, 3, 5, 1, [4], [False], 0, 0),
    (2, 7, 16, 2, [1, 5, 0], [True, False, True], 2, 3),
    (3, 37, 9, 1, [6, 2], [False, True], 1, 2),
    (2, 5, 13, 1, [3, 1, 4, 2, 1], [True, True, False, False, True], 3, 1),
    (2, 6, 16, 2, [70, 33, 32], [True, False, True], 1, 4),          # several chunks, a partial last one
]


@pytest.mark.parametrize("method", ssm.SCAN_METHODS)
@pytest.mark.parametrize("case", SCAN_CASES,
                         ids=lambda c: "h{}p{}n{}g{}-len{}".format(*c[:4], "_".join(map(str, c[4]))))
def test_ssm_scan_matches_reference_with_fresh_and_continued_slots(case, method):
    n_heads, head_dim, d_state, n_groups, lengths, init, n_pad_seq, n_pad_tok = case
    cu, n_tok = _packed(lengths, n_pad_seq, n_pad_tok)
    p = _ssm_params(n_heads, head_dim, d_state, n_groups, n_tok, seed=n_tok)
    slot = _slots(len(lengths), n_pad_seq, seed=head_dim)
    has_init = torch.tensor(init + [False] * n_pad_seq)
    pool = _pool((N_SLOTS, n_heads, head_dim, d_state), seed=d_state)
    for s, fresh in enumerate(init):                 # a reused slot: the old occupant's leftovers
        if not fresh:
            pool[slot[s]] = float("nan")
    got_pool, ref_pool = pool.clone(), pool.clone()
    y = ssm_chunked_scan(got_pool, slot, cu, has_init, method=method, impl="triton", **p)
    y_ref = ssm_chunked_scan_reference(ref_pool, slot, cu, has_init, **p)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m} [{case} {method}]")
    assert not y[: sum(lengths)].isnan().any() and (y[sum(lengths):] == 0).all(), case
    _assert_pool(got_pool, pool, slot[: len(lengths)], ref_pool[slot[: len(lengths)]], f"{case} {method}", tol=1e-4)


@pytest.mark.parametrize("method", ssm.SCAN_METHODS)
def test_ssm_scan_then_decode_equals_one_longer_scan(method):
    """Prefill of a prompt then decode steps leave the same state and outputs as prefilling it all:
    the two ops compute one recurrence."""
    n_heads, head_dim, d_state, steps = 2, 5, 7, 3
    p = _ssm_params(n_heads, head_dim, d_state, 1, 6 + steps, seed=9)
    slot = torch.tensor([4])
    pool = _pool((N_SLOTS, n_heads, head_dim, d_state), seed=10)
    whole = pool.clone()
    y_all = ssm_chunked_scan(whole, slot, torch.tensor([0, 6 + steps], dtype=torch.int32), torch.tensor([False]),
                             method=method, impl="triton", **p)
    split = pool.clone()
    head = {k: v[:6] if v.dim() > 1 else v for k, v in p.items()}
    y_head = ssm_chunked_scan(split, slot, torch.tensor([0, 6], dtype=torch.int32), torch.tensor([False]),
                              method=method, impl="triton", **head)
    ys = [ssm_decode_update(split, slot, impl="triton", **{k: v[t:t + 1] if v.dim() > 1 else v for k, v in p.items()})
          for t in range(6, 6 + steps)]
    torch.testing.assert_close(torch.cat([y_head, *ys]), y_all)
    torch.testing.assert_close(split, whole)


@pytest.mark.parametrize("tile", [16, 64])
def test_ssm_kernels_split_head_dim_into_blocks_with_a_partial_last_one(monkeypatch, tile):
    """Small tiles: head_dim 37 at d_state 8 runs as blocks of 2 or 8 rows (the chunked scan: 16),
    the last one partial."""
    monkeypatch.setattr(ssm, "DECODE_TILE", tile)
    monkeypatch.setattr(ssm, "SCAN_TILE", tile)
    monkeypatch.setattr(ssm, "CHUNK_P", 16)
    n_heads, head_dim, d_state = 2, 37, 8
    p = _ssm_params(n_heads, head_dim, d_state, 1, 4, seed=11)
    slot, pool = _slots(3, 1, seed=12), _pool((N_SLOTS, n_heads, head_dim, d_state), seed=13)
    got, ref = pool.clone(), pool.clone()
    torch.testing.assert_close(ssm_decode_update(got, slot, impl="triton", **p)[:3],
                               ssm_decode_update_reference(ref, slot, **p)[:3])
    _assert_pool(got, pool, slot[:3], ref[slot[:3]], f"decode tile={tile}")
    cu, has_init = torch.tensor([0, 3, 4, 4], dtype=torch.int32), torch.tensor([True, False, False])
    for method in ssm.SCAN_METHODS:
        got, ref = pool.clone(), pool.clone()
        torch.testing.assert_close(ssm_chunked_scan(got, slot[:3], cu, has_init, method=method, impl="triton", **p),
                                   ssm_chunked_scan_reference(ref, slot[:3], cu, has_init, **p))
        _assert_pool(got, pool, slot[:3], ref[slot[:3]], f"scan tile={tile} {method}")


def test_strided_slot_columns_read_each_lanes_own_slot():
    """A slot column of a 2-d table (stride > 1, e.g. a tree's node column) gives the same rows as
    its contiguous copy: the kernels read lane b's slot at its index b, never past the column."""
    n_heads, head_dim, d_state, n = 2, 7, 16, 4
    p = _ssm_params(n_heads, head_dim, d_state, 1, n, seed=3)
    table = torch.stack([_slots(n, 0, seed=5), _slots(n, 0, seed=6)], 1)      # [n, 2]: column 0 strided
    pool = _pool((N_SLOTS, n_heads, head_dim, d_state), seed=4)
    got, want = pool.clone(), pool.clone()
    y = ssm_decode_update(got, table[:, 0], impl="triton", **p)
    y_want = ssm_decode_update(want, table[:, 0].contiguous(), impl="triton", **p)
    assert torch.equal(got, want) and torch.equal(y, y_want)
    x, w = torch.randn(n, 11), torch.randn(11, 3)
    conv = _pool((N_SLOTS, 11, 2), seed=7)
    got, want = conv.clone(), conv.clone()
    out = conv_state_update(got, table[:, 0], x, w, impl="triton")
    assert torch.equal(out, conv_state_update(want, table[:, 0].contiguous(), x, w, impl="triton"))
    assert torch.equal(got, want)


# ---- conv window --------------------------------------------------------------------------------
CONV_SIZES = [(3, 2, 1, 0), (11, 3, 3, 2), (37, 4, 5, 3), (16, 4, 1, 4)]   # d, k, raw lanes, padded lanes


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("size", CONV_SIZES, ids=lambda s: "d{}k{}-raw{}pad{}".format(*s))
def test_conv_update_matches_reference_and_pads_write_only_the_sink(size, activation):
    d, k, n_raw, n_pad = size
    g = torch.Generator().manual_seed(d * k)
    x, w, bias = torch.randn(n_raw + n_pad, d, generator=g), torch.randn(d, k, generator=g), torch.randn(d, generator=g)
    slot = _slots(n_raw, n_pad, seed=d)
    pool = _pool((N_SLOTS, d, k - 1), seed=k)
    got_pool, ref_pool = pool.clone(), pool.clone()
    out = conv_state_update(got_pool, slot, x, w, bias, activation, impl="triton")
    out_ref = conv_state_update_reference(ref_pool, slot, x, w, bias, activation)
    torch.testing.assert_close(out[:n_raw], out_ref[:n_raw])
    _assert_pool(got_pool, pool, slot[:n_raw], ref_pool[slot[:n_raw]], f"{size} {activation}")
    # the window holds the last k - 1 inputs: its newest entry is x, the rest moved one left
    assert torch.equal(got_pool[slot[:n_raw], :, -1], x[:n_raw])
    assert torch.equal(got_pool[slot[:n_raw], :, :-1], pool[slot[:n_raw], :, 1:])


CONV_SCAN_CASES = [  # d, k, lengths, has_initial_state, padded seqs, padded tokens
    (3, 2, [4], [False], 0, 0),
    (11, 4, [1, 2, 0, 7], [True, True, True, False], 2, 3),
    (37, 3, [20, 1], [False, True], 1, 5),
    (5, 4, [2, 1, 3], [False, False, True], 0, 1),
]


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("case", CONV_SCAN_CASES,
                         ids=lambda c: "d{}k{}-len{}".format(c[0], c[1], "_".join(map(str, c[2]))))
def test_conv_prefill_matches_reference_and_conv1d(case, activation):
    d, k, lengths, init, n_pad_seq, n_pad_tok = case
    cu, n_tok = _packed(lengths, n_pad_seq, n_pad_tok)
    g = torch.Generator().manual_seed(n_tok)
    x, w, bias = torch.randn(n_tok, d, generator=g), torch.randn(d, k, generator=g), torch.randn(d, generator=g)
    slot = _slots(len(lengths), n_pad_seq, seed=d)
    has_init = torch.tensor(init + [False] * n_pad_seq)
    pool = _pool((N_SLOTS, d, k - 1), seed=k)
    for s, keep in enumerate(init):
        if not keep:
            pool[slot[s]] = float("nan")            # a reused slot's leftovers: never read
    got_pool, ref_pool = pool.clone(), pool.clone()
    out = conv_state_prefill(got_pool, slot, cu, has_init, x, w, bias, activation, impl="triton")
    out_ref = conv_state_prefill_reference(ref_pool, slot, cu, has_init, x, w, bias, activation)
    torch.testing.assert_close(out, out_ref)
    _assert_pool(got_pool, pool, slot[: len(lengths)], ref_pool[slot[: len(lengths)]], str(case))
    for s, (lo, hi) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1: len(lengths) + 1])):
        history = pool[slot[s]] if init[s] else torch.zeros(d, k - 1)
        stream = torch.cat([history, x[lo:hi].T], dim=1)                          # [d, k - 1 + length]
        if hi > lo:
            want = F.conv1d(stream[None], w[:, None, :], bias, groups=d)[0].T
            torch.testing.assert_close(out[lo:hi], F.silu(want) if activation else want)
        torch.testing.assert_close(got_pool[slot[s]], stream[:, -(k - 1):])
    assert (out[sum(lengths):] == 0).all()


def test_conv_prefill_then_updates_equal_one_longer_prefill():
    d, k, n, steps = 13, 4, 5, 3
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(n + steps, d, generator=g), torch.randn(d, k, generator=g)
    slot, pool = torch.tensor([2]), _pool((N_SLOTS, d, k - 1), seed=1)
    whole, split = pool.clone(), pool.clone()
    out_all = conv_state_prefill(whole, slot, torch.tensor([0, n + steps], dtype=torch.int32), torch.tensor([True]),
                                 x, w, impl="triton")
    out_head = conv_state_prefill(split, slot, torch.tensor([0, n], dtype=torch.int32), torch.tensor([True]),
                                  x[:n], w, impl="triton")
    outs = [conv_state_update(split, slot, x[t:t + 1], w, impl="triton") for t in range(n, n + steps)]
    torch.testing.assert_close(torch.cat([out_head, *outs]), out_all)
    torch.testing.assert_close(split, whole)


# ---- argument checks ----------------------------------------------------------------------------
def test_bad_shapes_are_refused_with_the_expected_shape():
    p = _ssm_params(4, 3, 5, 2, 2, seed=0)
    pool = torch.zeros(N_SLOTS, 4, 3, 5)
    with pytest.raises(ValueError, match=r"slot must be \[2\] int32/int64"):
        ssm_decode_update(pool, torch.zeros(3, dtype=torch.int64), **p)
    with pytest.raises(ValueError, match="n_groups dividing n_heads=4"):
        ssm_decode_update(pool, torch.zeros(2, dtype=torch.int64), **dict(p, B=torch.zeros(2, 3, 5)))
    with pytest.raises(ValueError, match=r"A must be contiguous \[n_heads=4\]"):
        ssm_decode_update(pool, torch.zeros(2, dtype=torch.int64), **dict(p, A=torch.zeros(4, 3)))
    with pytest.raises(ValueError, match=r"x must be \(2, 4, 3\)"):
        ssm_decode_update(pool, torch.zeros(2, dtype=torch.int64), **dict(p, x=torch.zeros(2, 4, 4)))
    with pytest.raises(ValueError, match=r"has_initial_state must be \[1\] bool"):
        ssm_chunked_scan(pool, torch.zeros(1, dtype=torch.int64), torch.tensor([0, 2], dtype=torch.int32),
                         torch.tensor([1]), **p)
    with pytest.raises(ValueError, match=r"weight must be \[d=6, k=4\]"):
        conv_state_update(torch.zeros(N_SLOTS, 6, 3), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 6),
                          torch.zeros(6, 1, 4))
    with pytest.raises(ValueError, match="method must be one of"):
        ssm_chunked_scan(pool, torch.zeros(1, dtype=torch.int64), torch.tensor([0, 2], dtype=torch.int32),
                         torch.tensor([True]), method="parallel", **p)
    with pytest.raises(ValueError, match="k >= 2"):
        conv_state_update(torch.zeros(N_SLOTS, 6, 0), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 6),
                          torch.zeros(6, 1))


# ---- GPU: a Mamba2-1B-like layer, eager and replayed from CUDA graphs ------------------------------
MAMBA2_1B = dict(n_heads=32, head_dim=64, d_state=128, n_groups=1)
CONV_DIM, CONV_K = 32 * 64 + 2 * 128, 4        # x, B and C go through the conv in Mamba2





# ---- a verify's tree: every node in one launch ----------------------------------------------------
TREES = {  # parents of each node (-1: the root); a padded lane's parents are its pads (all -1)
    "chain": [-1, 0, 1, 2, 3],
    "branches": [-1, 0, 0, 1, 2],
    "wide": [-1, 0, 0, 0, 0],
    "one": [-1],
}


def _tree_call(name, n_raw, n_pad, seed):
    """slot [bs] (raw lanes distinct live slots, padded lanes the sink), parents [bs, k]."""
    par = TREES[name]
    slot = _slots(n_raw, n_pad, seed=seed)
    parents = torch.tensor([par] * n_raw + [[-1] * len(par)] * n_pad, dtype=torch.int64)
    return slot, parents


def _tree_rows(slot, k):
    return (slot[:, None] * k + torch.arange(k)).flatten()


def _assert_tree_pool(after, before, owned_rows, want, case, tol=None):
    """The raw lanes' node rows equal `want`, the sink's nodes are free, every other row untouched."""
    k_sink = set(range(after.shape[0] // N_SLOTS))      # the sink's node rows: 0 .. k - 1
    owned = set(owned_rows.tolist())
    others = [r for r in range(after.shape[0]) if r not in owned and r not in k_sink]
    assert torch.equal(after[others], before[others]), f"node rows no lane owns were written [{case}]"
    torch.testing.assert_close(after[owned_rows].float(), want.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{m} [{case}]")


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "D-z-bias"])
@pytest.mark.parametrize("tree", list(TREES))
def test_ssm_tree_matches_its_node_by_node_reference_and_leaves_the_slots_alone(tree, extras):
    """Every node from its parent's state, in one launch: y and each node's state as the
    reference (a row copy and a decode step a node), the slots only read, the raw lanes' node
    rows the only ones written besides the sink's, and the decode kernel node by node gives the
    same bits."""
    n_heads, head_dim, d_state, n_groups, n_raw, n_pad = 3, 37, 9, 3, 3, 2
    slot, parents = _tree_call(tree, n_raw, n_pad, seed=len(tree))
    bs, k = parents.shape
    p = _ssm_params(n_heads, head_dim, d_state, n_groups, bs * k, seed=k, extras=extras)
    state = _pool((N_SLOTS, n_heads, head_dim, d_state), seed=1)
    pool = _pool((N_SLOTS * k, n_heads, head_dim, d_state), seed=2)
    got_state, got_tree, ref_tree = state.clone(), pool.clone(), pool.clone()
    y = ssm_tree_update(got_state, got_tree, slot, parents, impl="triton", **p)
    y_ref = ssm_tree_update_reference(state.clone(), ref_tree, slot, parents, **p)
    raw = (torch.arange(bs * k) < n_raw * k)
    case = f"tree={tree} extras={extras}"
    torch.testing.assert_close(y[raw], y_ref[raw], msg=lambda m: f"{m} [{case}]")
    assert torch.equal(got_state, state), case
    rows = _tree_rows(slot[:n_raw], k)
    _assert_tree_pool(got_tree, pool, rows, ref_tree[rows], case)
    # the same bits as the decode kernel run node by node on the same rows (the path it replaces)
    by_node, ys = pool.clone(), []
    per = {n: v.view(bs, k, *v.shape[1:]) if v.shape[0] == bs * k else v for n, v in p.items()}
    for j in range(k):
        node = slot * k + j
        src = state[slot] if j == 0 else by_node[slot * k + parents[:, j].clamp(min=0)]
        by_node.index_copy_(0, node[:n_raw], src[:n_raw])
        ys.append(ssm_decode_update(by_node, node[:n_raw], impl="triton",
                                    **{n: v[:n_raw, j] if v.dim() > 1 and v.shape[:2] == (bs, k) else v
                                       for n, v in per.items()}))
    assert torch.equal(got_tree[rows], by_node[rows]), case
    assert torch.equal(y.view(bs, k, *y.shape[1:])[:n_raw], torch.stack(ys, 1)), case


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_tree_matches_its_node_by_node_reference_and_leaves_the_slots_alone(tree, activation, dtype):
    d, kc, n_raw, n_pad = 37, 4, 3, 2
    slot, parents = _tree_call(tree, n_raw, n_pad, seed=kc + len(tree))
    bs, k = parents.shape
    g = torch.Generator().manual_seed(d + k)
    x = torch.randn(bs * k, d, generator=g).to(dtype)
    w, bias = torch.randn(d, kc, generator=g), torch.randn(d, generator=g)
    state = _pool((N_SLOTS, d, kc - 1), seed=3, dtype=dtype)
    pool = _pool((N_SLOTS * k, d, kc - 1), seed=4, dtype=dtype)
    got_state, got_tree, ref_tree = state.clone(), pool.clone(), pool.clone()
    out = conv_tree_update(got_state, got_tree, slot, parents, x, w, bias, activation, impl="triton")
    out_ref = conv_tree_update_reference(state.clone(), ref_tree, slot, parents, x, w, bias, activation)
    raw = torch.arange(bs * k) < n_raw * k
    case = f"tree={tree} {activation} {dtype}"
    tol = None if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[raw].float(), out_ref[raw].float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{m} [{case}]")
    assert torch.equal(got_state, state), case
    rows = _tree_rows(slot[:n_raw], k)
    _assert_tree_pool(got_tree, pool, rows, ref_tree[rows], case, tol=0)     # windows hold inputs: exact
    # node j's window ends with node j's input, after its parent's window moved one left
    xs = x.view(bs, k, d)[:n_raw]
    assert torch.equal(got_tree[rows].view(n_raw, k, d, kc - 1)[..., -1], xs), case
    # against the decode kernel node by node: the same bits
    by_node, outs = pool.clone(), []
    for j in range(k):
        node = slot[:n_raw] * k + j
        src = state[slot[:n_raw]] if j == 0 else by_node[slot[:n_raw] * k + parents[:n_raw, j].clamp(min=0)]
        by_node.index_copy_(0, node, src)
        outs.append(conv_state_update(by_node, node, xs[:, j], w, bias, activation, impl="triton"))
    assert torch.equal(got_tree[rows], by_node[rows]), case
    assert torch.equal(out.view(bs, k, d)[:n_raw], torch.stack(outs, 1)), case


def test_ssm_tree_with_mamba1_a_int32_indices_and_a_bf16_pool():
    """A [n_heads, d_state] (Mamba1: head_dim 1), slot and parents int32, state and per-node pool
    in bf16 (a node's state rounds to bf16 before its children read it, as the reference's)."""
    n_ch, d_state = 11, 16
    slot, parents = _tree_call("branches", 3, 1, seed=31)
    bs, k = parents.shape
    p = _ssm_params(n_ch, 1, d_state, 1, bs * k, seed=32, dtype=torch.bfloat16)
    p["A"] = -torch.rand(n_ch, d_state, generator=torch.Generator().manual_seed(33)) * 3
    state = _pool((N_SLOTS, n_ch, 1, d_state), seed=34, dtype=torch.bfloat16)
    pool = _pool((N_SLOTS * k, n_ch, 1, d_state), seed=35, dtype=torch.bfloat16)
    got, ref = pool.clone(), pool.clone()
    y = ssm_tree_update(state, got, slot.int(), parents.int(), impl="triton", **p)
    y_ref = ssm_tree_update_reference(state.clone(), ref, slot, parents, **p)
    raw, rows = slice(0, 3 * k), _tree_rows(slot[:3], k)
    torch.testing.assert_close(y[raw].float(), y_ref[raw].float(), rtol=2e-2, atol=2e-2)
    _assert_tree_pool(got, pool, rows, ref[rows], "mamba1 bf16 tree", tol=2e-2)


def test_tree_ops_refuse_a_node_pool_that_does_not_match_and_take_empty_calls():
    p = _ssm_params(2, 4, 8, 1, 6, seed=0)
    state, slot, parents = torch.zeros(N_SLOTS, 2, 4, 8), torch.tensor([1, 2]), torch.tensor([[-1, 0, 1]] * 2)
    with pytest.raises(ValueError, match=r"tree must be \[n_slots \* k = 27, 2, 4, 8\]"):
        ssm_tree_update(state, torch.zeros(N_SLOTS * 2, 2, 4, 8), slot, parents, impl="triton", **p)
    with pytest.raises(ValueError, match="tree must be"):      # another dtype than the slot pool's
        ssm_tree_update(state, torch.zeros(N_SLOTS * 3, 2, 4, 8, dtype=torch.bfloat16), slot, parents, **p)
    with pytest.raises(ValueError, match=r"bs \* k = 6 rows; got 4"):
        conv_tree_update(torch.zeros(N_SLOTS, 5, 3), torch.zeros(N_SLOTS * 3, 5, 3), slot, parents,
                         torch.zeros(4, 5), torch.zeros(5, 4))
    with pytest.raises(ValueError, match="parents must be"):
        conv_tree_update(torch.zeros(N_SLOTS, 5, 3), torch.zeros(N_SLOTS * 3, 5, 3), slot, parents.flatten(),
                         torch.zeros(6, 5), torch.zeros(5, 4))
    empty = {n: v[:0] if v.shape[0] == 6 else v for n, v in p.items()}
    y = ssm_tree_update(state, torch.zeros(N_SLOTS * 3, 2, 4, 8), slot[:0], parents[:0], impl="triton", **empty)
    assert y.shape == (0, 2, 4)

@pytest.mark.cuda
@pytest.mark.parametrize("n_raw,n_pad", [(1, 0), (13, 3), (60, 4)])
def test_cuda_ssm_decode_at_a_1b_shape_in_a_cuda_graph(n_raw, n_pad):
    dev, n = torch.device("cuda"), n_raw + n_pad
    shape = (80, MAMBA2_1B["n_heads"], MAMBA2_1B["head_dim"], MAMBA2_1B["d_state"])
    pool = _pool(shape, seed=0, device=dev)
    p = _ssm_params(**MAMBA2_1B, n=n, seed=1, device=dev, dtype=torch.bfloat16)
    slot = (torch.randperm(79)[:n_raw] + 1).to(dev)
    slot = torch.cat([slot, torch.zeros(n_pad, dtype=torch.int64, device=dev)])
    inputs = {"state": pool, "slot": slot, **p}
    new_p = _ssm_params(**MAMBA2_1B, n=n, seed=2, device=dev, dtype=torch.bfloat16)
    new_slot = torch.cat([(torch.randperm(79)[:n_raw] + 1).to(dev), slot[n_raw:]])
    before = pool.clone()
    ref_pool = before.clone()
    y = _replay_with_new_data(lambda **a: ssm_decode_update(**a, impl="triton"), inputs, {"slot": new_slot, **new_p})
    y_ref = ssm_decode_update_reference(ref_pool, new_slot, **new_p)
    torch.testing.assert_close(y[:n_raw].float(), y_ref[:n_raw].float(), rtol=2e-2, atol=2e-2)
    _assert_pool(pool, before, new_slot[:n_raw], ref_pool[new_slot[:n_raw]], f"graph n={n}", tol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ssm.SCAN_METHODS)
def test_cuda_ssm_scan_and_conv_prefill_at_a_1b_shape_in_a_cuda_graph(method):
    dev = torch.device("cuda")
    lengths, n_pad_seq = [1, 100, 513, 37], 4
    cu, n_tok = _packed(lengths, n_pad_seq, 11, device=dev)
    slot = torch.tensor([5, 17, 2, 40] + [0] * n_pad_seq, device=dev)
    has_init = torch.tensor([True, False, True, False] + [False] * n_pad_seq, device=dev)
    shape = (48, MAMBA2_1B["n_heads"], MAMBA2_1B["head_dim"], MAMBA2_1B["d_state"])
    pool, before = _pool(shape, seed=3, device=dev), None
    before = pool.clone()
    p = _ssm_params(**MAMBA2_1B, n=n_tok, seed=4, device=dev, dtype=torch.bfloat16)
    fresh = _ssm_params(**MAMBA2_1B, n=n_tok, seed=5, device=dev, dtype=torch.bfloat16)
    inputs = {"state": pool, "slot": slot, "cu_seqlens": cu, "has_initial_state": has_init, **p}
    y = _replay_with_new_data(lambda **a: ssm_chunked_scan(**a, method=method, impl="triton"), inputs, fresh)
    ref_pool = before.clone()
    y_ref = ssm_chunked_scan_reference(ref_pool, slot, cu, has_init, **fresh)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)
    _assert_pool(pool, before, slot[:4], ref_pool[slot[:4]], f"ssm scan graph {method}", tol=1e-3)

    conv_pool = _pool((48, CONV_DIM, CONV_K - 1), seed=6, device=dev, dtype=torch.bfloat16)
    conv_before = conv_pool.clone()
    g = torch.Generator().manual_seed(7)
    w = torch.randn(CONV_DIM, CONV_K, generator=g).to(dev)
    x = torch.randn(n_tok, CONV_DIM, generator=g).to(dev, torch.bfloat16)
    inputs = {"conv_state": conv_pool, "slot": slot, "cu_seqlens": cu, "has_initial_state": has_init, "x": x,
              "weight": w}
    x_new = torch.randn(n_tok, CONV_DIM, generator=g).to(dev, torch.bfloat16)
    out = _replay_with_new_data(lambda **a: conv_state_prefill(**a, activation="silu", impl="triton"), inputs,
                                {"x": x_new})
    ref_conv = conv_before.clone()
    out_ref = conv_state_prefill_reference(ref_conv, slot, cu, has_init, x_new, w, activation="silu")
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=2e-2, atol=2e-2)
    _assert_pool(conv_pool, conv_before, slot[:4], ref_conv[slot[:4]], "conv prefill graph", tol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("n_raw,n_pad", [(1, 0), (29, 3)])
def test_cuda_conv_update_at_a_1b_shape_in_a_cuda_graph(n_raw, n_pad):
    dev, n = torch.device("cuda"), n_raw + n_pad
    pool = _pool((80, CONV_DIM, CONV_K - 1), seed=0, device=dev, dtype=torch.bfloat16)
    before = pool.clone()
    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(CONV_DIM, CONV_K, generator=g).to(dev), torch.randn(CONV_DIM, generator=g).to(dev)
    slot = torch.cat([(torch.randperm(79)[:n_raw] + 1), torch.zeros(n_pad, dtype=torch.int64)]).to(dev)
    inputs = {"conv_state": pool, "slot": slot, "x": torch.randn(n, CONV_DIM, device=dev, dtype=torch.bfloat16)}
    new = {"slot": torch.cat([(torch.randperm(79)[:n_raw] + 1).to(dev), slot[n_raw:]]),
           "x": torch.randn(n, CONV_DIM, device=dev, dtype=torch.bfloat16)}
    out = _replay_with_new_data(lambda **a: conv_state_update(**a, weight=w, bias=bias, activation="silu",
                                                              impl="triton"), inputs, new)
    ref_pool = before.clone()
    out_ref = conv_state_update_reference(ref_pool, new["slot"], new["x"], w, bias, "silu")
    torch.testing.assert_close(out[:n_raw].float(), out_ref[:n_raw].float(), rtol=2e-2, atol=2e-2)
    _assert_pool(pool, before, new["slot"][:n_raw], ref_pool[new["slot"][:n_raw]], f"conv graph n={n}", tol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("n_raw,n_pad", [(1, 0), (15, 1)])
def test_cuda_tree_updates_at_a_1b_shape_in_a_cuda_graph(n_raw, n_pad):
    """conv_tree_update then ssm_tree_update (the hybrid's verify of an 8-node tree) captured once and
    replayed on new slots, parents and inputs: the torch references' outputs and node rows."""
    dev, k, n = torch.device("cuda"), 8, n_raw + n_pad
    par = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5])
    shape = (MAMBA2_1B["n_heads"], MAMBA2_1B["head_dim"], MAMBA2_1B["d_state"])
    state, tree = _pool((40, *shape), seed=0, device=dev), _pool((40 * k, *shape), seed=1, device=dev)
    cstate = _pool((40, CONV_DIM, CONV_K - 1), seed=2, device=dev, dtype=torch.bfloat16)
    ctree = _pool((40 * k, CONV_DIM, CONV_K - 1), seed=3, device=dev, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(CONV_DIM, CONV_K, generator=g).to(dev), torch.randn(CONV_DIM, generator=g).to(dev)

    def call(seed, perm_seed):
        live = torch.randperm(39, generator=torch.Generator().manual_seed(perm_seed))[:n_raw] + 1
        slot = torch.cat([live, torch.zeros(n_pad, dtype=torch.int64)]).to(dev)
        parents = torch.cat([par[None].expand(n_raw, k), torch.full((n_pad, k), -1)]).to(dev)
        p = _ssm_params(**MAMBA2_1B, n=n * k, seed=seed, device=dev, dtype=torch.bfloat16)
        p.pop("x")
        xbc = torch.randn(n * k, CONV_DIM, generator=torch.Generator().manual_seed(seed)).to(dev, torch.bfloat16)
        return {"slot": slot, "parents": parents, "xbc": xbc, **p}

    def verify(slot, parents, xbc, dt, A, B, C, D, z, dt_bias, impl="triton", st=state, tr=tree, cs=cstate, ct=ctree):
        u = (conv_tree_update if impl == "triton" else conv_tree_update_reference)(
            cs, ct, slot, parents, xbc, w, bias, "silu", **({"impl": impl} if impl == "triton" else {}))
        x = u[:, :MAMBA2_1B["n_heads"] * MAMBA2_1B["head_dim"]].reshape(-1, MAMBA2_1B["n_heads"], MAMBA2_1B["head_dim"])
        fn = ssm_tree_update if impl == "triton" else ssm_tree_update_reference
        return fn(st, tr, slot, parents, x, dt, A, B, C, D, z, dt_bias, **({"impl": impl} if impl == "triton" else {}))

    tree0, ctree0 = tree.clone(), ctree.clone()
    new = call(6, 7)
    y = _replay_with_new_data(verify, call(5, 5), new)
    ref_tree, ref_ctree = tree0.clone(), ctree0.clone()
    y_ref = verify(**new, impl="torch", tr=ref_tree, ct=ref_ctree)
    raw = slice(0, n_raw * k)
    torch.testing.assert_close(y[raw].float(), y_ref[raw].float(), rtol=3e-2, atol=3e-2)
    rows = (new["slot"][:n_raw, None] * k + torch.arange(k, device=dev)).flatten()
    torch.testing.assert_close(tree[rows], ref_tree[rows], rtol=1e-3, atol=1e-3)
    assert torch.equal(ctree[rows], ref_ctree[rows])


_SM90_TREE = r"""
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padgraph.backends.triton import conv_state, ssm

blocks = ssm._blocks(64, 128, ssm.DECODE_TILE)                    # Mamba2 at a 1B shape
kernels = {
    "ssm_tree": (ssm._ssm_tree_kernel, dict(HAS_D=True, HAS_Z=True, HAS_DT_BIAS=True, DT_SOFTPLUS=True,
                 A_PER_STATE=False, **blocks), 4, ["State", "Tree", "Dt", "A", "Dskip", "DtBias"], "*fp32"),
    "conv_tree": (conv_state._conv_tree_kernel, dict(K=4, HAS_BIAS=True, SILU=True, BLOCK_D=256, BLOCK_W=4),
                  4, ["W", "Bias"], "*bf16"),
}
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = {}
for name, (fn, consts, warps, fp32, default) in kernels.items():
    sig = {a: "constexpr" if a in consts else "*fp32" if a in fp32 else "*i64" if a in ("Slot", "Parents")
           else default if a[0].isupper() else "fp32" if a in ("dt_lo", "dt_hi") else "i32" for a in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    path = os.path.join(sys.argv[1], name + ".cubin")
    open(path, "wb").write(k.asm["cubin"])
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                           capture_output=True, text=True, check=True).stdout
    fields = dict(f.split(":") for f in usage.split() if f.startswith(("REG:", "STACK:")))
    out[name] = {"stack": int(fields["STACK"])}
print(json.dumps(out))
"""


def test_tree_kernels_compile_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot show: both tree kernels compile for sm_90 (ptxas) at a 1B
    Mamba2 shape and spill nothing."""
    import json
    import os
    import subprocess
    import sys

    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("Triton's bundled ptxas / cuobjdump are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_TREE, str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    for name, r in results.items():
        assert r["stack"] == 0, f"{name} spills: {r}"


def test_strided_head_parameters_read_by_their_strides():
    """dt with heads strided (a transposed view), D and dt_bias with stride 2, a conv bias with
    stride 2: the kernels index them by head / channel alone, so the wrappers hand them a unit
    stride; each gives the result of its contiguous copy."""
    g = torch.Generator().manual_seed(0)
    bs, heads, p, n, slots = 3, 4, 8, 16, 6
    state0 = torch.randn(slots, heads, p, n, generator=g)
    slot = torch.tensor([2, 0, 4])
    x = torch.randn(bs, heads, p, generator=g)
    b, c = torch.randn(bs, 1, n, generator=g), torch.randn(bs, 1, n, generator=g)
    a = -torch.rand(heads, generator=g) - 0.5
    dt, d, bias = (torch.randn(bs, heads, generator=g), torch.randn(heads, generator=g),
                   torch.randn(heads, generator=g))
    strided = (dt.t().contiguous().t(), torch.stack([d, d], 1)[:, 0],
               torch.stack([bias, bias], 1)[:, 0])
    assert strided[0].stride(-1) != 1 and strided[1].stride(0) == 2

    def run(args, impl):
        st = state0.clone()
        y = ssm_decode_update(st, slot, x, args[0], a, b, c, D=args[1], dt_bias=args[2], impl=impl)
        return y, st

    (want, want_st), (got, got_st) = run((dt, d, bias), "torch"), run(strided, "triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_st, want_st, rtol=1e-5, atol=1e-5)

    w, cb = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    cb_strided = torch.stack([cb, cb], 1)[:, 0]
    xs, cs = torch.randn(3, 8, generator=g), torch.randn(6, 8, 3, generator=g)
    outs = [conv_state_update(cs.clone(), slot, xs, w, bias_, "silu", impl=impl)
            for bias_, impl in ((cb, "torch"), (cb_strided, "triton"))]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
