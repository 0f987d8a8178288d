"""Host time per call of the runner's call path, isolated from model size.

A decode-shaped program with 8 inputs and a tiny body (one small fused op) so the GPU is idle
and what is timed is the host: padgraph's call path vs an SGLang-style hand-written runner vs
a bare `graph.replay()` of the same captured graph. Also prints a cProfile breakdown.

    python -m bench.bench_host.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch


import padgraph as pg  # noqa: E402
from bench.common import env_info, out_dir  # noqa: E402
from bench.bench_runner import HandwrittenRunner, Step, decode_program  # noqa: E402


class TinyStep(Step):
    """Same signature (and body) as the 1B decode step; a few elementwise ops instead of the model."""

    def __init__(self):
        pass

    def __call__(self, input_ids, positions, seq_lens, req_pool_indices, out_cache_loc,
                 temperature, stop_token, done):
        nxt = (input_ids + positions + seq_lens + req_pool_indices + out_cache_loc
               + (temperature * 2).long())
        nxt = torch.where(done, stop_token, nxt)
        return nxt, done | (nxt == stop_token)


def raw_batch(n, device):
    g = torch.Generator().manual_seed(n)
    return {
        "input_ids": torch.randint(1, 1000, (n,), generator=g).to(device),
        "positions": torch.randint(1, 1000, (n,), generator=g).to(device),
        "seq_lens": torch.randint(1, 1000, (n,), generator=g).int().to(device),
        "req_pool_indices": torch.randint(1, 100, (n,), generator=g).int().to(device),
        "out_cache_loc": torch.randint(1, 10000, (n,), generator=g).to(device),
        "temperature": torch.rand(n, generator=g).to(device),
        "stop_token": torch.full((n,), 2, dtype=torch.int64).to(device),
        "done": torch.zeros(n, dtype=torch.bool).to(device),
    }


def host_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


def stage_breakdown(runner, raw, calls):
    """Each step of the call path timed alone (host µs, median), to show where the time goes."""
    ext = runner.plan.extents(raw, runner.device)
    bucket = runner.plan.bucket_for(ext)
    g = runner._graphs[bucket]
    return {
        "validate+extents": host_us(lambda: runner.plan.extents(raw, runner.device, True), calls),
        "state guard": host_us(runner.state.check, calls),
        "aliasing check": host_us(lambda: runner._check_aliasing(raw), calls),
        "bucket lookup": host_us(lambda: runner.plan.bucket_for(ext), calls),
        "srcs + extents + H2D copy + event": host_us(lambda: runner.pack.block.send(raw, ext), calls),
        "graph.replay": host_us(g.graph.replay, calls),
        "slice outputs (cached views)": host_us(lambda: runner._finish_cached(g.outputs, ext, bucket), calls),
        "lend outputs (lifetimes enforced)": host_us(lambda: runner._lend(runner._finish_cached(g.outputs, ext, bucket)), calls),
        "whole call": host_us(lambda: runner(**raw), calls),
    }


def queued_us(runner, raw, calls: int = 200, sleep_ms: float = 50.0):
    """Host µs per call while the GPU is busy for `sleep_ms` (a call must never wait for it)."""
    cycles = int(sleep_ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    for _ in range(calls):
        runner(**raw)
    per_call = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return per_call


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    device = torch.device("cuda")
    step, program = TinyStep(), decode_program()
    runner = pg.compile(program, step.body, backend="cuda", progress=False)
    hand = HandwrittenRunner(step, program, device)
    rows = []
    for n in (1, 27, 200):
        raw = raw_batch(n, device)
        host_raw = {k: v.cpu() for k, v in raw.items()}
        ref = step(**raw)[0]
        assert torch.equal(runner(**raw).next_token, ref) and torch.equal(hand(**raw)[0], ref)
        assert torch.equal(runner(**host_raw).next_token, ref)
        bucket = runner.plan.bucket_for({"bs": n})
        g = runner._graphs[bucket].graph
        row = {"bs": n,
               "padgraph_us": host_us(lambda: runner(**raw), args.calls),
               "padgraph_host_inputs_us": host_us(lambda: runner(**host_raw), args.calls),
               "handwritten_us": host_us(lambda: hand(**raw), args.calls),
               "replay_only_us": host_us(g.replay, args.calls),
               "queued_behind_50ms_us": queued_us(runner, raw)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    stages = stage_breakdown(runner, raw_batch(27, device), args.calls)
    print("stages (µs, median):", json.dumps(stages), flush=True)
    prof = cProfile.Profile()
    raw = raw_batch(27, device)
    prof.enable()
    for _ in range(2000):
        runner(**raw)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(s.getvalue()[:6000])
    info = env_info()
    lines = [f"# bench_host — {info['date']}, {info['gpu']}, torch {info['torch']}, triton {info['triton']}",
             f"command: `{info['command']}`; 8 inputs, tiny body; host µs per call, median of {args.calls}", "",
             "| bs | padgraph | padgraph (host inputs) | handwritten | bare replay | padgraph, GPU busy 50 ms |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['padgraph_us']:.1f} | {r['padgraph_host_inputs_us']:.1f} | "
              f"{r['handwritten_us']:.1f} | {r['replay_only_us']:.1f} | {r['queued_behind_50ms_us']:.1f} |" for r in rows]
    lines += ["", "call path at bs=27, each step timed alone (host µs, median):", "",
              "| step | µs |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in stages.items()]
    (out_dir() / "bench_host.md").write_text("\n".join(lines) + "\n")
    (out_dir() / "bench_host.json").write_text(json.dumps({"env": info, "rows": rows, "stages": stages}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
