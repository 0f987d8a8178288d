"""Benchmark: EAGLE speculative sampling against plain sampling, per target entropy, in one process.

    python -m bench.bench_eagle_sampling            # GPU: the 1B-shaped target, bs 1 / 4 / 16
    python -m bench.bench_eagle_sampling --tiny     # CPU: reference backend, tiny target

A random target's next-token distribution is nearly flat (`examples/eagle.py --temperature 1`
on the tiny target: 5.53 nats, of ln 256 = 5.55 at most), which no trained model's is, and a
speculative sampler's accept length depends on it. So the bench sharpens the target: its
lm_head weight is scaled by a factor f (logits x f, the distribution of temperature 1/f), one f
per entry of ENTROPIES (mean next-token entropy at temperature 1, in nats). f is found by
bisection on the target's logits over every position of the bench's own prompts, then the
entropy is measured again with the scaled weights (the levels table's "on the prompts") and on
the tokens each plain run generated at its temperature (`examples/eagle.py`'s `mean_entropy`).

Per level: the draft head is distilled on the sharpened target, as `examples/eagle.py` and
`bench.bench_eagle` distil it (`padgraph.llm.distill`, the preset's settings; on a GPU the
draft reads the fp8 lm_head copy, `DRAFT_LM_HEAD`). Then, per batch size and temperature in
TEMPERATURES (0: the greedy anchor), plain decoding and EAGLE with each acceptance rule
(`WorkerOptions.spec_sampling`: "draws", "rejection") serve the same requests with the same
seeds (a request's seed is a function of its prompt), timed as `bench.bench_eagle.measure` times
them (a warm-up, then each batch `--repeats` times, the median run counted). Speedup = EAGLE
tokens/s over plain tokens/s at the same temperature, batch size and level.

Checked (a failed check exits 1 after the results are written):
- temperature 0: each rule's EAGLE tokens equal plain greedy's (`padgraph.llm.oracle`: up to a
  first divergence at a top-2 near-tie, tolerance `TIE_TOL` x f in bf16, since scaling the
  lm_head scales the logits' rounding; exact in fp32 on the CPU);
- "draws" at temperature > 0: EAGLE's tokens equal plain sampling's (SPEC 12.4: the rule draws
  each tree node's token with decode's keys). In bf16 the verify and decode paths' logits differ
  by rounding, which moves the draw's interval boundaries: a first divergence is "near a
  boundary" when the draw lies within 2 x TIE_TOL x f / T, in log-odds, of both tokens'
  intervals (each path pair moves a boundary's log-odds by at most TIE_TOL x f / T; the
  distance is measured on a dense forward, a third path); exact on the CPU;
- "rejection" at temperature > 0 draws other numbers (the same distribution): not compared;
- every plain sampled run: an eager re-draw (dense forward, the request's seed and position) of
  each of its tokens ("re-draw"); a token it does not give back must be a near-boundary draw as
  above (the dense forward's bf16 logits differ from the graphs' by rounding, which the lm_head
  factor scales: at 3 nats and T = 1, about one token in eight on an H200). Graphs that sampled
  another distribution (a stale weight, wrong keys) give tokens far from any boundary.

The engines are built once (one per rule, graphs captured at the first level); a new level
writes the scaled lm_head and the newly distilled head's weights into the tensors the graphs
read (in place: same storage, so the captured graphs and compiled kernels read the new values).
Writes PATH.md, PATH.json and PATH.png for --out PATH (default $OUT/eagle_sampling where the
environment sets OUT, as the other benches, else results/eagle_sampling; the PNG only where
matplotlib is installed). The JSON holds every row, a digest of each run's tokens, the levels'
factors and entropies, and the GPU, torch / triton versions, command and commit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import padgraph as pg
from bench.bench_eagle import DESCRIPTION, held_out_note, measure, prompts_for
from bench.common import env_info, pyplot
from examples.eagle import mean_entropy
from padgraph.llm import Engine, SpecConfig
from padgraph.llm.distill import build, distill
from padgraph.llm.oracle import TIE_TOL, first_divergences
from padgraph.llm.presets import DRAFT_COMPILE, DRAFT_LM_HEAD, GPU_TREE
from padgraph.llm.sampling import PURPOSE_DECODE, SamplingParams, random_bits, sample, \
    sampling_weights

ROOT = Path(__file__).resolve().parents[1]
ENTROPIES = (0.5, 1.5, 3.0)        # the target's mean next-token entropy at temperature 1, nats
TEMPERATURES = (0.0, 0.7, 1.0)     # 0: greedy, the anchor
RULES = ("draws", "rejection")
FACTOR_RANGE = (1e-3, 1e4)         # bisection bounds of the lm_head scale


@dataclass(frozen=True)
class Sizes:
    """One mode's sizes: distillation preset, batch sizes, distinct requests per batch size,
    new tokens per request, timed runs per batch, draft tree (steps, topk, k), draft lm_head."""
    preset: str
    batches: tuple
    requests: int
    new_tokens: int
    repeats: int
    tree: tuple
    lm_head: str
    model: str


# GPU: bench_eagle's target, tree, draft lm_head and 16 requests per batch size (bs 1 serves
# them one at a time); 64 new tokens and one timed run per batch keep 3 levels x 3
# temperatures x 2 rules short
GPU_SIZES = Sizes("1b", (1, 4, 16), 16, 64, 1, GPU_TREE["llama"], DRAFT_LM_HEAD["llama"],
                  DESCRIPTION["llama"])
# tiny: the CPU smoke mode (reference backend, fp32); a shallow tree keeps a round cheap there
TINY_SIZES = Sizes("tiny", (1, 4), 2, 10, 1, (3, 2, 4), "bf16",
                   "tiny Llama-like target, random init, fp32")


# ---------------------------------------------------------------------------- requests

def prompt_seed(prompt) -> int:
    """A request's sampling seed, a function of its prompt: the same in every run and batch."""
    return zlib.crc32(repr(list(prompt)).encode())


class Sampled:
    """An engine whose generate calls sample every request at `temperature`, each with its
    prompt's seed (`prompt_seed`): what `bench.bench_eagle.measure` drives."""

    def __init__(self, engine: Engine, temperature: float):
        self.engine, self.temperature = engine, temperature
        self.max_bs = engine.max_bs

    def params(self, prompts) -> list[SamplingParams]:
        return [SamplingParams(temperature=self.temperature, seed=prompt_seed(p)) for p in prompts]

    def generate_spec(self, prompts, news):
        return self.engine.generate_spec(prompts, news, sampling=self.params(prompts))

    def generate_greedy(self, prompts, news):
        return self.engine.generate_greedy(prompts, news, sampling=self.params(prompts))


def digest(reqs) -> str:
    """A short hash of the requests' output tokens, in order (equal runs, equal digests)."""
    return hashlib.sha1(repr([r.output for r in reqs]).encode()).hexdigest()[:16]


def row_batches(bs: int, requests: int, vocab: int) -> list[list[list[int]]]:
    """max(1, requests // bs) batches of bs prompts (`bench.bench_eagle.prompts_for`'s, with
    bench_eagle's seeds: at 16 requests, its rows' prompts)."""
    return [prompts_for(bs, vocab, seed=1000 * bs + i) for i in range(max(1, requests // bs))]


# ------------------------------------------------------------------- sharpening the target

@torch.no_grad()
def prompt_logits(target, prompts) -> torch.Tensor:
    """[positions, V] fp32: the target's next-token logits at every position of every prompt."""
    dev = target.lm_head.weight.device
    return torch.cat([target.forward_dense(torch.tensor([p], device=dev))[0][0].float()
                      for p in prompts])


@torch.no_grad()
def mean_entropy_at(logits: torch.Tensor, factor: float, chunk: int = 256) -> float:
    """Mean entropy (nats) of softmax(factor * logits) over the rows of logits [n, V]."""
    total = 0.0
    for part in logits.split(chunk):
        logp = (part * factor).log_softmax(-1)
        total += float(-(logp.exp() * logp).sum(-1).sum())
    return total / logits.shape[0]


def calibrate(logits: torch.Tensor, entropy: float, iters: int = 40) -> float:
    """The factor f (bisection on log f in FACTOR_RANGE) whose softmax(f * logits) has the mean
    entropy `entropy`: entropy falls as f grows (its derivative in f is -f Var_p(logits))."""
    lo, hi = (math.log(v) for v in FACTOR_RANGE)
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_entropy_at(logits, math.exp(mid)) > entropy else (lo, mid)
    return math.exp((lo + hi) / 2)


@torch.no_grad()
def sharpen(target, base: torch.Tensor, factor: float, chunk: int = 16384) -> None:
    """lm_head.weight <- base * factor, written in place (the graphs read this storage)."""
    w = target.lm_head.weight
    for dst, src in zip(w.split(chunk), base.split(chunk)):
        dst.copy_((src.float() * factor).to(w.dtype))


@torch.no_grad()
def copy_in_place(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """Every parameter and buffer of src written into dst's tensor of the same name (in place:
    what captured graphs read); ValueError if their names or shapes differ."""
    d = dict(dst.named_parameters()) | dict(dst.named_buffers())
    s = dict(src.named_parameters()) | dict(src.named_buffers())
    if d.keys() != s.keys() or any(d[n].shape != s[n].shape for n in d):
        raise ValueError(f"copy_in_place: tensors differ: {sorted(d)} vs {sorted(s)}")
    for name, t in d.items():
        t.copy_(s[name])


# ------------------------------------------------------------------------------- checks

@torch.no_grad()
def output_logits(target, r) -> torch.Tensor:
    """[len(output), V] fp32: the target's dense logits at the positions that produced r.output."""
    seq = torch.tensor([r.prompt + r.output[:-1]], device=target.lm_head.weight.device)
    return target.forward_dense(seq)[0][0, len(r.prompt) - 1:].float()


def lanes(params: SamplingParams, n: int, device) -> tuple:
    """(temperature, top_k, top_p, min_p) [n] each, as `sample` takes them."""
    full = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt, device=device)  # noqa: E731
    return (full(params.temperature), full(params.top_k, torch.int32), full(params.top_p),
            full(params.min_p))


@torch.no_grad()
def redraw_check(target, reqs, tol: float) -> dict:
    """An eager re-draw of a plain sampled run: each position's dense logits drawn with the
    request's parameters and seed at its absolute position. The share of tokens it gives back
    ("agreement"), and each other token classed as `draws_divergences` classes a divergence:
    near a boundary (`reach` of both tokens within tol log-odds) or other. Passed: no other."""
    same = n = 0
    near, other = [], []
    for r in reqs:
        logits = output_logits(target, r)                              # [m, V]
        m, dev = logits.shape[0], logits.device
        pos = torch.arange(len(r.prompt), len(r.prompt) + m, device=dev)
        seed = torch.full((m,), r.seed, dtype=torch.int64, device=dev)
        tok = sample(logits, *lanes(r.params, m, dev), seed, pos, PURPOSE_DECODE).cpu()
        got = torch.tensor(r.output)
        same += int((tok == got).sum())
        n += m
        for i in (tok != got).nonzero()[:, 0].tolist():
            reach = reach_at(logits[i:i + 1], r, i, (r.output[i], int(tok[i])))
            (near if reach <= tol else other).append((r.rid, i, round(reach, 4)))
    return {"agreement": same / max(n, 1), "near": len(near), "other": other, "tolerance": tol,
            "passed": not other}


def _log_odds(x: float) -> float:
    return -math.inf if x <= 0 else math.inf if x >= 1 else math.log(x) - math.log1p(-x)


@torch.no_grad()
def draw_reach(target, r, index: int, tokens) -> float:
    """How far (log-odds) request r's draw at output `index` lies from each of `tokens`'
    intervals of the cumulative distribution (0 inside it), the largest of them; the logits are
    a dense forward's over r's prefix, the draw the decode key's (seed, position)."""
    return reach_at(output_logits(target, r)[index:index + 1], r, index, tokens)


def reach_at(logits, r, index: int, tokens) -> float:
    """`draw_reach` over given logits [1, V] of r's output position `index`."""
    w, _ = sampling_weights(logits, *lanes(r.params, 1, logits.device))
    cum = w[0].double().cumsum(0).cpu()
    bits = random_bits(r.seed, len(r.prompt) + index, PURPOSE_DECODE)
    u = int((bits >> 2) & ((1 << 62) - 1)) / 2.0 ** 62
    u_odds, reach = _log_odds(u), 0.0
    for t in tokens:
        lo, hi = (float(cum[t - 1] / cum[-1]) if t else 0.0), float(cum[t] / cum[-1])
        if not lo <= u < hi:
            reach = max(reach, abs(u_odds - _log_odds(lo if u < lo else hi)))
    return reach


def draws_divergences(target, plain, spec, tol: float):
    """`first_divergences` for sampled runs: (n exact, near a boundary [(rid, index, reach)]
    with reach <= tol (`draw_reach` of both tokens), other divergences)."""
    exact, near, other = 0, [], []
    for a, b in zip(plain, spec):
        if a.output == b.output:
            exact += 1
            continue
        i = next((j for j, (x, y) in enumerate(zip(a.output, b.output)) if x != y), None)
        if i is None:                                   # a strict prefix: a length bug
            other.append((a.rid, min(len(a.output), len(b.output)), math.inf))
            continue
        reach = draw_reach(target, a, i, (a.output[i], b.output[i]))
        (near if reach <= tol else other).append((a.rid, i, round(reach, 4)))
    return exact, near, other


def token_check(target, plain, spec, temperature: float, factor: float, gpu: bool) -> dict:
    """Greedy (temperature 0) or "draws" check of spec against plain: counts and divergences."""
    if temperature == 0:
        tol = TIE_TOL * factor if gpu else 0.0
        exact, near, other = first_divergences([p.output for p in plain],
                                               [s.output for s in spec],
                                               [p.gaps for p in plain], tol,
                                               [p.rid for p in plain])
        kind = "greedy"
    else:
        tol = 2 * TIE_TOL * factor / temperature if gpu else 0.0
        exact, near, other = draws_divergences(target, plain, spec, tol)
        kind = "draws"
    return {"kind": kind, "n": len(plain), "exact": exact, "near": near, "other": other,
            "tolerance": tol, "passed": not other}


def check_cell(c: dict | None) -> str:
    """'16/16 (12 exact, 4 near, 0 other)', or 'not compared'."""
    if c is None:
        return "not compared"
    return (f"{c['exact'] + len(c['near'])}/{c['n']} ({c['exact']} exact, {len(c['near'])} "
            f"near, {len(c['other'])} other)")


# ------------------------------------------------------------------------------ running

def build_engines(target, head, sizes: Sizes, gpu: bool) -> dict:
    """One engine per rule over the same target and head (graphs on a GPU, as bench_eagle)."""
    spec = SpecConfig(*sizes.tree)
    max_bs, new = max(sizes.batches), sizes.new_tokens
    # prompts < 40, + output + the spec's reservation with the overlap round (bench_eagle's)
    max_context = max(40 + new + 32, spec.reservation(40 + new, overlap=True))
    kw = dict(max_bs=max_bs, max_context=max_context, buckets=pg.Buckets.default(max_bs),
              overlap=True, backend="cuda" if gpu else "reference")
    if gpu:
        kw.update(prefill="runner", draft_prefill="runner", draft_compile=DRAFT_COMPILE["llama"])
    return {rule: Engine(target, head, spec, spec_sampling=rule, **kw) for rule in RULES}


def level_head(target, head, pre: dict, overrides: dict, lm_head: str, first: bool) -> dict:
    """Distil a head on the (sharpened) target, as the presets do; the first level distils
    `head` itself, a later one a fresh head of its class copied into `head` in place."""
    fresh = head if first else type(head)(target).to(target.lm_head.weight.device)
    info = distill(target, fresh, **{**pre, **overrides})
    fresh.set_draft_lm_head(lm_head)
    if not first:
        copy_in_place(head, fresh)
    return info


def plain_entry(target, plain_reqs, plain, temperature: float, tol: float) -> dict:
    """A plain run's tokens/s, the entropy it sampled at and its eager re-draw check
    (`redraw_check`, tol: its near-boundary tolerance in log-odds)."""
    sampled = temperature > 0
    return {"tok_s": plain.tokens_per_s, "tokens": plain.tokens, "digest": digest(plain_reqs),
            "entropy": (mean_entropy(target, plain_reqs, SamplingParams(temperature=temperature))
                        if sampled else 0.0),
            "redraw": redraw_check(target, plain_reqs, tol) if sampled else None,
            "step_ms": 1e3 * plain.round_seconds}


def run_row(engines, target, batches, sizes: Sizes, temperature: float, level: dict,
            gpu: bool) -> list[dict]:
    """One (level, bs, temperature): plain, then EAGLE under each rule, on the same requests."""
    news = [sizes.new_tokens] * len(batches)
    plain_reqs, plain, _ = measure(Sampled(engines["draws"], temperature), "greedy", batches,
                                   news, sizes.repeats)
    base = {"target_entropy": level["target_entropy"], "factor": level["factor"],
            "bs": len(batches[0]), "requests": len(plain_reqs), "temperature": temperature,
            "plain": plain_entry(target, plain_reqs, plain, temperature,
                                 2 * TIE_TOL * level["factor"] / temperature if gpu and temperature else 0.0)}
    rows = []
    for rule in RULES:
        reqs, st, per = measure(Sampled(engines[rule], temperature), "spec", batches, news,
                                sizes.repeats)
        compared = temperature == 0 or rule == "draws"
        rows.append({**base, "rule": rule, "tok_s": st.tokens_per_s, "digest": digest(reqs),
                     "speedup": st.tokens_per_s / plain.tokens_per_s,
                     "accept_len": st.accept_len, "tokens_per_round": st.tokens_per_round,
                     "accept_len_per_batch": [s.accept_len for s in per],
                     "round_ms": 1e3 * st.round_seconds,
                     "check": (token_check(target, plain_reqs, reqs, temperature,
                                           level["factor"], gpu) if compared else None)})
        print(f"  H={level['target_entropy']} T={temperature} bs={rows[-1]['bs']} {rule}: "
              f"{st.tokens_per_s:.0f} tok/s vs plain {plain.tokens_per_s:.0f} "
              f"({rows[-1]['speedup']:.2f}x), accept {st.accept_len:.2f}, "
              f"check {check_cell(rows[-1]['check'])}", flush=True)
    return rows


def run_level(engines, target, rows_of: dict, sizes: Sizes, level: dict, gpu: bool) -> list:
    """Every batch size and temperature of one level."""
    rows = []
    for bs, batches in rows_of.items():
        for temperature in TEMPERATURES:
            rows += run_row(engines, target, batches, sizes, temperature, level, gpu)
    return rows


def run(sizes: Sizes, gpu: bool, overrides: dict, out: Path, command: str) -> dict:
    """Build the target, calibrate the factors, then per level: sharpen, distil, serve, write."""
    t0 = time.perf_counter()
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)                                   # as `presets.setup`
    target, head, pre = build(sizes.preset, device, torch.bfloat16 if gpu else torch.float32)
    rows_of = {bs: row_batches(bs, sizes.requests, target.cfg.vocab_size)
               for bs in sizes.batches}
    prompts = [p for batches in rows_of.values() for batch in batches for p in batch]
    logits = prompt_logits(target, prompts)                 # [positions, V] at factor 1
    factors = [calibrate(logits, h) for h in ENTROPIES]
    del logits
    base = target.lm_head.weight.detach().clone()
    engines, result = None, {"levels": [], "rows": []}
    for i, (entropy, factor) in enumerate(zip(ENTROPIES, factors)):
        sharpen(target, base, factor)
        level = {"target_entropy": entropy, "factor": factor,
                 "entropy_prompts": mean_entropy_at(prompt_logits(target, prompts), 1.0)}
        print(f"level {i}: lm_head x {factor:.3f}, mean entropy at T=1 on the prompts "
              f"{level['entropy_prompts']:.3f} nats (target {entropy})", flush=True)
        level["distill"] = level_head(target, head, pre, overrides, sizes.lm_head, first=i == 0)
        engines = engines or build_engines(target, head, sizes, gpu)
        result["rows"] += run_level(engines, target, rows_of, sizes, level, gpu)
        level["entropy_generated"] = pooled_entropy(result["rows"], entropy)
        result["levels"].append(level)
        # after every level: a run cut short keeps the levels it finished
        result["png"] = write(out, sizes, result, gpu, command, time.perf_counter() - t0)
    return result


def pooled_entropy(rows: list[dict], target_entropy: float) -> dict:
    """{temperature: mean entropy over the level's plain runs at it, weighted by tokens}."""
    out = {}
    for t in TEMPERATURES:
        runs = {r["bs"]: r["plain"] for r in rows
                if r["target_entropy"] == target_entropy and r["temperature"] == t}
        tokens = sum(p["tokens"] for p in runs.values())
        out[str(t)] = sum(p["entropy"] * p["tokens"] for p in runs.values()) / max(tokens, 1)
    return out


def summary(rows: list[dict]) -> dict:
    """The checks over all rows: compared rows passed, the lowest re-draw agreement, and
    whether all passed (every compared row, every re-draw without a token far from a boundary)."""
    checked = [r["check"] for r in rows if r["check"] is not None]
    redraw = [r["plain"]["redraw"] for r in rows if r["plain"]["redraw"] is not None]
    return {"compared_rows": len(checked), "passed_rows": sum(c["passed"] for c in checked),
            "greedy_rows": sum(c["kind"] == "greedy" for c in checked),
            "draws_rows": sum(c["kind"] == "draws" for c in checked),
            "redraw_min": min(a["agreement"] for a in redraw) if redraw else None,
            "redraw_other": sum(len(a["other"]) for a in redraw),
            "redraw_near": sum(a["near"] for a in redraw),
            "passed": all(c["passed"] for c in checked) and all(a["passed"] for a in redraw)}


# ------------------------------------------------------------------------------ output

def meta(sizes: Sizes, gpu: bool, command: str, seconds: float) -> dict:
    """What the run was measured on and with: GPU, versions, command, commit, sizes."""
    return {**env_info(command),
            "backend": "cuda (CUDA graphs, torch.compile)" if gpu else "reference (eager, CPU)",
            **asdict(sizes), "temperatures": list(TEMPERATURES), "entropies": list(ENTROPIES),
            "rules": list(RULES), "overlap": True, "wall_s": seconds,
            "tie_tol": TIE_TOL if gpu else 0.0,
            "sharpening": "lm_head.weight x factor; factor by bisection on the mean entropy at "
                          "temperature 1 over every position of the bench's prompts"}


def write(out: Path, sizes: Sizes, result: dict, gpu: bool, command: str, seconds: float):
    """PATH.json, PATH.md and (with matplotlib) PATH.png for out = PATH; returns whether the
    PNG was written."""
    data = {"meta": meta(sizes, gpu, command, seconds), "levels": result["levels"],
            "rows": result["rows"], "checks": summary(result["rows"])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text("\n".join(markdown(data)) + "\n")
    return plot(data, out.with_suffix(".png"))


def markdown(data: dict) -> list[str]:
    m, checks = data["meta"], data["checks"]
    lines = [f"# EAGLE speculative sampling against the target's entropy ({m['date']})", "",
             f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['commit']}; "
             f"{m['model']} ({m['preset']} preset), {m['backend']}; tree steps={m['tree'][0]} "
             f"topk={m['tree'][1]} k={m['tree'][2]}, draft lm_head {m['lm_head']}; "
             f"{m['new_tokens']} new tokens per request, {m['requests']} requests per batch size "
             f"(at least one batch), each batch timed {m['repeats']}x (median run); overlap "
             f"scheduling on; {m['wall_s']:.0f} s in all", "", f"command: `{m['command']}`", "",
             f"checks {'passed' if checks['passed'] else 'FAILED'}: "
             f"{checks['passed_rows']}/{checks['compared_rows']} compared rows passed "
             f"({checks['greedy_rows']} greedy, {checks['draws_rows']} draws); eager re-draws of "
             f"the plain sampled runs: {checks.get('redraw_other', 0)} tokens other than a near-"
             f"boundary draw ({checks.get('redraw_near', 0)} near), lowest agreement "
             + (f"{checks['redraw_min']:.4f}" if checks['redraw_min'] is not None else "-"), ""]
    lines += level_lines(data) + [""] + speedup_lines(data) + [""] + detail_lines(data)
    return lines


def level_lines(data: dict) -> list[str]:
    lines = ["## Levels: the sharpened target", "",
             "| target entropy at T=1 (nats) | lm_head factor | measured at T=1 on the prompts | "
             "measured on generated tokens, T=0.7 / T=1.0 | head: held-out greedy check | "
             "distillation s |", "|---|---|---|---|---|---|"]
    for lv in data["levels"]:
        d, g = lv["distill"], lv.get("entropy_generated", {})
        lines.append(f"| {lv['target_entropy']} | {lv['factor']:.3f} | "
                     f"{lv['entropy_prompts']:.3f} | {g.get('0.7', 0):.3f} / {g.get('1.0', 0):.3f} "
                     f"| {held_out_note(d.get('held_out'))} | {d['data_s'] + d['train_s']:.1f} |")
    return lines


def speedup_lines(data: dict) -> list[str]:
    """Rows (level, temperature) sorted by the entropy the plain runs sampled at."""
    batches = data["meta"]["batches"]
    lines = ["## Speedup against entropy", "",
             "EAGLE tokens/s over plain decoding's at the same temperature, batch size and level; "
             "in brackets the accept length (tokens per request-round, bonus included). Entropy: "
             "the target's mean next-token entropy at T over the tokens the plain runs "
             "generated (0 at T=0).", "",
             "| entropy at T (nats) | T | level: target H (factor) | "
             + " | ".join(f"bs {bs}: draws / rejection" for bs in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    keys = sorted({(r["target_entropy"], r["temperature"]) for r in data["rows"]},
                  key=lambda k: (entropy_of(data, *k), k))
    for h, t in keys:
        cells = []
        for bs in batches:
            by = {r["rule"]: r for r in data["rows"]
                  if (r["target_entropy"], r["temperature"], r["bs"]) == (h, t, bs)}
            cells.append(" / ".join(f"{by[rule]['speedup']:.2f}x ({by[rule]['accept_len']:.2f})"
                                    if rule in by else "-" for rule in RULES))
        factor = next(lv["factor"] for lv in data["levels"] if lv["target_entropy"] == h)
        lines.append(f"| {entropy_of(data, h, t):.3f} | {t} | {h} ({factor:.2f}) | "
                     + " | ".join(cells) + " |")
    return lines


def entropy_of(data: dict, target_entropy: float, temperature: float) -> float:
    """The plain runs' entropy at `temperature` on one level, pooled over batch sizes."""
    return pooled_entropy(data["rows"], target_entropy)[str(temperature)]


def detail_lines(data: dict) -> list[str]:
    lines = ["## Details", "",
             "Token checks: T=0, each rule against plain greedy (first divergence at a top-2 "
             f"near-tie within TIE_TOL x factor counts as near; TIE_TOL {TIE_TOL} on a GPU, 0 "
             "on the CPU); T>0, draws against plain sampling with the same seeds (near: the draw "
             "within 2 TIE_TOL x factor / T log-odds of both tokens' intervals); rejection "
             "sampling draws other numbers, not compared. Re-draw: the share of a plain sampled "
             "run's tokens an eager dense forward re-draws with the same keys.", "",
             "| target H | T | bs | requests | plain tok/s (ms per step) | draws tok/s (ms per "
             "round) | rejection tok/s (ms per round) | accept len draws / rejection "
             "(per batch: min-max) | draws check | rejection check | re-draw |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = sorted({(r["target_entropy"], r["temperature"], r["bs"]) for r in data["rows"]})
    for key in groups:
        by = {r["rule"]: r for r in data["rows"]
              if (r["target_entropy"], r["temperature"], r["bs"]) == key}
        d, j = by["draws"], by["rejection"]
        p = d["plain"]
        acc = " / ".join(f"{r['accept_len']:.2f} ({min(r['accept_len_per_batch']):.2f}-"
                         f"{max(r['accept_len_per_batch']):.2f})" for r in (d, j))
        redraw = ("-" if p["redraw"] is None else
                  f"{p['redraw']['agreement']:.4f} ({p['redraw']['near']} near, {len(p['redraw']['other'])} other)")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {d['requests']} | {p['tok_s']:.0f} "
                     f"({p['step_ms']:.2f}) | {d['tok_s']:.0f} ({d['round_ms']:.2f}) | "
                     f"{j['tok_s']:.0f} ({j['round_ms']:.2f}) | {acc} | {check_cell(d['check'])} "
                     f"| {check_cell(j['check'])} | {redraw} |")
    return lines


def plot(data: dict, path: Path) -> bool:
    """Speedup against the measured entropy, one panel per batch size, a line per rule; False
    without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    batches = data["meta"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, bs in zip(axes[0], batches):
        for i, (rule, marker) in enumerate(zip(RULES, "os")):
            mine = [r for r in data["rows"] if r["bs"] == bs and r["rule"] == rule]
            pts = sorted((r["plain"]["entropy"], r["speedup"]) for r in mine if r["temperature"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=f"C{i}",
                    label=f"{rule} (T {' / '.join(str(t) for t in TEMPERATURES if t)})")
            anchors = [r["speedup"] for r in mine if not r["temperature"]]
            ax.scatter([0.0] * len(anchors), anchors, marker=marker, facecolors="none",
                       edgecolors=f"C{i}", label=f"{rule}, greedy (one per level)")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=f"bs {bs}", xlabel="target entropy at T (nats; 0: greedy)",
               ylabel="speedup vs plain decoding")
        ax.legend(fontsize=8)
    fig.suptitle(f"EAGLE speculative sampling, {data['meta']['gpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke mode: reference backend, tiny target and sizes")
    ap.add_argument("--out", default=None,
                    help="output path without suffix: writes .md, .json, .png (default "
                         "$OUT/eagle_sampling where OUT is set, as the other benches, else "
                         "results/eagle_sampling; --tiny: eagle_sampling_tiny, under "
                         "results/local/ without OUT)")
    ap.add_argument("--new-tokens", type=int, default=None, help="per request")
    ap.add_argument("--requests", type=int, default=None,
                    help="distinct requests per batch size (at least one batch)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per batch (median)")
    ap.add_argument("--distill-steps", type=int, default=None,
                    help="training steps of each level's distillation (default: the preset's)")
    ap.add_argument("--distill-seqs", type=int, default=None,
                    help="greedy sequences of the target each head is distilled on")
    args = ap.parse_args(argv)
    for name in ("new_tokens", "requests", "repeats", "distill_steps", "distill_seqs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = not args.tiny
    if gpu and not torch.cuda.is_available():
        print("no GPU: run with --tiny for the CPU smoke mode", file=sys.stderr)
        return 2
    if not gpu:
        torch.set_num_threads(1)   # 2 OpenMP threads on 2 shared cores spin (examples/eagle.py)
    base = TINY_SIZES if args.tiny else GPU_SIZES
    sizes = Sizes(**{**asdict(base), **{k: getattr(args, k) for k in
                                        ("new_tokens", "requests", "repeats")
                                        if getattr(args, k) is not None}})
    overrides = {k: v for k, v in (("steps", args.distill_steps), ("n_seq", args.distill_seqs))
                 if v is not None}
    name = "eagle_sampling_tiny" if args.tiny else "eagle_sampling"
    default = Path(os.environ["OUT"]) / name if os.environ.get("OUT") else \
        ROOT / "results" / ("local" if args.tiny else "") / name
    out = Path(args.out) if args.out else default
    out = out.with_suffix("") if out.suffix in (".md", ".json", ".png") else out
    command = " ".join(["python -m bench.bench_eagle_sampling"] + sys.argv[1:]
                       if argv is None else ["python -m bench.bench_eagle_sampling", *argv])
    result = run(sizes, gpu, overrides, out, command)
    print(out.with_suffix(".md").read_text(), flush=True)
    if not result["png"]:
        print(f"matplotlib not installed: no {out.with_suffix('.png').name}", flush=True)
    checks = summary(result["rows"])
    print(f"wrote {out.name}.md / .json; checks "
          f"{'passed' if checks['passed'] else 'FAILED'}: {checks}", flush=True)
    return 0 if checks["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
