"""bench/bench_hf.py stays runnable: its CPU smoke mode on a tiny model writes the table, and
padgraph.hf's tokens equal hf-eager's there."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_hf  # noqa: E402


def test_bench_hf_tiny_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_hf, "ITERS", 3)
    monkeypatch.setattr(sys, "argv", ["bench_hf.py", "--tiny", "--device", "cpu", "--model", "qwen3",
                                      "--sizes", "1,3", "--variants", "hf-eager,padgraph"])
    bench_hf.main()
    rows = json.loads((tmp_path / "bench_hf_qwen3.json").read_text())["rows"]
    assert {(r["variant"], r["bs"]) for r in rows} == {(v, n) for v in ("hf-eager", "padgraph") for n in (1, 3)}
    assert all(r["rows_equal"] == r["bs"] for r in rows)
    assert "| 3 |" in (tmp_path / "bench_hf_qwen3.md").read_text()
