"""Collect main-job logs (`examples/eagle.py` output) into main_jobs.{md,json,png}.

    python -m bench.main_jobs <folder of logs> NAME=LOG [NAME=LOG ...]

Each LOG is one run's stdout; NAME labels it (e.g. llama=eagle_llama.log). Parsed: the final
line (tokens/s, accept_len, speedup_vs_greedy, greedy_match), the EAGLE and greedy phase lines
(ms per round / step, prefill), and the round-to-step ratio. The folder's env.txt (GPU, torch,
triton, CUDA) goes into the JSON's meta.
"""
import json
import re
import sys
from pathlib import Path

FINAL = re.compile(r"tokens/s=([\d.]+) accept_len=([\d.]+) speedup_vs_greedy=([\d.]+) "
                   r"greedy_match=(\d+)/(\d+)")
PHASES = re.compile(r"^(EAGLE|greedy)\s+ms per (round|step) \(mean of (\d+) launched[^)]*\): "
                    r"(.*?)\s+= ([\d.]+); prefill ([\d.]+) ms")
PART = re.compile(r"([a-z/-]+) ([\d.]+)")


def parse(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        if m := FINAL.search(line):
            out.update(tokens_s=float(m[1]), accept_len=float(m[2]), speedup_vs_greedy=float(m[3]),
                       greedy_match=f"{m[4]}/{m[5]}", final_line=m[0])
        elif m := PHASES.match(line):
            out[m[1].lower()] = {"launched": int(m[3]), "ms": float(m[5]),
                                 "prefill_ms": float(m[6]),
                                 "phases_ms": {k: float(v) for k, v in PART.findall(m[4])}}
    if "final_line" not in out:
        raise ValueError("no final line (tokens/s=... greedy_match=...) in the log")
    if "eagle" in out and "greedy" in out:
        out["round_over_step"] = round(out["eagle"]["ms"] / out["greedy"]["ms"], 3)
    return out


def main(folder: Path, pairs: list[str]) -> None:
    env = (folder / "env.txt").read_text().strip() if (folder / "env.txt").exists() else ""
    meta = dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", env))
    runs = {}
    for pair in pairs:
        name, log = pair.split("=", 1)
        runs[name] = {"log": log, **parse((folder / log).read_text())}
    (folder / "main_jobs.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    md = [f"# Main jobs (`examples/eagle.py`)\n", f"{env}\n",
          "| run | log | final line | EAGLE round ms (draft / verify / draft-extend / host) | "
          "greedy step ms | round / step | prefill ms (EAGLE / greedy) |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        e, g = r.get("eagle", {}), r.get("greedy", {})
        parts = " / ".join(f"{v:.2f}" for v in e.get("phases_ms", {}).values())
        md.append(f"| {name} | `{r['log']}` | `{r['final_line']}` | {e.get('ms', '')} ({parts}) | "
                  f"{g.get('ms', '')} | {r.get('round_over_step', '')} | "
                  f"{e.get('prefill_ms', '')} / {g.get('prefill_ms', '')} |")
    (folder / "main_jobs.md").write_text("\n".join(md) + "\n")
    try:
        import matplotlib
    except ImportError:                  # md + json only (matplotlib is not a dependency)
        print("matplotlib not installed: no main_jobs.png")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(runs)
    for i, name in enumerate(names):
        bottom = 0.0
        for j, (phase, ms) in enumerate(runs[name].get("eagle", {}).get("phases_ms", {}).items()):
            ax.bar(i - 0.2, ms, 0.4, bottom=bottom, color=f"C{j}", label=phase if i == 0 else None)
            bottom += ms
        ax.bar(i + 0.2, runs[name].get("greedy", {}).get("ms", 0), 0.4, color="grey",
               label="greedy step" if i == 0 else None)
        ax.annotate(f"{runs[name]['speedup_vs_greedy']:.2f}x", (i - 0.2, bottom), ha="center",
                    va="bottom", fontsize=9)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(title=f"eagle.py: EAGLE round vs greedy step ({meta.get('gpu', '?')})", ylabel="ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "main_jobs.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
