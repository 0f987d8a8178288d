"""Benchmark: the small-batch linear kernel (`padgraph.backends.triton.gemv`) against F.linear
(cuBLAS) at the Llama-3.2-1B decode shapes, bs 1 / 4 / 16.

Why: the 1B decode step at bs 1 is well above its weight-bandwidth floor (results/bench_runner.md),
and cuBLAS reads the small GEMMs' weights (qkv, o, down) at a third to 0.6 of copy bandwidth
(results/gemv.md). This measures whether a Triton kernel streams them faster, over a
sweep of tiles and split-K counts, before any model takes it.

How: each (shape, bs) is timed as a CUDA graph of CALLS calls, replayed REPEATS times after a
warm-up, median per call. The calls cycle through enough copies of the weight to exceed the L2
cache (a decode step reads each layer's weight once, after 15 other layers' weights flushed
it), so no call reads a warm weight. Every config's output is checked against F.linear in fp32
(relative error printed; a config over 1e-2 is reported and not counted). GB/s = weight bytes
/ time; "of copy" = that over the measured copy bandwidth (read + write bytes, as the other
benchmarks count it).

The chain (`--chain`, on by default): the GEMMs of a whole 1B decode step and nothing else, 16
layers of qkv -> o -> gate_up -> down with their own weights (each call's input is a slice of
the one before, so they run in order) and the lm_head, as one CUDA graph: once with F.linear
everywhere, once with each shape's faster of F.linear and the best gemv config of the sweep.
Against the step's weight floor (these weights' bytes / copy bandwidth) this bounds what a
decode body of one kernel per linear can reach, whatever runs between the linears.

Writes gemv.{md,json,png} under $OUT (or results/local).

    python -m bench.bench_gemv [--sizes 1,4,16] [--quick] [--no-chain]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton


from bench.common import copy_bandwidth, env_info, out_dir, pyplot  # noqa: E402

from padgraph.backends.triton.gemv import gemv  # noqa: E402

# (name, N, K) of the 1B model's decode linears: merged qkv, o, merged gate_up, down, lm_head
SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
          ("down", 2048, 8192), ("lm_head", 128256, 2048)]
CALLS, REPEATS = 20, 30
L2_BYTES = 256 << 20      # the weight copies a graph cycles through exceed this (H200 L2: 50 MB)
CONFIGS = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4, num_stages=4)
           for bn, bk, sk in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4))]
QUICK = [dict(block_n=16, block_k=256, split_k=sk, num_warps=4, num_stages=4) for sk in (1, 2)]


def replay_us(body):
    """Capture body() in a CUDA graph (after 3 warm-up runs on a side stream); the median µs of
    REPEATS replays after 3 more, and body's output in the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPEATS + 3):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:]), out


def time_graph(fn, xs, ws) -> float:
    """Median µs per call of fn(x, w) over CALLS calls cycling through the weight copies ws, as
    one CUDA graph replayed REPEATS times."""
    def calls():
        for i in range(CALLS):
            fn(xs[i % len(xs)], ws[i % len(ws)])
    return replay_us(calls)[0] / CALLS


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def bench_shape(name, n, k, m, configs, bw, gen) -> dict:
    wbytes = n * k * 2
    copies = max(1, min(64, -(-L2_BYTES // wbytes)))
    ws = [torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(copies)]
    xs = [torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
    want = F.linear(xs[0], ws[0])
    row = {"shape": name, "n": n, "k": k, "bs": m, "weight_bytes": wbytes, "copies": copies}
    row["cublas_us"] = time_graph(F.linear, xs, ws)
    results = []
    for cfg in configs:
        fn = lambda x, w, cfg=cfg: gemv(x, w, impl="triton", **cfg)   # noqa: E731
        try:
            err = rel_err(fn(xs[0], ws[0]), want)
        except triton.runtime.errors.OutOfResources as e:   # a tile past the shared memory
            results.append(dict(cfg, err=float("nan"), ok=False, error=str(e)))
            continue
        r = dict(cfg, err=err, ok=err < 1e-2)
        if r["ok"]:
            r["us"] = time_graph(fn, xs, ws)
        results.append(r)
    ok = [r for r in results if r["ok"]]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    row.update(configs=results, best=best,
               cublas_gbs=wbytes / row["cublas_us"] / 1e3,
               gemv_gbs=wbytes / best["us"] / 1e3 if best else 0.0)
    row["speedup"] = row["cublas_us"] / best["us"] if best else 0.0
    row["cublas_of_copy"] = row["cublas_gbs"] * 1e9 / bw
    row["gemv_of_copy"] = row["gemv_gbs"] * 1e9 / bw
    print(f"{name:>8} bs={m:>2}: cuBLAS {row['cublas_us']:7.1f} µs ({row['cublas_gbs']:6.0f} GB/s)"
          f"  gemv {best['us'] if best else float('nan'):7.1f} µs ({row['gemv_gbs']:6.0f} GB/s) "
          f"{row['speedup']:.2f}x  best {best and {k_: best[k_] for k_ in ('block_n', 'block_k', 'split_k')}}"
          f"  bad configs {sum('error' not in r_ for r_ in results) - len(ok)}"
          f"  over shared memory {sum('error' in r_ for r_ in results)}", flush=True)
    return row


LAYERS = 16  # Llama-3.2-1B


def chain_us(x0, layer_ws, head_w, linears) -> tuple[float, torch.Tensor]:
    """Median µs of one replay of the step's GEMM chain from x0 (a CUDA graph), and its output.
    linears: shape name -> fn(x, w)."""

    def step():
        x = x0
        for ws in layer_ws:
            q = linears["qkv"](x, ws["qkv"])[:, :2048]
            h = linears["o"](q, ws["o"])
            g = linears["gate_up"](h, ws["gate_up"])[:, :8192]
            x = linears["down"](g, ws["down"])  # no kernel between two linears
        return linears["lm_head"](x, head_w)

    us, out = replay_us(step)
    return us, out.clone()


def bench_chain(rows, sizes, bw, gen) -> list[dict]:
    """The whole step's GEMMs as one graph: F.linear everywhere, then each shape's faster of
    F.linear and its best gemv config (from the sweep's rows at that bs)."""
    dims = {name: (n, k) for name, n, k in SHAPES}
    # scaled by 1 / sqrt(K) (a cast is the last op): activations keep unit scale along the chain
    layer_ws = [{name: (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5)
                 .to(torch.bfloat16) for name, (n, k) in dims.items() if name != "lm_head"}
                for _ in range(LAYERS)]
    head_w = (torch.randn(*dims["lm_head"], generator=gen, device="cuda") / 2048 ** 0.5
              ).to(torch.bfloat16)
    weight_bytes = (sum(w.numel() for ws in layer_ws for w in ws.values()) + head_w.numel()) * 2
    floor_us = weight_bytes / bw * 1e6
    out = []
    for m in sizes:
        by = {r["shape"]: r for r in rows if r["bs"] == m}
        picks = {}
        for name in dims:
            r = by.get(name)
            if r and r["best"] and r["speedup"] > 1.0:
                cfg = {k_: r["best"][k_] for k_ in ("block_n", "block_k", "split_k",
                                                     "num_warps", "num_stages")}
                picks[name] = (lambda x, w, cfg=cfg: gemv(x, w, impl="triton", **cfg), cfg)
            else:
                picks[name] = (F.linear, "F.linear")
        x0 = torch.randn(m, 2048, generator=gen, device="cuda").to(torch.bfloat16)
        cublas_us, want = chain_us(x0, layer_ws, head_w, {n_: F.linear for n_ in dims})
        mixed_us, got = chain_us(x0, layer_ws, head_w, {n_: p[0] for n_, p in picks.items()})
        # every linear a gemv of one split (its best such config), without and with programmatic
        # dependent launch: how much of the chain's time is kernel boundaries
        split1 = {}
        for n_ in dims:
            ok = [c for c in by[n_]["configs"] if c["ok"] and c["split_k"] == 1] if n_ in by else []
            cfg = min(ok, key=lambda c: c["us"]) if ok else dict(CONFIGS[0])
            split1[n_] = {k_: cfg[k_] for k_ in ("block_n", "block_k", "num_warps", "num_stages")}
        variants = {}
        for label, pdl in (("gemv_split1", False), ("gemv_split1_pdl", True)):
            fns = {n_: (lambda x, w, c=c, pdl=pdl: gemv(x, w, impl="triton", pdl=pdl, **c))
                   for n_, c in split1.items()}
            try:
                us, got_v = chain_us(x0, layer_ws, head_w, fns)
                variants[label] = dict(us=us, over_floor=us / floor_us,
                                       rel_err=rel_err(got_v, want))
            except Exception as e:  # noqa: BLE001 - e.g. a Triton without launch_pdl
                variants[label] = dict(error=f"{type(e).__name__}: {e}"[:300])
            print(f"chain bs={m:>2} {label}: {variants[label]}", flush=True)
        isolated = sum((min(by[n_]["cublas_us"], by[n_]["best"]["us"]) if by[n_]["best"]
                        else by[n_]["cublas_us"]) * (1 if n_ == "lm_head" else LAYERS)
                       for n_ in dims if n_ in by)
        row = dict(bs=m, weight_bytes=weight_bytes, floor_us=floor_us, cublas_us=cublas_us,
                   mixed_us=mixed_us, isolated_sum_us=isolated,
                   picks={n_: p[1] for n_, p in picks.items()}, split1_configs=split1,
                   variants=variants,
                   mixed_rel_err=rel_err(got, want),
                   cublas_over_floor=cublas_us / floor_us, mixed_over_floor=mixed_us / floor_us)
        print(f"chain bs={m:>2}: F.linear {cublas_us:7.1f} µs ({row['cublas_over_floor']:.2f}x "
              f"floor {floor_us:.0f} µs)  mixed {mixed_us:7.1f} µs "
              f"({row['mixed_over_floor']:.2f}x, rel err {row['mixed_rel_err']:.1e})  "
              f"sum of isolated bests {isolated:.0f} µs", flush=True)
        out.append(row)
    return out


def markdown(meta, rows, chain=()) -> str:
    lines = [f"# Small-batch linear: gemv against F.linear (cuBLAS) ({meta['gpu']})", "",
             f"- date: {meta['date']}; torch {meta['torch']}, triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             f"- copy bandwidth (read + write): {meta['copy_GBps']:.0f} GB/s",
             f"- CUDA graph of {CALLS} calls cycling through weight copies > {L2_BYTES >> 20} MB "
             f"(no warm L2), median of {REPEATS} replays; {meta['n_configs']} configs a shape "
             "(tile rows / K tile / splits); checked against F.linear (rel err < 1e-2)", "",
             "| shape | N x K | bs | cuBLAS µs | cuBLAS GB/s (of copy) | gemv µs | gemv GB/s (of "
             "copy) | gemv / cuBLAS speedup | best config | max rel err |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        b = r["best"]
        cfg = f"{b['block_n']} / {b['block_k']} / {b['split_k']}" if b else "-"
        err = max((c["err"] for c in r["configs"] if "error" not in c), default=float("nan"))
        lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['bs']} | {r['cublas_us']:.1f} | "
                     f"{r['cublas_gbs']:.0f} ({r['cublas_of_copy']:.2f}) | "
                     f"{b['us'] if b else float('nan'):.1f} | {r['gemv_gbs']:.0f} "
                     f"({r['gemv_of_copy']:.2f}) | {r['speedup']:.2f}x | {cfg} | {err:.1e} |")
    if chain:
        lines += ["", f"## The step's GEMM chain ({LAYERS} x (qkv, o, gate_up, down) + lm_head, "
                  "one CUDA graph)", "",
                  f"Weights {chain[0]['weight_bytes'] / 1e9:.2f} GB; floor = those bytes / copy "
                  "bandwidth. \"mixed\": each shape's faster of F.linear and its best gemv "
                  "config at that bs; \"isolated\": the sum of each shape's best single-call time "
                  "from the table above.", "",
                  "| bs | floor µs | F.linear chain µs (x floor) | mixed chain µs (x floor) | "
                  "sum of isolated bests µs (x floor) | gemv taken for | mixed rel err |",
                  "|---:|---:|---:|---:|---:|---|---:|"]
        for c in chain:
            taken = ", ".join(n for n, p in c["picks"].items() if p != "F.linear") or "none"
            lines.append(f"| {c['bs']} | {c['floor_us']:.0f} | {c['cublas_us']:.0f} "
                         f"({c['cublas_over_floor']:.2f}) | {c['mixed_us']:.0f} "
                         f"({c['mixed_over_floor']:.2f}) | {c['isolated_sum_us']:.0f} "
                         f"({c['isolated_sum_us'] / c['floor_us']:.2f}) | {taken} | "
                         f"{c['mixed_rel_err']:.1e} |")
        lines += ["", "Every linear a one-split gemv (each shape's best one-split config), "
                  "launched plainly and as programmatic dependent launches (the weight's first tile is "
                  "requested before waiting for the kernel before):", "",
                  "| bs | variant | chain µs | x floor | rel err vs F.linear chain |",
                  "|---:|---|---:|---:|---:|"]
        for c in chain:
            for label, v in c.get("variants", {}).items():
                if "error" in v:
                    lines.append(f"| {c['bs']} | {label} | failed: {v['error'][:80]} | | |")
                else:
                    lines.append(f"| {c['bs']} | {label} | {v['us']:.0f} | {v['over_floor']:.2f} "
                                 f"| {v['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def plot(rows, path, chain=()) -> None:
    plt = pyplot()
    if plt is None:
        return
    width = max(6, len(rows) * 0.6) + (5 if chain else 0)
    fig, axes = plt.subplots(1, 2 if chain else 1, figsize=(width, 4), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r['shape']}\nbs {r['bs']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["cublas_gbs"] for r in rows], 0.4, label="F.linear (cuBLAS)")
    ax.bar([i + 0.2 for i in x], [r["gemv_gbs"] for r in rows], 0.4, label="gemv (best config)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="weight GB/s", title="small-batch linear, weight read rate")
    ax.legend()
    if chain:
        ax = axes[0][1]
        series = [("F.linear", lambda c: c["cublas_us"]), ("mixed", lambda c: c["mixed_us"])]
        series += [(label, lambda c, label=label: c["variants"][label].get("us", 0.0))
                   for label in chain[0].get("variants", {})]
        width = 0.8 / len(series)
        for j, (label, get) in enumerate(series):
            ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(chain))],
                   [get(c) for c in chain], width, label=label)
        ax.axhline(chain[0]["floor_us"], color="k", linestyle="--", label="weight floor")
        ax.set_xticks(range(len(chain)), [f"bs {c['bs']}" for c in chain])
        ax.set(ylabel="µs per step's GEMMs",
               title=f"the step's GEMM chain ({LAYERS} layers + lm_head)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--quick", action="store_true", help="two configs a shape (a smoke run)")
    ap.add_argument("--no-chain", action="store_true", help="skip the step's GEMM chain")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a GPU")
    sizes = [int(s) for s in args.sizes.split(",")]
    configs = QUICK if args.quick else CONFIGS
    bw = copy_bandwidth("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = dict(env_info(), copy_GBps=bw / 1e9, n_configs=len(configs), calls=CALLS,
                repeats=REPEATS, l2_bytes=L2_BYTES)
    rows = []
    out = out_dir()
    with torch.inference_mode():
        for (name, n, k), m in itertools.product(SHAPES, sizes):
            rows.append(bench_shape(name, n, k, m, configs, bw, gen))
            (out / "gemv.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        chain = [] if args.no_chain else bench_chain(rows, sizes, bw, gen)
    (out / "gemv.json").write_text(json.dumps({"meta": meta, "rows": rows, "chain": chain},
                                              indent=1))
    (out / "gemv.md").write_text(markdown(meta, rows, chain))
    plot(rows, out / "gemv.png", chain)
    print(markdown(meta, rows, chain))


if __name__ == "__main__":
    main()
