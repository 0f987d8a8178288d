"""Benchmark the sampler (`padgraph.llm.sampling.sample`, its Triton kernels) against greedy.

    python -m bench.bench_sampling            # GPU: Llama-3 vocabulary, bs 1 / 16 / 64
    python -m bench.bench_sampling --smoke    # CPU, tiny sizes, interpreter: checks the script

Each case draws one token a row from bf16 logits [bs, 128256], timed as CUDA-graph replays
(`triton.testing.do_bench` medians): torch's argmax (what greedy decode runs), `sample` with
temperature 0 (greedy through the sampler), temperature only, then the filters on sharp logits
(a trained model's shape: the nucleus is a few tokens) and on flat ones (a random model's:
top-p 0.9 keeps about 60 % of the vocabulary, top-k 5000 then top-p, min-p beside top-p).
Every case is first checked against the torch reference, token for token. The kernels run a
fixed number of passes; the second table gives the most any row of the case used (the
rest of the passes find nothing to do). Last, sharp top-p over several row-group counts of a
select pass (`select_policy(bs).groups` the default: how many programs share a chunk's rows,
each working through its rows in turn). Writes sampling.md / sampling.json to $OUT.

    python -m bench.bench_sampling --sweep    # the select passes' launch grid instead

--sweep times greedy, temperature 0.7 and sharp / flat top-p over the select passes' launch
choices (`SelectPolicy`: row groups G, warps a program, the draw in the gather on or off,
programmatic dependent launch on or off; the chunk of logits a program reads, halved and
doubled; the select kernel's register cap raised to 192 and 255; the keys a row may gather
halved, with and without half the chunk; the small-gather registers off and doubled; the
split's packing off, halved and doubled; a program a chunk, or 32, 16 and 8 programs
sharing a row's chunks (X); the first pass over twice the row groups, or a row a group,
the later passes over the policy's;
`--fields small,pack` moves only those),
each checked against the torch reference, and writes sampling_sweep.md / .json: the data
`select_policy` is chosen from.

    python -m bench.bench_sampling --passes   # each launch's own GPU time instead

--passes profiles the same cases at `select_policy`'s launch with PDL off (so that no launch's
time holds its wait for the one before): torch.profiler over graph replays, each launch's median
kernel time by its place in the call (the chunk max, then select passes 1 to 12), so a call's
time splits into what each pass costs; writes sampling_passes.md / .json.

    python -m bench.bench_sampling --ab REV   # the sampler at git revision REV beside today's

--ab imports `backends/triton/sampling.py` as it was at REV (or from a .py file) beside today's
and times every case with both in one process, in turn, each side's tokens checked against the
torch reference first; writes sampling_ab.md / .json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import NamedTuple

if "--smoke" in sys.argv:  # before triton is imported: kernels run interpreted on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from bench.common import env_info, module_at, out_dir, pyplot  # noqa: E402
from bench.gpu_timing import bench_us, graph_of, profile_replays  # noqa: E402
from padgraph.backends.triton import sampling as kernels  # noqa: E402
from padgraph.llm.sampling import PURPOSE_DECODE, sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {   # name: (logit scale, temperature, top_k, top_p, min_p)
    "sample greedy": (4.0, 0.0, 0, 1.0, 0.0),
    "temperature 0.7": (4.0, 0.7, 0, 1.0, 0.0),
    "top-p 0.9 (sharp)": (8.0, 0.7, 0, 0.9, 0.0),
    "top-k 50 + top-p 0.95 (sharp)": (8.0, 1.0, 50, 0.95, 0.0),
    "top-p 0.9 (flat)": (1.0, 1.0, 0, 0.9, 0.0),
    "top-p 0.99 (flat)": (1.0, 1.0, 0, 0.99, 0.0),
    "top-k 5000 + top-p 0.9 (flat)": (1.0, 1.0, 5000, 0.9, 0.0),
    "min-p 0.01 + top-p 0.9 (flat)": (1.0, 1.0, 0, 0.9, 0.01),
}


def lanes(bs, temperature, top_k, top_p, min_p, device):
    return (torch.full((bs,), temperature, device=device),
            torch.full((bs,), top_k, dtype=torch.int32, device=device),
            torch.full((bs,), top_p, device=device), torch.full((bs,), min_p, device=device),
            torch.arange(bs, device=device) + 7, torch.full((bs,), 100, device=device))


def run_case(logits, scale, temperature, top_k, top_p, min_p) -> tuple[float, int]:
    """(µs a call, the most select passes a row used)."""
    x = (logits * scale).to(torch.bfloat16)
    args = lanes(x.shape[0], temperature, top_k, top_p, min_p, x.device)
    stages = kernels.sample_stages(x, *args, PURPOSE_DECODE)
    want = sample(x, *args, PURPOSE_DECODE, impl="torch")
    assert torch.equal(sample(x, *args, PURPOSE_DECODE), want), \
        "the kernels and the torch reference disagree"
    assert torch.equal(stages.tokens, want), "the kernels and the torch reference disagree"
    passes = int(stages.passes.max())
    return bench_us(graph_of(lambda: sample(x, *args, PURPOSE_DECODE))), passes


GROUPS_CASE = "top-p 0.9 (sharp)"


def run_groups(logits, bs: int) -> tuple[int, dict]:
    """`GROUPS_CASE` with the select passes over several row-group counts G (grid (G, X), X the
    policy's chunk groups whatever G is; each program works through rows g, g + G, ... in
    turn): (the default G, {G: µs a call}), each G's tokens checked against the torch
    reference first."""
    scale, *params = CASES[GROUPS_CASE]
    x = (logits * scale).to(torch.bfloat16)
    args = lanes(bs, *params, x.device)
    want = sample(x, *args, PURPOSE_DECODE, impl="torch")
    default = kernels.select_policy(bs).groups
    out = {}
    for g in sorted({default, bs, max(1, bs // 4), min(bs, 2 * default)}):
        got = kernels.sample_stages(x, *args, PURPOSE_DECODE, groups=g).tokens
        assert torch.equal(got, want), f"G={g}: the kernels and the torch reference disagree"
        out[g] = bench_us(graph_of(lambda g=g: kernels.sample_stages(x, *args, PURPOSE_DECODE, groups=g).tokens))
    return default, out


def table(title, names, rows, key, fmt):
    return [title, "", "| bs | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|",
            *("| %d | " % r["bs"] + " | ".join(fmt(r[key][n]) for n in names) + " |"
              for r in rows), ""]


SWEEP_CASES = ("sample greedy", "temperature 0.7", "top-p 0.9 (sharp)", "top-p 0.9 (flat)")


class Launch(NamedTuple):
    """One launch of the sampler's kernels: `SelectPolicy`'s fields and `sample_stages`' knobs
    (chunk: the logits a program reads; regs: the select kernel's register cap; cap: the keys a
    row may gather; small: a gather of at most this many keys ends in registers that wide;
    pack: a split packs a chunk's keys first where at most this many count; chunk_groups: the
    programs that share a row's chunks, 0 for one a chunk)."""
    groups: int
    warps: int
    gather_draw: bool
    pdl: bool
    chunk: int = kernels.CHUNK
    regs: int = kernels.SELECT_REGS
    cap: int = kernels.CAP
    small: int = kernels.SMALL
    pack: int = kernels.PACK
    chunk_groups: int = 0
    first_groups: int = 0

    def key(self) -> str:
        out = (f"G={self.groups} X={self.chunk_groups or 'C'} warps={self.warps} "
               f"draw={int(self.gather_draw)} pdl={int(self.pdl)}")
        for f in ("chunk", "regs", "cap", "small", "pack", "first_groups"):
            if getattr(self, f) != self._field_defaults[f]:
                out += f" {f}={getattr(self, f)}"
        return out

    def run(self, x, args):
        """The tokens of this launch (the fields are `sample_stages`' keywords)."""
        return kernels.sample_stages(x, *args, PURPOSE_DECODE, **self._asdict()).tokens


SWEEP_FIELDS = ("groups", "draw", "pdl", "chunk", "regs", "cap", "small", "pack",
                "chunk_groups", "first_groups")


def sweep_configs(bs: int, fields=SWEEP_FIELDS) -> list[Launch]:
    """The launches to time at bs rows: the policy's, then each of `fields` moved. At 4 warps
    the default cap makes ptxas spill; half the cap with half the chunk does not (Triton 3.9,
    sm_90: 124 registers, no stack). small = cap and pack = 0 turn those paths off."""
    pol = kernels.select_policy(bs)
    base = Launch(pol.groups, pol.warps, pol.gather_draw, pol.pdl,
                  chunk_groups=pol.chunk_groups, first_groups=pol.first_groups)
    out = [base]
    if "groups" in fields:
        groups = sorted({pol.groups, bs, max(1, bs // 2), max(1, bs // 4)})
        out += [base._replace(groups=g, warps=w) for g in groups for w in (4, 8)
                if (g, w) != (base.groups, base.warps)]
    if "draw" in fields:
        out.append(base._replace(gather_draw=not base.gather_draw))
    if "pdl" in fields:
        out.append(base._replace(pdl=not base.pdl))
    if "chunk" in fields:
        out += [base._replace(chunk=c) for c in (base.chunk // 2, 2 * base.chunk)]
    if "regs" in fields:
        out += [base._replace(regs=r) for r in (192, 255)]
    if "cap" in fields:
        out += [base._replace(cap=base.cap // 2), base._replace(chunk=base.chunk // 2, cap=base.cap // 2)]
    if "small" in fields:
        out += [base._replace(small=base.cap), base._replace(small=2 * base.small)]
    if "pack" in fields:
        out += [base._replace(pack=0), base._replace(pack=base.pack // 2),
                base._replace(pack=2 * base.pack)]
    if "chunk_groups" in fields:        # X programs share a row's C chunks (0: X = C)
        out += [base._replace(chunk_groups=x) for x in (0, 32, 16, 8) if x != pol.chunk_groups]
    if "first_groups" in fields:        # the first pass over more row groups than the rest
        first = base.first_groups or base.groups
        out += [base._replace(first_groups=0 if g == base.groups else g)
                for g in sorted({base.groups, 2 * base.groups, bs}) if g != first and g <= bs]
    return out


def run_sweep(V: int, sizes, device, fields=SWEEP_FIELDS) -> None:
    rows = []
    for bs in sizes:
        logits = torch.randn(bs, V, generator=torch.Generator().manual_seed(bs)).to(device)
        row = {"bs": bs, "policy": kernels.select_policy(bs)._asdict(), "us": {}}
        for name in SWEEP_CASES:
            scale, *params = CASES[name]
            x = (logits * scale).to(torch.bfloat16)
            args = lanes(bs, *params, x.device)
            want = sample(x, *args, PURPOSE_DECODE, impl="torch")
            for launch in sweep_configs(bs, fields):
                key = launch.key()
                assert torch.equal(launch.run(x, args), want), f"{name} {key}: mismatch"
                got = {}
                replay = graph_of(lambda launch=launch: got.update(tokens=launch.run(x, args)))
                replay()
                assert torch.equal(got["tokens"], want), f"{name} {key}: a replay's tokens differ"
                row["us"][f"{name} | {key}"] = bench_us(replay)
        rows.append(row)
        print(row, flush=True)
    md = ["# Sampler launch sweep: µs a call, [bs, V] bf16 logits, V = %d" % V, "",
          f"`{json.dumps(env_info())}`", "", "The first launch of each size is `select_policy`'s.", ""]
    for r in rows:
        md += [f"bs {r['bs']}:", "", "| launch | " + " | ".join(SWEEP_CASES) + " |",
               "|---" * (len(SWEEP_CASES) + 1) + "|"]
        for launch in sweep_configs(r["bs"], fields):
            key = launch.key()
            md.append(f"| {key} | " + " | ".join(f"{r['us'][f'{c} | {key}']:.1f}"
                                                 for c in SWEEP_CASES) + " |")
        md.append("")
    out = out_dir()
    (out / "sampling_sweep.md").write_text("\n".join(md))
    (out / "sampling_sweep.json").write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))
    print("\n".join(md))


def pass_times(replay, reps: int = 20) -> tuple[list[str], list[float]]:
    """The kernels of one replay in launch order and the median µs of each (torch.profiler over
    `reps` replays, kernels inside CUDA graphs included; a replay starts at its chunk-max
    kernel)."""
    events = profile_replays(replay, reps)
    ks = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    calls: list[list] = []
    for e in ks:
        if "chunk_max" in e.name or not calls:
            calls.append([])
        calls[-1].append(e)
    n = statistics.mode(len(c) for c in calls)
    calls = [c for c in calls if len(c) == n]
    return [e.name for e in calls[0]], [statistics.median(c[i].device_time for c in calls) for i in range(n)]


def run_passes(V: int, sizes, device) -> None:
    """Each launch's time of the `SWEEP_CASES` at `select_policy`'s launch, PDL off."""
    rows = []
    for bs in sizes:
        logits = torch.randn(bs, V, generator=torch.Generator().manual_seed(bs)).to(device)
        row = {"bs": bs, "policy": kernels.select_policy(bs)._asdict(), "us": {}, "passes": {}}
        for name in SWEEP_CASES:
            scale, *params = CASES[name]
            x = (logits * scale).to(torch.bfloat16)
            args = lanes(bs, *params, x.device)
            want = sample(x, *args, PURPOSE_DECODE, impl="torch")
            stages = kernels.sample_stages(x, *args, PURPOSE_DECODE, pdl=False)
            assert torch.equal(stages.tokens, want), f"{name}: mismatch"
            replay = graph_of(lambda: kernels.sample_stages(x, *args, PURPOSE_DECODE, pdl=False).tokens)
            names, row["us"][name] = pass_times(replay)
            assert len(names) == 1 + kernels.PASSES, f"{name}: a call launched {names}"
            row["passes"][name] = int(stages.passes.max())
        rows.append(row)
        print(row, flush=True)
    heads = ["max", *(f"pass {i}" for i in range(1, kernels.PASSES + 1)), "sum"]
    md = ["# Sampler launches one by one: median kernel µs, [bs, V] bf16 logits, V = %d" % V, "",
          f"`{json.dumps(env_info())}`", "",
          "select_policy's launch, PDL off; a row works in at most `passes` of the 12 select passes.", ""]
    for r in rows:
        md += [f"bs {r['bs']}:", "", "| case | passes | " + " | ".join(heads) + " |",
               "|---" * (len(heads) + 2) + "|"]
        for name in SWEEP_CASES:
            t = r["us"][name]
            md.append(f"| {name} | {r['passes'][name]} | " + " | ".join(f"{v:.1f}" for v in t)
                      + f" | {sum(t):.1f} |")
        md.append("")
    out = out_dir()
    (out / "sampling_passes.md").write_text("\n".join(md))
    (out / "sampling_passes.json").write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))
    print("\n".join(md))


def run_ab(V: int, sizes, source: str, rounds: int = 3) -> None:
    """The sampler module at git revision (or .py file) `source` beside today's, in one process:
    every case of `CASES` at each size, each side's tokens checked against the torch reference,
    then both timed as CUDA-graph replays in turn, `rounds` times; the median of the rounds."""
    sides = {source: module_at(source, "backends/triton/sampling.py", "padgraph.backends.triton"),
             "today": kernels}
    rows = []
    for bs in sizes:
        logits = torch.randn(bs, V, generator=torch.Generator().manual_seed(bs)).to(DEVICE)
        row = {"bs": bs, "us": {}}
        for name, (scale, *params) in CASES.items():
            x = (logits * scale).to(torch.bfloat16)
            args = lanes(bs, *params, x.device)
            want = sample(x, *args, PURPOSE_DECODE, impl="torch")
            replays = {}
            for side, module in sides.items():
                got = module.sample_stages(x, *args, PURPOSE_DECODE).tokens
                assert torch.equal(got, want), f"{side}, {name}, bs {bs}: not the reference's tokens"
                replays[side] = graph_of(lambda m=module: m.sample_stages(x, *args, PURPOSE_DECODE).tokens)
            times = {side: [] for side in sides}
            for _ in range(rounds):
                for side, replay in replays.items():
                    times[side].append(bench_us(replay))
            row["us"][name] = {side: statistics.median(t) for side, t in times.items()}
        rows.append(row)
        print(row, flush=True)
    md = [f"# Sampler A/B: {source} against today's, µs a call, [bs, V] bf16 logits, V = {V}", "",
          f"`{json.dumps(env_info())}`", "",
          f"Same process, CUDA-graph replays, median of {rounds} `do_bench` medians taken in turn.", "",
          f"| bs | case | {source} | today | change |", "|---|---|---|---|---|"]
    for r in rows:
        for name, t in r["us"].items():
            md.append(f"| {r['bs']} | {name} | {t[source]:.1f} | {t['today']:.1f} | "
                      f"{100 * (t['today'] / t[source] - 1):+.1f} % |")
    out = out_dir()
    (out / "sampling_ab.md").write_text("\n".join(md) + "\n")
    (out / "sampling_ab.json").write_text(json.dumps({"env": env_info(), "source": source,
                                                      "rows": rows}, indent=1))
    print("\n".join(md))


def plot(data: dict, path) -> bool:
    """µs a call by case, a group of bars per batch size, torch's argmax as a dashed line over
    each group; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows, names = data["rows"], list(CASES)
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r["us"][name] for r in rows], width,
               label=name, color=f"C{i}")
    for j, r in enumerate(rows):
        ax.hlines(r["us"]["argmax"], j - width / 2, j + 0.8 - width / 2, colors="black",
                  linestyles="--", label="torch argmax" if j == 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                  [f"bs {r['bs']}" for r in rows])
    ax.set(ylabel="µs a call (CUDA-graph replay)", yscale="log")
    ax.legend(fontsize=7, ncol=3)
    env = data["env"]
    ax.set_title(f"Sampler on [bs, 128256] bf16 logits, {env.get('gpu', '')}, commit "
                 f"{env.get('commit', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (script check)")
    ap.add_argument("--sweep", action="store_true", help="the select passes' launch grid")
    ap.add_argument("--fields", default=",".join(SWEEP_FIELDS),
                    help="--sweep: the launch fields to move, comma-separated (default: all)")
    ap.add_argument("--passes", action="store_true", help="each launch's own GPU time (a GPU)")
    ap.add_argument("--ab", metavar="REV", default=None,
                    help="the sampler at git revision REV (or a .py file) beside today's, same "
                         "process")
    ap.add_argument("--sizes", default="1,16,64",
                    help="batch sizes (rows of logits), comma-separated; --smoke: 2")
    args = ap.parse_args()
    device = DEVICE
    V, sizes = (5000, (2,)) if args.smoke else (128256, tuple(int(b) for b in args.sizes.split(",")))
    if args.ab:
        return run_ab(V, sizes, args.ab)
    if args.sweep:
        fields = tuple(f for f in args.fields.split(",") if f)
        unknown = set(fields) - set(SWEEP_FIELDS)
        if unknown:
            raise SystemExit(f"--fields: unknown {sorted(unknown)}; known {SWEEP_FIELDS}")
        return run_sweep(V, (20,) if args.smoke else sizes, device, fields)
    if args.passes:
        if device != "cuda":
            raise SystemExit("--passes profiles GPU kernels: it needs a GPU")
        return run_passes(V, sizes, device)
    rows = []
    for bs in sizes:
        logits = torch.randn(bs, V, generator=torch.Generator().manual_seed(bs)).to(device)
        x = (logits * 4).to(torch.bfloat16)
        row = {"bs": bs, "us": {"argmax": bench_us(graph_of(lambda: x.argmax(-1)))},
               "passes": {}}
        for name, case in CASES.items():
            row["us"][name], row["passes"][name] = run_case(logits, *case)
        row["default_groups"], row["by_groups"] = run_groups(logits, bs)
        rows.append(row)
        print(row, flush=True)
    md = ["# Sampling: µs a call, [bs, V] bf16 logits, V = %d" % V, "",
          f"`{json.dumps(env_info())}`", ""]
    md += table("µs a call (CUDA-graph replay, median):", ["argmax", *CASES], rows, "us",
                lambda v: f"{v:.1f}")
    md += table(f"Select passes with work, of {kernels.PASSES} (the most any row used):",
                list(CASES), rows, "passes", str)
    md += [f"{GROUPS_CASE} by row groups G of a select pass (µs a call; default G marked *):", ""]
    md += [f"- bs {r['bs']}: " + ", ".join(f"G={g}{'*' if g == r['default_groups'] else ''} {us:.1f}"
                                           for g, us in r["by_groups"].items()) for r in rows] + [""]
    out = out_dir()
    (out / "sampling.md").write_text("\n".join(md))
    data = {"env": env_info(), "rows": rows}
    (out / "sampling.json").write_text(json.dumps(data, indent=1))
    plot(data, out / "sampling.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()
