"""Summarize Nsight Compute SASS exports (`gpu_suite.sh ncu` writes ncu_<case>_sass.csv): the
share of each warp-stall reason over the kernel's samples, and the instructions with the most
samples (their dominant reason), as markdown and JSON.

    python scripts/ncu_stalls.py OUT.md ncu_a_sass.csv [ncu_b_sass.csv ...]   # + OUT.json
"""
import collections
import csv
import json
import sys
from pathlib import Path

TOP = 6


def summarize(path: Path) -> dict:
    rows = list(csv.reader(path.open()))
    header = rows[1]
    col = {h: i for i, h in enumerate(header)}
    data = [r for r in rows[2:] if len(r) == len(header)]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = collections.Counter()
    for r in data:
        for h in reasons:
            total[h[6:]] += int(r[col[h]] or 0)
    n = sum(total.values())
    samples = col["Warp Stall Sampling (All Samples)"]
    hot = sorted(data, key=lambda r: -int(r[samples] or 0))[:TOP]
    return dict(case=path.name.removeprefix("ncu_").removesuffix("_sass.csv"),
                kernel=rows[0][1], samples=n,
                reasons={k: round(v / n, 3) for k, v in total.most_common(8)},
                hot=[dict(share=round(int(r[samples]) / n, 3), sass=r[col["Source"]].strip(),
                          reason=max(reasons, key=lambda h: int(r[col[h]] or 0))[6:])
                     for r in hot])


def main() -> None:
    out = Path(sys.argv[1])
    summaries = [summarize(Path(p)) for p in sys.argv[2:]]
    lines = ["# Warp stall samples (Nsight Compute, SASS source page)", ""]
    for s in summaries:
        lines += [f"## {s['case']} (`{s['kernel']}`, {s['samples']} samples)", "",
                  ", ".join(f"{k} {v:.0%}" for k, v in s["reasons"].items()), "",
                  "| share | instruction | main reason |", "|---:|---|---|"]
        lines += [f"| {h['share']:.1%} | `{h['sass']}` | {h['reason']} |" for h in s["hot"]]
        lines.append("")
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(summaries, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
