"""bench_eagle's measurement on the CPU (reference backend, tiny model): rows of several
batches, each timed several times with the median run counted, add up to what the batches did,
and the first-divergence check compares the right requests."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import bench_eagle  # noqa: E402
from models.eagle_head import EagleHead  # noqa: E402
from models.llama import LlamaConfig, LlamaModel  # noqa: E402
from spec_decode import RunStats, SpecConfig, Worker  # noqa: E402

import padgraph as pg  # noqa: E402


def _worker():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    head = EagleHead.copy_of_target(target).eval()
    return Worker(target, head, SpecConfig(steps=3, topk=2, num_draft_tokens=5), max_bs=4,
                  max_context=64, buckets=pg.Buckets([1, 2, 4]))


def test_row_batches_give_distinct_requests_per_row():
    b1, b4, b16 = (bench_eagle.row_batches(bs, 1000) for bs in (1, 4, 16))
    assert (len(b1), len(b4), len(b16)) == (16, 4, 1)
    assert all(len(b) == bs for bs, bb in ((1, b1), (4, b4), (16, b16)) for b in bb)
    assert len({tuple(p) for b in b1 for p in b}) == 16          # not one request 16 times


def test_measure_sums_median_runs_and_keeps_request_order():
    w = _worker()
    vocab = w.target.cfg.vocab_size
    batches = [bench_eagle.prompts_for(2, vocab, seed=s) for s in (1, 2, 3)]
    news = [6, [3, 9], 5]
    greedy, g, g_per = bench_eagle.measure(w, "greedy", batches, news, repeats=3)
    spec, e, e_per = bench_eagle.measure(w, "spec", batches, news, repeats=3)
    assert [len(r.output) for r in greedy] == [6, 6, 3, 9, 5, 5]
    assert [r.output for r in spec] == [r.output for r in greedy]   # oracle head: exact
    assert len(g_per) == len(e_per) == 3
    for tot, per in ((g, g_per), (e, e_per)):
        assert tot.tokens == sum(s.tokens for s in per) == 34
        assert abs(tot.seconds - sum(s.seconds for s in per)) < 1e-12
        assert tot.rounds == sum(s.rounds for s in per)
        assert tot.accepted == sum(s.accepted for s in per)
    assert e.accept_len > 1.5
    match, div = bench_eagle.match_line(greedy, spec)
    assert match.startswith("6/6 (6 exact") and div == {"near_tie": [], "other": []}


def test_total_of_no_runs_and_one_run():
    s = RunStats(tokens=10, seconds=0.5, rounds=4, accepted=8, request_rounds=4, overlap=True)
    t = bench_eagle.total([s])
    assert (t.tokens, t.seconds, t.accept_len, t.overlap) == (10, 0.5, 2.0, True)
    assert bench_eagle.total([]).tokens_per_s == 0.0


def test_main_job_log_parser(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import main_jobs
    log = ("EAGLE  ms per round (mean of 33 launched, overlap on, 12 lane-rounds discarded): "
           "draft 0.84  verify 1.46  draft-extend 0.19  host/other 0.03  = 2.52; prefill 12.6 ms once\n"
           "greedy ms per step (mean of 124 launched, overlap on, 0 lane-steps discarded): decode "
           "1.34  host/other 0.01  = 1.35; prefill 12.1 ms once\n"
           "tokens/s=12017.0 accept_len=3.44 speedup_vs_greedy=1.87 greedy_match=16/16\n")
    r = main_jobs.parse(log)
    assert r["eagle"]["phases_ms"] == {"draft": 0.84, "verify": 1.46, "draft-extend": 0.19,
                                       "host/other": 0.03}
    assert (r["eagle"]["launched"], r["greedy"]["ms"], r["greedy"]["prefill_ms"]) == (33, 1.35, 12.1)
    assert (r["speedup_vs_greedy"], r["greedy_match"], r["round_over_step"]) == (1.87, "16/16", 1.867)
    (tmp_path / "a.log").write_text(log)
    (tmp_path / "env.txt").write_text("date=2026-12-01 gpu=NVIDIA H200 torch=2.11.0 triton=3.6.0")
    main_jobs.main(tmp_path, ["llama=a.log"])
    import json
    j = json.loads((tmp_path / "main_jobs.json").read_text())
    assert j["meta"]["gpu"] == "NVIDIA H200" and j["runs"]["llama"]["tokens_s"] == 12017.0
    assert "1.867" in (tmp_path / "main_jobs.md").read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "main_jobs.png").exists()


def test_tokens_per_round_counts_what_rounds_emitted():
    """accept_len is verify's count; tokens_per_round what the requests gained (budgets cut the
    last round): every emitted token but the prefill's first one per request."""
    w = _worker()
    prompts = bench_eagle.prompts_for(3, w.target.cfg.vocab_size, seed=5)
    with torch.no_grad():
        reqs, st = w.generate_spec(prompts, [5, 9, 2])
    assert st.emitted == sum(len(r.output) for r in reqs) - len(reqs)
    assert st.emitted <= st.accepted
    assert st.tokens_per_round <= st.accept_len


def test_total_sums_phases_so_the_round_time_is_the_runs_mean():
    a = RunStats(rounds=2, phases={"prefill": 1.0, "draft": 0.2, "verify": 0.4})
    b = RunStats(rounds=6, phases={"prefill": 2.0, "draft": 0.6, "verify": 1.2, "host": 0.2})
    t = bench_eagle.total([a, b])
    assert t.phases == {"prefill": 3.0, "draft": 0.8, "verify": 1.6, "host": 0.2}
    assert abs(t.round_seconds - (0.8 + 1.6 + 0.2) / 8) < 1e-12     # prefill excluded
    assert a.phases == {"prefill": 1.0, "draft": 0.2, "verify": 0.4}  # inputs untouched


def test_round_cell_reads_both_times_and_old_rows():
    r = {"round_in_greedy_steps": 1.4125, "eagle_round_ms": 1.821, "greedy_step_ms": 1.289}
    assert bench_eagle.round_cell(r) == "1.41 (1.82 / 1.29)"
    assert bench_eagle.round_cell({}) == "-"


def test_queue_times_split_rounds_and_prefills():
    q = {"phases_s": {"greedy": {"prefill": 0.0444, "decode": 0.5},
                      "eagle": {"prefill": 0.070, "draft": 0.1}},
         "prefills": {"greedy": 12, "eagle": 10},
         "round_ms": {"greedy": 1.3712, "eagle": 2.0649}}
    assert bench_eagle.queue_times(q) == "1.37 / 2.06 | 3.70 / 7.00"
    assert bench_eagle.queue_times({}) == "- | -"


def test_distill_overrides_from_the_environment():
    assert bench_eagle.distill_overrides({}) == {}
    assert bench_eagle.distill_overrides({"EAGLE_DISTILL_STEPS": "900",
                                          "EAGLE_DISTILL_SEQS": "512"}) == {"steps": 900,
                                                                            "n_seq": 512}
    assert bench_eagle.distill_overrides({"EAGLE_DISTILL_DEPTH": "3"}) == {"depth": 3}
    import pytest
    with pytest.raises(ValueError, match="EAGLE_DISTILL_SEQS"):
        bench_eagle.distill_overrides({"EAGLE_DISTILL_SEQS": "0"})


def test_held_out_note():
    assert bench_eagle.held_out_note(None) == "no held-out check"
    assert bench_eagle.held_out_note({"accept": 3.3201, "top1": [0.874, 0.8745], "depth": 2}) == \
        "held-out chain accept 3.32, top-1 per depth 0.874 / 0.875"


def test_kernel_table_counts_per_call():
    """bench.common.kernel_table: GPU kernels only, per call, ranked by time; kernel_lines
    prints it."""
    from types import SimpleNamespace

    import torch

    from bench.common import kernel_lines, kernel_table
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda name, us, dev=cuda: SimpleNamespace(name=name, device_time=us, device_type=dev)  # noqa: E731
    events = [ev("gemv", 30.0), ev("gemv", 34.0), ev("norm", 2.0), ev("norm", 2.0),
              ev("aten::mm", 99.0, cpu)]
    t = kernel_table(events, n_calls=2, top=1)
    assert t["kernels"] == 2.0 and t["kernel_us"] == 34.0
    assert t["top"] == [(32.0, 1.0, "gemv")]
    lines = kernel_lines(t, "padgraph+compile bs=1", "step")
    assert lines[0] == "profile padgraph+compile bs=1: 2 kernels and 34 kernel-µs per step; top 1 by time:"
    assert lines[1].split() == ["32.0", "µs", "1.0x", "gemv"]


def test_bound_cell_from_a_measured_row():
    """The bs 1 row of the H200's bench_eagle (results/eagle.json): accept and greedy steps a
    round bound the speedup; the prefill's share of EAGLE's and greedy's time."""
    import json
    path = os.path.join(os.path.dirname(__file__), "..", "results", "eagle.json")
    with open(path) as f:
        row = json.load(f)["rows"][0]
    assert row["bs"] == 1
    assert bench_eagle.bound_cell(row) == "2.69x; 3.5% / 1.2%"
    assert bench_eagle.bound_cell({"accept_len": 3.0}) == "-"


def test_variant_rows_compare_against_the_rows_greedy_run():
    """An extra EAGLE worker (EAGLE_DRAFT_PREFILL=eager,runner) is measured on the row's batches
    and compared with the row's greedy run; its md table lists it per bs."""
    w = _worker()
    batches = [bench_eagle.prompts_for(2, w.target.cfg.vocab_size, seed=s) for s in (1, 2)]
    greedy, g, _ = bench_eagle.measure(w, "greedy", batches, [6, 6], repeats=1)
    spec, e, _ = bench_eagle.measure(w, "spec", batches, [6, 6], repeats=1)
    v = bench_eagle.variant_entry(g, greedy, e, spec)
    assert v["greedy_match"].startswith("4/4")
    assert abs(v["speedup_vs_greedy"] - e.tokens_per_s / g.tokens_per_s) < 1e-12
    assert abs(v["round_in_greedy_steps"] - e.round_seconds / g.round_seconds) < 1e-12
    assert bench_eagle.variant_lines([{"bs": 1}]) == []
    lines = bench_eagle.variant_lines([{"bs": 1, "variants": {"draft_prefill=runner": v}},
                                       {"bs": 4, "variants": {"draft_prefill=runner": v}}])
    body = [ln for ln in lines if ln.startswith("| 1 |") or ln.startswith("| 4 |")]
    assert len(body) == 2 and all("draft_prefill=runner" in ln for ln in body)
    assert f"{v['speedup_vs_greedy']:.2f}x" in body[0]
