"""bench/bench_hybrid.py stays runnable and its checks can fail: the CPU mode (--tiny, reference
backend) writes the page and JSON, counts the decode step's floor bytes as its docstring says,
its decode runner's tokens equal the eager step's and its speculative tokens greedy decoding's;
the step check flags a runner that forgets the recurrent state."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:        # bench/ imports from the checkout's root
    sys.path.insert(0, str(ROOT))

from bench import bench_hybrid as bh  # noqa: E402
from padgraph.llm import Engine, SpecConfig  # noqa: E402
from padgraph.llm.kv import FIRST  # noqa: E402
from padgraph.llm.models.hybrid import HybridConfig, HybridModel  # noqa: E402


def floor_bytes(cfg: HybridConfig, params: int, bs: int, ctx_total: int, elem: int = 4) -> dict:
    """The decode step's bytes, written out from the configuration (fp32: 4 bytes an element)."""
    n_a, n_m = cfg.pattern.count("A"), cfg.pattern.count("M")
    row = n_m * (cfg.conv_dim * (cfg.conv_kernel - 1) * elem + cfg.ssm_heads * cfg.ssm_head_dim * cfg.d_state * 4)
    return {"weights": (params - cfg.vocab_size * cfg.hidden_size + bs * cfg.hidden_size) * elem,
            "kv": (ctx_total + bs) * n_a * 2 * cfg.n_kv_heads * cfg.head_dim * elem,   # + the new token
            "state": 2 * bs * row}


def test_tiny_mode_runs_end_to_end_and_its_tokens_check(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "bench.bench_hybrid", "--tiny", "--check",
                           "--recurrent-ops", "inductor,opaque"], cwd=ROOT,
                          env=env, capture_output=True, text=True)   # no timeout: a busy machine is slow, not wrong
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "bench_hybrid.json").read_text())
    assert {"gpu", "torch", "triton", "command", "commit"} <= set(data["env"])
    assert data["env"]["command"] == "python -m bench.bench_hybrid --tiny --check --recurrent-ops inductor,opaque"
    cfg = HybridConfig(**data["model"]["config"])
    assert cfg == bh.TINY.cfg and data["failures"] == []

    decode = data["decode"]
    assert decode["setup"]["backend"] == "reference" and decode["setup"]["buckets"]
    assert [(r["recurrent_ops"], r["bs"]) for r in decode["rows"]] == [
        (ops, n) for ops in ("inductor", "opaque") for n in bh.TINY.decode_sizes]
    for r in decode["rows"]:
        assert r["step_us"] > 0 and r["host_us"] > 0
        assert r["bytes"] == floor_bytes(cfg, data["model"]["params"], r["bs"], round(r["ctx_mean"] * r["bs"]))
        assert (r["tokens_equal"], r["near_ties"], r["other"]) == (r["bs"], 0, 0)   # fp32, same kernels

    spec = data["spec"]
    assert spec["head"] == "distil" and spec["head_info"]["steps"] == bh.TINY.distill["steps"]
    assert spec["tree"]["num_draft_tokens"] == bh.TINY.tree[2]
    assert [(r["recurrent_ops"], r["bs"]) for r in spec["rows"]] == [
        (ops, n) for ops in ("inductor", "opaque") for n in bh.TINY.spec_sizes]
    for r in spec["rows"]:
        n = r["requests"]
        assert r["greedy_match"].startswith(f"{n}/{n} ({n} exact"), r["greedy_match"]   # fp32: exact
        assert r["greedy_tok_s"] > 0 and r["eagle_tok_s"] > 0 and r["accept_len"] >= 1.0
        assert r["rounds"]["eagle_rounds"] < r["rounds"]["greedy_steps"]
    page = (tmp_path / "bench_hybrid.md").read_text()
    assert "## Decode step against its floor" in page and "## Speculative rounds" in page
    assert "every token check passed" in page


def test_the_step_check_flags_a_runner_that_forgets_the_state():
    """`check_step` restores the lanes' recurrent rows around the runner's step: the runner's
    tokens equal the eager step's; a runner that zeroes every recurrent row before its step gives
    tokens the check counts as differing beyond a near tie."""
    torch.manual_seed(0)
    target = HybridModel(HybridConfig.tiny()).eval()
    engine = Engine(target, None, SpecConfig(3, 2, 5), max_bs=8, max_context=48)
    worker = engine.worker
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(6, 24, (8,), generator=gen).tolist()
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in lens]
    reqs = engine.admit(prompts, [2] * 8)
    with torch.no_grad():
        raw = bh.decode_inputs(worker, reqs)
        assert bh.check_step(worker, raw) == {"tokens_equal": 8, "near_ties": 0, "other": 0}
        real = worker.runner("decode")

        def forgetful(**inputs):
            for t in worker.kv.conv + worker.kv.ssm:
                t[FIRST:].zero_()
            return real(**inputs)
        worker.runner = lambda name: forgetful if name == "decode" else real
        found = bh.check_step(worker, raw)
    assert found["other"] >= 2, found
