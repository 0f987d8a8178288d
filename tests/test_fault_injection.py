"""The fault catalogue (padgraph.spec.inject) on the CPU: every injected padding bug is caught by at
least one detector, and none of the detectors raises an alarm on the same programs without the bug."""
import pytest
import torch

from padgraph.spec import faults as F
from padgraph.spec import inject as I


@pytest.fixture(scope="module")
def rows():
    return {r["fault"]: r for r in I.run_all(["all"], "reference", torch.device("cpu"), programs=100)}


def test_catalogue_covers_the_known_classes(rows):
    assert len(F.FAULTS) >= 12 and set(rows) == {f.name for f in F.FAULTS}
    assert {f.kind for f in F.FAULTS} == {"backend", "program", "usage"}


@pytest.mark.parametrize("name", [f.name for f in F.FAULTS])
def test_fault_is_caught_and_clean_case_is_not(rows, name):
    r = rows[name]
    assert not I.caught(r["clean"]), f"{name}: a detector flagged the program without the bug: {r['clean']}"
    if r["graph_only"]:
        pytest.skip(f"{name}: the bug exists only under a capture (cuda)")
    assert I.caught(r["with_bug"]), f"{name}: no detector caught the bug: {r['with_bug']}"


def test_detectors_that_the_design_promises(rows):
    """Where each detector is the designed line of defence, it must be the one that catches."""
    assert rows["live-kv-row"]["with_bug"]["canary"] == "call 1"      # the clamp lands on the canary row
    for name in ("live-kv-row", "live-recurrent-row", "raw-metadata"):
        assert rows[name]["with_bug"]["check"] != "-" and rows[name]["with_bug"]["shadow"] != "-", name
    assert rows["output-past-call"]["with_bug"]["enforced"] == "call 2"
    assert rows["state-rebound"]["with_bug"]["enforced"] != "-"
    assert rows["missing-factor"]["with_bug"]["enforced"] == "call 1"
    assert rows["stale-tail"]["with_bug"]["shadow"] != "-"


def test_command_line(capsys):
    assert I.main(["--inject", "live-kv-row,output-past-call"]) == 0
    out = capsys.readouterr().out
    assert "faults=2 caught=2 false_alarms=0" in out
    with pytest.raises(KeyError, match="no fault 'nope'"):
        I.main(["--inject", "nope"])


@pytest.mark.cuda
def test_cuda_catches_every_fault_including_graph_only():
    rows = I.run_all(["all"], "cuda", torch.device("cuda"), programs=60)
    bad = [(r["fault"], r["with_bug"], r["clean"]) for r in rows if not r["ok"] or r["graph_only"]]
    assert not bad, bad
    baked = next(r for r in rows if r["fault"] == "baked-scalar")
    assert baked["with_bug"]["shadow"] != "-"
