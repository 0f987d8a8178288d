"""Generated programs with recurrent state (rule 7.9): what they draw, what their oracle says, and
that they catch the bug class they exist for.

A recurrent program keeps state `rec` read-modify-written per lane, h <- decay * where(fresh, 0, h)
+ x, in a slot-indexed pool with sink 0 (slot input `r_slot`, pad 0; `r_fresh`, pad True) or
batch-ordered (`rows=bs`). Its call sequences admit requests into free slots, release some (the
caller fills a released row with nan) and hand released slots to new, fresh requests. The
oracle applies the recurrence lane by lane on the CPU, never through the body.
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, find, given, seed, settings, strategies as st

import padgraph as pg
from padgraph.spec import cases as C
from padgraph.spec import generated as G
from padgraph.spec import oracle as O
from padgraph.spec import strategies as SG

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "spec_fixtures"))
from buggy_backends import StaleLaneRunner  # noqa: E402

if "stale-lane" not in pg.backend_names():
    pg.register_backend("stale-lane", StaleLaneRunner)

QUIET = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@st.composite
def recurrent_cases(draw, kind=None, state=None):
    recipe = draw(SG.recipes(recurrent=kind or draw(st.sampled_from(["pool", "rows"])), state=state))
    return recipe, draw(SG.call_lists(recipe))


def _ran(recipe, call) -> bool:
    """Whether SPEC runs the call (not rejected, not past the ladder under overflow="error")."""
    on_ladder = O.bucket(G.build_program(recipe), dict(call.ext))[1]
    return call.reject is None and (on_ladder or recipe.overflow == "eager")


@seed(11)
@settings(QUIET, max_examples=150)
@given(recurrent_cases(kind="pool"))
def test_pool_calls_draw_distinct_live_slots_never_the_sink(case):
    """Every call's lanes are distinct slots past the sink, one per raw lane; a lane is fresh
    exactly when its slot had no call that ran since it was admitted; released rows are free."""
    recipe, calls = case
    started = {}
    for call in calls:
        slots = [s for s, _ in call.lanes]
        assert len(slots) == dict(call.ext)["bs"] and len(set(slots)) == len(slots), call
        assert 0 not in slots and max(slots) < G.rec_rows(recipe), call
        for s in call.poison:           # released before the call: its next occupant is fresh
            started.pop(s, None)
        for s, fresh in call.lanes:
            assert fresh == (not started.get(s, False)), (s, fresh, started, call)
        if _ran(recipe, call):
            started.update((s, True) for s in slots)


def test_call_sequences_reuse_released_slots_for_fresh_requests():
    """Some drawn sequence releases a slot (filled with nan) and hands it to a fresh request."""
    def reuses(case):
        _, calls = case
        released = set()
        for call in calls:
            released |= set(call.poison)
            if any(fresh and s in released for s, fresh in call.lanes):
                return True
        return False
    find(recurrent_cases(kind="pool"), reuses, settings=settings(QUIET, max_examples=500, database=None))


@seed(12)
@settings(QUIET, max_examples=100)
@given(recurrent_cases(kind="rows"))
def test_rows_lanes_whose_row_a_pad_may_have_written_are_fresh(case):
    """Batch-ordered: a lane continues (not fresh) only from a row a raw lane or the initial
    state left; rows [n, bucket) of a call that ran, and rows the caller filled, start fresh."""
    recipe, calls = case
    unknown = set()
    for call in calls:
        unknown |= set(call.poison)
        for row, fresh in call.lanes:
            assert fresh or row not in unknown, (row, unknown, call)
        if _ran(recipe, call):
            n = dict(call.ext)["bs"]
            size = O.bucket(G.build_program(recipe), dict(call.ext))[0]
            unknown = (unknown - set(range(n))) | set(range(n, size))


POOL_INPUTS = (("r_slot", (("bs", 1, 0),), torch.int64, ("fill", 0)),
               ("r_fresh", (("bs", 1, 0),), torch.bool, ("fill", True)),
               ("r_x", (("bs", 1, 0), 3), torch.float32, ("fill", float("nan"))))


def test_oracle_applies_the_recurrence_per_lane():
    recipe = G.Recipe(ladder=(4,), inputs=POOL_INPUTS, recurrent="pool")
    mirror = {"rec": G._rec_initial(recipe, "cpu")}
    before = [t.clone() for t in mirror["rec"]]
    raw = {"r_slot": torch.tensor([3, 1]), "r_fresh": torch.tensor([False, True]),
           "r_x": torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 8.0]])}
    out = C.recur(recipe, {"rec": G.wrap_state("list", *mirror["rec"])}, raw)
    want3 = 0.5 * before[0][3] + raw["r_x"][0]
    assert torch.equal(out, torch.stack([want3, raw["r_x"][1]]))
    assert torch.equal(mirror["rec"][1][3], 0.25 * before[1][3] + raw["r_x"][0, :2])
    untouched = [r for r in range(G.rec_rows(recipe)) if r not in (1, 3)]
    assert all(torch.equal(m[untouched], b[untouched]) for m, b in zip(mirror["rec"], before))


def test_released_nan_rows_stay_bitwise_and_fresh_lanes_never_read_them():
    """A slot released with nan in it, reused by a fresh request: its new row is x exactly, the
    other released row keeps the caller's nan bit for bit, and a pad of nan reaches only the sink."""
    recipe = G.Recipe(ladder=(2, 4), inputs=POOL_INPUTS, recurrent="pool", rec_form="dict")
    calls = [G.Call(ext=(("bs", 3),), lanes=((1, True), (2, True), (3, True))),
             G.Call(ext=(("bs", 2),), lanes=((3, False), (1, False)), seed=1),
             G.Call(ext=(("bs", 1),), lanes=((2, True),), poison=(1, 2), seed=2)]
    C.run_case(recipe, calls, backend="reference", device="cpu")


@pytest.mark.parametrize("how", G.REC_WRITES)
def test_judge_flags_a_body_whose_padded_lane_writes_a_live_row(how, monkeypatch):
    """The judge itself: a body that sends padded lanes to slot 1 instead of the sink is reported."""
    recipe = G.Recipe(ladder=(4,), inputs=POOL_INPUTS[:2] + (POOL_INPUTS[2][:3] + (("fill", 5.0),),),
                      recurrent="pool", rec_write=how)
    real = G._write_rows

    def to_live(how_, leaf, slot, new):
        real(how_, leaf, torch.where(slot == 0, torch.ones_like(slot), slot), new)
    monkeypatch.setattr(G, "_write_rows", to_live)
    calls = [G.Call(ext=(("bs", 1),), lanes=((2, True),))]
    with pytest.raises(AssertionError, match=r"state rec leaf 0 \(non-sink\) differs at \[0"):
        C.run_case(recipe, calls, backend="reference", device="cpu")


@pytest.mark.filterwarnings("ignore::padgraph.OverflowWarning")
@seed(13)
@settings(QUIET, max_examples=40)
@given(recurrent_cases())
def test_reference_passes_recurrent_programs(case):
    recipe, calls = case
    C.run_case(recipe, calls, backend="reference", device="cpu")


@pytest.mark.filterwarnings("ignore::padgraph.OverflowWarning")
def test_recurrent_programs_catch_a_backend_whose_padded_lanes_write_live_slots():
    """StaleLaneRunner: padded lanes of the slot input keep earlier calls' slots. Programs
    without recurrent or sink state cannot see it; a recurrent pool program does, naming `rec`."""
    def passes(case):
        recipe, calls = case
        C.run_case(recipe, calls, backend="stale-lane", device="cpu")
        return True

    @seed(14)
    @settings(QUIET, max_examples=30)
    @given(st.data())
    def blind(data):
        recipe = data.draw(SG.recipes(recurrent="none", state="none"))
        passes((recipe, data.draw(SG.call_lists(recipe))))
    blind()

    def caught(case):
        try:
            passes(case)
        except AssertionError as e:
            return "state rec leaf" in str(e)
        return False
    recipe, calls = find(recurrent_cases(kind="pool", state="none"), caught,
                         settings=settings(QUIET, max_examples=300, database=None))
    C.run_case(recipe, calls, backend="reference", device="cpu")      # the program itself is right


@pytest.mark.filterwarnings("ignore::padgraph.OverflowWarning")
@seed(16)
@settings(QUIET, max_examples=6)
@given(recurrent_cases())
def test_compiled_bodies_keep_the_recurrence_exact(case):
    """torch_compile=True: inductor may fuse decay * h + x into one multiply-add; decay is a power
    of two and x a multiple of 1/8, so the fused result is the eager one, bit for bit."""
    recipe, calls = case
    C.run_case(recipe, calls, backend="reference", device="cpu", torch_compile=True)


VARIANTS = {"auto": {}, "in-graph": {"pack": "in-graph"}, "eager": {"pack": "eager"}, "torch": {"pack": "torch"},
            "torch_compile": {"torch_compile": True}}


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore::padgraph.OverflowWarning")
@pytest.mark.parametrize("variant", list(VARIANTS))
@seed(15)
@settings(QUIET, max_examples=16)
@given(case=recurrent_cases())
def test_cuda_backend_passes_recurrent_programs(variant, case):
    """Every pack strategy and compiled bodies: the CUDA graph's padded lanes write only the sink."""
    recipe, calls = case
    C.run_case(recipe, calls, backend="cuda", device="cuda", **VARIANTS[variant])
