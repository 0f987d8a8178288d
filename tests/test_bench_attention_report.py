"""bench_attention's in-graph timing (on the CPU: plain loops) and its report section."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import bench_attention  # noqa: E402


def test_in_graph_us_runs_every_call_after_a_flush_and_subtracts_the_flushes():
    log = []
    fns = [lambda i=i: log.append(f"call{i}") for i in range(2)]
    us = bench_attention.in_graph_us(fns, 5, lambda: log.append("flush"))
    assert us >= 0.0
    # the first timed loop: flush before each of 5 calls, the functions cycled
    first = log[:10]
    assert first == ["flush", "call0", "flush", "call1", "flush", "call0", "flush", "call1",
                     "flush", "call0"]
    assert log.count("call0") + log.count("call1") < log.count("flush")  # flush-only loops ran


def test_report_has_the_in_graph_table():
    meta = dict(gpu="GPU", date="d", torch="t", triton="tr", command="c", copy_bw_GBps=4250.0)
    row = dict(kind="decode", layout="random", bs=1, ctx=512, num_splits=4, fold=True,
               ours_us=12.9, ours_eager_us=100.0, sdpa_us=11.9, sdpa_eager_us=70.0, floor_us=0.5,
               frac_copy_bw=0.04, speedup_vs_sdpa=11.9 / 12.9, sdpa_backend="CUDNN_ATTENTION",
               vs_reference=2e-3, ok=True, in_graph_calls=20, ig_ours_us=5.0, ig_sdpa_us=4.0)
    md = bench_attention.markdown(meta, [row], [], [], [])
    assert "Inside a graph of 20 calls" in md
    assert "| random | 1 | 512 | 5.0 | 4.0 | 0.80x | 0.5 |" in md
    no_ig = {k: v for k, v in row.items() if not k.startswith(("ig_", "in_graph"))}
    assert "Inside a graph" not in bench_attention.markdown(meta, [no_ig], [], [], [])
