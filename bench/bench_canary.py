"""The canary's cost on the Llama-1B-shaped decode step, paired and at kernel level.

Two runners of the same captured step (`bench.bench_runner`'s program and body, the cache bound
as state): `padgraph`, and `padgraph+canary`, whose cache's last slot and request row are canary
rows checked by one Triton launch inside every replay (`pg.State(canary=...)`). Per batch size:

- paired step time: `--rounds` rounds, each timing a block of `--block` back-to-back calls of
  each runner in turn (CUDA events around the block, no synchronisation inside it: the steady
  state a serving loop runs in); the cost is the median over rounds of each round's ratio, so
  clock drift between rounds cancels;
- the canary kernel's own GPU time per step (torch.profiler, kernels named `_canary_kernel`), as
  a share of the step: the cost with no timing noise in it.

Both runners' tokens are compared, and `canary_check()` must find no canary row written.

    python -m bench.bench_canary [--sizes 1,16,64] [--rounds 15] [--block 40]

Writes canary.{md,json} under $OUT (or results/local).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

import padgraph as pg
from bench.bench_runner import build_step, canary_program, decode_program, make_batch, next_tokens
from bench.common import env_info, out_dir


def block_us(fn, raw: dict, n: int) -> float:
    """µs per call over n back-to-back calls (CUDA events around the block)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn(**raw)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def canary_kernel_us(fn, raw: dict, calls: int = 20) -> float:
    """GPU µs per call spent in the canary's kernel (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(**raw)
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if "canary" in e.key)
    return total / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=40)
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    device = torch.device("cuda")
    cfg, model, kv, step = build_step(args.tiny, device)
    program = decode_program()
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        plain = pg.compile(program, step.body, backend="cuda", progress=False)
        prog, state = canary_program(program, kv)
        guarded = pg.compile(prog, step.body, backend="cuda", progress=False, state=state, restore_state=False)
        for n in sizes:
            raw = make_batch(n, kv, cfg, gen, device)
            same = bool(torch.equal(next_tokens(plain(**raw)), next_tokens(guarded(**raw))))
            for fn in (plain, guarded):
                block_us(fn, raw, 5)                    # warm-up
            pairs = []
            for _ in range(args.rounds):
                a, b = block_us(plain, raw, args.block), block_us(guarded, raw, args.block)
                pairs.append((a, b))
            ratio = statistics.median(b / a for a, b in pairs)
            step_us = statistics.median(a for a, _ in pairs)
            kern = canary_kernel_us(guarded, raw)
            row = {"bs": n, "step_us": step_us, "with_canary_us": statistics.median(b for _, b in pairs),
                   "paired_cost_pct": (ratio - 1) * 100, "canary_kernel_us": kern,
                   "kernel_cost_pct": kern / step_us * 100, "tokens_equal": same}
            rows.append(row)
            print(f"bs={n}: step {step_us:.1f} µs, with canary {row['with_canary_us']:.1f} µs "
                  f"(paired {row['paired_cost_pct']:+.2f} %), canary kernel {kern:.2f} µs "
                  f"({row['kernel_cost_pct']:.2f} % of the step), tokens equal: {same}", flush=True)
        guarded.canary_check()                          # raises if a replay wrote a canary row
        print(f"canary_check: no canary row written ({len(guarded._canary)} canary rows)")
    command = (f"python -m bench.bench_canary --sizes {args.sizes} --rounds {args.rounds} --block {args.block}"
               + (" --tiny" if args.tiny else ""))
    res = {"env": env_info(command), "canary_rows": len(guarded._canary), "rows": rows}
    out = out_dir()
    (out / "canary.json").write_text(json.dumps(res, indent=1))
    lines = ["| bs | step µs | with canary µs | paired cost | canary kernel µs | kernel share | tokens |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['step_us']:.1f} | {r['with_canary_us']:.1f} | {r['paired_cost_pct']:+.2f} % | "
              f"{r['canary_kernel_us']:.2f} | {r['kernel_cost_pct']:.2f} % | {'equal' if r['tokens_equal'] else 'DIFFER'} |"
              for r in rows]
    (out / "canary.md").write_text("# Canary cost\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
