"""Benchmark: plain greedy (graphs), EAGLE (graphs), EAGLE (eager) on the 1B-shaped target.

One GPU call, distillation included:  python -m bench.bench_eagle
Writes $OUT/eagle.md and $OUT/eagle.json (date, GPU, torch/triton versions, command).
EAGLE_MODEL=deepseek: the DeepSeek-like target (MLA + MoE, "ds-lite") with the MTP-style head,
written to $OUT/eagle_deepseek.{md,json}.
Targets: EAGLE graphs >= 2.5x / 2.0x / 1.5x greedy graphs at bs = 1 / 4 / 16; EAGLE graphs >= 3x
EAGLE eager at bs=1.
EAGLE_STEPS / EAGLE_TOPK / EAGLE_K override the draft tree, EAGLE_DISTILL_STEPS /
EAGLE_DISTILL_SEQS / EAGLE_DISTILL_DEPTH the head's distillation (training steps, greedy
sequences of the target, unrolled draft steps);
the md and JSON record what ran.
Every loop runs with overlap scheduling on (padgraph.llm.Engine(overlap=True): round / step N+1
is queued before N is read back), greedy included, so the speedup compares equally scheduled
loops; the output says so.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch

import padgraph as pg
from bench.common import command_line
from padgraph.llm.oracle import TIE_TOL, first_divergences
from padgraph.llm.presets import DRAFT_COMPILE, DRAFT_LM_HEAD, GPU_TREE, MODELS, setup
from padgraph.llm import Engine, RunStats, SpecConfig

BATCHES = (1, 4, 16)
NEW_TOKENS = 128
ROW_REQUESTS = 16   # distinct requests per row: bs = 1 serves 16 one at a time, bs = 4 four batches
REPEATS = 3         # each batch is timed this many times; the run of median time counts
# Continuous admission: QUEUE requests through max(BATCHES) rows, outputs uniform in
# QUEUE_NEW (within the workers' max_context); a request that finishes frees its row for the next.
QUEUE, QUEUE_NEW = 64, (64, 129)
MODEL = os.environ.get("EAGLE_MODEL", "llama")
DESCRIPTION = {"llama": "Llama-3.2-1B shape, random init (scaled residual), bf16",
               "deepseek": "DeepSeek-like (MLA + dense masked MoE), V2-Lite widths, 6 layers, "
                           "16 experts top-6, MTP-style head, random init, bf16"}
OVERLAP = True     # overlap scheduling for every loop (padgraph.llm.Engine)
# the graph workers' prefill (padgraph.llm.Engine(prefill=)): "runner" (default: the prefill
# program, CUDA graphs per bucket of packed prompt tokens) or "eager" (plain torch calls)
PREFILL = os.environ.get("EAGLE_PREFILL", "runner")
# the EAGLE worker's draft-head prefill (Engine(draft_prefill=)): "runner" (default: the
# draft-prefill program, graphs on the prefill ladder) or "eager" (plain torch calls). A comma
# list ("runner,eager") measures the others too, in the same process on the same batches, as
# extra EAGLE workers (each row's "variants"; the tables stay the first one's). On a GPU the two
# gave the same speedup at bs 1 / 4 / 16 within ~1%, in one process.
DRAFT_PREFILLS = os.environ.get("EAGLE_DRAFT_PREFILL", "runner").split(",")
DRAFT_PREFILL = DRAFT_PREFILLS[0]
RESULT = ("eagle" if MODEL == "llama" else f"eagle_{MODEL}") + \
    ("_eager_prefill" if PREFILL == "eager" else "") + \
    ("_draft_prefill_eager" if DRAFT_PREFILL == "eager" else "")
OVERLAP_NOTE = ("overlap scheduling on: each loop queues round (greedy: step) N+1 before it "
                "reads N back; finished requests leave one round late")


def distill_overrides(env) -> dict:
    """distill() keyword arguments from EAGLE_DISTILL_STEPS / EAGLE_DISTILL_SEQS /
    EAGLE_DISTILL_DEPTH (ints >= 1)."""
    out = {}
    for var, key in (("EAGLE_DISTILL_STEPS", "steps"), ("EAGLE_DISTILL_SEQS", "n_seq"),
                     ("EAGLE_DISTILL_DEPTH", "depth")):
        if env.get(var):
            v = int(env[var])
            if v < 1:
                raise ValueError(f"{var} must be >= 1; got {v}")
            out[key] = v
    return out


def held_out_note(h) -> str:
    """'held-out chain accept 3.32, top-1 per depth 0.874 / 0.874 / 0.875' (distill's check)."""
    if not h:
        return "no held-out check"
    return (f"held-out chain accept {h['accept']:.2f}, top-1 per depth "
            + " / ".join(f"{t:.3f}" for t in h["top1"]))


def prompts_for(bs: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 40, (bs,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def row_batches(bs: int, vocab: int) -> list[list[list[int]]]:
    """ROW_REQUESTS distinct requests as ROW_REQUESTS // bs batches of bs (at least one batch): the
    bs = 1 row serves 16 requests one after another instead of timing one request's path (its
    accept length and its near-tie divergence decide a single-request ratio: 4.06 and 2.42 in
    two runs of the same head that differed only in the prefill's kernels)."""
    return [prompts_for(bs, vocab, seed=1000 * bs + i) for i in range(max(1, ROW_REQUESTS // bs))]


def measure(worker: Engine, mode: str, batches, news, repeats: int = REPEATS):
    """A warm-up run (8 tokens each, at most one batch of prompts), then each batch timed `repeats`
    times; the run of median time counts. Returns (requests of all batches, in order; the summed
    RunStats; per-batch RunStats). news: per batch, one count for all its requests or a list.
    The repeats must give the same tokens (graphs replay the same kernels on the same inputs);
    a batch whose repeats differ is reported on stderr and its median run still counts."""
    gen = worker.generate_greedy if mode == "greedy" else worker.generate_spec
    warm = batches[0][:worker.max_bs]
    reqs_all, per_batch = [], []
    with torch.no_grad():
        gen(warm, [8] * len(warm))                       # capture / JIT / warm caches
        for prompts, n in zip(batches, news):
            n = n if isinstance(n, list) else [n] * len(prompts)
            runs = sorted((gen(prompts, n) for _ in range(repeats)), key=lambda r: r[1].seconds)
            outs = {tuple(tuple(r.output) for r in reqs) for reqs, _ in runs}
            if len(outs) != 1:
                print(f"WARNING {mode}: {repeats} runs of one batch gave {len(outs)} different "
                      f"token sets", file=sys.stderr, flush=True)
            reqs, st = runs[len(runs) // 2]
            reqs_all += reqs
            per_batch.append(st)
    return reqs_all, total(per_batch), per_batch


def total(stats: list[RunStats]) -> RunStats:
    """RunStats summed over runs (tokens / seconds / rounds / accept counts; overlap if all)."""
    out = RunStats(overlap=all(s.overlap for s in stats))
    for s in stats:
        for f in ("tokens", "seconds", "rounds", "accepted", "emitted", "request_rounds",
                  "discarded", "prefills"):
            setattr(out, f, getattr(out, f) + getattr(s, f))
        for name, t in s.phases.items():
            out.phases[name] = out.phases.get(name, 0.0) + t
    return out


def match_line(greedy_reqs, spec_reqs) -> tuple[str, dict]:
    exact, ties, other = first_divergences([g.output for g in greedy_reqs],
                                           [s.output for s in spec_reqs],
                                           [g.gaps for g in greedy_reqs], TIE_TOL)
    n = len(greedy_reqs)
    return (f"{exact + len(ties)}/{n} ({exact} exact, {len(ties)} tie, {len(other)} other)",
            {"near_tie": ties, "other": other})


def main():
    out_dir = os.environ.get("OUT", ".")
    t_start = time.perf_counter()
    print(OVERLAP_NOTE if OVERLAP else "overlap scheduling off", flush=True)
    steps, topk, k = GPU_TREE[MODEL]                     # the main job's tree (eagle.py)
    spec = SpecConfig(steps=int(os.environ.get("EAGLE_STEPS", steps)),
                      topk=int(os.environ.get("EAGLE_TOPK", topk)),
                      num_draft_tokens=int(os.environ.get("EAGLE_K", k)))
    target, head, dinfo = setup(MODELS[MODEL][0], "cuda", **distill_overrides(os.environ))
    head.set_draft_lm_head(DRAFT_LM_HEAD[MODEL])        # as the main job (eagle.py) runs it
    buckets = pg.Buckets.default(max(BATCHES))
    # prompts < 40, + output + the spec's reservation with the overlap round (200 as before at
    # the default spec, more for deeper trees)
    max_context = max(40 + NEW_TOKENS + 32, spec.reservation(40 + NEW_TOKENS, overlap=True))
    kw = dict(max_bs=max(BATCHES), max_context=max_context, buckets=buckets, overlap=OVERLAP)
    workers = {
        "greedy_graphs": Engine(target, head, spec, backend="cuda", prefill=PREFILL, **kw),
        "eagle_graphs": Engine(target, head, spec, backend="cuda", prefill=PREFILL,
                               draft_compile=DRAFT_COMPILE[MODEL], draft_prefill=DRAFT_PREFILL,
                               **kw),
        "eagle_eager": Engine(target, head, spec, backend="reference", **kw),
    }
    for dp in DRAFT_PREFILLS[1:]:
        workers[f"eagle_graphs[draft_prefill={dp}]"] = Engine(
            target, head, spec, backend="cuda", prefill=PREFILL, draft_compile=DRAFT_COMPILE[MODEL],
            draft_prefill=dp, **kw)
    rows = []
    for bs in BATCHES:
        batches = row_batches(bs, target.cfg.vocab_size)
        news = [NEW_TOKENS] * len(batches)
        greedy_reqs, g, _ = measure(workers["greedy_graphs"], "greedy", batches, news)
        eagle_reqs, e, e_per = measure(workers["eagle_graphs"], "spec", batches, news)
        # the eager worker is ~10x slower: its first batch once, against the graphs' same batch
        _, ee, _ = measure(workers["eagle_eager"], "spec", batches[:1], news[:1], repeats=1)
        match, divergences = match_line(greedy_reqs, eagle_reqs)
        variants = {}
        for name in workers:
            if name.startswith("eagle_graphs["):
                v_reqs, v, _ = measure(workers[name], "spec", batches, news)
                variants[name[len("eagle_graphs["):-1]] = variant_entry(g, greedy_reqs, v, v_reqs)
        rows.append({"variants": variants,
            "bs": bs, "requests": len(eagle_reqs), "batches": len(batches), "repeats": REPEATS,
            "greedy_graphs_tok_s": g.tokens_per_s, "eagle_graphs_tok_s": e.tokens_per_s,
            "eagle_eager_tok_s": ee.tokens_per_s, "accept_len": e.accept_len,
            "accept_len_per_batch": [s.accept_len for s in e_per],
            "overlap": [g.overlap, e.overlap, ee.overlap],
            "rounds": {"greedy_steps": g.rounds, "eagle_rounds": e.rounds,
                       "eagle_discarded_lane_rounds": e.discarded},
            "speedup_vs_greedy": e.tokens_per_s / g.tokens_per_s,
            "eagle_round_ms": 1e3 * e.round_seconds, "greedy_step_ms": 1e3 * g.round_seconds,
            "round_in_greedy_steps": e.round_seconds / g.round_seconds if g.round_seconds else 0.0,
            "phases_s": {"greedy": g.phases, "eagle": e.phases},
            "graphs_vs_eager": e_per[0].tokens_per_s / ee.tokens_per_s,
            "greedy_match": match, "first_divergences": divergences})
        print(rows[-1], flush=True)
        write(out_dir, rows, spec, dinfo, time.perf_counter() - t_start)   # after every bs
    # continuous admission: the graph workers, QUEUE requests of varied output lengths
    g = torch.Generator().manual_seed(99)
    prompts = prompts_for(QUEUE, target.cfg.vocab_size, seed=99)
    news = torch.randint(*QUEUE_NEW, (QUEUE,), generator=g).tolist()
    res = {name: measure(workers[name], "greedy" if name.startswith("greedy") else "spec",
                         [prompts], [news]) for name in ("greedy_graphs", "eagle_graphs")}
    match, _ = match_line(res["greedy_graphs"][0], res["eagle_graphs"][0])
    gs, es = res["greedy_graphs"][1], res["eagle_graphs"][1]
    queue = {"requests": QUEUE, "rows": max(BATCHES), "new_tokens": list(QUEUE_NEW),
             "repeats": REPEATS,
             "greedy_graphs_tok_s": gs.tokens_per_s, "eagle_graphs_tok_s": es.tokens_per_s,
             "accept_len": es.accept_len, "speedup_vs_greedy": es.tokens_per_s / gs.tokens_per_s,
             "rounds": {"greedy_steps": gs.rounds, "eagle_rounds": es.rounds},
             "prefills": {"greedy": gs.prefills, "eagle": es.prefills}, "greedy_match": match,
             "phases_s": {"greedy": gs.phases, "eagle": es.phases},
             "round_ms": {"greedy": 1e3 * gs.round_seconds, "eagle": 1e3 * es.round_seconds}}
    print(queue, flush=True)
    write(out_dir, rows, spec, dinfo, time.perf_counter() - t_start, queue)


def round_cell(r: dict) -> str:
    """'1.41 (1.82 / 1.29)': one EAGLE round in greedy steps (prefill excluded), and both in ms."""
    if "round_in_greedy_steps" not in r:        # a row written before the column existed
        return "-"
    return (f"{r['round_in_greedy_steps']:.2f} ({r['eagle_round_ms']:.2f} / "
            f"{r['greedy_step_ms']:.2f})")


def bound_cell(r: dict) -> str:
    """'2.65x; 7.5% / 1.3%': accept / (round in greedy steps), the speedup a row would reach
    with no prefill and no batch tail, then the prefill phase's share of EAGLE's and greedy's
    time; '-' for a row written before the phases were kept."""
    if "round_in_greedy_steps" not in r or "phases_s" not in r:
        return "-"
    share = {m: r["phases_s"][m].get("prefill", 0.0) / max(sum(r["phases_s"][m].values()), 1e-12)
             for m in ("eagle", "greedy")}
    return (f"{r['accept_len'] / r['round_in_greedy_steps']:.2f}x; "
            f"{100 * share['eagle']:.1f}% / {100 * share['greedy']:.1f}%")


def variant_entry(g: RunStats, greedy_reqs, v: RunStats, v_reqs) -> dict:
    """One extra EAGLE worker's result on a row, against the row's greedy run g."""
    return {"eagle_graphs_tok_s": v.tokens_per_s, "accept_len": v.accept_len,
            "speedup_vs_greedy": v.tokens_per_s / g.tokens_per_s if g.tokens_per_s else 0.0,
            "round_in_greedy_steps": v.round_seconds / g.round_seconds if g.round_seconds else 0.0,
            "phases_s": {"greedy": dict(g.phases), "eagle": dict(v.phases)},
            "greedy_match": match_line(greedy_reqs, v_reqs)[0]}


def variant_lines(rows: list[dict]) -> list[str]:
    """The md table of the rows' extra EAGLE workers (none: no lines)."""
    found = [(r["bs"], name, v) for r in rows for name, v in r.get("variants", {}).items()]
    if not found:
        return []
    lines = ["", f"## Variants (same process, same batches, against the same greedy runs; the "
             f"table above: draft prefill {DRAFT_PREFILL})", "",
             "| bs | variant | EAGLE graphs tok/s | accept len | speedup vs greedy | "
             "EAGLE round / greedy step | bound: accept / round; prefill share (EAGLE / greedy) "
             "| greedy match |", "|---|---|---|---|---|---|---|---|"]
    for bs, name, v in found:
        lines.append(f"| {bs} | {name} | {v['eagle_graphs_tok_s']:.0f} | {v['accept_len']:.2f} | "
                     f"{v['speedup_vs_greedy']:.2f}x | {v['round_in_greedy_steps']:.2f} | "
                     f"{bound_cell(v)} | {v['greedy_match']} |")
    return lines


def queue_times(q: dict) -> str:
    """'1.37 / 2.06 | 3.70 / 7.00': ms per greedy step / EAGLE round, then the prefill phase's ms
    per prefill batch (greedy / EAGLE); '- | -' for a result written before they were kept."""
    if "phases_s" not in q:
        return "- | -"
    per = {m: 1e3 * q["phases_s"][m].get("prefill", 0.0) / max(1, q["prefills"][m])
           for m in ("greedy", "eagle")}
    return (f"{q['round_ms']['greedy']:.2f} / {q['round_ms']['eagle']:.2f} | "
            f"{per['greedy']:.2f} / {per['eagle']:.2f}")


def write(out_dir, rows, spec, dinfo, seconds, queue=None):
    import triton
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "command": command_line(),
        "model": DESCRIPTION[MODEL],
        "draft": {"compile": DRAFT_COMPILE[MODEL], "lm_head": DRAFT_LM_HEAD[MODEL]},
        "spec": vars(spec) if hasattr(spec, "__dict__") else str(spec),
        "new_tokens": NEW_TOKENS, "distill": dinfo, "wall_s": seconds,
        "targets": {"eagle_vs_greedy": {"bs1": ">= 2.5", "bs4": ">= 2.0", "bs16": ">= 1.5"},
                    "graphs_vs_eager_bs1": ">= 3.0"},
        "overlap": OVERLAP, "scheduling": OVERLAP_NOTE if OVERLAP else "overlap off",
        "prefill": PREFILL, "draft_prefill": DRAFT_PREFILL, "draft_prefill_variants": DRAFT_PREFILLS[1:],
    }
    meta["spec"] = {"steps": spec.steps, "topk": spec.topk, "k": spec.num_draft_tokens}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{RESULT}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "continuous": queue}, f, indent=2)
    lines = [f"# EAGLE benchmark ({meta['date']})", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; {meta['model']}; "
             f"steps={spec.steps} topk={spec.topk} k={spec.num_draft_tokens}; draft compiled "
             f"{DRAFT_COMPILE[MODEL]}, draft lm_head {DRAFT_LM_HEAD[MODEL]}; prefill {PREFILL}, "
             f"draft prefill {DRAFT_PREFILL}; "
             f"{NEW_TOKENS} new tokens per request; distillation {dinfo['data_s'] + dinfo['train_s']:.0f}s "
             f"({dinfo.get('steps', '?')} steps on {dinfo.get('n_seq', '?')} sequences, unrolled "
             f"{dinfo.get('depth', 1)} deep, kept step {dinfo.get('kept_step')}; "
             f"{held_out_note(dinfo.get('held_out'))})",
             "", f"{meta['scheduling']} (rounds counted as launched)", "",
             f"command: `{meta['command']}`", "",
             f"Each row: {ROW_REQUESTS} distinct requests (at least one batch) as batches of bs, each "
             f"batch timed {REPEATS} times and its median run counted; tokens/s = all tokens over "
             "the summed times. EAGLE eager: the row's first batch, once (graphs vs eager: the "
             "graphs' run of that batch against it).", "",
             "| bs | requests | greedy graphs tok/s | EAGLE graphs tok/s | EAGLE eager tok/s | "
             "accept len (per batch: min-max) | speedup vs greedy | EAGLE round / greedy step "
             "(ms) | bound: accept / round; prefill share (EAGLE / greedy) | graphs vs eager | "
             f"greedy match (first divergence: exact / top-2 gap <= {TIE_TOL} / other) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = r.get("accept_len_per_batch") or [r["accept_len"]]
        lines.append(f"| {r['bs']} | {r.get('requests', r['bs'])} | {r['greedy_graphs_tok_s']:.0f} | "
                     f"{r['eagle_graphs_tok_s']:.0f} | "
                     f"{r['eagle_eager_tok_s']:.0f} | {r['accept_len']:.2f} "
                     f"({min(per):.2f}-{max(per):.2f}) | "
                     f"{r['speedup_vs_greedy']:.2f}x | {round_cell(r)} | {bound_cell(r)} | "
                     f"{r['graphs_vs_eager']:.2f}x | "
                     f"{r['greedy_match']} |")
    lines += variant_lines(rows)
    if queue:
        q = queue
        lines += ["", f"## Continuous admission: {q['requests']} requests through {q['rows']} "
                  f"rows, {q['new_tokens'][0]}-{q['new_tokens'][1] - 1} new tokens each", "",
                  "| greedy graphs tok/s | EAGLE graphs tok/s | accept len | speedup vs greedy | "
                  "steps / rounds | prefill batches (greedy / EAGLE) | ms per step / round | "
                  "ms per prefill batch (greedy / EAGLE) | greedy match |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| {q['greedy_graphs_tok_s']:.0f} | {q['eagle_graphs_tok_s']:.0f} | "
                  f"{q['accept_len']:.2f} | {q['speedup_vs_greedy']:.2f}x | "
                  f"{q['rounds']['greedy_steps']} / {q['rounds']['eagle_rounds']} | "
                  f"{q['prefills']['greedy']} / {q['prefills']['eagle']} | {queue_times(q)} | "
                  f"{q['greedy_match']} |",
                  "", "Time per step / round: the phases after prefill (decode or draft, verify, "
                  "draft-extend, host) over the rounds launched; per prefill batch: the prefill "
                  "phase (the admissions' prefill and, for EAGLE, the head's prefill, on the "
                  "stream's timeline) over the prefill batches."]
    with open(os.path.join(out_dir, f"{RESULT}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
