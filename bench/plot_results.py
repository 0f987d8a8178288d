"""PNG figures of a results folder's JSON files (attention, MLA, host time, EAGLE), for results/<date>/.

    python scripts/plot_results.py results/2026-12-01      (needs matplotlib; not a dependency)
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def attention(d: Path) -> None:
    a = json.loads((d / "attention.json").read_text())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for layout, ax in zip(("random", "contiguous"), axes):
        for ctx in sorted({r["ctx"] for r in a["rows"]}):
            rows = [r for r in a["rows"] if r["kind"] == "decode" and r["layout"] == layout and r["ctx"] == ctx]
            ax.plot([r["bs"] for r in rows], [r["speedup_vs_sdpa"] for r in rows], "o-", label=f"ctx {ctx}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title=f"decode vs SDPA ({layout} slots)", xlabel="bs", ylabel="speedup (>1: ours faster)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(d / "attention.png", dpi=110)


def mla(d: Path) -> None:
    m = json.loads((d / "mla.json").read_text())
    keyed = [r for r in m["rows"] if "rows_us" in r]  # bench_mla --keys-major
    fig, axes = plt.subplots(1, 2 if keyed else 1, figsize=(12 if keyed else 6, 4), squeeze=False)
    ax = axes[0][0]
    for ctx in sorted({r["ctx"] for r in m["rows"] if r["kind"] == "decode"}):
        rows = [r for r in m["rows"] if r["kind"] == "decode" and r["ctx"] == ctx]
        ax.plot([r["bs"] for r in rows], [r["fraction"] for r in rows], "o-", label=f"ctx {ctx}")
    ax.axhline(0.6, color="grey", lw=0.8, ls="--", label="target 0.6")
    ax.set_xscale("log", base=2)
    ax.set(title="MLA decode: fraction of copy bandwidth", xlabel="bs", ylabel="fraction")
    ax.legend()
    if keyed:
        ax = axes[0][1]
        for kind, marker in (("decode", "o"), ("verify", "s"), ("extend", "^")):
            for ctx in sorted({r["ctx"] for r in keyed if r["kind"] == kind}):
                rows = [r for r in keyed if r["kind"] == kind and r["ctx"] == ctx]
                ax.plot([r["bs"] for r in rows], [r["keys_us"] / r["rows_us"] for r in rows],
                        marker=marker, label=f"{kind} ctx {ctx}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set(title="keys-major / row-major kernel time (<1: keys-major faster)", xlabel="bs",
               ylabel="time ratio")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(d / "mla.png", dpi=110)


def host(d: Path, name: str) -> None:
    h = json.loads((d / f"{name}.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    stages = {k: v for k, v in h["stages"].items() if k != "whole call"}
    ax.barh(list(stages), list(stages.values()))
    ax.set(title=f"host µs per step at bs=27 (whole call {h['stages']['whole call']:.1f} µs)", xlabel="µs")
    fig.tight_layout()
    fig.savefig(d / f"{name}.png", dpi=110)


def eagle(d: Path, name: str) -> None:
    """bench_eagle: tokens/s of greedy and EAGLE (graphs) per batch size, speedups annotated;
    each extra EAGLE worker of a row (its "variants", same process) as one more bar."""
    e = json.loads((d / f"{name}.json").read_text())
    rows = list(e["rows"])
    bs = [str(r["bs"]) for r in rows]
    if e.get("continuous"):   # the continuous-admission row: requests through rows
        c = e["continuous"]
        rows.append(c)
        bs.append(f"{c['requests']} req\n{c['rows']} rows")
    names = sorted({v for r in rows for v in r.get("variants", {})})
    main = f"EAGLE (graphs, draft prefill {e['meta']['draft_prefill']})" if names else "EAGLE (graphs)"
    series = [("greedy (graphs)", [r["greedy_graphs_tok_s"] for r in rows], None),
              (main, [r["eagle_graphs_tok_s"] for r in rows], [r["speedup_vs_greedy"] for r in rows])]
    for n in names:
        vs = [r.get("variants", {}).get(n) for r in rows]
        series.append((f"EAGLE (graphs, {n})", [v["eagle_graphs_tok_s"] if v else 0 for v in vs],
                       [v["speedup_vs_greedy"] if v else None for v in vs]))
    x, w = range(len(bs)), 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(6 + len(names), 4))
    for j, (label, vals, ups) in enumerate(series):
        xs = [i - 0.4 + w * (j + 0.5) for i in x]
        ax.bar(xs, vals, w, label=label)
        for xi, v, up in zip(xs, vals, ups or []):
            if up is not None:
                ax.annotate(f"{up:.2f}x", (xi, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), bs)
    ax.set(title=f"bench_eagle ({e['meta']['gpu']}, prefill {e['meta'].get('prefill', 'eager')})",
           xlabel="bs", ylabel="tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(d / f"{name}.png", dpi=110)


def topk(d: Path) -> None:
    t = json.loads((d / "topk.json").read_text())
    steps = t["step"]
    names = [k for k in steps[0] if k not in ("n", "floor_bf16_us", "floor_fp8_us", "fused_max_err",
                                                "fused_unpromoted_max_err")]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ax.bar([i + j * width for i in range(len(steps))], [s[name] for s in steps], width, label=name)
    ax.plot([i + 0.4 - width / 2 for i in range(len(steps))], [s["floor_fp8_us"] for s in steps], "k_",
            ms=40, label="fp8 weight floor")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(steps))], [f"n={s['n']}" for s in steps])
    ax.set(title="one draft step: lm_head + top-k (µs, lower is better)", ylabel="µs")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(d / "topk.png", dpi=110)


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    for name, fn in (("attention", attention), ("mla", mla), ("topk", topk)):
        if (folder / f"{name}.json").exists():
            fn(folder)
    for n in ("eagle", "eagle_deepseek", "eagle_eager_prefill", "eagle_deepseek_eager_prefill"):
        if (folder / f"{n}.json").exists():
            eagle(folder, n)
    for n in ("bench_host", "bench_host_final"):
        if (folder / f"{n}.json").exists():
            host(folder, n)
