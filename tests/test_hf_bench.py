"""bench/bench_hf.py stays runnable: its CPU smoke mode on a tiny model writes the table, and
padgraph.hf's tokens equal hf-eager's there (run as the command a user types, not imported), for a
Llama-like model and for the hybrid (Bamba: Mamba2 and attention layers); where transformers lacks
the linear-attention cache API the hybrid is refused, naming the version, before anything is built."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:        # bench/ imports from the checkout's root
    sys.path.insert(0, str(ROOT))

from bench import bench_hf  # noqa: E402
from padgraph.hf import support  # noqa: E402


@pytest.mark.parametrize("model", ["qwen3", "bamba1b"])
def test_bench_hf_tiny_cpu(tmp_path, model):
    if model in bench_hf.HYBRIDS and not support.linear_cache_api():
        pytest.skip(f"transformers {transformers.__version__} has no linear-attention cache API")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_hf.py"), "--tiny", "--device", "cpu", "--model", model,
           "--sizes", "1,3", "--variants", "hf-eager,padgraph", "--iters", "3"]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)   # no timeout: a busy machine is slow, not wrong
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.startswith(f"transformers {transformers.__version__} from "), done.stdout[:300]
    data = json.loads((tmp_path / f"bench_hf_{model}.json").read_text())
    rows = data["rows"]
    assert {(r["variant"], r["bs"]) for r in rows} == {(v, n) for v in ("hf-eager", "padgraph") for n in (1, 3)}
    assert all(r["rows_equal"] == r["bs"] for r in rows)
    assert data["env"]["transformers"] == transformers.__version__
    page = (tmp_path / f"bench_hf_{model}.md").read_text()
    assert "| 3 |" in page
    if model in bench_hf.HYBRIDS:       # the page says which Mamba code HF's peers run
        assert data["env"]["config"]["attn_layer_indices"] == [1]
        assert "HF's Mamba layers run" in data["env"]["hf_path"] and data["env"]["hf_path"] in page


def test_a_hybrid_is_refused_without_the_linear_cache_api(monkeypatch):
    """transformers without the linear-attention cache API (5.17): a clear refusal naming the
    version, from main() before any model is built; a Llama-like model is not refused."""
    monkeypatch.setattr(bench_hf, "linear_cache_api", lambda: False)
    monkeypatch.setattr(bench_hf, "build_model", lambda *a, **k: pytest.fail("built a model it cannot serve"))
    monkeypatch.setattr(sys, "argv", ["bench_hf.py", "--tiny", "--device", "cpu", "--model", "bamba1b"])
    with pytest.raises(SystemExit) as refused:
        bench_hf.main()
    msg = str(refused.value.code)
    assert f"transformers {transformers.__version__}" in msg and "does not have" in msg, msg
    assert "get_conv_state" in msg and "PYTHONPATH" in msg, msg
    bench_hf.refuse_unservable("llama1b")           # attention only: served on any version
