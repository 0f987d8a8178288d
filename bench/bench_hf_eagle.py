"""Benchmark: EAGLE on a Hugging Face model through padgraph.hf against padgraph.hf's greedy decoder,
in one process on the same weights.

  greedy   padgraph.hf.Decoder(model, torch_compile=True): one decode-program replay per token
  eagle    padgraph.hf.Decoder(model, torch_compile=True, draft=Eagle(...)): an EAGLE head
           distilled from the model here, then padgraph.llm's prefill / draft / verify /
           draft-extend programs over the model's own layers

The model is bench_hf's (Llama-3.2-1B shape or a ~1.1B Qwen3, random bf16 weights) with its token
embedding redrawn from N(0, 1), as the main job's target: with HF's 0.02 init the residual stream
hardly depends on the token and a random model's greedy text is a near-constant loop, which says
nothing about a draft. Per batch size (prompts of CTX tokens): tokens/s of `generate(...,
max_new_tokens=NEW)` (median of REPEATS runs, prefill included), EAGLE's accept length (tokens per
request-round), the speedup, and the rows whose tokens equal greedy's (a difference at a bf16
near-tie of the top two logits is possible and counted as such by the main job's rule, not here:
this reports exact rows).

    python bench/bench_hf_eagle.py --model llama1b|qwen3 [--sizes 1,4,16]
    python bench/bench_hf_eagle.py --tiny --device cpu         # smoke: tiny fp32, reference backend
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import transformers

import padgraph.hf as pghf
try:
    from bench.common import command_line
except ImportError:         # run by its path: bench/ is on sys.path, the repository root is not
    from common import command_line

from bench_hf import Clock, build_model     # run as a script, like bench_hf: bench/ is on sys.path

CTX, NEW, REPEATS = 128, 128, 3
DISTIL = {"llama1b": dict(n_seq=256, prompt_len=16, gen_len=48, steps=300, lr=3e-4),
          "qwen3": dict(n_seq=256, prompt_len=16, gen_len=48, steps=300, lr=3e-4),
          "tiny": dict(n_seq=16, prompt_len=8, gen_len=16, steps=30, lr=3e-3)}


def timed_generate(dec, ids, clock: Clock):
    """(tokens [n, NEW], median seconds of a whole generate) over REPEATS runs after one warm run."""
    mask = torch.ones_like(ids)
    out = dec.generate(ids, mask, max_new_tokens=NEW)
    secs = [clock.seconds(lambda: dec.generate(ids, mask, max_new_tokens=NEW))[1] for _ in range(REPEATS)]
    return out[:, ids.shape[1]:], statistics.median(secs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama1b", choices=["llama1b", "qwen3"])
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny fp32 model (smoke run)")
    args = ap.parse_args()
    global CTX, NEW
    if args.tiny:
        CTX, NEW = 12, 16
    device = torch.device(args.device)
    backend = "cuda" if device.type == "cuda" else "reference"
    sizes = [int(s) for s in args.sizes.split(",")]
    model = build_model(args.model, args.tiny, device, torch.float32 if args.tiny else torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0, generator=torch.Generator(device).manual_seed(1))
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(1, model.config.vocab_size, (n, CTX), generator=gen).to(device) for n in sizes}
    clock, max_len = Clock(device), CTX + NEW
    greedy, t_greedy = clock.seconds(lambda: pghf.Decoder(model, max_batch=max(sizes), max_len=max_len,
                                                          backend=backend, torch_compile=True))
    draft = pghf.Eagle(distill=DISTIL["tiny" if args.tiny else args.model], log=print)
    eagle, t_eagle = clock.seconds(lambda: pghf.Decoder(model, max_batch=max(sizes), max_len=max_len,
                                                        backend=backend, torch_compile=True, draft=draft))
    rows = []
    for n, ids in prompts.items():
        want, s_greedy = timed_generate(greedy, ids, clock)
        got, s_eagle = timed_generate(eagle, ids, clock)
        st = eagle.last_stats
        rows.append({"bs": n, "greedy_tok_s": n * NEW / s_greedy, "eagle_tok_s": n * NEW / s_eagle,
                     "speedup": s_greedy / s_eagle, "accept_len": st.accepted / max(st.request_rounds, 1),
                     "rows_equal": int((got == want).all(1).sum())})
        r = rows[-1]
        print(f"bs={n:>3} greedy {r['greedy_tok_s']:9.1f} tok/s  eagle {r['eagle_tok_s']:9.1f} tok/s  "
              f"{r['speedup']:.2f}x  accept {r['accept_len']:.2f}  rows equal {r['rows_equal']}/{n}", flush=True)
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "transformers": transformers.__version__, "command": command_line(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "none (cpu)",
            "model": f"{args.model}{' (tiny)' if args.tiny else ''}", "ctx": CTX, "new_tokens": NEW,
            "warmup_s": {"greedy": t_greedy, "eagle (distillation included)": t_eagle},
            "distill": eagle.distilled}
    lines = [f"# bench_hf_eagle — {info['date']}, {info['gpu']}, torch {info['torch']}, "
             f"transformers {info['transformers']}", f"command: `{info['command']}`; {info['model']}; prompts of "
             f"{CTX} tokens, {NEW} new; warm-up s: {t_greedy:.1f} greedy, {t_eagle:.1f} EAGLE (distillation "
             f"included)", "", "| bs | greedy tok/s | EAGLE tok/s | speedup | accept len | rows equal greedy's |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['greedy_tok_s']:.1f} | {r['eagle_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['accept_len']:.2f} | {r['rows_equal']}/{r['bs']} |" for r in rows]
    out = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results" / "local")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_hf_eagle_{args.model}"
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"env": info, "rows": rows}, indent=1, default=str))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
