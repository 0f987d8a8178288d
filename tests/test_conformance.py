"""The conformance suite (padgraph.spec) run against the reference backend, as part of `pytest tests`.

It runs through the documented entry points in a subprocess, so a failing conformance case fails
this test with pytest's summary of the failures; and it checks that the suite does fail a backend
with a known bug (a suite that passes everything proves nothing).
"""
import os
import subprocess
import sys


HERE = os.path.dirname(os.path.abspath(__file__))


def _run(args, tmp_path, extra_path=None):
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _tail(text, n=60):
    return "\n".join(text.splitlines()[-n:])


def test_reference_passes_the_whole_suite(tmp_path):
    rc, out = _run(["-m", "padgraph.spec", "--backend", "reference", "-q", "-rfEs"], tmp_path)
    assert rc == 0, f"conformance suite on 'reference' failed (exit {rc}):\n{_tail(out)}"
    assert " passed" in out and "no tests ran" not in out, _tail(out)


def test_reference_passes_the_whole_suite_with_compiled_bodies(tmp_path):
    rc, out = _run(["-m", "padgraph.spec", "--backend", "reference", "--torch-compile", "-q", "-rfEs"],
                   tmp_path)
    assert rc == 0, f"conformance suite on 'reference' --torch-compile failed (exit {rc}):\n{_tail(out)}"
    assert " passed" in out and "no tests ran" not in out, _tail(out)


def test_pytest_pyargs_entry_point(tmp_path):
    rc, out = _run(["-m", "pytest", "-p", "padgraph.spec.plugin", "--pyargs", "padgraph.spec",
                    "--backend", "reference", "-q", "-k", "rule2 or rule3"], tmp_path)
    assert rc == 0, f"`pytest -p padgraph.spec.plugin --pyargs padgraph.spec` failed (exit {rc}):\n{_tail(out)}"


STALE_TAIL_FAILS = ["test_r1_3_no_stale_tails", "test_stale_tail_after_larger_call",
                    "test_stale_tail_body_mutates_inputs", "test_r5_2_hook_raises",
                    "test_caller_batch_unchanged_when_hook_raises"]


def test_suite_catches_a_stale_tail_backend(tmp_path):
    backend = "buggy_backends:StaleTailRunner"
    fixtures = os.path.join(HERE, "spec_fixtures")
    rc, out = _run(["-m", "padgraph.spec", "--backend", backend, "-q", "-rf", "-k", "stale or r5_2 or hook_raises"],
                   tmp_path, extra_path=fixtures)
    assert rc == 1, f"the suite should fail a stale-tail backend (exit {rc}):\n{_tail(out)}"
    for case in STALE_TAIL_FAILS:
        assert f"FAILED " in out and case in out, f"{case} should fail on a stale-tail backend:\n{_tail(out)}"
    xfails = tmp_path / "xfails.txt"
    xfails.write_text("# known failures of the stale-tail backend\n" + "\n".join(STALE_TAIL_FAILS) + "\n")
    rc, out = _run(["-m", "padgraph.spec", "--backend", backend, "-q", "--xfails", str(xfails),
                    "-k", "stale or r5_2 or hook_raises"], tmp_path, extra_path=fixtures)
    assert rc == 0 and "xfailed" in out, f"an xfail list should turn those failures into xfails (exit {rc}):\n{_tail(out)}"


def test_reference_passes_a_fixed_seed_budget_of_generated_programs(tmp_path):
    """The generated cases at CI's budget: 2,000 programs with their call sequences, seed 7."""
    rc, out = _run(["-m", "padgraph.spec", "--backend", "reference", "-q", "-k", "generated",
                    "--generated", "2000", "--seed", "7"], tmp_path)
    assert rc == 0, f"generated cases on 'reference' failed (exit {rc}):\n{_tail(out)}"
    assert "programs=2000" in out and "failing_shards=0" in out, _tail(out)
