"""Soak: the EAGLE main job's runner programs (prefill, draft, verify, draft-extend, decode) served
under continuous admission for `--calls` runner calls, with every safety feature on: the canary
(slot 1 and request row 1 of the caches, checked in every replay) and the shadow re-running every
`--every`-th call of each runner eagerly (and the first call of every bucket).

Requests arrive in waves larger than max_bs, with mixed prompt lengths, budgets and sampling
parameters (greedy, temperature 0.7 and 1.0 with top-p / top-k / min-p), so rows and slots are
reused all along. At the end: the runner calls, shadow-verified calls and mismatches, canary
hits (a synchronous `canary_check` of every runner), and the device memory allocated after each
wave: its growth from the first wave to the last, and from the first wave after the last CUDA
graph was captured (a bucket first reached late captures its graph then) to the last; growth
after the last capture means something is kept per call.

    python -m bench.soak [--calls 10000] [--every 50] [--dtypes bf16,fp32] [--tiny]

Writes soak.{md,json} under $OUT (or results/local).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import padgraph as pg
from bench.common import env_info, out_dir
from padgraph.llm import Engine, SpecConfig
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.sampling import SamplingParams

MIXES = (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9),
         SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, min_p=0.05))


def wave(vocab: int, n: int, gen: torch.Generator, max_prompt: int, max_new: int):
    """n requests: random prompts and budgets, sampling parameters cycling through MIXES."""
    lens = torch.randint(4, max_prompt, (n,), generator=gen).tolist()
    news = torch.randint(2, max_new, (n,), generator=gen).tolist()
    prompts = [torch.randint(1, vocab, (m,), generator=gen).tolist() for m in lens]
    return prompts, news, [MIXES[i % len(MIXES)] for i in range(n)]


def runner_calls(engine) -> int:
    return sum(sum(r.stats.calls.values()) + r.stats.eager_fallbacks for r in engine.worker._runners.values())


def shadow_counts(engine) -> tuple[int, int]:
    rs = engine.worker._runners.values()
    return sum(r.stats.shadow_calls for r in rs), sum(r.stats.shadow_mismatches for r in rs)


def captures(engine) -> int:
    return sum(len(r.stats.capture) for r in engine.worker._runners.values())


def soak(args, dtype: torch.dtype, exact: bool) -> dict:
    """One soak at `dtype` with the shadow's exact comparison on or off: its result record."""
    rtol = args.rtol if exact else None
    gpu = torch.cuda.is_available() and not args.tiny
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = LlamaConfig.llama_1b() if gpu else LlamaConfig.tiny(n_layers=2)
    target = LlamaModel(cfg).to(device, dtype).eval()
    head = EagleHead(target).to(device, dtype).eval()     # random: accepts little, calls a lot
    shadow = pg.Shadow(every=args.every, first=1, on_mismatch="log", exact=exact, rtol=rtol)
    engine = Engine(target, head, SpecConfig(steps=3, topk=4, num_draft_tokens=8),
                    backend="cuda" if device == "cuda" else "reference", max_bs=16, max_context=256,
                    buckets=pg.Buckets.default(16), compile_options={"shadow": shadow},
                    torch_compile=False, prefill="runner" if device == "cuda" else "eager")
    gen = torch.Generator().manual_seed(1)
    waves, t0, mem, caps = 0, time.perf_counter(), [], []
    while runner_calls(engine) < args.calls:
        prompts, news, params = wave(cfg.vocab_size, 40, gen, 64, 96)
        mode = engine.generate_spec if waves % 3 else engine.generate_greedy
        with torch.no_grad():
            mode(prompts, news, sampling=params)
        waves += 1
        if device == "cuda":
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
            caps.append(captures(engine))
        print(f"wave {waves}: {runner_calls(engine)} runner calls", flush=True)
    hits = []
    for name, r in engine.worker._runners.items():
        try:
            r.canary_check()
        except pg.CanaryError as e:
            hits.append(f"{name}: {e}")
    verified, mismatches = shadow_counts(engine)
    growth = (mem[-1] - mem[0]) if len(mem) > 1 else 0
    settled = next((i for i in range(len(caps)) if caps[i] == caps[-1]), 0)   # first wave after the last capture
    steady = (mem[-1] - mem[settled]) if mem else 0
    res = {"dtype": str(dtype).removeprefix("torch."), "shadow_exact": exact, "shadow_rtol": rtol,
           "calls": runner_calls(engine), "waves": waves, "seconds": time.perf_counter() - t0,
           "shadow_every": args.every, "shadow_verified": verified, "shadow_mismatches": mismatches,
           "canary_rows": sum(len(r._canary) for r in engine.worker._runners.values() if r._canary is not None),
           "canary_hits": hits, "memory_after_first_wave": mem[0] if mem else None,
           "memory_growth_bytes": growth, "memory_per_wave": mem, "graphs_captured_per_wave": caps,
           "steady_from_wave": settled + 1, "memory_growth_after_last_capture_bytes": steady,
           "model": "llama-1b shape" if gpu else "tiny"}
    res["line"] = (f"soak {res['dtype']} exact={exact} rtol={rtol}: calls={res['calls']} waves={waves} shadow_verified={verified} "
                   f"mismatches={mismatches} canary_rows={res['canary_rows']} canary_hits={len(hits)} "
                   f"memory_growth={growth} bytes (after the last capture, waves {settled + 1}..{waves}: {steady} bytes)")
    print(res["line"], flush=True)
    del engine, target, head
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


DTYPES = {"bf16": (torch.bfloat16, False), "fp32": (torch.float32, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10000, help="runner calls to serve at least, per dtype")
    ap.add_argument("--every", type=int, default=50, help="shadow-verify every N-th call of each runner")
    ap.add_argument("--dtypes", default="bf16,fp32",
                    help="comma-separated, each a soak of its own: bf16 (the shadow's exact comparison off, "
                         "SPEC 7.8: bf16 GEMMs round by row count and the draft's top-k meets near ties) "
                         "and fp32 (exact comparison on); the CPU's --tiny soak runs fp32 only")
    ap.add_argument("--rtol", type=float, default=1e-4,
                    help="the shadow's relative tolerance where the exact comparison is on (fp32): a "
                         "16-layer fp32 forward differs by up to ~4e-5 relative between GEMMs chosen "
                         "for another row count (a prefill of 428 tokens against its bucket of 512); "
                         "a padding bug moves a value by its row's scale")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (the CPU runs this)")
    args = ap.parse_args()
    names = [d for d in args.dtypes.split(",") if d]
    if not names or any(d not in DTYPES for d in names):
        ap.error(f"--dtypes: a comma-separated subset of {sorted(DTYPES)}; got {args.dtypes!r}")
    if args.tiny or not torch.cuda.is_available():
        names = ["fp32"]
    runs = [soak(args, *DTYPES[d]) for d in names]
    command = ("python -m bench.soak" + (" --tiny" if args.tiny else "") + f" --calls {args.calls} "
               f"--every {args.every} --dtypes {','.join(names)} --rtol {args.rtol:g}")
    res = {"env": env_info(), "command": command, "runs": runs}
    out = out_dir()
    (out / "soak.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "soak.md").write_text("# Soak\n\n" + "\n".join(f"- {r['line']}" for r in runs) + "\n")


if __name__ == "__main__":
    main()
