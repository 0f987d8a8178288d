"""bench_runner's report where a listed variant did not run (padgraph+compile+pdl on a torch
without inductor's triton.enable_pdl): its cells read "-", the floor comes from the variants
that ran, whichever is listed first."""
from types import SimpleNamespace

import pytest

from bench import bench_runner
from padgraph.llm.models.llama import LlamaConfig


def test_the_report_takes_a_size_floor_from_a_variant_that_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = [{"bs": n, "variant": v, "step_us": 100.0 + n, "b2b_us": 90.0 + n, "host_us": 10.0, "floor_us": 40.0 + n,
             "token_match_vs_eager": 1.0} for n in (1, 16) for v in ("padgraph+compile", "padgraph+fused")]
    names = ["padgraph+compile+pdl", "padgraph+compile", "padgraph+fused"]
    bench_runner.report(rows, {}, names, [1, 16], 1e12, 10**6, LlamaConfig.tiny(), SimpleNamespace(iters=5))
    table = (tmp_path / "bench_runner.md").read_text()
    assert "| 1 | 41 | - | 101 / 91 / 10 | 101 / 91 / 10 |\n" in table, table
    assert "| 16 | 56 | - | 116 / 106 / 10 | 116 / 106 / 10 |\n" in table, table
    assert "handwritten" not in table.split("setup")[0]    # no ratio column without both runners


def test_the_report_gives_the_runner_against_the_hand_written_one_where_both_ran(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = [{"bs": 1, "variant": v, "step_us": us, "b2b_us": us, "host_us": 10.0, "floor_us": 40.0,
             "token_match_vs_eager": 1.0} for v, us in (("handwritten", 200.0), ("padgraph", 198.0))]
    bench_runner.report(rows, {}, ["handwritten", "padgraph"], [1], 1e12, 10**6, LlamaConfig.tiny(),
                        SimpleNamespace(iters=5))
    table = (tmp_path / "bench_runner.md").read_text()
    assert "| bs | floor | handwritten | padgraph | padgraph/handwritten |" in table, table
    assert "| 1 | 40 | 200 / 200 / 10 | 198 / 198 / 10 | 0.990 |" in table, table


def test_the_greedy_body_takes_the_steps_tokens():
    """`GreedyStep` (the engine's greedy body: `forward_decode_greedy`) gives the next tokens
    the Step's temperature-scaled argmax gives, and finishes rows as it does (stop token, done
    mask), on the tiny model on the CPU."""
    import torch
    cfg, model, kv, step = bench_runner.build_step(True, "cpu")
    raw = bench_runner.make_batch(5, kv, cfg, torch.Generator().manual_seed(3), "cpu")
    raw["done"][1] = True
    want_next, want_fin = step(**raw)
    got_next, got_fin = bench_runner.GreedyStep(model, kv)(**raw)
    assert torch.equal(got_next, want_next) and torch.equal(got_fin, want_fin)
    assert got_next[1] == raw["stop_token"][1] and bool(got_fin[1])


def test_tokens_are_judged_against_the_eager_model_with_near_ties_apart():
    """`eager_reference` gives the eager Step's tokens (whatever variant runs first) and each
    row's top-2 gap; `judge_tokens` counts a differing row as a near tie when that gap is within
    4 bf16 ulps of the top logit, and gives the gap in ulps of any other."""
    import torch
    cfg, model, kv, step = bench_runner.build_step(True, "cpu")
    model.to(torch.bfloat16)
    raw = bench_runner.make_batch(6, kv, cfg, torch.Generator().manual_seed(5), "cpu")
    raw["done"][2] = True
    toks, gap, tol = bench_runner.eager_reference(step, raw)
    want, _ = step(**raw)
    assert torch.equal(toks, want) and toks[2] == raw["stop_token"][2]
    assert (gap >= 0).all() and (tol > 0).all()
    assert bench_runner.judge_tokens(toks, toks, gap, tol) == {
        "token_match_vs_eager": 1.0, "near_ties": 0, "far_gaps_ulps": []}
    gap = torch.tensor([0.0, 0.01, 2.0, 0.0, 0.0, 0.0])
    tol = torch.full((6,), 0.0625)                                  # 4 ulps of a top logit in [8, 16)
    got = toks.clone()
    got[1] += 1                                                     # a near tie: 0.01 <= 0.0625
    got[2] += 1                                                     # 2.0 apart: 128 ulps
    judged = bench_runner.judge_tokens(got, toks, gap, tol)
    assert judged["token_match_vs_eager"] == pytest.approx(4 / 6)
    assert (judged["near_ties"], judged["far_gaps_ulps"]) == (1, [128.0])
    line = bench_runner.token_summary([{"variant": "v", "bs": 6, **judged}])
    assert "v bs 6 match 0.667 (1 differing rows at a near tie" in line and "[128.0] ulps" in line
    assert "equal the eager model's" in bench_runner.token_summary(
        [{"variant": "v", "bs": 6, "token_match_vs_eager": 1.0, "near_ties": 0, "far_gaps_ulps": []}])


def test_tie_margin_takes_the_ulp_of_the_dtype_asked():
    import torch
    from bench.common import tie_margin
    logits = torch.tensor([[10.0, 9.5, 1.0], [-3.0, 0.25, 0.0]])
    gap, tol = tie_margin(logits, torch.bfloat16)
    assert torch.equal(gap, torch.tensor([0.5, 0.25]))
    assert torch.equal(tol, 4 * torch.finfo(torch.bfloat16).eps * torch.tensor([8.0, 0.25]))
    assert torch.equal(tie_margin(logits)[1], 4 * torch.finfo(torch.float32).eps * torch.tensor([8.0, 0.25]))


def test_run_all_judges_each_variant_against_the_eager_step(monkeypatch):
    """run_all (timers stubbed: no GPU) judges a variant listed first against the eager model's
    tokens, not against itself: a variant that moves one row's token is reported as such."""
    import torch
    cfg, model, kv, step = bench_runner.build_step(True, "cpu")
    raw = bench_runner.make_batch(4, kv, cfg, torch.Generator().manual_seed(1), "cpu")
    monkeypatch.setattr(bench_runner, "time_calls", lambda fn, raw, iters: (1.0, 1.0))
    monkeypatch.setattr(bench_runner, "time_us", lambda fn, reps, back_to_back=1: 1.0)

    def moved(**r):
        nxt, fin = step(**r)
        return nxt.clone().index_fill_(0, torch.tensor([3]), cfg.vocab_size - 1 - int(nxt[3])), fin
    floor = bench_runner.StepFloor(cfg, lambda n: 0, 1e12)
    rows = bench_runner.run_all({"moved": moved, "eager": lambda **r: step(**r)}, {}, {4: raw}, [4], 1,
                                floor, lambda rows, done: None,
                                lambda r: bench_runner.eager_reference(step, r))
    by = {r["variant"]: r for r in rows}
    assert by["eager"]["token_match_vs_eager"] == 1.0
    assert by["moved"]["token_match_vs_eager"] == 0.75
    assert by["moved"]["near_ties"] + len(by["moved"]["far_gaps_ulps"]) == 1
