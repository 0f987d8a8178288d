"""Per-round phases of EAGLE main-job logs (examples/eagle.py stdout) -> md + JSON + PNG.

    python scripts/eagle_phases.py OUT_DIR ENV_FILE "COMMAND" "NAME=LOG" ["NAME=LOG" ...]
"""
import json
import re
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out_dir, env_file, command = sys.argv[1:4]
runs = [a.split("=", 1) for a in sys.argv[4:]]
out = {"env": open(env_file).read().strip(), "command": command, "runs": []}
for name, path in runs:
    t = open(path).read()
    m = re.search(r"EAGLE  ms per round .*?: draft ([\d.]+)  verify ([\d.]+)  draft-extend ([\d.]+)  host/other ([\d.]+)  = ([\d.]+)", t)
    g = re.search(r"greedy ms per step .*?: decode ([\d.]+)  host/other ([\d.]+)  = ([\d.]+)", t)
    f = re.search(r"tokens/s=([\d.]+) accept_len=([\d.]+) speedup_vs_greedy=([\d.]+) greedy_match=(\d+)/(\d+)", t)
    rounds = re.search(r"(\d+) rounds launched", t)
    out["runs"].append({"name": name, "log": path, "draft_ms": float(m[1]), "verify_ms": float(m[2]),
        "draft_extend_ms": float(m[3]), "host_ms": float(m[4]), "round_ms": float(m[5]),
        "greedy_step_ms": float(g[3]), "tokens_per_s": float(f[1]), "accept_len": float(f[2]),
        "speedup_vs_greedy": float(f[3]), "greedy_match": f"{f[4]}/{f[5]}", "rounds": int(rounds[1])})
json.dump(out, open(f"{out_dir}/eagle_phases.json", "w"), indent=1)
md = ["# EAGLE main job, per-round phases (H200)", "", out["env"], "", f"command: `{out['command']}`", "",
      "| run | draft ms | verify ms | draft-extend ms | host ms | round ms | greedy step ms | round/step | rounds | accept_len | speedup_vs_greedy | greedy_match |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in out["runs"]:
    md.append(f"| {r['name']} | {r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['draft_extend_ms']:.2f} | {r['host_ms']:.2f} | {r['round_ms']:.2f} | {r['greedy_step_ms']:.2f} | {r['round_ms']/r['greedy_step_ms']:.2f} | {r['rounds']} | {r['accept_len']:.2f} | {r['speedup_vs_greedy']:.2f} | {r['greedy_match']} |")
open(f"{out_dir}/eagle_phases.md", "w").write("\n".join(md) + "\n")
fig, ax = plt.subplots(figsize=(9, 3.6))
left = [0.0] * len(out["runs"])
for key, c in (("draft_ms", "C0"), ("verify_ms", "C1"), ("draft_extend_ms", "C2"), ("host_ms", "C3")):
    vals = [r[key] for r in out["runs"]]
    ax.barh(range(len(vals)), vals, left=left, color=c, label=key[:-3].replace("_", "-"))
    left = [a + b for a, b in zip(left, vals)]
for r in out["runs"]:
    ax.axvline(r["greedy_step_ms"] * 1.5, color="k", ls=":", lw=0.8)
ax.set_yticks(range(len(out["runs"]))); ax.set_yticklabels([r["name"][:40] for r in out["runs"]], fontsize=7)
ax.set_xlabel("ms per round (dotted: 1.5 greedy steps, the target)"); ax.legend(fontsize=7); ax.set_title("EAGLE llama main job, H200")
fig.tight_layout(); fig.savefig(f"{out_dir}/eagle_phases.png", dpi=110)
print("\n".join(md))
