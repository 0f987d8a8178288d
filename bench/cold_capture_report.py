"""cold_capture.{json,md,png} from a log of cold-capture runs with Triton's setup thread on and off.

The log (on the GPU, from the repo root after installing padgraph):

    cd examples; for p in 1 0 1 0; do PADGRAPH_TRITON_PREWARM=$p python3 -c "import bench_attention
    as b, json; r=b.cold_capture(); print('PREWARM=$p', json.dumps([...]))"; done

Each line: `PREWARM=<0|1> <JSON list of bench_attention.cold_capture rows>` (two fresh processes
sharing a new, empty Triton cache: the first compiles, the second loads).

    python scripts/cold_capture_report.py results/<date> [cold_capture.log]
"""
import json
import statistics
import sys
from pathlib import Path

TARGET_S = 2.0


def main(folder: Path, log: str = "cold_capture.log") -> None:
    runs = []
    for line in (folder / log).read_text().splitlines():
        if line.startswith("PREWARM="):
            flag, payload = line.split(" ", 1)
            runs.append({"prewarm": flag.endswith("1"), "rows": json.loads(payload)})
    env = (folder / "env.txt").read_text().strip() if (folder / "env.txt").exists() else ""
    summary = {}
    for prewarm in (False, True):
        for label in ("empty Triton cache", "Triton cache of the run before"):
            rows = [r for run in runs if run["prewarm"] == prewarm for r in run["rows"]
                    if r["label"] == label]
            if rows:
                summary[f"prewarm={int(prewarm)} / {label}"] = {
                    k: statistics.median(r[k] for r in rows) for k in ("first_s", "process_s")
                } | {"n": len(rows), "first_s_all": [r["first_s"] for r in rows]}
    (folder / "cold_capture.json").write_text(json.dumps(
        {"env": env, "target_s": TARGET_S, "runs": runs, "summary": summary}, indent=1))
    lines = ["# Cold capture of the default ladder (36 buckets, 16 x (store_kv + decode "
             "attention))",
             "", f"{env}", "", "Command: see `scripts/cold_capture_report.py` (runs alternated on, "
             "off, on, off; each run two fresh processes sharing a new Triton cache). Target "
             f"(#12): <= {TARGET_S} s with an empty cache. Setup thread = "
             "`padgraph.backends.triton.prewarm` (PADGRAPH_TRITON_PREWARM=0 switches it off).", "",
             "| setup thread | Triton cache | capture s (median; each run) | process s (median) |",
             "|---|---|---|---:|"]
    for key, s in summary.items():
        flag, label = key.split(" / ")
        each = ", ".join(f"{x:.2f}" for x in s["first_s_all"])
        lines.append(f"| {'on' if flag.endswith('1') else 'off'} | {label} | {s['first_s']:.2f} "
                     f"({each}) | {s['process_s']:.2f} |")
    (folder / "cold_capture.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    keys = list(summary)
    ax.bar(range(len(keys)), [summary[k]["first_s"] for k in keys])
    ax.axhline(TARGET_S, color="k", linestyle="--", label=f"target {TARGET_S} s (empty cache)")
    ax.set_xticks(range(len(keys)), [
        ("thread on" if k.startswith("prewarm=1") else "thread off") + "\n"
        + ("empty cache" if "empty" in k else "cached") for k in keys], fontsize=8)
    ax.set(ylabel="capture s", title="cold capture of the 36-bucket ladder")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "cold_capture.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
