"""bench_runner's report where a listed variant did not run (padgraph+compile+pdl on a torch
without inductor's triton.enable_pdl): its cells read "-", the floor comes from the variants
that ran, whichever is listed first."""
from types import SimpleNamespace

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
