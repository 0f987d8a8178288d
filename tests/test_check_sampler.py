"""pg.check without `sample=`: index inputs are drawn from what the program declares.

A paged decode body indexes state with its inputs (`req_pool_indices` into `req_to_token`,
`out_cache_loc` into the KV pools). Drawn as small random integers they collide with the sink
rows and with each other, and a correct body then "breaks" the contract on every trial. An
integer input whose pad is a sink row of a state is an index into that state, so the default
sampler draws it as distinct non-sink rows: a correct body gets no finding, a buggy one still
does, and every finding names where: the lane of an output, the row of a state.
"""
import pytest
import torch

import padgraph as pg
from padgraph.check import default_sample
from padgraph.check_inputs import index_inputs
from padgraph.llm.programs import decode_program

H, SLOTS, REQS, MAX_LEN = 4, 64, 9, 32
B = pg.Buckets([1, 2, 4, 8])
EMB = torch.randn(SLOTS, H, generator=torch.Generator().manual_seed(0))


def _program():
    return decode_program(lambda a: {"y": pg.Output((a.bs,), torch.float32)}, buckets=B)


def _state():
    """Paged KV: request row r, position p -> a non-sink slot; row 0 (the sink request) -> slot 0."""
    r, p = torch.arange(REQS)[:, None], torch.arange(MAX_LEN)[None, :]
    table = (1 + (r * 7 + p) % (SLOTS - 1)) * (r > 0)
    return {"k_cache": torch.zeros(SLOTS, H), "v_cache": torch.zeros(SLOTS, H),
            "req_to_token": table.to(torch.int32)}


def decode(x, slot_of=None):
    """One token per request: its K/V at its slot, the slot in its page table, then attention
    over the request's first seq_lens slots."""
    req = x.req_pool_indices.long()
    loc = x.out_cache_loc if slot_of is None else slot_of(x)
    x.req_to_token[req, x.positions] = loc.to(torch.int32)
    k = EMB[x.input_ids]
    x.k_cache.index_copy_(0, loc, k)
    x.v_cache.index_copy_(0, loc, 2 * k)
    slots = x.req_to_token[req].long()                                        # [bs, MAX_LEN]
    live = torch.arange(MAX_LEN)[None, :] < x.seq_lens[:, None]
    scores = (x.k_cache[slots] * k[:, None, :]).sum(-1)                      # [bs, MAX_LEN]
    w = torch.where(live, scores.exp(), torch.zeros(()))
    y = (w[..., None] * x.v_cache[slots]).sum((1, 2)) / w.sum(1).clamp(min=1e-6)
    return {"y": y}


def test_index_inputs_are_the_ones_whose_pad_is_a_sink():
    r = pg.compile(_program(), decode, "reference", state=_state())
    got = index_inputs(r.program, r.state)
    # every pad-0 integer input indexes a state with sink 0 (and canary row 1, which the runner
    # programs declare); the smallest dim 0 bounds them all
    assert set(got) == {"input_ids", "positions", "req_pool_indices", "out_cache_loc"}, got
    assert all(v == (REQS, frozenset({0, 1})) for v in got.values()), got
    assert "seq_lens" not in got        # pad 1: no sink, a length


def test_correct_paged_decode_body_has_no_finding_without_sample():
    st = _state()
    before = {n: t.clone() for n, t in st.items()}
    res = pg.check(_program(), decode, state=st, trials=12)
    assert res.ok, str(res)
    drew = "'req_pool_indices' as distinct rows in [0, 9) (the lowest first) but [0, 1]"
    assert any(drew in n for n in res.notes), res.notes
    assert all(torch.equal(st[n], before[n]) for n in st), "pg.check must restore state"


def test_small_integer_draws_would_flood_the_same_body():
    """Why the declared sampler: the same correct body under draws in 0..3 (raw lanes on the
    sink row, two lanes on one slot) is reported on its own inputs' account."""
    res = pg.check(_program(), decode, state=_state(), sample=lambda g: default_sample(_program(), g), trials=12)
    assert not res.ok


def _padded_lanes_write_live_slots(x):
    lane = torch.arange(x.bucket)
    return torch.where(lane < x.extent("bs"), x.out_cache_loc, lane + 1)      # stale slots 1.. for pads


def test_padded_lanes_writing_live_slots_are_found_and_name_the_rows():
    res = pg.check(_program(), lambda x: decode(x, _padded_lanes_write_live_slots), state=_state(), trials=8)
    writes = [f for f in res.findings if f.kind == "state-write" and f.buffer in ("state 'k_cache'", "state 'v_cache'")]
    assert writes, str(res)
    assert all(f.rows and f"rows {list(f.rows)[:8]}" in f.detail for f in writes), [f.detail for f in writes]
    assert all(0 not in f.rows for f in writes), "the sink is no stray write"


def test_a_raw_lane_reading_padded_lanes_is_found_and_names_the_lane():
    def leaky(x):
        out = decode(x)
        out["y"] = out["y"] + x.seq_lens.float().sum()        # every raw lane reads the padded lengths (pad 1)
        return out

    res = pg.check(_program(), leaky, state=_state(), trials=8)
    leaks = [f for f in res.findings if f.kind == "pad-leakage" and f.buffer == "output 'y'"]
    assert leaks, str(res)
    for f in leaks:
        assert len(f.lane) == 1 and f.lane[0] < f.extents["bs"], f
        assert f"at lane {list(f.lane)}" in f.detail and "in the baseline" in f.detail, f.detail


def test_a_state_leak_names_the_row():
    """Raw lanes copy a padded lane's K into their own slot: state findings name the row."""
    def copies_pad(x):
        out = decode(x)
        x.k_cache[x.out_cache_loc[:1]] += x.k_cache[x.out_cache_loc[-1:]]     # the last lane: padded (the sink) in a larger bucket
        return out

    res = pg.check(_program(), copies_pad, state=_state(), trials=8)
    leaks = [f for f in res.findings if f.kind == "state-leakage"]
    assert leaks, str(res)
    for f in leaks:
        assert f.rows and f.rows[0] >= 1 and f"at row {f.rows[0]}" in f.detail, f.detail


@pytest.mark.parametrize("bad,err,parts", [
    (dict(trials=0), pg.ContractValueError, ["trials", ">= 1", "0"]),
    (dict(trials=2.5), pg.ContractTypeError, ["trials", "an int", "2.5"]),
    (dict(trials=True), pg.ContractTypeError, ["trials", "an int", "True"]),
    (dict(seed="a"), pg.ContractTypeError, ["seed", "an int", "'a'"]),
    (dict(seed=-1), pg.ContractValueError, ["seed", ">= 0", "-1"]),
    (dict(sample=3), pg.ContractTypeError, ["sample", "callable", "3"]),
    (dict(tolerance=1e-3), pg.ContractValueError, ["tolerance", "(rtol, atol)", "0.001"]),
    (dict(tolerance=(1e-3, -1)), pg.ContractValueError, ["tolerance", ">= 0"]),
    (dict(tolerance=(1e-3, "0")), pg.ContractValueError, ["tolerance", ">= 0", "'0'"]),
    (dict(prepare=3), pg.ContractTypeError, ["prepare", "callable", "3"]),
    (dict(state=3), pg.ContractTypeError, ["state", "mapping", "int"]),
])
def test_check_arguments_are_checked(bad, err, parts):
    kw = {"state": _state(), **bad}
    with pytest.raises(err) as e:
        pg.check(_program(), decode, **kw)
    assert isinstance(e.value, pg.ContractError)
    for part in parts:
        assert part in str(e.value), f"message={str(e.value)!r}, but should contain {part!r}"


def test_check_tolerance_may_leave_one_to_the_dtype():
    assert pg.check(_program(), decode, state=_state(), tolerance=(None, 1e-6), trials=2).ok


def test_check_program_and_body_are_checked():
    with pytest.raises(pg.ContractValueError, match="program must be a pg.Program, got 3"):
        pg.check(3, decode)
    with pytest.raises(pg.ContractTypeError, match="body must be a callable"):
        pg.check(_program(), 3, state=_state())


def test_canary_rows_are_never_drawn():
    import dataclasses
    if "canary" not in {f.name for f in dataclasses.fields(pg.State)}:
        pytest.skip("this pg.State has no canary rows")
    bs = pg.Axis("bs")
    prog = pg.Program("canary", inputs={"loc": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)},
                      state={"kv": pg.State(sink=0, canary=(1, 2))}, buckets=[1, 2, 4])
    r = pg.compile(prog, lambda x: {"y": x.kv[x.loc]}, "reference", state={"kv": torch.zeros(8)})
    assert index_inputs(prog, r.state) == {"loc": (8, frozenset({0, 1, 2}))}


def test_the_standard_decode_runner_has_no_finding_without_sample():
    """padgraph.llm's own decode program and body (KV pools and a page table with sink 0): no
    finding without sample=, where draws in 0..3 reported dozens."""
    from padgraph.llm import SpecConfig, Worker, checks
    from padgraph.llm.models.eagle_head import EagleHead
    from padgraph.llm.models.llama import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny()).eval()
    w = Worker(target, EagleHead(target).eval(), SpecConfig(steps=3, topk=2, num_draft_tokens=5), max_bs=8,
               max_context=48, buckets=B)
    checks.own_slots(w)                                      # every row but 0 owns 48 slots
    program, body = w.programs["decode"], w.bodies["decode"]
    with torch.no_grad():
        res = pg.check(program, body, state=w.state("decode"), trials=6, tolerance=(1e-5, 1e-5))
        assert res.ok, str(res)
        flooded = pg.check(program, body, state=w.state("decode"), trials=6, tolerance=(1e-5, 1e-5),
                           sample=lambda g: default_sample(program, g))
    assert len(flooded.findings) > 6, str(flooded)
