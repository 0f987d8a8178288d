"""Benchmark: a Hugging Face Llama (Llama-3.2-1B shape, bf16, random init) decoding through padgraph
against HF's own ways, all in one process on the same weights:

  hf-eager         model.forward + StaticCache at the raw batch size
  hf-compiled      HF's fast path: torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                   + StaticCache (inductor's own cudagraphs; every "skipping cudagraphs" reason torch
                   logs is printed and recorded, so a host-bound result cannot pass unnoticed)
  padgraph         examples/hf_llama.py's decode program, HF's eager forward inside padgraph's graphs
  padgraph+compile the same with HF's decoder layer compiled inside padgraph's graphs (regional:
                   hf_llama.torch_compile_options, the 16 layers sharing one graph, plus the final
                   norm and the RoPE tables; --pg-compile whole compiles the whole body instead),
                   one compilation serving the whole ladder

Per raw batch size (1, 3, 8, 27, 64; prompts of CTX random tokens, prefilled eagerly): the decode
step time (CUDA events around the call, median after warm-up; the cache holds the prompts' real
K/V and every call writes the next column; padgraph runs at the bucket of pg.Buckets.default(64)),
and the greedy tokens of STEPS steps against hf-eager's. Warm-up: pg.compile for the whole ladder
against hf-compiled's first WARM calls at each measured size (compile, warm-up, graph record).
hf-eager runs first: the others' tokens are compared with it. Writes bench_hf.{md,json,png} to
$OUT (or results/local); the results are rewritten after every variant.

    python examples/bench_hf.py [--sizes 1,3,8] [--variants hf-eager,padgraph] [--tiny --device cpu]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_llama as H  # noqa: E402
from bench.common import CudagraphSkips, env_info, out_dir, plot_step_times  # noqa: E402

from transformers import StaticCache  # noqa: E402

import padgraph as pg  # noqa: E402

SIZES = [1, 3, 8, 27, 64]
VARIANTS = ["hf-eager", "hf-compiled", "padgraph", "padgraph+compile"]
CTX, STEPS, ITERS, WARM = 256, 8, 60, 3
HEADROOM = 96                           # cache columns after the prompt: STEPS + WARM + ITERS fit


class Clock:
    """Step time of fn(): CUDA events on a GPU, perf_counter on a CPU (smoke runs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def median_us(self, fn, iters: int) -> float:
        for _ in range(WARM):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def seconds(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0


# ---- one decoder per variant: prefill(ids) -> tokens [bs]; step(tokens) -> tokens [bs] ------------
class HFDecoder:
    """HF's forward (eager or compiled) over a StaticCache of exactly bs rows."""

    def __init__(self, model, forward, bs: int, max_cache_len: int):
        self.model, self.forward = model, forward
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.pos = None                                                   # [bs, 1] int64

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits
        self.pos = torch.full((ids.shape[0], 1), ids.shape[1], dtype=torch.int64, device=ids.device)
        return logits[:, -1].argmax(-1)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = self.forward(input_ids=tokens[:, None], position_ids=self.pos, past_key_values=self.cache,
                                  use_cache=True).logits
        self.pos = self.pos + 1
        return logits[:, -1].argmax(-1).clone()                          # cudagraph outputs are reused


class PGDecoder:
    """hf_llama's runner: rows [0, bs) of a cache sized for the ladder; every row at one column."""

    def __init__(self, model, runner, cache, seen):
        self.model, self.runner, self.cache, self.seen = model, runner, cache, seen
        self.cols = torch.arange(seen.shape[1], device=seen.device)
        self.write_pos, self.pos = 0, None

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        first, width = H.prefill(self.model, self.cache, self.seen, ids.tolist())
        self.write_pos = width
        self.pos = torch.full((ids.shape[0],), width, dtype=torch.int64, device=ids.device)
        return first

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.runner(input_ids=tokens, position_ids=self.pos,
                          write_pos=self.cols[self.write_pos:self.write_pos + 1]).next_token
        self.write_pos, self.pos = self.write_pos + 1, self.pos + 1
        return out


def greedy(dec, ids: torch.Tensor, clock: Clock) -> tuple[torch.Tensor, float]:
    """([bs, STEPS] greedy tokens after the prompts, seconds of the first WARM decode steps)."""
    toks = [dec.prefill(ids)]
    clock.sync()
    t0 = time.perf_counter()
    for i in range(STEPS - 1):
        toks.append(dec.step(toks[-1]))
        if i == WARM - 1:
            clock.sync()
            warm = time.perf_counter() - t0
    return torch.stack(toks, 1), warm


# ---- the variants -------------------------------------------------------------------------------
def run_hf(model, name: str, sizes, prompts, clock: Clock, results: dict) -> None:
    forward = model.forward
    if name == "hf-compiled":
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    warm = {"seconds": 0.0, "per_size": {}, "cudagraph_skips": 0, "skip_reasons": []}
    for n in sizes:
        dec = HFDecoder(model, forward, n, CTX + HEADROOM)
        with CudagraphSkips() as skips:
            tokens, seconds = greedy(dec, prompts[n], clock)   # the first calls compile and record graphs
        warm["seconds"] += seconds
        warm["per_size"][n] = seconds
        warm["cudagraph_skips"] += skips.count
        warm["skip_reasons"] += [r for r in skips.reasons if r not in warm["skip_reasons"]]
        if name == "hf-compiled":
            print(f"bs={n:>3} {name}: warm-up {seconds:.2f} s; {skips.summary()}", flush=True)
        record(results, name, n, n, clock.median_us(lambda: dec.step(tokens[:, -1]), ITERS), tokens)
    if name == "hf-compiled":
        results["warmup"][name] = warm


def run_pg(model, name: str, sizes, prompts, clock: Clock, results: dict, pg_compile) -> None:
    ladder = list(pg.Buckets.default(max(sizes)))
    cache, seen = H.new_cache(model, ladder[-1], CTX + HEADROOM)
    options = {"torch_compile": H.torch_compile_options(model, pg_compile)} if name == "padgraph+compile" else {}
    if clock.cuda:
        options["progress"] = False
    backend = "cuda" if clock.cuda else "reference"
    with CudagraphSkips() as skips:
        (runner, program, _), seconds = clock.seconds(
            lambda: H.build_runner(model, cache, seen, ladder, backend, **options))
    results["warmup"][name] = {"seconds": seconds, "ladder": ladder, "compiles": runner.stats.compiles,
                               "recompiles": runner.stats.recompiles, "cudagraph_skips": skips.count,
                               "compile_seconds": runner.stats.compile_seconds}
    print(f"{name}: compile {seconds:.2f} s for ladder {ladder}; torch.compile graphs {runner.stats.compiles} "
          f"({runner.stats.recompiles} recompiles)", flush=True)
    dec = PGDecoder(model, runner, cache, seen)
    for n in sizes:
        tokens, _ = greedy(dec, prompts[n], clock)
        bucket = next(b for b in program.buckets if b >= n)
        record(results, name, n, bucket, clock.median_us(lambda: dec.step(tokens[:, -1]), ITERS), tokens)
    results["warmup"][name]["recompiles_after_calls"] = runner.stats.recompiles


def record(results: dict, name: str, n: int, bucket: int, step_us: float, tokens: torch.Tensor) -> None:
    ref = results["tokens"].setdefault(n, tokens) if name == "hf-eager" else results["tokens"].get(n)
    agree = float((tokens == ref).float().mean()) if ref is not None else float("nan")
    rows = int((tokens == ref).all(1).sum()) if ref is not None else -1
    results["rows"].append({"bs": n, "variant": name, "bucket": bucket, "step_us": step_us,
                            "token_agreement": agree, "rows_equal": rows})
    print(f"bs={n:>3} {name:<17} bucket {bucket:>3}  step {step_us / 1e3:7.3f} ms  "
          f"tokens vs hf-eager {agree:.3f} ({rows}/{n} rows equal)", flush=True)


# ---- report ---------------------------------------------------------------------------------------
def report(results: dict, names, sizes, cfg) -> None:
    out = out_dir()
    info = env_info(" ".join(["python"] + sys.argv))
    import transformers
    info["transformers"] = transformers.__version__
    rows = results["rows"]
    data = {"env": info, "config": cfg.to_dict(), "ctx": CTX, "steps": STEPS, "iters": ITERS,
            "warmup": results["warmup"], "rows": rows}
    (out / "bench_hf.json").write_text(json.dumps(data, indent=1, default=str))
    lines = table(rows, names, sizes, info) + warmup_lines(results["warmup"], sizes)
    (out / "bench_hf.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_step_times(rows, names, out / "bench_hf.png", "HF Llama (1B shape, bf16) decode step", "decode step (ms)")


def table(rows, names, sizes, info) -> list[str]:
    by = {(r["bs"], r["variant"]): r for r in rows}
    ratio = lambda n, a, b: (f"{by[(n, a)]['step_us'] / by[(n, b)]['step_us']:.2f}"
                             if (n, a) in by and (n, b) in by else "-")
    cell = lambda n, v: (f"{by[(n, v)]['step_us'] / 1e3:.3f} ({by[(n, v)]['token_agreement']:.2f})"
                         if (n, v) in by else "-")
    lines = [f"# bench_hf — {info['date']}, {info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
             f"transformers {info['transformers']}",
             f"command: `{info['command']}`; prompts of {CTX} tokens, {STEPS} greedy tokens compared with hf-eager", "",
             "decode step ms (median, CUDA events) and (token agreement with hf-eager)", "",
             "| bs | bucket | " + " | ".join(names) + " | pg+compile / hf-compiled | padgraph / hf-compiled |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for n in sizes:
        bucket = next((by[(n, v)]["bucket"] for v in ("padgraph", "padgraph+compile") if (n, v) in by), n)
        lines.append(f"| {n} | {bucket} | " + " | ".join(cell(n, v) for v in names)
                     + f" | {ratio(n, 'padgraph+compile', 'hf-compiled')} | {ratio(n, 'padgraph', 'hf-compiled')} |")
    return lines


def warmup_lines(warm: dict, sizes) -> list[str]:
    lines = ["", "warm-up seconds:", ""]
    hf = warm.get("hf-compiled")
    if hf:
        lines.append(f"- hf-compiled: {hf['seconds']:.1f} s over sizes {list(sizes)} "
                     f"({', '.join(f'{k}: {v:.2f}' for k, v in hf['per_size'].items())}); "
                     + (f"cudagraphs SKIPPED {hf['cudagraph_skips']}x: {hf['skip_reasons'] or 'no reason logged'}"
                        if hf["cudagraph_skips"]
                        else "cudagraphs captured (no skip logged)"))
    for v in ("padgraph", "padgraph+compile"):
        if v in warm:
            w = warm[v]
            rel = f", {w['seconds'] / hf['seconds']:.2f}x hf-compiled's" if hf and hf["seconds"] else ""
            lines.append(f"- {v}: {w['seconds']:.1f} s for the ladder {w['ladder']}{rel}; torch.compile graphs "
                         f"{w['compiles']} ({w['recompiles']} recompiles at compile, "
                         f"{w.get('recompiles_after_calls', '?')} after the calls; "
                         f"{w['compile_seconds']:.1f} s in the calls that compiled)")
    return lines




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model (smoke test)")
    ap.add_argument("--pg-compile", default="regions", choices=["regions", "whole"],
                    help="padgraph+compile: compile each decoder layer (regions) or the whole body")
    args = ap.parse_args()
    names, sizes = args.variants.split(","), [int(s) for s in args.sizes.split(",")]
    device = torch.device(args.device)
    cfg = H.tiny_config() if args.tiny else H.llama_1b_config()
    model = H.build_model(cfg, device, torch.float32 if args.tiny else torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(1, cfg.vocab_size, (n, CTX), generator=gen).to(device) for n in sizes}
    clock = Clock(device)
    results = {"rows": [], "warmup": {}, "tokens": {}}
    order = [v for v in VARIANTS if v in names]                # hf-eager first: the token reference
    for name in order:
        if name.startswith("hf"):
            run_hf(model, name, sizes, prompts, clock, results)
        else:
            run_pg(model, name, sizes, prompts, clock, results, args.pg_compile)
        report(results, order, sizes, cfg)               # after every variant: a timeout keeps the rest


if __name__ == "__main__":
    main()
