"""Benchmark: the DeepSeek-like decode step with the routed MoE kernels on and off.

One process, one model (the `lite` preset: V2-Lite widths, 6 layers, 16 experts top-6, bf16,
random weights), one latent cache. For each batch size and each path, `MoePolicy` forces the
MoE layers' path (dense masked: routed_max_ratio 0; routed: inf), the decode step
(`forward_decode`) is captured in a CUDA graph and its replays are timed with CUDA events
(median of REPEATS runs of ITERS replays). Beside it, one MoE layer alone (router, experts,
shared expert), captured and timed the same way, and the path the default policy picks.

Bytes a step reads, per path: every weight but the embedding table (n rows of it) and the
routed experts, plus the experts: dense all n_experts slices a MoE layer; routed the T * top_k
slices its programs request, and the distinct experts among them (what DRAM must deliver when
L2 serves a repeated slice), counted from the router's picks on this batch. The floor is those
bytes over the measured device-to-device copy bandwidth. The next tokens of the two paths are
compared (bf16: they may differ where the top-2 logits nearly tie).

--tiles '[[block_f, block_h, block_k], ...]' also times the routed kernels alone
(`launch_routed`, one MoE layer's experts) at each size with those tiles. --profile lists the
default path's step at each size by kernel class (`bench.common.kernel_classes`: count, µs and
share of the step a class takes, and the GPU span of a replay) from torch.profiler over ITERS
replays, and its slowest kernels. --bodies eager,compiled runs everything for the eager body,
then compiles each decoder layer (`torch.compile`, fullgraph, static shapes: what padgraph.llm's
engine runs inside its graphs on a GPU) and runs it again on the same weights, inputs and cache;
the compiled body's logits are checked against the eager one's (the MoE layer timed alone stays
eager). Writes bench_moe.{md,json} under $OUT (or results/local), and with --profile
bench_moe.png: each body's step by kernel class at each size, against the weight floor.

    python -m bench.bench_moe [--sizes 1,16] [--layers 6] [--context 256] [--tiles ...] [--profile]
                              [--bodies eager,compiled]
    python -m bench.bench_moe --tiny     # CPU smoke run (no graphs; torch reference)
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from bench.bench_runner import step_weight_bytes
from bench.common import (copy_bandwidth, env_info, gpu_span_us, kernel_classes, kernel_table, out_dir,
                          pyplot, time_us)
from bench.gpu_timing import graph_of, profile_replays
from padgraph.backends.triton.moe_routed import RoutedTiles, launch_routed
from padgraph.llm import Batch
from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel, LatentCache, MoE, MoePolicy

PATHS = {"dense": MoePolicy(routed_max_ratio=0.0), "routed": MoePolicy(routed_max_ratio=math.inf)}
ITERS, REPEATS = 20, 7


def decode_inputs(model: DeepSeekModel, bs: int, context: int, device, gen) -> tuple:
    """(input_ids [bs], positions [bs], Batch): bs requests of `context` tokens each (the new
    one included) over a latent cache of random rows; rows 1..bs, slot 0 the sink."""
    cfg = model.cfg
    kv = LatentCache(cfg.n_layers, bs * context + 2, cfg.latent_width, context, bs + 1,
                     model.lm_head.weight.dtype, device)
    for lat in kv.latent:
        lat.copy_(torch.randn(lat.shape, generator=gen).to(lat.dtype) * 0.5)
    kv.req_to_token[1:] = (1 + torch.arange(bs * context, device=device)).view(bs, context)
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=device)
    lens = torch.full((bs,), context, dtype=torch.int32, device=device)
    loc = kv.req_to_token[rows.long(), context - 1].long()
    ids = torch.randint(1, cfg.vocab_size, (bs,), generator=gen).to(device)
    pos = torch.full((bs,), context - 1, dtype=torch.long, device=device)
    return ids, pos, Batch(kv, kv.req_to_token, rows, lens, loc)


def timed_us(fn, device) -> float:
    """Median µs a call of fn: CUDA-graph replays timed with events on a GPU, wall clock on CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    return time_us(graph_of(fn), REPEATS, back_to_back=ITERS)


def profiled(fn) -> dict:
    """The captured step's kernels over ITERS replays queued back to back: per replay, the
    classes (`kernel_classes`), the GPU span and the slowest kernels (`kernel_table`)."""
    events = profile_replays(graph_of(fn), ITERS)
    classes = [{k: v for k, v in c.items() if k != "names"} for c in kernel_classes(events, ITERS)]
    return {"classes": classes, "span_us": gpu_span_us(events, ITERS), **kernel_table(events, ITERS, top=12)}


def moe_layers(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def slice_bytes(moe: MoE) -> int:
    """Bytes of one routed expert: its gate_up [hidden, 2F] and down [F, hidden] slices."""
    return (moe.gate_up[0].numel() + moe.down[0].numel()) * moe.gate_up.element_size()


def distinct_experts(model, ids, pos, batch) -> list[int]:
    """Per MoE layer, the number of distinct experts the router picks for this step's tokens."""
    counts, hooks = [], []
    for m in moe_layers(model):
        hooks.append(m.register_forward_hook(
            lambda mod, inp, out: counts.append(
                int(mod.select(inp[0].reshape(-1, inp[0].shape[-1]))[0].unique().numel()))))
    try:
        model.forward_decode(ids, pos, batch)
    finally:
        for h in hooks:
            h.remove()
    return counts


def weight_bytes(model, bs: int, distinct: list[int]) -> dict:
    """Bytes of weights a step of bs requests reads, per path (module doc)."""
    moes, k = moe_layers(model), model.cfg.top_k
    experts = sum(m.gate_up.numel() + m.down.numel() for m in moes) * moes[0].gate_up.element_size()
    rest = step_weight_bytes(model, bs) - experts
    one = slice_bytes(moes[0])
    return {"dense": rest + experts, "routed": rest + len(moes) * bs * k * one,
            "routed_distinct": rest + sum(distinct) * one}


def run_size(model, bs: int, args, device, bw: float, body: str = "eager") -> dict:
    gen = torch.Generator().manual_seed(bs)          # every body sees the same inputs and cache
    ids, pos, batch = decode_inputs(model, bs, args.context, device, gen)
    moe = moe_layers(model)[0]
    x = torch.randn(bs, model.cfg.hidden_size, generator=gen).to(device, model.lm_head.weight.dtype)
    row = {"body": body, "bs": bs, "default_path": "routed" if moe.routed(bs) else "dense"}
    logits = {}
    with torch.no_grad():
        model.set_moe_policy(PATHS["routed"])
        with torch.compiler.set_stance("force_eager"):      # its hooks count on the host
            row["distinct_experts"] = distinct_experts(model, ids, pos, batch)
        row["bytes"] = weight_bytes(model, bs, row["distinct_experts"])
        for name, policy in PATHS.items():
            model.set_moe_policy(policy)
            logits[name] = model.forward_decode(ids, pos, batch)[0].float()
            row[f"{name}_step_us"] = timed_us(lambda: model.forward_decode(ids, pos, batch), device)
            row[f"{name}_moe_layer_us"] = timed_us(lambda: moe(x), device)
        if args.tiles:
            idx, w = moe.select(x)
            row["tiles_us"] = {str(t): timed_us(
                lambda t=t: launch_routed(x, idx, w, moe.gate_up, moe.down,
                                          RoutedTiles(*t)), device) for t in args.tiles}
        model.set_moe_policy(MoePolicy())
        row["logits"] = model.forward_decode(ids, pos, batch)[0].float()      # the default path's
        if args.profile and device.type == "cuda":
            row["profile"] = profiled(lambda: model.forward_decode(ids, pos, batch))
    row["floor_us"] = {p: b / bw * 1e6 for p, b in row["bytes"].items()} if bw else {}
    row["same_next_tokens"] = int((logits["dense"].argmax(-1) == logits["routed"].argmax(-1)).sum())
    row["max_logit_diff"] = float((logits["dense"] - logits["routed"]).abs().max())
    return row


def compare_bodies(rows) -> None:
    """Each non-eager row's default-path logits against the eager body's at its size: same next
    tokens and the largest difference (then the logits are dropped from the rows)."""
    eager = {r["bs"]: r["logits"] for r in rows if r["body"] == "eager"}
    for r in rows:
        logits = r.pop("logits")
        if r["body"] != "eager" and r["bs"] in eager:
            ref = eager[r["bs"]]
            r["vs_eager"] = {"same_next_tokens": int((logits.argmax(-1) == ref.argmax(-1)).sum()),
                             "max_logit_diff": float((logits - ref).abs().max())}


def report(rows, meta) -> str:
    gb = lambda b: f"{b / 1e9:.2f}"  # noqa: E731
    lines = [f"# DeepSeek-like decode step, routed MoE on / off ({meta['gpu']})", "",
             f"`{meta['command']}`; {meta['date']}, torch {meta['torch']}, triton "
             f"{meta['triton']}; {meta['model']}; context {meta['context']} tokens a request; "
             f"copy bandwidth {meta['copy_bw_gbs']:.0f} GB/s.", "",
             "| body | bs | default path | dense step µs | routed step µs | dense MoE layer µs | "
             "routed MoE layer µs | weight GB dense | routed (requested) | routed (distinct) | "
             "floor µs dense / routed distinct | same next tokens | max logit diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, fl = r["bytes"], r["floor_us"]
        floor = f"{fl['dense']:.0f} / {fl['routed_distinct']:.0f}" if fl else "-"
        lines.append(f"| {r['body']} | {r['bs']} | {r['default_path']} | {r['dense_step_us']:.0f} | "
                     f"{r['routed_step_us']:.0f} | {r['dense_moe_layer_us']:.1f} | "
                     f"{r['routed_moe_layer_us']:.1f} | {gb(b['dense'])} | {gb(b['routed'])} | "
                     f"{gb(b['routed_distinct'])} | {floor} | {r['same_next_tokens']}/{r['bs']} | "
                     f"{r['max_logit_diff']:.3g} |")
    for r in rows:
        if "profile" in r:
            pr = r["profile"]
            lines += ["", f"The {r['body']} body's step at bs {r['bs']} ({r['default_path']} path, the "
                      "default) by kernel class: "
                      f"{pr['kernels']:.0f} kernels, {pr['kernel_us']:.0f} kernel-µs and a GPU span of "
                      f"{pr['span_us']:.0f} µs a replay.", "",
                      "| class | kernels | µs | share of kernel time |", "|---|---|---|---|"]
            lines += [f"| {c['class']} | {c['kernels']:.0f} | {c['us']:.1f} | "
                      f"{100 * c['us'] / pr['kernel_us']:.1f} % |" for c in pr["classes"]]
            lines += ["", "Slowest kernels (µs a replay, launches a replay, name): " + "; ".join(
                f"{us:.1f} µs x{n:.0f} `{name[:70]}`" for us, n, name in pr["top"][:8])]
    for r in rows:
        if "vs_eager" in r:
            v = r["vs_eager"]
            lines += ["", f"The {r['body']} body at bs {r['bs']} against the eager body (default "
                      f"path): same next tokens {v['same_next_tokens']}/{r['bs']}, max logit "
                      f"difference {v['max_logit_diff']:.3g}."]
    for r in rows:
        if "tiles_us" in r:
            lines += ["", f"Routed kernels alone at bs {r['bs']} (one MoE layer's experts), "
                      "tiles [block_f, block_h, block_k]: " + ", ".join(
                          f"{t}: {us:.1f} µs" for t, us in r["tiles_us"].items())]
    return "\n".join(lines) + "\n"


def plot_classes(rows, meta, path) -> None:
    """Stacked kernel µs by class of each profiled (body, bs) step, the weight floor of its
    default path dashed. Skipped without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    sizes = sorted({r["bs"] for r in rows if "profile" in r})
    order = list(dict.fromkeys(c["class"] for r in rows if "profile" in r
                               for c in r["profile"]["classes"]))
    color = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(order)}
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.5), squeeze=False)
    for ax, bs in zip(axes[0], sizes):
        runs = [r for r in rows if r["bs"] == bs and "profile" in r]
        labels = [f"{r['body']} body\n{r['profile']['kernels']:.0f} kernels" for r in runs]
        bottom = [0.0] * len(runs)
        for c in order:
            vals = [next((k["us"] for k in r["profile"]["classes"] if k["class"] == c), 0.0)
                    for r in runs]
            ax.bar(labels, vals, bottom=bottom, label=c, color=color[c])
            bottom = [b + v for b, v in zip(bottom, vals)]
        if runs[0]["floor_us"]:
            path_key = "routed_distinct" if runs[0]["default_path"] == "routed" else "dense"
            ax.axhline(runs[0]["floor_us"][path_key], color="k", ls="--", label="weight floor")
        ax.set(title=f"bs {bs} ({runs[0]['default_path']} MoE): kernel µs a step by class",
               ylabel="µs")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="center right")
    fig.suptitle(f"DeepSeek-like decode step ({meta['model'].split(',')[0]}), {meta['gpu']}, "
                 f"{meta['date']}")
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1,16")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--tiles", type=json.loads, default=None)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run at the tiny preset")
    p.add_argument("--profile", action="store_true",
                   help="the default path's step by kernel class at each size (torch.profiler; a GPU)")
    p.add_argument("--bodies", default="eager",
                   help="eager and / or compiled (each decoder layer torch.compile'd), in order")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cfg = DeepSeekConfig.tiny() if args.tiny else DeepSeekConfig.lite(n_layers=args.layers)
    model = DeepSeekModel(cfg).to(device)
    model = (model if device.type == "cpu" else model.bfloat16()).eval()
    bw = copy_bandwidth(device) if device.type == "cuda" else 0.0
    bodies = args.bodies.split(",")
    if sorted(set(bodies)) != sorted(bodies) or not set(bodies) <= {"eager", "compiled"}:
        p.error(f"--bodies: eager and / or compiled, each once; got {args.bodies!r}")
    rows = []
    for body in bodies:
        if body == "compiled":
            for layer in model.layers:
                layer.compile(fullgraph=True, dynamic=False)
        for bs in (int(s) for s in args.sizes.split(",")):
            rows.append(run_size(model, bs, args, device, bw, body))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "logits"}), flush=True)
    compare_bodies(rows)
    meta = {**env_info(), "context": args.context, "copy_bw_gbs": bw / 1e9,
            "model": ("tiny" if args.tiny else f"lite, {args.layers} layers") + f", "
                     f"{cfg.n_routed_experts} experts top-{cfg.top_k}, "
                     f"{len(moe_layers(model))} MoE layers"}
    out = out_dir()
    (out / "bench_moe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "bench_moe.md").write_text(report(rows, meta))
    if any("profile" in r for r in rows):
        plot_classes(rows, meta, out / "bench_moe.png")
    print(report(rows, meta))


if __name__ == "__main__":
    main()
