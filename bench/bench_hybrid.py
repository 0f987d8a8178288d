"""Benchmark: padgraph.llm's hybrid reference model (`padgraph.llm.models.hybrid`: Llama attention
layers and Mamba2 layers, random init) served by the engine, in one process.

  decode   the engine's decode runner (`Engine(backend="cuda")` as it serves by default: CUDA
           graphs over the default ladder, the decoder layers compiled as regions) at bs 1 / 16
           / 64, contexts uniform in [256, 1024), against the step's floor: the bytes it must
           move over the GPU's measured copy bandwidth (`bench.common.copy_bandwidth`), where
           those bytes are every weight once (the embedding table: a row per request;
           `bench.bench_runner.step_weight_bytes`), each request's K and V of every attention
           layer up to its length, and each Mamba layer's convolution window and SSM state per
           request, read and written. Per size: step µs (median of CUDA events around the
           runner call, host included) and host µs; the runner's next tokens against the eager
           model's step on the same cache state (`forward_decode`: no graphs, no compile; the
           state restored in between): equal, or differing where the eager top-2 logit gap is
           within TIE_TOL (a bf16 near tie).
  spec     EAGLE rounds against plain greedy decoding on one engine (the same runners), at bs 1
           / 4 / 16: each row serves 16 requests (`Mode.row_requests`) as batches of bs, 128 new
           tokens each, each batch timed 3 times (`Mode.repeats`), the median run counted
           (`bench.bench_eagle.measure`); tokens/s, accept length, speedup, round and step ms,
           and the speculative tokens against greedy decoding's (`bench.bench_eagle.match_line`:
           exact, or a first divergence at a top-2 gap within TIE_TOL). The head: an `EagleHead`
           distilled from the target as the 1B Llama preset distils its own
           (`padgraph.llm.distill.PRESETS["1b"]`'s corpus and steps; EAGLE_DISTILL_STEPS / _SEQS
           / _DEPTH override them as for bench_eagle), with the main job's draft compile
           (`--draft-compile`) and draft lm_head (`padgraph.llm.presets`); `--head passthrough`
           takes the untrained head the tests use (the target's embedding -> lm_head path).

The model on a GPU (bf16): Llama-3.2-1B's widths, 16 layers, attention at every 4th (3, 7, 11,
15; 32 heads, 8 KV heads of 64), Mamba2 mixers elsewhere (32 heads of 64 channels, d_state 128,
one B/C group, convolution width 4), SwiGLU 8192, vocabulary 128256, untied lm_head (`hybrid_1b`;
bench_hf's `bamba1b` is transformers' Bamba at the same shape). `--tiny`: `HybridConfig.tiny()`
in fp32 on the CPU (reference backend, no graphs, untimed in any useful sense), small sizes and
a briefly distilled head: a smoke run of every path and check, in seconds. `--check`: exit 1
when a token check fails (after writing the results).

Writes bench_hybrid.md, .json and .png to $OUT (or results/local): GPU, versions, command,
commit, configuration, copy bandwidth and every row; a run of one part (`--parts decode`) writes
bench_hybrid_decode.* (bench_hybrid_spec.*), so two runs' files stay apart.

`--recurrent-ops inductor,opaque` runs each part once per value in the same process: how the
compiled layers run the Mamba updates (padgraph's Triton kernels as opaque ops, the model's
default; or inductor's code for their references, `HybridModel(opaque_recurrent=False)`); every
row names its value. `--profile` (a GPU) lists the speculative engine's greedy step at bs 1 by
kernel class, per recurrent-ops value (torch.profiler; a `canary` class is the check every
replay runs over the canary rows, `bench.common.KERNEL_CLASSES`).

    python -m bench.bench_hybrid [--parts decode,spec] [--head distil|passthrough] [--check]
                                 [--recurrent-ops inductor,opaque] [--profile]
    python -m bench.bench_hybrid --tiny --check           # CPU smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from bench.bench_eagle import distill_overrides, held_out_note, match_line, measure, prompts_for
from bench.bench_runner import step_weight_bytes, time_calls
from bench.common import copy_bandwidth, env_info, kernel_classes, kernel_table, out_dir, plot_step_times
from bench.gpu_timing import profile_replays
from padgraph.llm import Batch, Engine, SpecConfig
from padgraph.llm.distill import PRESETS, distill
from padgraph.llm.models import EagleHead
from padgraph.llm.models.hybrid import HybridConfig, HybridModel
from padgraph.llm.oracle import TIE_TOL
from padgraph.llm.presets import DRAFT_COMPILE, DRAFT_LM_HEAD, GPU_TREE

PARTS = ("decode", "spec")
RECURRENT_OPS = ("opaque", "inductor")   # how compiled layers run the Mamba updates (--recurrent-ops)
HEADS = ("distil", "passthrough")


def hybrid_1b() -> HybridConfig:
    """The GPU model: Llama-3.2-1B's widths, attention every 4th of 16 layers, Mamba2 elsewhere.
    init_std 0.008, as `LlamaConfig.llama_1b` and for its reason: at 0.02 the random target is a
    chaotic generator no draft can predict (an H100 run distilled a head to a held-out accept
    length of 1.05). Its greedy next token agrees with the embedding -> lm_head map of the
    current token 11 % of the time at 0.02, 61 % at 0.008 (CPU, fp32, 2 random prompts, 24
    greedy tokens each; the Llama preset: 96 %): the Mamba layers keep it more context-dependent
    (63 % at 0.006, 67 % at 0.004)."""
    return HybridConfig(vocab_size=128256, hidden_size=2048, pattern="MMMA" * 4, n_heads=32,
                        n_kv_heads=8, head_dim=64, ffn_size=8192, ssm_heads=32, ssm_head_dim=64,
                        d_state=128, n_groups=1, conv_kernel=4, max_position=4096, init_std=0.008)


@dataclass(frozen=True)
class Mode:
    """What one run measures, and at which sizes."""
    cfg: HybridConfig
    device: str
    dtype: torch.dtype
    decode_sizes: tuple[int, ...]
    ctx: tuple[int, int]            # decode contexts uniform in [lo, hi)
    iters: int                      # timed decode steps per size
    spec_sizes: tuple[int, ...]
    tree: tuple[int, int, int]      # SpecConfig(steps, topk, num_draft_tokens)
    new_tokens: int                 # per request, spec part
    row_requests: int               # requests per spec row (batches of bs)
    repeats: int                    # timed runs per batch, the median counted
    distill: dict                   # padgraph.llm.distill.distill's options


def _preset(name: str) -> dict:
    return {k: v for k, v in PRESETS[name].items() if k not in ("cfg", "family")}


GPU = Mode(hybrid_1b(), "cuda", torch.bfloat16, decode_sizes=(1, 16, 64), ctx=(256, 1024), iters=50,
           spec_sizes=(1, 4, 16), tree=GPU_TREE["llama"], new_tokens=128, row_requests=16, repeats=3,
           distill=_preset("1b"))
TINY = Mode(HybridConfig.tiny(), "cpu", torch.float32, decode_sizes=(1, 3), ctx=(8, 24), iters=3,
            spec_sizes=(1, 3), tree=(3, 2, 5), new_tokens=6, row_requests=3, repeats=1,
            distill=dict(n_seq=4, prompt_len=4, gen_len=4, gen_batch=4, steps=2, batch=4, lr=3e-3,
                         n_check=1))


def backend_of(mode: Mode) -> str:
    return "cuda" if mode.device == "cuda" else "reference"


# ---- decode: the runner's step against its floor ------------------------------------------------
def step_bytes(target: HybridModel, kv, seq_lens: torch.Tensor) -> dict:
    """Bytes a decode step of len(seq_lens) requests must move: "weights" (every parameter once,
    the embedding table a row per request), "kv" (each attention layer's K and V up to each
    request's length, seq_lens [bs] counting the new token) and "state" (each Mamba layer's
    convolution window and SSM state of each request, read and written)."""
    cfg, n = target.cfg, seq_lens.numel()
    per_token = cfg.pattern.count("A") * 2 * cfg.n_kv_heads * cfg.head_dim * kv.k[0].element_size()
    per_row = sum(t[0].numel() * t.element_size() for t in kv.conv + kv.ssm)
    return {"weights": step_weight_bytes(target, n), "kv": int(seq_lens.sum()) * per_token,
            "state": 2 * n * per_row}


def decode_inputs(worker, reqs) -> dict:
    """Prefill the requests; the decode runner's inputs for their first step (greedy lanes)."""
    logits, _, b = worker.prefill(reqs)
    rows, L = b.rows, b.seq_lens
    return dict(input_ids=logits.argmax(-1), positions=L.long(), seq_lens=L + 1, req_pool_indices=rows,
                out_cache_loc=worker.kv.req_to_token[rows.long(), L.long()].long(),
                **worker.lane_inputs(worker.lanes(reqs)))


def check_step(worker, raw: dict) -> dict:
    """The decode runner's next tokens against the eager model's step (`forward_decode`) from the
    same recurrent state: each lane's request rows are restored before the eager step and after
    it (a step rewrites them in place; its K/V write is the same slot and value both times)."""
    kv, rows = worker.kv, raw["req_pool_indices"].long()
    pools = kv.conv + kv.ssm
    saved = [t[rows].clone() for t in pools]
    got = worker.runner("decode")(**raw).next_token.clone()
    for t, s in zip(pools, saved):
        t[rows] = s
    b = Batch(kv, kv.req_to_token, raw["req_pool_indices"], raw["seq_lens"], raw["out_cache_loc"])
    logits, _ = worker.target.forward_decode(raw["input_ids"], raw["positions"], b)   # [bs, V] fp32
    for t, s in zip(pools, saved):
        t[rows] = s
    top2 = logits.topk(2, dim=-1).values
    tie = (top2[:, 0] - top2[:, 1]) <= TIE_TOL
    differ = got != logits.argmax(-1)
    return {"tokens_equal": int((~differ).sum()), "near_ties": int((differ & tie).sum()),
            "other": int((differ & ~tie).sum())}


def time_step(fn, raw: dict, iters: int, cuda: bool) -> tuple[float, float]:
    """(median µs a call, median host µs a call): `bench_runner.time_calls` on a GPU; on the CPU
    the wall clock is both."""
    if cuda:
        return time_calls(fn, raw, iters)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn(**raw)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), statistics.median(times)


def decode_row(engine: Engine, n: int, mode: Mode, gen: torch.Generator, bw: float, ops: str = "opaque") -> dict:
    """n requests admitted and prefilled, their first decode step timed, checked, released."""
    vocab, lens = mode.cfg.vocab_size, torch.randint(*mode.ctx, (n,), generator=gen).tolist()
    reqs = engine.admit([torch.randint(1, vocab, (m,), generator=gen).tolist() for m in lens], [2] * n)
    worker = engine.worker
    with torch.no_grad():
        raw = decode_inputs(worker, reqs)
        check = check_step(worker, raw)
        step_us, host_us = time_step(worker.runner("decode"), raw, mode.iters, mode.device == "cuda")
    moved = step_bytes(worker.target, worker.kv, raw["seq_lens"])
    for r in reqs:
        engine.release(r)
    floor_us = sum(moved.values()) / bw * 1e6
    row = {"bs": n, "variant": "decode runner", "recurrent_ops": ops, "ctx_mean": sum(lens) / n, "step_us": step_us,
           "host_us": host_us, "floor_us": floor_us, "x_floor": step_us / floor_us, "bytes": moved, **check}
    print(f"decode bs={n:>3} [{ops}]: step {step_us:9.1f} µs (host {host_us:8.1f}), floor {floor_us:8.1f} µs "
          f"({', '.join(f'{k} {v / 1e6:.1f} MB' for k, v in moved.items())}), x{row['x_floor']:.2f}; "
          f"tokens {check['tokens_equal']}/{n} equal eager's, {check['near_ties']} near ties, "
          f"{check['other']} other", flush=True)
    return row


def compile_kind(options: dict) -> str | None:
    """A runner's torch.compile, in a word: "regions" (the decoder layers), "whole" or None."""
    tc = options.get("torch_compile")
    return None if tc is None else "regions" if "regions" in tc else "whole"


def decode_part(target: HybridModel, mode: Mode, bw: float, ops_variants=("opaque",)) -> dict:
    """The decode runner at every decode size, on an engine of max_bs the largest (no head); one
    engine per recurrent-ops variant (`RECURRENT_OPS`), the same sizes and contexts for each."""
    out = {"variants": []}
    for ops in ops_variants:
        target.opaque_recurrent = ops == "opaque"
        d = _decode_variant(target, mode, bw, ops)
        out["variants"].append(ops)
        out.setdefault("setup", d["setup"])
        out.setdefault("setups", {})[ops] = d["setup"]
        out.setdefault("rows", []).extend(d["rows"])
        gc.collect()
        if mode.device == "cuda":
            torch.cuda.empty_cache()
    return out


def _decode_variant(target: HybridModel, mode: Mode, bw: float, ops: str) -> dict:
    spec = SpecConfig(*mode.tree)
    engine = Engine(target, None, spec, backend=backend_of(mode), max_bs=max(mode.decode_sizes),
                    max_context=spec.reservation(mode.ctx[1] + 2))
    t0 = time.perf_counter()
    runner = engine.worker.runner("decode")
    setup = {"seconds": time.perf_counter() - t0, "buckets": list(engine.worker.programs["decode"].buckets),
             "torch_compile": compile_kind(engine.worker.options("decode")),
             "backend": backend_of(mode), "compiles": runner.stats.compiles,
             "compile_seconds": runner.stats.compile_seconds}
    print(f"decode runner: {setup['seconds']:.1f} s for the ladder {setup['buckets']} "
          f"({setup['compiles']} compiles, {setup['compile_seconds']:.1f} s compiling)", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = [decode_row(engine, n, mode, gen, bw, ops) for n in mode.decode_sizes]
    return {"setup": setup, "rows": rows}


# ---- spec: EAGLE rounds against greedy ---------------------------------------------------------
def make_head(target: HybridModel, mode: Mode, kind: str) -> tuple[EagleHead, dict]:
    """An EagleHead for the target: distilled (`distill` with the mode's options) or the
    untrained passthrough; on a GPU it drafts with the main job's lm_head (`DRAFT_LM_HEAD`)."""
    head = EagleHead(target).to(target.lm_head.weight.device)
    if kind == "distil":
        info = distill(target, head, **{**mode.distill, **distill_overrides(os.environ)})
    else:
        head.init_passthrough()
        head.eval().to(target.lm_head.weight.dtype)
        info = {"passthrough": True}
    for p in head.parameters():
        p.requires_grad_(False)
    if mode.device == "cuda":
        head.set_draft_lm_head(DRAFT_LM_HEAD["llama"])
    return head, info


def phase_line(phases: dict) -> str:
    return " / ".join(f"{k} {v:.2f}" for k, v in phases.items()) or "-"


def spec_row(engine: Engine, bs: int, mode: Mode) -> dict:
    """Plain greedy and EAGLE on the same batches (`bench_eagle.measure`), and the token check."""
    vocab = mode.cfg.vocab_size
    batches = [prompts_for(bs, vocab, seed=1000 * bs + i) for i in range(max(1, mode.row_requests // bs))]
    news = [mode.new_tokens] * len(batches)
    greedy_reqs, g, _ = measure(engine, "greedy", batches, news, repeats=mode.repeats)
    spec_reqs, e, e_per = measure(engine, "spec", batches, news, repeats=mode.repeats)
    match, div = match_line(greedy_reqs, spec_reqs)
    row = {"bs": bs, "requests": len(spec_reqs), "batches": len(batches),
           "greedy_tok_s": g.tokens_per_s, "eagle_tok_s": e.tokens_per_s, "accept_len": e.accept_len,
           "accept_len_per_batch": [s.accept_len for s in e_per],
           "speedup_vs_greedy": e.tokens_per_s / g.tokens_per_s if g.tokens_per_s else 0.0,
           "greedy_step_ms": 1e3 * g.round_seconds, "eagle_round_ms": 1e3 * e.round_seconds,
           "rounds": {"greedy_steps": g.rounds, "eagle_rounds": e.rounds},
           "phases_s": {"greedy": dict(g.phases), "eagle": dict(e.phases)},    # where a step's time went
           "greedy_match": match, "near_ties": len(div["near_tie"]), "other": len(div["other"]),
           "first_divergences": div}
    print(f"spec bs={bs:>3}: greedy {row['greedy_tok_s']:8.0f} tok/s, EAGLE {row['eagle_tok_s']:8.0f} tok/s, "
          f"accept {row['accept_len']:.2f}, speedup {row['speedup_vs_greedy']:.2f}x; greedy match {match}; "
          f"phases s: greedy {phase_line(g.phases)}, EAGLE {phase_line(e.phases)}", flush=True)
    return row


def profile_greedy(engine: Engine, mode: Mode, n_tokens: int = 24) -> dict:
    """One request's greedy decoding on the speculative engine under torch.profiler (`--profile`,
    after one run outside it): its GPU kernels by class (`bench.common.kernel_classes`) and the
    slowest ones, per greedy step (the prefill's kernels are spread over the steps)."""
    prompts, ran = prompts_for(1, mode.cfg.vocab_size, seed=7), {}
    with torch.no_grad():
        events = profile_replays(lambda: ran.update(stats=engine.generate_greedy(prompts, [n_tokens])[1]), 1)
    steps = max(ran["stats"].rounds, 1)
    classes = [{k: v for k, v in c.items() if k != "names"} for c in kernel_classes(events, steps)]
    return {"steps": steps, "classes": classes, **kernel_table(events, steps, top=10)}


def spec_part(target: HybridModel, mode: Mode, head_kind: str, draft_compile: str,
              ops_variants=("opaque",), profile: bool = False) -> dict:
    """The head, then per recurrent-ops variant one engine (the default ladder up to the largest
    size; on a GPU the head's draft bodies compiled `draft_compile`) serving greedy and EAGLE at
    every spec size; `profile` (a GPU): its greedy step's kernels by class (`profile_greedy`)."""
    t0 = time.perf_counter()
    head, info = make_head(target, mode, head_kind)
    info["seconds"] = time.perf_counter() - t0
    spec = SpecConfig(*mode.tree)
    longest = 40 + mode.new_tokens                  # prompts_for: prompts of 8 to 39 tokens
    draft = {"draft_compile": draft_compile} if mode.device == "cuda" else {}
    rows, profiles = [], {}
    for ops in ops_variants:
        target.opaque_recurrent = ops == "opaque"
        engine = Engine(target, head, spec, backend=backend_of(mode), max_bs=max(mode.spec_sizes),
                        max_context=spec.reservation(longest, overlap=True), **draft)
        rows += [{**spec_row(engine, bs, mode), "recurrent_ops": ops} for bs in mode.spec_sizes]
        if profile and mode.device == "cuda":
            profiles[ops] = profile_greedy(engine, mode)
        overlap = engine.opts.overlap
        del engine
        gc.collect()
    return {"head": head_kind, "head_info": info, "tree": dataclasses.asdict(spec), "new_tokens": mode.new_tokens,
            "draft": {**draft, "lm_head": DRAFT_LM_HEAD["llama"] if mode.device == "cuda" else "target's"},
            "overlap": overlap, "rows": rows, "profiles": profiles}


# ---- the page ------------------------------------------------------------------------------------
def failures(result: dict) -> list[str]:
    """The token checks that failed: a decode lane or a speculative request differing from its
    reference beyond a near tie."""
    bad = [f"decode bs {r['bs']}: {r['other']} tokens differ from the eager step beyond a near tie"
           for r in result.get("decode", {}).get("rows", []) if r["other"]]
    bad += [f"spec bs {r['bs']}: {r['other']} requests differ from greedy beyond a near tie: "
            f"{r['first_divergences']['other']}" for r in result.get("spec", {}).get("rows", []) if r["other"]]
    return bad


def describe(cfg: HybridConfig) -> str:
    """The configuration in a line."""
    return (f"{cfg.n_layers} layers, pattern {cfg.pattern} (A attention, M Mamba2), hidden {cfg.hidden_size}; "
            f"attention {cfg.n_heads} heads, {cfg.n_kv_heads} KV heads of {cfg.head_dim}; Mamba2 "
            f"{cfg.ssm_heads} heads of {cfg.ssm_head_dim} channels, d_state {cfg.d_state}, {cfg.n_groups} "
            f"B/C group(s), convolution width {cfg.conv_kernel}; SwiGLU {cfg.ffn_size}; vocabulary "
            f"{cfg.vocab_size}, untied lm_head")


def decode_lines(d: dict) -> list[str]:
    s = d["setup"]
    compiled = "the decoder layers compiled as regions" if s["torch_compile"] else "no torch.compile"
    clock = ("median of CUDA events around the call, host included" if s["backend"] == "cuda"
             else "median wall clock of the call (CPU smoke: no meaning as a time)")
    lines = ["## Decode step against its floor", "",
             f"The engine's decode runner ({s['backend']} backend; ladder {s['buckets']}; {compiled}; "
             f"{s['seconds']:.1f} s to build the ladder, {s['compiles']} compiles). Step: {clock}; floor: "
             "the bytes a step moves (weights once, the embedding a row per request; K/V up to each "
             "request's length; the Mamba layers' conv and SSM state of each request, read and written) "
             "over the copy bandwidth; tokens: the step's against the eager model's on the same state.", "",
             "Recurrent ops: `inductor`, the Mamba updates as inductor's code for their torch references "
             "inside the compiled layers; `opaque`, padgraph's Triton kernels as opaque ops there "
             "(`HybridModel(opaque_recurrent=True)`).", "",
             "| bs | recurrent ops | mean context | step µs | host µs | floor µs | weights / KV / state MB "
             "| x floor | tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        mb = " / ".join(f"{r['bytes'][k] / 1e6:.0f}" for k in ("weights", "kv", "state"))
        lines.append(f"| {r['bs']} | {r.get('recurrent_ops', 'inductor')} | {r['ctx_mean']:.0f} | "
                     f"{r['step_us']:.1f} | {r['host_us']:.1f} | "
                     f"{r['floor_us']:.1f} | {mb} | {r['x_floor']:.2f} | {r['tokens_equal']}/{r['bs']} "
                     f"(+{r['near_ties']} near ties, {r['other']} other) |")
    return lines


def spec_lines(s: dict) -> list[str]:
    info, t = s["head_info"], s["tree"]
    head = ("the untrained passthrough head (the target's embedding -> lm_head path)" if s["head"] == "passthrough"
            else f"a head distilled in {info['seconds']:.0f} s ({info.get('steps')} steps on "
                 f"{info.get('n_seq')} greedy sequences, kept step {info.get('kept_step')}; "
                 f"{held_out_note(info.get('held_out'))})")
    lines = ["## Speculative rounds against greedy decoding", "",
             f"EAGLE with {head}; tree steps {t['steps']}, topk {t['topk']}, k {t['num_draft_tokens']}; "
             f"draft bodies compiled {s['draft'].get('draft_compile', 'no')}, draft lm_head {s['draft']['lm_head']}; "
             f"{s['new_tokens']} new tokens a request; overlap {s['overlap']}. "
             f"Greedy match: exact, or the first divergence at a top-2 gap <= {TIE_TOL} (a near tie).", "",
             "| bs | recurrent ops | requests | greedy tok/s | EAGLE tok/s | accept len | speedup | greedy step ms "
             "| EAGLE round ms | greedy match |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['bs']} | {r.get('recurrent_ops', 'inductor')} | {r['requests']} | "
                     f"{r['greedy_tok_s']:.0f} | {r['eagle_tok_s']:.0f} | "
                     f"{r['accept_len']:.2f} | {r['speedup_vs_greedy']:.2f}x | {r['greedy_step_ms']:.2f} | "
                     f"{r['eagle_round_ms']:.2f} | {r['greedy_match']} |")
    for ops, pr in s.get("profiles", {}).items():
        lines += ["", f"Greedy step at bs 1 on this engine by kernel class ({ops} recurrent ops; torch.profiler over "
                  f"{pr['steps']} steps, the prefill spread over them): {pr['kernels']:.0f} kernels and "
                  f"{pr['kernel_us']:.0f} kernel-µs a step.", "", "| class | kernels | µs a step |", "|---|---|---|"]
        lines += [f"| {c['class']} | {c['kernels']:.0f} | {c['us']:.1f} |" for c in pr["classes"]]
    return lines


def stem_of(parts: list[str]) -> str:
    """bench_hybrid for every part; bench_hybrid_<part> for one (two runs' files stay apart)."""
    return "bench_hybrid" if set(parts) == set(PARTS) else "_".join(["bench_hybrid", *parts])


def write(result: dict) -> None:
    env, m = result["env"], result["model"]
    lines = [f"# bench_hybrid: the hybrid reference model on the engine ({env['date']})", "",
             f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, commit {env['commit']}; "
             f"command `{env['command']}`; copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s", "",
             f"Model: {m['params'] / 1e9:.3f}B params, {m['dtype']}, random init; {m['shape']}", ""]
    if "decode" in result:
        lines += decode_lines(result["decode"]) + [""]
    if "spec" in result:
        lines += spec_lines(result["spec"]) + [""]
    lines += [f"check: {'; '.join(result['failures']) or 'every token check passed'}"]
    out, stem = out_dir(), stem_of(result["env"]["parts"])
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    if "decode" in result:
        plot_step_times(result["decode"]["rows"], ["decode runner"], out / f"{stem}.png",
                        "hybrid decode step", "step time (ms)", floor_key="floor_us")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts run: decode, spec")
    ap.add_argument("--head", default="distil", choices=HEADS, help="the EAGLE head of the spec part")
    ap.add_argument("--draft-compile", default=DRAFT_COMPILE["llama"], choices=["regions", "whole"],
                    help="the head's draft bodies on a GPU (WorkerOptions.draft_compile)")
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model on the CPU (smoke run)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a token check fails")
    ap.add_argument("--recurrent-ops", default="opaque",
                    help="comma-separated: opaque (padgraph's kernels as opaque ops in the compiled layers, "
                         "the default), inductor (the Mamba updates' references compiled by inductor); "
                         "each part runs once per value, in this process")
    ap.add_argument("--profile", action="store_true",
                    help="spec part, a GPU: the speculative engine's greedy step by kernel class")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    ops_variants = [o for o in args.recurrent_ops.split(",") if o]
    if not ops_variants or set(ops_variants) - set(RECURRENT_OPS):
        ap.error(f"--recurrent-ops takes {', '.join(RECURRENT_OPS)}; got {args.recurrent_ops!r}")
    if set(parts) - set(PARTS):
        ap.error(f"--parts takes {', '.join(PARTS)}; got {args.parts!r}")
    mode = TINY if args.tiny else GPU
    if mode.device == "cuda" and not torch.cuda.is_available():
        ap.error("the 1B-like hybrid needs a GPU; --tiny runs the tiny model on the CPU")
    torch.manual_seed(0)
    target = HybridModel(mode.cfg).to(mode.device, mode.dtype).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    bw = copy_bandwidth(torch.device(mode.device)) if mode.device == "cuda" else float("nan")
    result = {"env": {**env_info(), "cuda": torch.version.cuda, "tiny": args.tiny,
                      "parts": parts},
              "copy_bandwidth_GBps": bw / 1e9,
              "model": {"config": dataclasses.asdict(mode.cfg), "shape": describe(mode.cfg), "dtype": str(mode.dtype),
                        "params": sum(p.numel() for p in target.parameters())}}
    if "decode" in parts:
        result["decode"] = decode_part(target, mode, bw, ops_variants)
        gc.collect()                    # the decode engine's pools and graphs, before the next
        if mode.device == "cuda":
            torch.cuda.empty_cache()
    if "spec" in parts:
        result["spec"] = spec_part(target, mode, args.head, args.draft_compile, ops_variants, args.profile)
    result["failures"] = failures(result)
    write(result)
    if args.check and result["failures"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
