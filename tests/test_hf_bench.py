"""bench/bench_hf.py stays runnable: its CPU smoke mode on a tiny model writes the table, and
padgraph.hf's tokens equal hf-eager's there (run as the command a user types, not imported)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_bench_hf_tiny_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_hf.py"), "--tiny", "--device", "cpu", "--model", "qwen3",
           "--sizes", "1,3", "--variants", "hf-eager,padgraph", "--iters", "3"]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)   # no timeout: a busy machine is slow, not wrong
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads((tmp_path / "bench_hf_qwen3.json").read_text())["rows"]
    assert {(r["variant"], r["bs"]) for r in rows} == {(v, n) for v in ("hf-eager", "padgraph") for n in (1, 3)}
    assert all(r["rows_equal"] == r["bs"] for r in rows)
    assert "| 3 |" in (tmp_path / "bench_hf_qwen3.md").read_text()
