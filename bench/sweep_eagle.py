"""The draft tree's shape against its cost: EAGLE (graphs) over several (steps, topk, k) on one
target and one distilled head, against greedy (graphs) on the same requests, in one process.

    python -m bench.sweep_eagle                       # GPU: the 1B-shaped target
    EAGLE_MODEL=deepseek python -m bench.sweep_eagle  # the DeepSeek-like target
    python -m bench.sweep_eagle --device cpu          # reference backend, tiny sizes: runs the
                                                         # loop, says nothing about speed

Each tree is a fresh Engine (its own graphs) on the ladder [1, 16] only, so a tree costs one
capture per bucket; dynamo's caches are reset between trees so no tree runs past its recompile
limit. Rows: bs 1 (8 requests one at a time) and bs 16 (one batch of 16), 128 new tokens each;
each batch timed REPEATS times, the median run counts (bench_eagle.measure). A round's cost is
given in greedy steps from the per-phase clocks (prefill excluded on both sides).
Writes $OUT/sweep_eagle[_deepseek].{md,json,png} after every tree (a cut run keeps what it did).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass

import torch

import padgraph as pg
from bench.common import pyplot
from bench.bench_eagle import match_line, measure, prompts_for
from padgraph.llm.presets import DRAFT_COMPILE, DRAFT_LM_HEAD, MODELS, setup
from padgraph.llm import Engine, RunStats, SpecConfig

# (steps, topk, k): `examples/eagle.py`'s tree first, then deeper ones. (3, 4, 8) won a sweep
# while the head accepted ~3.0 of at most 4; with early stopping it accepts ~3.8
# (results/eagle.md), so the depth of the tree is what caps accept now.
TREES = [(3, 4, 8), (4, 4, 8), (5, 4, 8), (5, 4, 10), (6, 4, 12), (4, 2, 6), (6, 2, 8)]
REPEATS = 3


@dataclass(frozen=True)
class SweepContext:
    """What every write of one sweep shares: the folder, the target model, the head's distillation
    info, the batch sizes, the new tokens a request and whether it ran on the GPU."""
    out_dir: str
    model: str
    dinfo: dict
    sizes: tuple
    new: int
    gpu: bool


def phases(stats: list[RunStats]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in stats:
        for k, v in s.phases.items():
            out[k] = out.get(k, 0.0) + v
    return out


def per_round_ms(stats: list[RunStats]) -> tuple[float, dict[str, float]]:
    """(ms per round or step without prefill, ms per phase per round) over the runs."""
    rounds = sum(s.rounds for s in stats)
    ph = {k: 1e3 * v / max(rounds, 1) for k, v in phases(stats).items() if k != "prefill"}
    return sum(ph.values()), ph


def row(worker: Engine, mode: str, batches, new: int):
    reqs, tot, per = measure(worker, mode, batches, [new] * len(batches), repeats=REPEATS)
    ms, ph = per_round_ms(per)
    return reqs, {"tok_s": tot.tokens_per_s, "accept_len": tot.accept_len, "rounds": tot.rounds,
                  "ms_per_round": ms, "phases_ms": ph, "seconds": tot.seconds}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trees", default=None,
                    help="steps,topk,k;... (default: the module's TREES)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="only write the md and png of an earlier run's json")
    args = ap.parse_args(argv)
    if args.render:
        return render(args.render)
    model = os.environ.get("EAGLE_MODEL", "llama")
    gpu = args.device == "cuda"
    trees = TREES if args.trees is None else [tuple(int(v) for v in t.split(","))
                                                for t in args.trees.split(";")]
    new = args.new_tokens or (128 if gpu else 12)
    sizes = (1, 16) if gpu else (1, 4)
    n_single = 8 if gpu else 2
    backend = "cuda" if gpu else "reference"
    t_start = time.perf_counter()
    target, head, dinfo = setup(MODELS[model][0 if gpu else 1], args.device)
    if gpu:
        head.set_draft_lm_head(DRAFT_LM_HEAD[model])
    vocab = target.cfg.vocab_size
    batches = {1: [prompts_for(1, vocab, seed=1000 + i) for i in range(n_single)],
               sizes[1]: [prompts_for(sizes[1], vocab, seed=1000 * sizes[1])]}
    buckets = pg.Buckets(list(sizes))
    deepest = max(trees, key=lambda t: SpecConfig(*t).reservation(0, overlap=True))

    def worker(spec, greedy=False):
        max_context = spec.reservation(40 + new + 32, overlap=True)
        kw = dict(max_bs=sizes[1], max_context=max_context, buckets=buckets, backend=backend)
        if gpu:
            kw["prefill"] = "runner"          # as bench_eagle and the main job on a GPU
            if not greedy:
                kw["draft_compile"] = DRAFT_COMPILE[model]
                kw["draft_prefill"] = "runner"
        return Engine(target, head, spec, **kw)

    sweep = SweepContext(os.environ.get("OUT", "."), model, dinfo, sizes, new, gpu)
    greedy_w = worker(SpecConfig(*deepest), greedy=True)
    greedy = {bs: row(greedy_w, "greedy", batches[bs], new) for bs in sizes}
    del greedy_w
    results = []
    for steps, topk, k in trees:
        spec = SpecConfig(steps=steps, topk=topk, num_draft_tokens=k)
        if gpu:
            torch._dynamo.reset()            # each tree recompiles its bodies; no stale guards
        t0 = time.perf_counter()
        w = worker(spec)
        entry = {"steps": steps, "topk": topk, "k": k, "rows": {}}
        for bs in sizes:
            reqs, r = row(w, "spec", batches[bs], new)
            g_reqs, g = greedy[bs]
            same = sum(a.output == b.output for a, b in zip(reqs, g_reqs))
            match, _ = match_line(g_reqs, reqs)
            r.update(speedup_vs_greedy=r["tok_s"] / g["tok_s"],
                     round_in_greedy_steps=r["ms_per_round"] / g["ms_per_round"],
                     exact_greedy=f"{same}/{len(reqs)}", greedy_match=match)
            entry["rows"][bs] = r
        entry["setup_and_run_s"] = time.perf_counter() - t0
        results.append(entry)
        print({"tree": (steps, topk, k), **{f"bs{bs}": (round(r["speedup_vs_greedy"], 3),
                                                        round(r["accept_len"], 2),
                                                        round(r["round_in_greedy_steps"], 2))
                                             for bs, r in entry["rows"].items()}}, flush=True)
        del w
        write(sweep, {bs: g for bs, (_, g) in greedy.items()}, results,   # after every tree
              time.perf_counter() - t_start)


def write(sweep: SweepContext, greedy, results, seconds):
    import triton
    name = ("sweep_eagle" + ("" if sweep.model == "llama" else f"_{sweep.model}")
            + ("" if sweep.gpu else "_cpu"))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": (torch.cuda.get_device_name() if sweep.gpu
                       else "cpu (reference backend, tiny)"),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join([sys.executable] + sys.argv), "model": sweep.model,
            "new_tokens": sweep.new, "repeats": REPEATS, "sizes": list(sweep.sizes),
            "distill": sweep.dinfo, "wall_s": seconds}
    os.makedirs(sweep.out_dir, exist_ok=True)
    path = os.path.join(sweep.out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "greedy": greedy, "trees": results}, f, indent=2)
    render(path)


def render(path: str) -> None:
    """<name>.md and <name>.png beside a sweep's <name>.json (also: --render PATH)."""
    with open(path) as f:
        d = json.load(f)
    meta, greedy, results = d["meta"], d["greedy"], d["trees"]
    sizes = [str(bs) for bs in meta["sizes"]]
    base = path[:-len(".json")]
    hdr = " | ".join(f"bs {bs}: speedup / accept / round in steps (draft, verify, extend ms)"
                     for bs in sizes)
    lines = [f"# EAGLE tree sweep ({meta['date']})", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; {meta['model']}; "
             f"{meta['new_tokens']} new tokens; each batch timed {meta['repeats']} times, median "
             "counted", "", f"command: `{meta['command']}`", "",
             "greedy ms per step: " + ", ".join(f"bs {bs} {greedy[bs]['ms_per_round']:.2f}"
                                                for bs in sizes), "",
             f"| steps | topk | k | {hdr} | greedy match |",
             "|---|---|---|" + "---|" * len(sizes) + "---|"]
    for e in results:
        cells = []
        for bs in sizes:
            r = e["rows"][bs]
            ph = r["phases_ms"]
            cells.append(f"{r['speedup_vs_greedy']:.2f}x / {r['accept_len']:.2f} / "
                         f"{r['round_in_greedy_steps']:.2f} ({ph.get('draft', 0):.2f}, "
                         f"{ph.get('verify', 0):.2f}, {ph.get('draft_extend', 0):.2f})")
        same = ", ".join(e["rows"][bs].get("greedy_match", e["rows"][bs]["exact_greedy"])
                         for bs in sizes)
        lines.append(f"| {e['steps']} | {e['topk']} | {e['k']} | " + " | ".join(cells) +
                     f" | {same} |")
    lines += ["", "round in steps: EAGLE ms per round over greedy ms per step, prefill excluded; "
              "greedy match: requests that equal greedy up to their first divergence at a bf16 "
              "top-2 near-tie (bench_eagle's rule; a run before that rule was in the sweep gives "
              "only the exactly equal ones)"]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for bs in sizes:
        xs = [e["rows"][bs]["round_in_greedy_steps"] for e in results]
        ys = [e["rows"][bs]["speedup_vs_greedy"] for e in results]
        ax.scatter(xs, ys, label=f"bs {bs}")
        for e, x, y in zip(results, xs, ys):
            ax.annotate(f"{e['steps']},{e['topk']},{e['k']}", (x, y), fontsize=7)
    ax.set_xlabel("round cost (greedy steps, prefill excluded)")
    ax.set_ylabel("speedup vs greedy")
    ax.set_title(f"EAGLE tree sweep (steps,topk,k), {meta['model']} ({meta['device']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
