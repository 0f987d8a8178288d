"""Host time per call of the runner's call path, isolated from model size.

A decode-shaped program with 8 inputs and a tiny body (one small fused op) so the GPU is idle
and what is timed is the host: padgraph's call path vs an SGLang-style hand-written runner vs
a bare `graph.replay()` of the same captured graph. Also prints a cProfile breakdown.

    python -m bench.bench_host [--calls 2000]
    python -m bench.bench_host --baseline PATH [--rounds 2]

With `--baseline PATH` (another checkout of this repository, e.g. the previous commit in a
folder) the same benchmark runs through PATH's padgraph and through this tree's, each in its own
process, alternating `--rounds` times on the same machine; both tables and the per-step
comparison are printed and written.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "--tree" in sys.argv:               # a child timing another checkout: before padgraph is imported
    from bench import tree
    tree.use(sys.argv[sys.argv.index("--tree") + 1])

import torch  # noqa: E402

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


def host_us(fn, calls, stat=statistics.median):
    """Host µs of one call (GPU work excluded: a sync after each), `stat` over `calls` calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return stat(ts)


def stage_breakdown(runner, raw, calls):
    """Each step of the call path timed alone (host µs, median), to show where the time goes."""
    ext = runner.plan.extents(raw, runner.device)
    bucket = runner.plan.bucket_for(ext)
    g = runner._graphs[bucket]
    replay = getattr(g, "replay", g.graph.replay)       # as the call replays it (bound once where the tree does)
    fresh = alternating(raw)
    return {
        "validate+extents": host_us(lambda: runner.plan.extents(raw, runner.device, True), calls),
        "state guard": host_us(runner.state.check, calls),
        "aliasing check": host_us(lambda: runner._check_aliasing(raw), calls),
        "bucket lookup": host_us(lambda: runner.plan.bucket_for(ext), calls),
        "srcs + extents + H2D copy (+ its fence)": host_us(lambda: runner.pack.block.send(next(fresh), ext), calls),
        "srcs + extents, the same sources as the last call": host_us(lambda: runner.pack.block.send(raw, ext), calls),
        "graph.replay": host_us(replay, calls),
        "slice outputs (cached views)": host_us(lambda: runner._finish_cached(g.outputs, ext, bucket), calls),
        "lend outputs (lifetimes enforced)": host_us(lambda: runner._lend(runner._finish_cached(g.outputs, ext, bucket)), calls),
        "whole call": host_us(lambda: runner(**raw), calls),
        "whole call, new input tensors each call": host_us(lambda: runner(**next(fresh)), calls),
        # the staging fences a group of calls with one event: its cost falls on one call in a group
        "whole call, mean": host_us(lambda: runner(**raw), calls, statistics.fmean),
    }


def alternating(raw):
    """raw, then a copy of it at other addresses, in turn: every call's inputs are new tensors
    (a runner that finds its last call's sources again sends no copy)."""
    pair = (raw, {k: v.clone() for k, v in raw.items()})
    i = 0
    while True:
        yield pair[i]
        i ^= 1


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


def measure(calls: int) -> dict:
    """Every table of this benchmark, for the padgraph this process imported."""
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
        fresh = alternating(raw)
        assert all(torch.equal(runner(**next(fresh)).next_token, ref) for _ in range(3))
        bucket = runner.plan.bucket_for({"bs": n})
        g = runner._graphs[bucket].graph
        row = {"bs": n,
               "padgraph_us": host_us(lambda: runner(**raw), calls),
               "padgraph_new_tensors_us": host_us(lambda: runner(**next(fresh)), calls),
               "padgraph_host_inputs_us": host_us(lambda: runner(**host_raw), calls),
               "handwritten_us": host_us(lambda: hand(**raw), calls),
               "replay_only_us": host_us(g.replay, calls),
               "queued_behind_50ms_us": queued_us(runner, raw)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    stages = stage_breakdown(runner, raw_batch(27, device), calls)
    print("stages (µs, median):", json.dumps(stages), flush=True)
    return {"padgraph": str(Path(pg.__file__).resolve().parents[1]), "rows": rows, "stages": stages,
            "profile": profile(runner)}


def profile(runner) -> str:
    prof = cProfile.Profile()
    raw = raw_batch(27, torch.device("cuda"))
    prof.enable()
    for _ in range(2000):
        runner(**raw)
    prof.disable()
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.strip_dirs()                  # file names only: no machine's paths in the results
    stats.sort_stats("tottime").print_stats(18)
    return s.getvalue()[:6000]


def tables(res: dict) -> list[str]:
    lines = ["| bs | padgraph | padgraph (new tensors each call) | padgraph (host inputs) | handwritten | "
             "bare replay | padgraph, GPU busy 50 ms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['padgraph_us']:.1f} | {_us(r.get('padgraph_new_tensors_us'))} | "
              f"{r['padgraph_host_inputs_us']:.1f} | {r['handwritten_us']:.1f} | {r['replay_only_us']:.1f} | "
              f"{r['queued_behind_50ms_us']:.1f} |" for r in res["rows"]]
    lines += ["", "call path at bs=27, each step timed alone (host µs, median):", "",
              "| step | µs |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in res["stages"].items()]
    return lines


def run_child(calls: int, tree: str | None) -> dict:
    """This benchmark in a fresh process, through `tree`'s padgraph (None: this checkout's)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        cmd = [sys.executable, "-m", "bench.bench_host", "--calls", str(calls), "--json", str(out)]
        cmd += ["--tree", tree] if tree is not None else []
        subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[1])
        return json.loads(out.read_text())


def merged(runs: list[dict]) -> dict:
    """Rounds of one tree: the median of each number."""
    rows = [{k: (statistics.median(r["rows"][i][k] for r in runs) if k != "bs" else row["bs"]) for k in row}
            for i, row in enumerate(runs[0]["rows"])]
    stages = {k: statistics.median(r["stages"][k] for r in runs) for k in runs[0]["stages"]}
    return {"padgraph": runs[0]["padgraph"], "rows": rows, "stages": stages}


def compare(args) -> None:
    """The baseline checkout and this one, alternating in fresh processes on this machine."""
    runs: dict[str, list] = {"baseline": [], "this tree": []}
    for _ in range(args.rounds):
        runs["baseline"].append(run_child(args.calls, str(Path(args.baseline).resolve())))
        runs["this tree"].append(run_child(args.calls, None))
    base, mine = merged(runs["baseline"]), merged(runs["this tree"])
    info = env_info()
    lines = [f"# bench_host — {info['date']}, {info['gpu']}, torch {info['torch']}, triton {info['triton']}",
             f"command: `{info['command']}`; 8 inputs, tiny body; host µs per call, median of {args.calls}, "
             f"median over {args.rounds} alternating rounds", "",
             f"## this tree ({mine['padgraph']})", ""] + tables(mine)
    lines += ["", f"## baseline ({base['padgraph']})", ""] + tables(base)
    lines += ["", "## per step at bs=27 (host µs)", "", "| step | baseline | this tree | change |", "|---|---|---|---|"]
    steps = {**base["stages"], **mine["stages"]}
    for k in steps:
        b, m = base["stages"].get(k), mine["stages"].get(k)
        change = f"{m - b:+.1f}" if b is not None and m is not None else "-"
        lines.append(f"| {k} | {_us(b)} | {_us(m)} | {change} |")
    for i, r in enumerate(mine["rows"]):
        b = base["rows"][i]
        lines.append(f"| whole call, bs {r['bs']} (padgraph column) | {b['padgraph_us']:.1f} | {r['padgraph_us']:.1f} | "
                     f"{r['padgraph_us'] - b['padgraph_us']:+.1f} |")
    (out_dir() / "bench_host_vs_baseline.md").write_text("\n".join(lines) + "\n")
    (out_dir() / "bench_host_vs_baseline.json").write_text(json.dumps({"env": info, "runs": runs}, indent=1))
    print("\n".join(lines))


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--baseline", help="another checkout of this repository, timed the same way in its own process")
    ap.add_argument("--rounds", type=int, default=2, help="with --baseline: alternating runs of each tree")
    ap.add_argument("--tree", help=argparse.SUPPRESS)    # a child: import padgraph from this checkout
    ap.add_argument("--json", help=argparse.SUPPRESS)    # a child: write the results here and stop
    args = ap.parse_args()
    if args.baseline:
        return compare(args)
    res = measure(args.calls)
    if args.json:
        Path(args.json).write_text(json.dumps(res))
        return
    print(res["profile"])
    info = env_info()
    lines = [f"# bench_host — {info['date']}, {info['gpu']}, torch {info['torch']}, triton {info['triton']}",
             f"command: `{info['command']}`; 8 inputs, tiny body; host µs per call, median of {args.calls}", ""]
    lines += tables(res)
    (out_dir() / "bench_host.md").write_text("\n".join(lines) + "\n")
    (out_dir() / "bench_host.json").write_text(json.dumps({"env": info, "rows": res["rows"], "stages": res["stages"]}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
