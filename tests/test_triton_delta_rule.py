"""The gated delta rule (Qwen3-Next's linear attention) over a slot-indexed state pool: the Triton
kernels against their torch reference and against transformers' own Qwen3-Next functions
(`torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`) on awkward sizes (Triton
interpreted on CPU), and at Qwen3-Next-80B-A3B's linear-attention shape on a GPU, replayed from
CUDA graphs with new data.

Besides the values, every case checks the pool contract the kernels keep: padded lanes (slot 0,
the sink) write only slot 0, rows no lane owns are bitwise untouched, raw lanes' rows equal an
unpadded run's, and a new request in a reused slot never reads the leftovers (filled with nan).
"""
import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

from padgraph.backends.triton import delta_rule
from padgraph.backends.triton.delta_rule import (delta_rule_decode_update, delta_rule_decode_update_reference,
                                                 delta_rule_prefill, delta_rule_prefill_reference)
from padgraph.errors import ContractTypeError, ContractValueError
from recurrent_cases import packed as _packed, replay_with_new_data as _replay_with_new_data

N_SLOTS = 9
PER_TOKEN = ("q", "k", "v", "g", "beta")


def _inputs(n_k_heads, n_v_heads, dk, dv, n, seed, device="cpu", dtype=torch.float32):
    """Per-token inputs of a gated delta net, seeded: g = -exp(A_log) * softplus(a + dt_bias) and
    beta = sigmoid(b), as Qwen3-Next computes them."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    a_log = torch.rand(n_v_heads, generator=gen).mul(16).clamp(min=0.01).log()
    p = {"q": r(n, n_k_heads, dk), "k": r(n, n_k_heads, dk), "v": r(n, n_v_heads, dv),
         "g": -a_log.exp() * torch.nn.functional.softplus(r(n, n_v_heads) + 1.0) * 0.1,
         "beta": torch.sigmoid(r(n, n_v_heads))}
    return {k: (v.to(dtype) if k in ("q", "k", "v") else v).to(device) for k, v in p.items()}


def _rows(p, rows):
    return {k: v[rows] for k, v in p.items()}


def _pool(shape, seed, device="cpu", dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _slots(n_raw, n_pad, seed, device="cpu"):
    """Distinct live slots in 1..N_SLOTS-1 for the raw lanes, the sink 0 for the padded ones."""
    live = torch.randperm(N_SLOTS - 1, generator=torch.Generator().manual_seed(seed))[:n_raw] + 1
    return torch.cat([live, torch.zeros(n_pad, dtype=torch.int64)]).to(device)


def _assert_pool(after, before, owned, want_owned, case, tol=None):
    """Owned rows equal `want_owned` (within `tol`, default by dtype), the sink is free, every other
    row is bitwise untouched (nan rows compared as nan)."""
    owned = owned.tolist()
    others = [r for r in range(1, after.shape[0]) if r not in owned]
    assert torch.equal(after[others].nan_to_num(7.0), before[others].nan_to_num(7.0)), \
        f"rows no lane owns were written [{case}]"
    torch.testing.assert_close(after[owned].float(), want_owned.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{m} [{case}]")


def _hf(fn, p, initial_state, use_qk_l2norm=True, **kw):
    """transformers' function on one sequence p [length, ...] from `initial_state` [n_v_heads, dk, dv]
    (None: zeros): (o [length, n_v_heads, dv], final state [n_v_heads, dk, dv]). q and k are
    repeated to the value heads first, as the model does before calling it (transformers 5.17's
    function takes equal head counts only)."""
    rep = p["v"].shape[1] // p["q"].shape[1]
    q, k = (p[n].repeat_interleave(rep, dim=1) for n in ("q", "k"))
    o, S = fn(q[None], k[None], p["v"][None], g=p["g"][None], beta=p["beta"][None],
              initial_state=None if initial_state is None else initial_state[None], output_final_state=True,
              use_qk_l2norm_in_kernel=use_qk_l2norm, **kw)
    return o[0], S[0]


# ---- delta_rule_decode_update ---------------------------------------------------------------------
DECODE_SIZES = [  # n_k_heads, n_v_heads, dk, dv, raw lanes, padded lanes
    (1, 1, 3, 5, 1, 0), (2, 4, 7, 16, 3, 2), (3, 3, 37, 9, 5, 3), (1, 3, 5, 13, 3, 1), (2, 6, 16, 8, 1, 4)]


@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2norm", "raw-qk"])
@pytest.mark.parametrize("size", DECODE_SIZES, ids=lambda s: "hk{}hv{}dk{}dv{}-raw{}pad{}".format(*s))
def test_decode_matches_reference_and_pads_write_only_the_sink(size, use_qk_l2norm):
    n_k, n_v, dk, dv, n_raw, n_pad = size
    n = n_raw + n_pad
    p = _inputs(n_k, n_v, dk, dv, n, seed=n * 7 + dk)
    for name in PER_TOKEN:                      # padded lanes carry garbage: it must not reach raw lanes
        p[name][n_raw:] = float("nan")
    slot = _slots(n_raw, n_pad, seed=dk)
    pool = _pool((N_SLOTS, n_v, dk, dv), seed=dv)
    pool[0] = float("nan")                      # the sink holds padded lanes' garbage: no raw lane reads it
    got_pool, ref_pool = pool.clone(), pool.clone()
    o = delta_rule_decode_update(got_pool, slot, use_qk_l2norm=use_qk_l2norm, impl="triton", **p)
    o_ref = delta_rule_decode_update_reference(ref_pool, slot, use_qk_l2norm=use_qk_l2norm, **p)
    case = f"size={size} l2norm={use_qk_l2norm}"
    torch.testing.assert_close(o[:n_raw], o_ref[:n_raw], msg=lambda m: f"{m} [{case}]")
    _assert_pool(got_pool, pool, slot[:n_raw], ref_pool[slot[:n_raw]], case)
    # the raw lanes' rows are bitwise those of the same call without its padded lanes
    exact_pool = pool.clone()
    o_exact = delta_rule_decode_update(exact_pool, slot[:n_raw], use_qk_l2norm=use_qk_l2norm, impl="triton",
                                       **_rows(p, slice(0, n_raw)))
    assert torch.equal(got_pool[slot[:n_raw]], exact_pool[slot[:n_raw]]), case
    assert torch.equal(o[:n_raw], o_exact), case


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("size", [(1, 1, 4, 4), (2, 4, 7, 5), (3, 6, 16, 9)],
                         ids=lambda s: "hk{}hv{}dk{}dv{}".format(*s))
def test_decode_equals_transformers_recurrent_step(size, impl):
    """One step of transformers' Qwen3-Next recurrence from the slot's state, lane by lane."""
    n_k, n_v, dk, dv = size
    p = _inputs(n_k, n_v, dk, dv, 3, seed=dk + dv)
    slot, pool = _slots(3, 0, seed=1), _pool((N_SLOTS, n_v, dk, dv), seed=2)
    got = pool.clone()
    o = delta_rule_decode_update(got, slot, impl=impl, **p)
    for lane in range(3):
        o_hf, S_hf = _hf(torch_recurrent_gated_delta_rule, _rows(p, slice(lane, lane + 1)), pool[slot[lane]])
        torch.testing.assert_close(o[lane], o_hf[0], msg=lambda m: f"{m} [lane {lane} {impl}]")
        torch.testing.assert_close(got[slot[lane]], S_hf, msg=lambda m: f"{m} [lane {lane} {impl}]")


def test_decode_with_a_low_precision_pool_and_inputs():
    """bf16 q/k/v and a bf16 pool: fp32 arithmetic inside, o in q's dtype, the pool in its own."""
    p = _inputs(2, 4, 12, 10, 4, seed=3, dtype=torch.bfloat16)
    slot, pool = _slots(4, 0, seed=4), _pool((N_SLOTS, 4, 12, 10), seed=5, dtype=torch.bfloat16)
    got, ref = pool.clone(), pool.clone()
    o = delta_rule_decode_update(got, slot, impl="triton", **p)
    o_ref = delta_rule_decode_update_reference(ref, slot, **p)
    assert o.dtype == torch.bfloat16 and got.dtype == torch.bfloat16
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
    _assert_pool(got, pool, slot, ref[slot], "bf16", tol=2e-2)


# ---- delta_rule_prefill ---------------------------------------------------------------------------
PREFILL_CASES = [  # n_k_heads, n_v_heads, dk, dv, lengths, has_initial_state, padded seqs, padded tokens
    (1, 1, 3, 5, [4], [False], 0, 0),
    (2, 4, 7, 16, [1, 5, 0], [True, False, True], 2, 3),
    (3, 3, 37, 9, [6, 2], [False, True], 1, 2),
    (1, 2, 5, 13, [3, 1, 4, 2, 1], [True, True, False, False, True], 3, 1),
    (1, 2, 6, 16, [40, 17, 16], [True, False, True], 1, 4),          # several chunks, a partial last one
]


def _reused_slots_poisoned(pool, slot, init):
    """A fresh request's slot holds the previous occupant's leftovers: nan and inf."""
    for s, keep in enumerate(init):
        if not keep:
            pool[slot[s]] = float("nan")
            pool[slot[s], 0, 0] = float("inf")
    return pool


@pytest.mark.parametrize("method", delta_rule.PREFILL_METHODS)
@pytest.mark.parametrize("case", PREFILL_CASES,
                         ids=lambda c: "hk{}hv{}dk{}dv{}-len{}".format(*c[:4], "_".join(map(str, c[4]))))
def test_prefill_matches_reference_with_fresh_and_continued_slots(case, method):
    n_k, n_v, dk, dv, lengths, init, n_pad_seq, n_pad_tok = case
    cu, n_tok = _packed(lengths, n_pad_seq, n_pad_tok)
    p = _inputs(n_k, n_v, dk, dv, n_tok, seed=n_tok)
    for name in PER_TOKEN:                      # padded tokens carry garbage: it must not reach anything
        p[name][sum(lengths):] = float("nan")
    slot = _slots(len(lengths), n_pad_seq, seed=dk)
    has_init = torch.tensor(init + [False] * n_pad_seq)
    pool = _reused_slots_poisoned(_pool((N_SLOTS, n_v, dk, dv), seed=dv), slot, init)
    pool[0] = float("nan")                      # the sink holds padded lanes' garbage: no raw lane reads it
    got_pool, ref_pool = pool.clone(), pool.clone()
    o = delta_rule_prefill(got_pool, slot, cu, has_init, method=method, impl="triton", **p)
    o_ref = delta_rule_prefill_reference(ref_pool, slot, cu, has_init, **p)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m} [{case} {method}]")
    assert not o[: sum(lengths)].isnan().any() and (o[sum(lengths):] == 0).all(), case
    _assert_pool(got_pool, pool, slot[: len(lengths)], ref_pool[slot[: len(lengths)]], f"{case} {method}", tol=1e-4)


HF_CASES = [  # n_k_heads, n_v_heads, dk, dv, lengths, has_initial_state
    (1, 1, 4, 4, [5], [True]), (2, 4, 7, 5, [3, 9, 1], [False, True, True]), (1, 3, 16, 9, [33, 2], [True, False])]


@pytest.mark.parametrize("impl_method", ["triton-sequential", "triton-chunked", "torch-sequential"])
@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "hk{}hv{}dk{}dv{}".format(*c[:4]))
def test_prefill_equals_transformers_recurrent_and_chunked_functions(case, impl_method):
    """Each sequence's outputs and final state are those of transformers' Qwen3-Next functions
    (recurrent and chunked, at a chunk size that splits the sequences) from the slot, or from None."""
    impl, method = impl_method.split("-")
    n_k, n_v, dk, dv, lengths, init = case
    cu, n_tok = _packed(lengths, 0, 0)
    p = _inputs(n_k, n_v, dk, dv, n_tok, seed=len(lengths) + dk)
    slot, pool = _slots(len(lengths), 0, seed=6), _pool((N_SLOTS, n_v, dk, dv), seed=7)
    got = pool.clone()
    o = delta_rule_prefill(got, slot, cu, torch.tensor(init), method=method, impl=impl, **p)
    for s, (lo, hi) in enumerate(zip(cu.tolist()[:-1], cu.tolist()[1:])):
        start = pool[slot[s]] if init[s] else None
        for name, fn, kw in (("recurrent", torch_recurrent_gated_delta_rule, {}),
                             ("chunked", torch_chunk_gated_delta_rule, {"chunk_size": 4})):
            o_hf, S_hf = _hf(fn, _rows(p, slice(lo, hi)), start, **kw)
            case_s = f"seq {s} vs transformers' {name} [{case} {impl_method}]"
            torch.testing.assert_close(o[lo:hi], o_hf, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m} {case_s}")
            torch.testing.assert_close(got[slot[s]], S_hf, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m} {case_s}")


@pytest.mark.parametrize("method", delta_rule.PREFILL_METHODS)
def test_prefill_then_decode_equals_one_longer_prefill(method):
    """Prefill of a prompt then decode steps leave the same state and outputs as prefilling it all:
    the two ops compute one recurrence."""
    n_k, n_v, dk, dv, steps = 1, 2, 5, 7, 3
    p = _inputs(n_k, n_v, dk, dv, 19 + steps, seed=9)
    slot, pool = torch.tensor([4]), _pool((N_SLOTS, n_v, dk, dv), seed=10)
    whole, split = pool.clone(), pool.clone()
    o_all = delta_rule_prefill(whole, slot, torch.tensor([0, 19 + steps], dtype=torch.int32), torch.tensor([False]),
                               method=method, impl="triton", **p)
    o_head = delta_rule_prefill(split, slot, torch.tensor([0, 19], dtype=torch.int32), torch.tensor([False]),
                                method=method, impl="triton", **_rows(p, slice(0, 19)))
    os = [delta_rule_decode_update(split, slot, impl="triton", **_rows(p, slice(t, t + 1)))
          for t in range(19, 19 + steps)]
    torch.testing.assert_close(torch.cat([o_head, *os]), o_all)
    torch.testing.assert_close(split, whole)


@pytest.mark.parametrize("g_scale", [0.0, 60.0], ids=["no-decay", "steep-decay"])
def test_chunked_prefill_stays_finite_at_extreme_gates(g_scale):
    """g = 0 (no forgetting) and g ~ -60 a token (exp underflows to 0 within a chunk): the chunked
    form masks before exp, so no inf * 0, and agrees with the token-by-token recurrence."""
    p = _inputs(2, 2, 8, 8, 21, seed=11)
    p["g"] = -torch.rand(21, 2, generator=torch.Generator().manual_seed(12)) * g_scale
    p["beta"][5:9] = 1.0                                     # beta 1: the state's column overwritten
    cu, has_init = torch.tensor([0, 21], dtype=torch.int32), torch.tensor([True])
    slot, pool = torch.tensor([3]), _pool((N_SLOTS, 2, 8, 8), seed=13)
    got, ref = pool.clone(), pool.clone()
    o = delta_rule_prefill(got, slot, cu, has_init, method="chunked", impl="triton", **p)
    o_ref = delta_rule_prefill_reference(ref, slot, cu, has_init, **p)
    assert torch.isfinite(o).all() and torch.isfinite(got).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tile", [16, 64])
def test_kernels_split_dv_into_blocks_with_a_partial_last_one(monkeypatch, tile):
    """Small tiles: dv 37 at dk 8 runs as blocks of 2 or 8 columns (the chunked prefill: 16), the
    last one partial."""
    monkeypatch.setattr(delta_rule, "DECODE_TILE", tile)
    monkeypatch.setattr(delta_rule, "SCAN_TILE", tile)
    monkeypatch.setattr(delta_rule, "CHUNK_V", 16)
    n_k, n_v, dk, dv = 1, 2, 8, 37
    p = _inputs(n_k, n_v, dk, dv, 4, seed=14)
    slot, pool = _slots(3, 1, seed=15), _pool((N_SLOTS, n_v, dk, dv), seed=16)
    got, ref = pool.clone(), pool.clone()
    torch.testing.assert_close(delta_rule_decode_update(got, slot, impl="triton", **p)[:3],
                               delta_rule_decode_update_reference(ref, slot, **p)[:3])
    _assert_pool(got, pool, slot[:3], ref[slot[:3]], f"decode tile={tile}")
    cu, has_init = torch.tensor([0, 3, 4, 4], dtype=torch.int32), torch.tensor([True, False, False])
    for method in delta_rule.PREFILL_METHODS:
        got, ref = pool.clone(), pool.clone()
        torch.testing.assert_close(delta_rule_prefill(got, slot[:3], cu, has_init, method=method, impl="triton", **p),
                                   delta_rule_prefill_reference(ref, slot[:3], cu, has_init, **p))
        _assert_pool(got, pool, slot[:3], ref[slot[:3]], f"prefill tile={tile} {method}")


def test_an_explicit_scale_replaces_the_head_dim_default():
    """scale=None is dk ** -0.5 (transformers'); an explicit scale is used as given."""
    p = _inputs(1, 1, 9, 4, 2, seed=17)
    slot, pool = _slots(2, 0, seed=18), _pool((N_SLOTS, 1, 9, 4), seed=19)
    default, explicit, other = pool.clone(), pool.clone(), pool.clone()
    o = delta_rule_decode_update(default, slot, impl="triton", **p)
    torch.testing.assert_close(delta_rule_decode_update(explicit, slot, scale=9 ** -0.5, impl="triton", **p), o)
    o2 = delta_rule_decode_update(other, slot, scale=1.0, impl="triton", **p)
    torch.testing.assert_close(o2, o * 3.0)       # o is linear in q: S^T (scale q)


def test_under_torch_compile_the_pool_is_updated_in_place_as_eager():
    """While torch.compile traces, the ops run their torch references (`resolve_impl`): the pool
    update must survive functionalisation as an in-place write to the caller's pool."""
    p = _inputs(1, 2, 5, 3, 4, seed=20)
    slot, pool = _slots(3, 1, seed=21), _pool((N_SLOTS, 2, 5, 3), seed=22)
    eager, compiled = pool.clone(), pool.clone()
    o = delta_rule_decode_update(eager, slot, impl="triton", **p)
    step = torch.compile(lambda st, sl, kw: delta_rule_decode_update(st, sl, **kw), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(step(compiled, slot, p)[:3], o[:3])
    _assert_pool(compiled, pool, slot[:3], eager[slot[:3]], "compiled decode")


# ---- argument checks ----------------------------------------------------------------------------
def test_bad_arguments_are_refused_naming_the_op_argument_and_what_is_allowed():
    p = _inputs(2, 4, 3, 5, 2, seed=0)
    pool, two = torch.zeros(N_SLOTS, 4, 3, 5), torch.zeros(2, dtype=torch.int64)
    op = "program 'delta_rule_decode_update'"
    with pytest.raises(ContractValueError, match=rf"{op}, input 'slot': shape must be \[2\]"):
        delta_rule_decode_update(pool, torch.zeros(3, dtype=torch.int64), **p)
    with pytest.raises(ContractTypeError, match="input 'slot': dtype must be int32 or int64"):
        delta_rule_decode_update(pool, two.float(), **p)
    with pytest.raises(ContractValueError, match="n_k_heads dividing n_v_heads=4"):
        delta_rule_decode_update(pool, two, **dict(p, q=torch.zeros(2, 3, 3), k=torch.zeros(2, 3, 3)))
    with pytest.raises(ContractValueError, match=r"input 'k': shape .* must be \(2, 2, 3\), got \(2, 2, 4\)"):
        delta_rule_decode_update(pool, two, **dict(p, k=torch.zeros(2, 2, 4)))
    with pytest.raises(ContractValueError, match=r"input 'v': shape .* must be \(2, 4, 5\)"):
        delta_rule_decode_update(pool, two, **dict(p, v=torch.zeros(2, 4, 6)))
    with pytest.raises(ContractValueError, match=r"input 'g': shape .* must be \(2, 4\)"):
        delta_rule_decode_update(pool, two, **dict(p, g=torch.zeros(2, 2)))
    with pytest.raises(ContractValueError, match="input 'v': layout must be contiguous in its last dim"):
        delta_rule_decode_update(pool, two, **dict(p, v=torch.zeros(2, 4, 5).transpose(0, 2).contiguous()
                                                   .transpose(0, 2)))
    with pytest.raises(ContractValueError, match=r"input 'state': shape must be \[n_slots, n_v_heads, dk, dv\]"):
        delta_rule_decode_update(pool[0], two, **p)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ContractTypeError, match=r"'delta_rule_prefill', input 'has_initial_state': dtype must be bool"):
        delta_rule_prefill(pool, two[:1], cu, torch.tensor([1]), **p)
    with pytest.raises(ContractValueError, match="method must be one of"):
        delta_rule_prefill(pool, two[:1], cu, torch.tensor([True]), method="parallel", **p)
    with pytest.raises(ValueError):      # the contract errors stay ValueErrors for callers
        delta_rule_prefill(pool, two, cu, torch.tensor([True]), **p)


# ---- GPU: Qwen3-Next-80B-A3B's linear attention, eager and replayed from CUDA graphs --------------
QWEN3_NEXT = dict(n_k_heads=16, n_v_heads=32, dk=128, dv=128)   # linear_num_{key,value}_heads, *_head_dim




@pytest.mark.cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("n_raw,n_pad", [(1, 0), (13, 3), (60, 4)])
def test_cuda_decode_at_qwen3_next_shape_in_a_cuda_graph(n_raw, n_pad, pool_dtype):
    dev, n = torch.device("cuda"), n_raw + n_pad
    pool = _pool((80, QWEN3_NEXT["n_v_heads"], QWEN3_NEXT["dk"], QWEN3_NEXT["dv"]), seed=0, device=dev,
                 dtype=pool_dtype)
    slot = torch.cat([torch.randperm(79)[:n_raw] + 1, torch.zeros(n_pad, dtype=torch.int64)]).to(dev)
    inputs = {"state": pool, "slot": slot, **_inputs(**QWEN3_NEXT, n=n, seed=1, device=dev, dtype=torch.bfloat16)}
    fresh = _inputs(**QWEN3_NEXT, n=n, seed=2, device=dev, dtype=torch.bfloat16)
    fresh["slot"] = torch.cat([(torch.randperm(79)[:n_raw] + 1).to(dev), slot[n_raw:]])   # a new batch, same pads
    before = pool.clone()
    o = _replay_with_new_data(lambda **a: delta_rule_decode_update(**a, impl="triton"), inputs, fresh)
    ref_pool = before.clone()
    o_ref = delta_rule_decode_update_reference(ref_pool, fresh["slot"], **{k: fresh[k] for k in PER_TOKEN})
    torch.testing.assert_close(o[:n_raw].float(), o_ref[:n_raw].float(), rtol=2e-2, atol=2e-2)
    tol = 1e-4 if pool_dtype == torch.float32 else 2e-2
    _assert_pool(pool, before, fresh["slot"][:n_raw], ref_pool[fresh["slot"][:n_raw]], f"graph n={n}", tol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("method", delta_rule.PREFILL_METHODS)
def test_cuda_prefill_at_qwen3_next_shape_in_a_cuda_graph(method):
    dev = torch.device("cuda")
    lengths, n_pad_seq = [1, 100, 513, 37], 4
    cu, n_tok = _packed(lengths, n_pad_seq, 11, device=dev)
    slot = torch.tensor([5, 17, 2, 40] + [0] * n_pad_seq, device=dev)
    has_init = torch.tensor([True, False, True, False] + [False] * n_pad_seq, device=dev)
    pool = _pool((48, QWEN3_NEXT["n_v_heads"], QWEN3_NEXT["dk"], QWEN3_NEXT["dv"]), seed=3, device=dev)
    pool = _reused_slots_poisoned(pool, slot[:4], [True, False, True, False])
    before = pool.clone()
    inputs = {"state": pool, "slot": slot, "cu_seqlens": cu, "has_initial_state": has_init,
              **_inputs(**QWEN3_NEXT, n=n_tok, seed=4, device=dev, dtype=torch.bfloat16)}
    fresh = _inputs(**QWEN3_NEXT, n=n_tok, seed=5, device=dev, dtype=torch.bfloat16)
    o = _replay_with_new_data(lambda **a: delta_rule_prefill(**a, method=method, impl="triton"), inputs, fresh)
    ref_pool = before.clone()
    o_ref = delta_rule_prefill_reference(ref_pool, slot, cu, has_init, **fresh)
    assert torch.isfinite(o).all(), method
    torch.testing.assert_close(o.float(), o_ref.float(), rtol=3e-2, atol=3e-2)
    _assert_pool(pool, before, slot[:4], ref_pool[slot[:4]], f"prefill graph {method}", tol=2e-3)


@pytest.mark.cuda
def test_cuda_prefill_equals_transformers_chunked_function_at_qwen3_next_shape():
    """One 300-token sequence from a live slot against transformers' chunked function on the GPU."""
    dev = torch.device("cuda")
    p = _inputs(**QWEN3_NEXT, n=300, seed=6, device=dev, dtype=torch.bfloat16)
    pool = _pool((4, QWEN3_NEXT["n_v_heads"], QWEN3_NEXT["dk"], QWEN3_NEXT["dv"]), seed=7, device=dev)
    slot, cu = torch.tensor([2], device=dev), torch.tensor([0, 300], dtype=torch.int32, device=dev)
    o_hf, S_hf = _hf(torch_chunk_gated_delta_rule, p, pool[2].clone())
    for method in delta_rule.PREFILL_METHODS:
        got = pool.clone()
        o = delta_rule_prefill(got, slot, cu, torch.tensor([True], device=dev), method=method, impl="triton", **p)
        torch.testing.assert_close(o.float(), o_hf.float(), rtol=3e-2, atol=3e-2, msg=lambda m: f"{m} [{method}]")
        torch.testing.assert_close(got[2], S_hf, rtol=1e-2, atol=1e-2, msg=lambda m: f"{m} [{method}]")


@pytest.mark.parametrize("method", delta_rule.PREFILL_METHODS)
def test_a_full_reset_decay_and_tokens_before_the_first_sequence(method):
    """g = -inf (exp(g) = 0: the state reset) at a token mid-chunk: the chunked form's
    cumulative differences stay finite, as the reference's and the sequential kernel's; tokens
    before cu_seqlens[0] belong to no sequence in the kernels and the reference alike."""
    for cu_list, reset in (([0, 20], 5), ([3, 8, 12], None)):
        n_tok = cu_list[-1]
        p = _inputs(1, 2, 8, 8, n_tok, seed=11)
        if reset is not None:
            p["g"][reset, 0] = float("-inf")
        cu = torch.tensor(cu_list, dtype=torch.int32)
        n_seq = len(cu_list) - 1
        slot = torch.arange(1, n_seq + 1)
        has_init = torch.ones(n_seq, dtype=torch.bool)
        pool = _pool((N_SLOTS, 2, 8, 8), seed=3)
        got_pool, ref_pool = pool.clone(), pool.clone()
        o = delta_rule_prefill(got_pool, slot, cu, has_init, method=method, impl="triton", **p)
        o_ref = delta_rule_prefill_reference(ref_pool, slot, cu, has_init, **p)
        assert not o.isnan().any() and (o_ref[: cu_list[0]] == 0).all()
        torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_pool, ref_pool, rtol=1e-4, atol=1e-4)
