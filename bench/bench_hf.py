"""Benchmark: a Hugging Face causal LM (random weights, bf16) decoding greedily through
padgraph.hf against HF's own ways, in one process on the same weights.

  hf-eager      model.forward + StaticCache at the raw batch size (eager, HF's SDPA attention)
  hf-auto       HF's shipped auto-compile path: generate(past_key_values=StaticCache(...)), which
                compiles the forward by itself (its step time: the difference of two generate
                lengths over the difference of their tokens)
  hf-compiled   torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
                + StaticCache, every cache tensor marked a static address (keys, values and the
                write counters), so inductor's cudagraphs are not skipped for "mutated inputs"
  padgraph      padgraph.hf.Decoder: padgraph.llm's engine over the model, HF's eager forward inside
                its decode program's CUDA graphs
  pg+compile    the same with torch_compile=True: the decoder layers compiled as regions (one
                graph they all share), with the final norm and the rotary embedding, size-obliviously
  pg+whole      torch_compile="whole": the whole forward, one size-oblivious trace for the ladder
  pg+compile-dyn  torch_compile={} (the whole forward, torch's dynamic shapes)

For hf-auto and hf-compiled every "skipping cudagraphs" reason torch logs is printed and the
count of torch's `counters["inductor"]["cudagraph_skips"]` kept: a peer whose graphs were skipped
is VOID in the table (its time is a host-bound path, not a compiled graph); one for which dynamo
compiled no graph at all (generate's auto-compile criteria refused it) is UNCOMPILED.

Models (`MODELS`): llama1b, qwen3, and bamba1b, a hybrid: transformers' Bamba (Mamba2 layers and
attention layers) at Llama-1B's widths, the shape of bench_hybrid's reference hybrid. For it HF's
own paths are the same four: transformers 5.25's StaticCache holds a Mamba layer's convolution
window and SSM state in place at static addresses (`LinearAttentionLayer`), so `generate`
auto-compiles with it and reduce-overhead keeps its cudagraphs; its Mamba layers run the CUDA
kernels of mamba_ssm / causal_conv1d where those are installed and transformers' torch code
otherwise (the page says which). padgraph.hf serves a hybrid through HF's linear-attention cache
API (`Cache.get_conv_state`, ...), which transformers 5.17 lacks: there the benchmark refuses
the model, naming the version, before it builds anything. It prints the transformers version
and where it was imported from first (a newer one carried on PYTHONPATH shows there).

Per batch size (1, 4, 16, 64; prompts of CTX random tokens): ms per decode step (HF's static-cache
peers: median over ITERS steps, CUDA events, each step writing the next position; hf-auto and
padgraph, whose loops are their generate calls: the difference of two generate lengths over the
difference of their tokens, so padgraph's step is its engine's round, host bookkeeping included),
and the first STEPS greedy tokens against hf-eager's (rows equal; bf16 near-ties of a random model
may differ). --profile lists the step kernels of the peers timed step by step. Warm-up: padgraph's
`Decoder(...)` for the whole ladder against the calls that compiled and recorded HF's graphs.
Writes bench_hf_<model>.md and .json to $OUT (or results/local).

    python bench/bench_hf.py --model llama1b|qwen3|bamba1b [--sizes 1,4,16,64] [--variants ...]
    python bench/bench_hf.py --tiny --device cpu          # smoke: tiny fp32, CUDA-only peers skipped
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
import transformers.generation.utils
from transformers import StaticCache

import padgraph.hf as pghf
try:
    from bench.common import command_line, git_commit, plot_step_times, split_ties, tie_margin
except ImportError:         # run by its path: bench/ is on sys.path, the repository root is not
    from common import command_line, git_commit, plot_step_times, split_ties, tie_margin
from padgraph.hf.support import linear_cache_api

SIZES = [1, 4, 16, 64]
VARIANTS = ["hf-eager", "hf-auto", "hf-compiled", "padgraph", "pg+compile", "pg+whole", "pg+compile-dyn"]
PG_COMPILE = {"padgraph": False, "pg+compile": True, "pg+whole": "whole", "pg+compile-dyn": {}}  # torch_compile
# generate's cache keyword: `past_key_values` through transformers 5.17, `cache` after (the old name warns)
CACHE_KWARG = "cache" if "cache" in getattr(transformers.generation.utils, "ALL_CACHE_NAMES", ()) \
    else "past_key_values"
RUN_ORDER = ["hf-eager", "pg+compile", "pg+whole", "hf-compiled", "hf-auto", "padgraph", "pg+compile-dyn"]   # hf-eager: the token reference
CUDA_ONLY = {"hf-auto", "hf-compiled"}
CTX, STEPS, ITERS, HEADROOM = 256, 16, 50, 128      # STEPS + ITERS + warm steps fit in HEADROOM
PROFILE: set[int] = set()                           # --profile: the batch sizes whose step kernels are listed


# --model -> (transformers config class, causal-LM class, the shape the page states)
MODELS = {
    "llama1b": ("LlamaConfig", "LlamaForCausalLM", "Llama-3.2-1B's shape"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3-1.7B's widths, 16 layers"),
    "bamba1b": ("BambaConfig", "BambaForCausalLM",
                "Bamba (Mamba2 + attention), Llama-3.2-1B's widths: 16 layers, attention at layers "
                "3, 7, 11, 15 (32 heads, 8 KV heads of 64), Mamba2 elsewhere (32 heads of 64, "
                "d_state 128, 1 group, conv 4, expand 1), SwiGLU 8192, vocab 128256, untied"),
}
HYBRIDS = {"bamba1b"}            # recurrent mixers: padgraph.hf needs HF's linear-attention cache API


def model_config(name: str, tiny: bool):
    """Llama-3.2-1B's shape, Qwen3-1.7B's with 16 layers (~1.2B), or Bamba at Llama-1B's widths
    (`MODELS`); tiny: 2 layers, hidden 64 (Bamba: a Mamba2 layer, then an attention layer)."""
    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if name == "bamba1b":
        return transformers.BambaConfig(**bamba_size(tiny), **common)
    if tiny:
        size = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    elif name == "llama1b":
        size = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    else:
        size = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                    tie_word_embeddings=True)
    return getattr(transformers, MODELS[name][0])(**size, **common)


def bamba_size(tiny: bool) -> dict:
    """BambaConfig's fields: the 1B-like shape of `MODELS["bamba1b"]` (bench_hybrid's hybrid
    reference model has the same), or the tiny one. Attention heads are hidden / heads wide."""
    if tiny:
        return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                    mamba_n_heads=8, mamba_d_head=8, mamba_expand=1, mamba_d_state=16, mamba_n_groups=1,
                    mamba_chunk_size=16, max_position_embeddings=1024)
    return dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                attn_layer_indices=[3, 7, 11, 15], num_attention_heads=32, num_key_value_heads=8,
                mamba_n_heads=32, mamba_d_head=64, mamba_expand=1, mamba_d_state=128, mamba_n_groups=1,
                mamba_d_conv=4, max_position_embeddings=8192, tie_word_embeddings=False)


def build_model(name: str, tiny: bool, device, dtype):
    cfg = model_config(name, tiny)
    cls = getattr(transformers, MODELS[name][1])
    torch.manual_seed(0)
    with torch.device(device):
        return cls._from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()


def refuse_unservable(name: str) -> None:
    """SystemExit naming the transformers version where padgraph.hf cannot serve `name`: a hybrid
    keeps its recurrent state through HF's linear-attention cache API (get_conv_state /
    update_conv_state, get_recurrent_state / update_recurrent_state), which older Caches lack."""
    if name in HYBRIDS and not linear_cache_api():
        raise SystemExit(
            f"bench_hf: --model {name} needs transformers' linear-attention cache API (Cache.get_conv_state, "
            f"update_conv_state, get_recurrent_state, update_recurrent_state), which transformers "
            f"{transformers.__version__} (at {Path(transformers.__file__).parent}) does not have; "
            "padgraph.hf refuses hybrids there. Run it with a transformers that has it (5.25 does) first on "
            "PYTHONPATH.")


HF_KERNELS = {"mamba_ssm": "selective_state_update / mamba_chunk_scan_combined",
              "causal_conv1d": "causal_conv1d_update / causal_conv1d_fn"}


def hf_mamba_path(name: str) -> str:
    """Which Mamba code HF's peers run for a hybrid: the CUDA kernel packages where importable
    (transformers' `use_kernel_func_from_hub_with_fallback` takes them), its torch code otherwise."""
    if name not in HYBRIDS:
        return ""
    have = {pkg: importlib.util.find_spec(pkg) is not None for pkg in HF_KERNELS}
    found = [f"{pkg} ({HF_KERNELS[pkg]})" for pkg, ok in have.items() if ok]
    missing = [pkg for pkg, ok in have.items() if not ok]
    if not missing:
        return "HF's Mamba layers run the CUDA kernels of " + ", ".join(found)
    return (f"HF's Mamba layers run transformers' torch code for what {', '.join(missing)} (not installed) "
            "would do" + (f"; the kernels of {', '.join(found)}" if found else "")
            + "; HF hub kernels off (use_kernels not set)")


# ---- measuring ----------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU, perf_counter on a CPU (smoke runs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def median_ms(self, step, iters: int) -> float:
        """step(i) for i in 0..iters-1 (each its own position); median ms of one step."""
        times = []
        for i in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(i)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step(i)
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


class Skips:
    """torch's cudagraph skips while the block runs: the counter's delta and the logged reasons;
    `graphs`: the graphs dynamo compiled meanwhile (0: the peer ran its forward uncompiled)."""

    LOGGER = "torch._inductor.cudagraph_utils.__cudagraphs"

    def __enter__(self):
        from torch._dynamo.utils import counters
        self.reasons, self.counters = [], counters
        keep = self.reasons

        class Keep(logging.Handler):
            def emit(self, record):
                if "skipping cudagraphs" in record.getMessage():
                    keep.append(record.getMessage())
        self.handler, self.start = Keep(), counters["inductor"]["cudagraph_skips"]
        self.graphs_start = counters["stats"]["unique_graphs"]
        logging.getLogger(self.LOGGER).addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        logging.getLogger(self.LOGGER).removeHandler(self.handler)
        self.count = self.counters["inductor"]["cudagraph_skips"] - self.start
        self.graphs = self.counters["stats"]["unique_graphs"] - self.graphs_start


@dataclass
class Run:
    """One peer at one batch size."""

    toks: torch.Tensor              # [bs, STEPS] greedy tokens
    step_ms: float
    warm_s: float                   # seconds of the calls that compiled / recorded graphs
    skips: "Skips | None" = None
    margins: tuple | None = None    # hf-eager: (top-2 gap, tie tolerance), each [bs, STEPS]
    timed: object = None            # timed(i): the step that was timed (i < ITERS), for --profile


# ---- the peers ----------------------------------------------------------------------------------
def run_hf_static(model, ids, clock: Clock, compiled: bool):
    """hf-eager / hf-compiled: prefill eagerly into a StaticCache, then one forward per step."""
    forward = model.forward
    if compiled:
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    bs = ids.shape[0]
    cache = StaticCache(config=model.config, max_cache_len=CTX + HEADROOM)
    margins = []                                      # hf-eager: (top-2 gap, tie tolerance) per step
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    tok = logits.argmax(-1)
    margins.append(tie_margin(logits))
    mark_static(cache)                                # after the prefill: its layers are allocated now
    pos = torch.arange(CTX, CTX + HEADROOM, device=ids.device)[:, None].expand(-1, bs).contiguous()  # [HEADROOM, bs]

    def step(tok, i):
        with torch.no_grad():
            logits = forward(input_ids=tok[:, None], position_ids=pos[i][:, None], past_key_values=cache,
                             use_cache=True).logits[:, -1]
        if not compiled:
            margins.append(tie_margin(logits))
        return logits.argmax(-1).clone()              # cudagraph outputs are reused by the next replay

    with Skips() as skips:
        toks, warm = greedy(step, tok, clock)
    timed = lambda i: step(toks[:, -1], STEPS + i)                                  # noqa: E731
    ms = clock.median_ms(timed, ITERS)
    gap_tol = None if compiled else tuple(torch.stack(m[:STEPS], 1) for m in zip(*margins))   # [bs, STEPS] each
    return Run(toks, ms, warm, skips, gap_tol, timed)


def mark_static(cache) -> None:
    """Every tensor of every cache layer a static address: keys, values, write counters."""
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor):
                torch._dynamo.mark_static_address(t)


def greedy(step, tok, clock: Clock):
    """STEPS greedy tokens from the prefill's token; seconds the first 3 steps took (warm-up)."""
    toks = [tok]
    clock.sync()
    t0, warm = time.perf_counter(), 0.0
    for i in range(STEPS - 1):
        toks.append(step(toks[-1], i))
        if i == 2:
            clock.sync()
            warm = time.perf_counter() - t0
    return torch.stack(toks, 1), warm


def run_hf_auto(model, ids, clock: Clock):
    """HF's generate with a static cache, which compiles the forward itself. Every call gets a
    fresh StaticCache of one length (CTX + HEADROOM): with `cache_implementation="static"` the
    cache is sized by each call's `max_new_tokens`, so the two timed lengths recompiled the
    forward (their step time then held compile time) and cudagraph trees failed on the change.
    Each batch size starts from `torch._dynamo.reset()`, as a process serving one size would: on
    the H200 (torch 2.11, transformers 5.17) generate ran bs 1, then failed inside torch's
    cudagraph trees at bs 4 ("length mismatch between inputs, recorded_data_ptr, and
    placeholders") with the first size's graphs still held."""
    torch._dynamo.reset()
    def gen(n):
        cache = StaticCache(config=model.config, max_cache_len=CTX + HEADROOM)
        with torch.no_grad():
            return model.generate(ids, do_sample=False, max_new_tokens=n, **{CACHE_KWARG: cache})
    with Skips() as skips:
        out, warm = clock.seconds(lambda: gen(STEPS))
    _, short = clock.seconds(lambda: gen(STEPS))
    _, long = clock.seconds(lambda: gen(STEPS + ITERS))
    return Run(out[:, CTX:], (long - short) * 1e3 / ITERS, warm, skips)


def run_padgraph(dec, ids, clock: Clock):
    """padgraph.hf.Decoder: generate (the engine's prefill, then one decode round a token); a
    step is the difference of two generate lengths over the difference of their tokens. Both
    lengths run once untimed first: without that, the first batch size timed held a one-time
    cost of the longer generate (an H100, Bamba with torch_compile=True: 18.5 ms a step at bs 1,
    timed first, against 2.5 ms at bs 4 after it)."""
    def gen(n):
        return dec.generate(ids, torch.ones_like(ids), max_new_tokens=n)[:, ids.shape[1]:]
    toks, warm = clock.seconds(lambda: gen(STEPS))
    _, warm_long = clock.seconds(lambda: gen(STEPS + ITERS))
    warm += warm_long
    _, short = clock.seconds(lambda: gen(STEPS))
    _, long = clock.seconds(lambda: gen(STEPS + ITERS))
    return Run(toks, (long - short) * 1e3 / ITERS, warm)


def kernel_profile(timed, steps: int = 20, top: int = 25) -> list[str]:
    """The GPU kernels of `steps` timed steps (torch.profiler; kernels inside CUDA graphs are
    reported one by one): per step, each kernel name's launches and microseconds, the busiest first."""
    from torch.profiler import ProfilerActivity, profile
    for i in range(3):
        timed(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            timed(i)
        torch.cuda.synchronize()
    by: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n_us = by.setdefault(e.name, [0, 0.0])
            n_us[0] += 1
            n_us[1] += e.time_range.elapsed_us()
    busy = sum(us for _, us in by.values()) / steps
    lines = [f"  {sum(n for n, _ in by.values()) / steps:.0f} kernels a step, {busy:.1f} us of kernel time a step"]
    for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {n / steps:6.1f} x {us / n:7.2f} us = {us / steps:8.1f} us  {name[:110]}")
    return lines


# ---- the run ------------------------------------------------------------------------------------
def run_variant(name, model, prompts, clock, results, backend):
    dec = None
    if name in PG_COMPILE:
        dec, secs = clock.seconds(lambda: pghf.Decoder(model, max_batch=max(prompts), max_len=CTX + HEADROOM,
                                                       backend=backend, torch_compile=PG_COMPILE[name]))
        st, ladder = dec.worker.runner("decode").stats, list(dec.worker.programs["decode"].buckets)
        results["warmup"][name] = {"seconds": secs, "ladder": ladder,
                                   "compiles": st.compiles, "compile_seconds": st.compile_seconds}
        print(f"{name}: Decoder(...) {secs:.1f} s for the ladder {ladder} "
              f"({st.compiles} compiles, {st.compile_seconds:.1f} s of it compiling)", flush=True)
    warm_total, skip_total, graphs, reasons = 0.0, 0, 0, []
    for bs, ids in prompts.items():
        if dec is not None:
            run = run_padgraph(dec, ids, clock)
        elif name == "hf-auto":
            run = run_hf_auto(model, ids, clock)
        else:
            run = run_hf_static(model, ids, clock, compiled=name == "hf-compiled")
        warm_total += run.warm_s
        if run.skips is not None:
            skip_total += run.skips.count
            graphs += run.skips.graphs
            reasons += [r for r in run.skips.reasons if r not in reasons]
        record(results, name, bs, run)
        if PROFILE and bs in PROFILE and run.timed is not None:
            lines = kernel_profile(run.timed)
            results["profiles"][f"{name} bs={bs}"] = lines
            print(f"profile {name} bs={bs}:", *lines, sep="\n", flush=True)
    if dec is None and name != "hf-eager":
        results["warmup"][name] = {"seconds": warm_total, "cudagraph_skips": skip_total, "skip_reasons": reasons,
                                   "compiled_graphs": graphs}
        print(f"{name}: warm-up {warm_total:.1f} s; {graphs} graphs compiled; cudagraph skips {skip_total}: "
              f"{reasons or 'none logged'}{'; ' + UNCOMPILED if not graphs else ''}", flush=True)


def record(results, name, bs, run: Run):
    if name == "hf-eager":
        results["reference"][bs] = run
    ref = results["reference"].get(bs)
    equal, ties, far = judge(run.toks, ref)
    results["rows"].append({"bs": bs, "variant": name, "step_ms": run.step_ms, "rows_equal": equal,
                            "near_ties": ties, "far_gaps_ulps": far})
    print(f"bs={bs:>3} {name:<12} step {run.step_ms:8.3f} ms  tokens: {equal}/{bs} rows equal hf-eager's, "
          f"{ties} more first differ at a near tie", flush=True)


def judge(toks, ref: Run | None) -> tuple[int, int, list]:
    """(rows equal to hf-eager's, rows whose first difference is at a near tie of hf-eager's top 2,
    the top-2 gap in ulps at the first difference of each other differing row)."""
    if ref is None:
        return -1, 0, []
    same = toks == ref.toks                                                          # [bs, STEPS]
    equal = int(same.all(1).sum())
    if ref.margins is None:
        return equal, 0, []
    first = (~same).int().argmax(1)                                                  # first differing step
    gap, tol = (m.gather(1, first[:, None])[:, 0] for m in ref.margins)
    return equal, *split_ties(~same.all(1), gap, tol)


UNCOMPILED = ("UNCOMPILED: dynamo compiled no graph while this peer ran (for hf-auto: generate's auto-compile "
              "criteria refused the model or its cache), so its times are eager ones")


def void(results, name) -> bool:
    return results["warmup"].get(name, {}).get("cudagraph_skips", 0) > 0


def mark(results, name) -> str:
    """' VOID' (torch skipped the peer's cudagraphs), ' UNCOMPILED' (nothing compiled), or ''."""
    w = results["warmup"].get(name, {})
    if w.get("compiled_graphs", 1) == 0:
        return " UNCOMPILED"
    return " VOID" if void(results, name) else ""


def table(results, names, sizes, info) -> list[str]:
    by = {(r["bs"], r["variant"]): r for r in results["rows"]}
    def cell(bs, v):
        r = by.get((bs, v))
        if r is None:
            return "-"
        ties = f" +{r['near_ties']} ties" if r.get("near_ties") else ""
        ties += f"; beyond a tie: {r['far_gaps_ulps']} ulps" if r.get("far_gaps_ulps") else ""
        return f"{r['step_ms']:.3f}{mark(results, v)} ({r['rows_equal']}/{bs}{ties})"
    lines = [f"# bench_hf — {info['date']}, {info['gpu']}, torch {info['torch']}, transformers {info['transformers']}",
             f"command: `{info['command']}`; {info['model']}; prompts of {CTX} tokens; (rows whose "
             f"{STEPS} greedy tokens equal hf-eager's, + those first differing at a near tie of its "
             f"top 2: within 4 ulps); VOID: torch skipped the peer's cudagraphs; UNCOMPILED: nothing was "
             "compiled for the peer", "",
             f"shape: {info['shape']}" + (f"; {info['hf_path']}" if info.get("hf_path") else ""), "",
             "| bs | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {bs} | " + " | ".join(cell(bs, v) for v in names) + " |" for bs in sizes]
    lines += [f"- {v} FAILED: {why}" for v, why in results["failed"].items()]
    lines += ["", "warm-up:", ""]
    for v, w in results["warmup"].items():
        extra = (f"; {w['compiled_graphs']} graphs compiled; cudagraph skips {w['cudagraph_skips']}: "
                 f"{w['skip_reasons'] or 'none logged'}{'; ' + UNCOMPILED if not w['compiled_graphs'] else ''}"
                 if "cudagraph_skips" in w else f"; ladder {w['ladder']}, torch.compile graphs {w['compiles']}")
        lines.append(f"- {v}: {w['seconds']:.1f} s{extra}")
    return lines


def report(results, names, sizes, info) -> None:
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results" / "local")
    out.mkdir(parents=True, exist_ok=True)
    lines = table(results, names, sizes, info)
    (out / f"{info['stem']}.md").write_text("\n".join(lines) + "\n")
    data = {"env": info, "ctx": CTX, "steps": STEPS, "iters": ITERS, "warmup": results["warmup"],
            "rows": results["rows"], "failed": results["failed"], "profiles": results["profiles"]}
    (out / f"{info['stem']}.json").write_text(json.dumps(data, indent=1, default=str))
    plot_step_times([{**r, "step_us": r["step_ms"] * 1e3} for r in results["rows"]], names,
                    out / f"{info['stem']}.png", f"{info['model'].split(',')[0]} decode step", "step time (ms)")
    print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama1b", choices=list(MODELS))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model (smoke run)")
    ap.add_argument("--iters", type=int, default=50, help="timed decode steps per peer and size")
    ap.add_argument("--profile", default="", help="batch sizes (e.g. 1,64) whose step kernels are listed "
                                                  "per variant (GPU)")
    args = ap.parse_args()
    print(f"transformers {transformers.__version__} from {Path(transformers.__file__).parent}; "
          f"torch {torch.__version__}", flush=True)
    refuse_unservable(args.model)
    global CTX, ITERS, PROFILE
    PROFILE = {int(s) for s in args.profile.split(",") if s} if args.device == "cuda" else set()
    CTX = 16 if args.tiny else CTX
    ITERS = args.iters
    device = torch.device(args.device)
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [v for v in VARIANTS if v in args.variants.split(",")]     # hf-eager first: the token reference
    if device.type != "cuda":
        names = [v for v in names if v not in CUDA_ONLY]
    else:
        torch._logging.set_logs(cudagraphs=True)       # torch prints every "skipping cudagraphs due to ..."
        torch._dynamo.config.recompile_limit = 64      # hf-auto, hf-compiled: a graph per size, never eager fallback
    model = build_model(args.model, args.tiny, device, torch.float32 if args.tiny else torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(1, model.config.vocab_size, (n, CTX), generator=gen).to(device) for n in sizes}
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none (cpu)",
            "transformers": transformers.__version__, "stem": f"bench_hf_{args.model}", "command": command_line(),
            "commit": git_commit(),
            "model": f"{args.model}{' (tiny)' if args.tiny else ''}, {model.num_parameters() / 1e9:.2f}B params, "
                     f"{next(model.parameters()).dtype}",
            "shape": "tiny: 2 layers, hidden 64" if args.tiny else MODELS[args.model][2],
            "config": bamba_size(args.tiny) if args.model in HYBRIDS else None, "hf_path": hf_mamba_path(args.model)}
    if info["hf_path"]:
        print(info["hf_path"], flush=True)
    results = {"rows": [], "warmup": {}, "reference": {}, "failed": {}, "profiles": {}}
    backend = "cuda" if device.type == "cuda" else "reference"
    for name in sorted(names, key=RUN_ORDER.index):  # padgraph's compiled path and its best peer first
        torch._dynamo.reset()       # each compiled path starts from no dynamo / cudagraph-tree state
        try:
            run_variant(name, model, prompts, Clock(device), results, backend)
        except Exception as e:      # a peer that crashes is reported as such; the others still run
            results["failed"][name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{name}: FAILED: {results['failed'][name]}", flush=True)
        report(results, names, sizes, info)              # after every variant: a timeout keeps the rest


if __name__ == "__main__":
    main()
