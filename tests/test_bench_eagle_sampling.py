"""bench/bench_eagle_sampling.py stays runnable and its checks can fail: the CPU mode (--tiny,
reference backend) writes the tables and JSON, its greedy and "draws" runs emit plain decoding's
tokens, and the checkers flag a changed token."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:        # bench/ and examples/ import from the checkout's root
    sys.path.insert(0, str(ROOT))

from bench import bench_eagle_sampling as bes  # noqa: E402
from padgraph.llm import Engine, SpecConfig  # noqa: E402
from padgraph.llm.distill import build  # noqa: E402
from padgraph.llm.models.eagle_head import EagleHead  # noqa: E402
from padgraph.llm.sampling import SamplingParams  # noqa: E402

ROW_KEYS = {"target_entropy", "factor", "bs", "requests", "temperature", "rule", "plain",
            "tok_s", "digest", "speedup", "accept_len", "tokens_per_round",
            "accept_len_per_batch", "round_ms", "check"}


def test_tiny_mode_runs_end_to_end_and_matches_plain_decoding(tmp_path):
    out = tmp_path / "eagle_sampling_tiny"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "bench.bench_eagle_sampling", "--tiny",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    meta, sizes = data["meta"], bes.TINY_SIZES
    assert {"gpu", "torch", "triton", "command", "commit"} <= set(meta)
    assert meta["command"].startswith("python -m bench.bench_eagle_sampling --tiny")
    assert [lv["target_entropy"] for lv in data["levels"]] == list(bes.ENTROPIES)
    for lv in data["levels"]:      # the factor reaches its entropy on the prompts (fp32: exactly)
        assert lv["factor"] > 0 and abs(lv["entropy_prompts"] - lv["target_entropy"]) < 0.01
    rows = data["rows"]
    assert len(rows) == len(bes.ENTROPIES) * len(sizes.batches) * len(bes.TEMPERATURES) * 2
    assert {(r["target_entropy"], r["bs"], r["temperature"], r["rule"]) for r in rows} == {
        (h, bs, t, rule) for h in bes.ENTROPIES for bs in sizes.batches
        for t in bes.TEMPERATURES for rule in bes.RULES}
    for r in rows:
        assert ROW_KEYS <= set(r) and r["speedup"] > 0 and r["accept_len"] >= 1
        if r["temperature"] == 0 or r["rule"] == "draws":    # plain decoding's tokens, exactly
            assert r["digest"] == r["plain"]["digest"], r
            assert r["check"]["exact"] == r["check"]["n"] == r["requests"], r["check"]
        else:
            assert r["check"] is None
        if r["temperature"] > 0:
            assert r["plain"]["entropy"] > 0 and r["plain"]["redraw"]["agreement"] == 1.0 and r["plain"]["redraw"]["passed"]
    assert data["checks"]["passed"]
    md = out.with_suffix(".md").read_text()
    for title in ("## Levels", "## Speedup against entropy", "## Details"):
        assert title in md
    assert "matplotlib not installed" in done.stdout or out.with_suffix(".png").exists()


@pytest.fixture(scope="module")
def sampled_runs():
    """A tiny target's plain runs of 3 requests: greedy and at temperature 1."""
    torch.manual_seed(0)
    target, _, _ = build("tiny", "cpu", torch.float32)
    engine = Engine(target, None, SpecConfig(3, 2, 4), max_bs=4, max_context=64)
    prompts = [[5, 9, 200, 17], [3, 1, 4, 1, 5, 9, 2], [250, 7]]
    runs = {}
    for t in (0.0, 1.0):
        params = [SamplingParams(temperature=t, seed=bes.prompt_seed(p)) for p in prompts]
        runs[t], _ = engine.generate_greedy(prompts, [12] * 3, sampling=params)
    return target, runs


def changed(reqs, rid: int, index: int):
    """Copies of the requests with request rid's token at `index` replaced."""
    out = copy.deepcopy(reqs)
    out[rid].output[index] = (out[rid].output[index] + 1) % 256
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_check_flags_a_changed_token(sampled_runs, temperature):
    target, runs = sampled_runs
    plain = runs[temperature]
    same = bes.token_check(target, plain, plain, temperature, 1.0, gpu=False)
    assert same["passed"] and same["exact"] == 3
    bad = bes.token_check(target, plain, changed(plain, 1, 5), temperature, 1.0, gpu=False)
    assert not bad["passed"] and bad["exact"] == 2 and [o[:2] for o in bad["other"]] == [(1, 5)]


def test_redraw_check_sees_the_tokens_the_graphs_drew(sampled_runs):
    """The runs' own tokens re-draw exactly; a changed token is reported as a token far from a
    boundary at tolerance 0, and as near one only under a tolerance wider than its reach."""
    target, runs = sampled_runs
    same = bes.redraw_check(target, runs[1.0], 0.0)
    assert same["agreement"] == 1.0 and same["passed"] and same["near"] == 0
    bad_runs = changed(runs[1.0], 0, 2)
    bad = bes.redraw_check(target, bad_runs, 0.0)
    assert bad["agreement"] < 1.0 and not bad["passed"] and bad["other"][0][:2] == (0, 2)
    assert all(rid == 0 and i >= 2 for rid, i, _ in bad["other"])    # later logits see the change
    reach = max(o[2] for o in bad["other"])
    wide = bes.redraw_check(target, bad_runs, reach + 1.0)
    assert wide["passed"] and wide["near"] == len(bad["other"])


def test_draw_reach_is_zero_inside_the_drawn_tokens_interval(sampled_runs):
    target, runs = sampled_runs
    r = runs[1.0][0]
    assert bes.draw_reach(target, r, 3, (r.output[3],)) == 0.0
    assert bes.draw_reach(target, r, 3, ((r.output[3] + 1) % 256,)) > 0.0


def test_calibrate_reaches_each_entropy():
    logits = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 2
    for h in (0.5, 1.5, 3.0):
        assert abs(bes.mean_entropy_at(logits, bes.calibrate(logits, h)) - h) < 1e-3


def test_copy_in_place_keeps_the_storage_graphs_read():
    target, _, _ = build("tiny", "cpu", torch.float32)
    dst, src = EagleHead(target, seed=1), EagleHead(target, seed=2)
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    bes.copy_in_place(dst, src)
    for n, t in dst.state_dict().items():
        assert t.data_ptr() == ptrs[n] and torch.equal(t, src.state_dict()[n])
    with pytest.raises(ValueError, match="copy_in_place"):
        bes.copy_in_place(dst, torch.nn.Linear(2, 2))
