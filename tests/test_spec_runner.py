"""The conformance runner's front door: a backend that cannot run stops the session with one clear
error before any case is collected; a third party's `module:Class` backend still runs; without
pytest, `python -m padgraph.spec` says how to install it. Subprocesses, like test_conformance.py.
"""
import os
import sys
import textwrap

import torch

from test_conformance import _run  # the suite run in a subprocess, one helper for both files

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "spec_fixtures")


def _assert_stopped(rc, out, *parts):
    """Exit status nonzero but not 'cases failed' (1); one error naming the parts; no case ran."""
    assert rc not in (0, 1), f"exit {rc}, expected a usage error:\n{out}"
    errors = [line for line in out.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1, f"expected exactly one error line:\n{out}"
    for part in parts:
        assert part in errors[0], f"the error should name {part!r}:\n{out}"
    for word in ("passed", "failed", "collected", "skipped"):
        assert word not in out, f"no case should be collected or run ({word!r} seen):\n{out}"


def test_unavailable_cuda_stops_before_any_case(tmp_path):
    if torch.cuda.is_available():
        import pytest
        pytest.skip("this machine has CUDA: the cuda backend is available")
    rc, out = _run(["-m", "padgraph.spec", "--backend", "cuda", "-q"], tmp_path)
    _assert_stopped(rc, out, "'cuda'", "cannot run on this machine", "NVIDIA GPU")


def test_unknown_backend_stops_before_any_case(tmp_path):
    rc, out = _run(["-m", "padgraph.spec", "--backend", "nosuch", "-q"], tmp_path)
    _assert_stopped(rc, out, "'nosuch'", "is not a backend", "'reference'")


def test_unknown_backend_through_pytest_pyargs(tmp_path):
    rc, out = _run(["-m", "pytest", "-p", "padgraph.spec.plugin", "--pyargs", "padgraph.spec",
                    "--backend", "nosuch", "-q", "-p", "no:cacheprovider"], tmp_path)
    _assert_stopped(rc, out, "'nosuch'", "is not a backend")


def test_unimportable_third_party_backend_stops(tmp_path):
    rc, out = _run(["-m", "padgraph.spec", "--backend", "no_such_module:Runner", "-q"], tmp_path)
    _assert_stopped(rc, out, "'no_such_module:Runner'", "cannot be imported", "no_such_module")


def test_backend_decides_it_is_unavailable(tmp_path):
    """The runner class says why it cannot run (its name is not tested anywhere)."""
    (tmp_path / "offline_backend.py").write_text(textwrap.dedent('''
        from padgraph.reference import ReferenceRunner

        class OfflineRunner(ReferenceRunner):
            backend = "offline"

            @classmethod
            def unavailable(cls):
                return "the offline accelerator is not attached"
    '''))
    rc, out = _run(["-m", "padgraph.spec", "--backend", "offline_backend:OfflineRunner", "-q"], tmp_path,
                   extra_path=str(tmp_path))
    _assert_stopped(rc, out, "'offline_backend:OfflineRunner'", "the offline accelerator is not attached")


def test_third_party_backend_still_runs(tmp_path):
    rc, out = _run(["-m", "padgraph.spec", "--backend", "buggy_backends:StaleTailRunner", "-q",
                    "-k", "rule2 or rule3"], tmp_path, extra_path=FIXTURES)
    assert rc == 0 and " passed" in out, f"a module:Class backend should run the suite (exit {rc}):\n{out[-3000:]}"


def test_without_pytest_says_how_to_install(tmp_path):
    code = ("import runpy, sys; sys.modules['pytest'] = None; "      # import pytest -> ImportError
            "sys.argv = ['padgraph.spec', '--backend', 'reference']; "
            "runpy.run_module('padgraph.spec', run_name='__main__')")
    rc, out = _run(["-c", code], tmp_path)
    lines = out.strip().splitlines()
    assert rc != 0 and len(lines) == 1 and "pip install pytest hypothesis" in lines[0], f"exit {rc}:\n{out}"
