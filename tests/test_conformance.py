"""The conformance suite (padgraph.spec) run against the reference backend, as part of `pytest tests`.

It runs through the documented entry points in a subprocess, so a failing conformance case fails
this test with pytest's summary of the failures; and it checks that the suite does fail a backend
with a known bug (a suite that passes everything proves nothing).

Cost, on a 2-core machine: these are the longest tests of `pytest tests`. The suite with compiled
bodies runs as two shards (`COMPILED_SHARDS`) that pytest-xdist spreads over its workers; the
generated programs run once, at a fixed budget and seed (`GENERATED`), not again inside the
whole-suite runs (the compiled run draws `GENERATED_COMPILED` of them: each compiles a body of
its own). No call has a wall-clock limit that a slow or busy machine trips: `DEADLOCK_S` only stops
a child that hangs, far past any slow run.
"""
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLOCK_S = 3 * 3600
GENERATED, GENERATED_SEED = 2000, 7
GENERATED_COMPILED = 16             # one program per shard of test_generated
# -k expressions over the suite's modules: the first shard, and its complement (so every case
# runs in exactly one shard, whatever cases are added later)
_FIRST = "test_edges or test_hazards or test_regressions or test_rule10 or test_rule11 or test_generated"
COMPILED_SHARDS = {"edges-hazards-regressions-rules10-11-generated": _FIRST, "rules1-9": f"not ({_FIRST})"}


def _run(args, tmp_path, extra_path=None):
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=DEADLOCK_S)
    return proc.returncode, proc.stdout + proc.stderr


def _tail(text, n=60):
    return "\n".join(text.splitlines()[-n:])


def test_reference_passes_the_whole_suite(tmp_path):
    """Every case but the generated ones (test_reference_passes_a_fixed_seed_budget_... runs those)."""
    rc, out = _run(["-m", "padgraph.spec", "--backend", "reference", "-q", "-rfEs", "-k", "not test_generated"],
                   tmp_path)
    assert rc == 0, f"conformance suite on 'reference' failed (exit {rc}):\n{_tail(out)}"
    assert " passed" in out and "no tests ran" not in out, _tail(out)


@pytest.mark.parametrize("shard", list(COMPILED_SHARDS))
def test_reference_passes_the_whole_suite_with_compiled_bodies(shard, tmp_path):
    rc, out = _run(["-m", "padgraph.spec", "--backend", "reference", "--torch-compile", "-q", "-rfEs",
                    "-k", COMPILED_SHARDS[shard], "--generated", str(GENERATED_COMPILED)], tmp_path)
    assert rc == 0, f"conformance suite on 'reference' --torch-compile ({shard}) failed (exit {rc}):\n{_tail(out)}"
    assert " passed" in out and "no tests ran" not in out, _tail(out)


def test_pytest_pyargs_entry_point(tmp_path):
    rc, out = _run(["-m", "pytest", "-p", "padgraph.spec.plugin", "--pyargs", "padgraph.spec",
                    "--backend", "reference", "-q", "-k", "rule2 or rule3"], tmp_path)
    assert rc == 0, f"`pytest -p padgraph.spec.plugin --pyargs padgraph.spec` failed (exit {rc}):\n{_tail(out)}"


STALE_TAIL_FAILS = ["test_r1_3_no_stale_tails", "test_stale_tail_after_larger_call",
                    "test_stale_tail_body_mutates_inputs", "test_r5_2_hook_raises",
                    "test_caller_batch_unchanged_when_hook_raises",
                    # a stale slot tail: padded lanes read-modify-write live requests' recurrent rows
                    "test_r7_9_a_request_pool_over_calls_at_every_bucket_with_slot_reuse",
                    "test_r7_9_shadow_passes_the_body_and_reports_a_clamped_pad"]
STALE_TAIL_CASES = "stale or r5_2 or hook_raises or r7_9_a_request_pool or r7_9_shadow"


def test_suite_catches_a_stale_tail_backend(tmp_path):
    backend = "buggy_backends:StaleTailRunner"
    fixtures = os.path.join(HERE, "spec_fixtures")
    rc, out = _run(["-m", "padgraph.spec", "--backend", backend, "-q", "-rf", "-k", STALE_TAIL_CASES],
                   tmp_path, extra_path=fixtures)
    assert rc == 1, f"the suite should fail a stale-tail backend (exit {rc}):\n{_tail(out)}"
    for case in STALE_TAIL_FAILS:
        assert re.search(rf"FAILED \S*::{case}\b", out), f"{case} should fail on a stale-tail backend:\n{_tail(out)}"
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("# known failures of the stale-tail backend\n" + "\n".join(STALE_TAIL_FAILS) + "\n")
    rc, out = _run(["-m", "padgraph.spec", "--backend", backend, "-q", "--xfails", str(xfails),
                    "-k", STALE_TAIL_CASES], tmp_path, extra_path=fixtures)
    assert rc == 0 and "xfailed" in out, f"an xfail list should turn those failures into xfails (exit {rc}):\n{_tail(out)}"


def test_reference_passes_a_fixed_seed_budget_of_generated_programs(tmp_path):
    """The generated cases at CI's budget: 2,000 programs with their call sequences, seed 7."""
    rc, out = _run(["-m", "padgraph.spec", "--backend", "reference", "-q", "-k", "generated",
                    "--generated", str(GENERATED), "--seed", str(GENERATED_SEED)], tmp_path)
    assert rc == 0, f"generated cases on 'reference' failed (exit {rc}):\n{_tail(out)}"
    assert f"programs={GENERATED}" in out and "failing_shards=0" in out, _tail(out)


def test_generated_suite_catches_a_stale_lane_backend(tmp_path):
    """A backend whose padded lanes keep earlier calls' slots (a stale lane table) fails the
    generated suite: padded lanes write live rows of sink state and read-modify-write live rows of
    recurrent state (rule 7.9). tests/test_generated_recurrent.py shows the recurrent programs
    alone catch it, and programs with neither kind of state cannot."""
    fixtures = os.path.join(HERE, "spec_fixtures")
    rc, out = _run(["-m", "padgraph.spec", "--backend", "buggy_backends:StaleLaneRunner", "-q", "-rf",
                    "-k", "generated", "--generated", "48", "--seed", str(GENERATED_SEED), "--no-shrink"],
                   tmp_path, extra_path=fixtures)
    assert rc == 1, f"the generated suite should fail a stale-lane backend (exit {rc}):\n{_tail(out)}"
    assert re.search(r"state (rec|kv) leaf \d+ \(non-sink\) differs", out), (
        f"a failure should name the live state row a padded lane wrote:\n{_tail(out)}")
