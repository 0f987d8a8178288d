"""EAGLE speculative decoding end to end: distil a draft head, serve a batch, compare with greedy.

    python examples/eagle.py --model llama        # or --model deepseek (MLA + MoE, MTP head)

What it does, in order:
1. Builds a target model with random weights and *distils* a draft head from it: the head (one
   decoder layer on top of the target's embedding and lm_head) is trained for a few seconds to
   predict the target's own next greedy token from the target's hidden state. A speculative
   decoder is only as fast as its draft is right, and no published head fits a random target,
   so the run trains its own (`padgraph.llm.distill`).
2. Serves the same requests twice on padgraph's runners: EAGLE (the head drafts a tree of
   tokens, the target verifies the tree in one call) and plain greedy decoding.
3. Checks the oracle: EAGLE's output equals greedy's token for token (`greedy_match=N/N`).

--temperature T (default 0: greedy) samples instead, both runs with the same per-request seeds,
and prints the target's mean next-token entropy at T over the tokens it generated (a random
target's distribution is nearly flat, no real model's is: a low T sharpens it, and the speedup
depends on it). With the default acceptance rule (--spec-sampling draws) EAGLE emits plain
sampling's tokens, and the line checks them (`sampled_match=N/N`); "rejection" emits the same
distribution through other random draws, so no token is compared.

Why the CPU speedup says little, and is often below 1: on the CPU (what CI runs: a tiny
target, fp32, the "reference" backend that runs each program eagerly) a forward's cost grows
with its tokens and with its many small PyTorch ops, so verifying 6 tree tokens costs several
greedy steps and the drafted tokens barely pay for it. On a GPU a verify of k tokens costs about
one decode step (both are memory bound) and the runners replay CUDA graphs, so the same accept
length gives 2x and more (H200: `speedup_vs_greedy` 2.26 Llama 1B, 1.97 DeepSeek-V2-Lite widths).

On a GPU: the Llama-3.2-1B-shaped target (deepseek: DeepSeek-V2-Lite widths, 6 layers, 16
experts; bf16) on the "cuda" backend, 16 requests of varied prompt and output lengths; the
decoder layers and the draft bodies are torch.compile'd once for the whole ladder and captured in
padgraph's graphs. Both loops run with overlap scheduling (round N+1 queued before round N is read
back); "host" is the time the host waits for the previous round's readback and processes it.
The last line is `tokens/s=… accept_len=… speedup_vs_greedy=… greedy_match=N/N`.
"""
from __future__ import annotations

import argparse

import torch

import padgraph as pg
from padgraph.llm import Engine, SpecConfig
from padgraph.llm.sampling import SamplingParams, sampling_probs
from padgraph.llm.oracle import TIE_TOL, compare, first_divergences, oracle_line  # noqa: F401
from padgraph.llm.presets import (DRAFT_COMPILE, DRAFT_LM_HEAD, GPU_TREE, MODELS, WORKLOADS,
                                  setup, workload)

SPEC_PHASES = ("draft", "verify", "draft_extend", "host")
GREEDY_PHASES = ("decode", "host")
CPU_TIMING_NOTE = ("timing on the CPU: 'reference' backend, fp32, tiny sizes, one thread, "
                   "perf_counter. These show how this run's time splits (mostly PyTorch op "
                   "dispatch and the reference backend's per-call work, little arithmetic), "
                   "not an H200's; on a GPU the phases come from CUDA events.")
HOST_NOTE = ("host/other = the host waiting for the previous {unit}'s readback + emitting and "
             "retiring (with overlap the next {unit} is already queued meanwhile; on a GPU: the "
             "stream's wait for the host)")


def phase_line(name: str, unit: str, stats, phases) -> str:
    """Mean ms per round (or step) launched in each phase, their sum, and the one-off prefill."""
    ms = {p: 1e3 * stats.phases.get(p, 0.0) / max(stats.rounds, 1) for p in phases}
    parts = "  ".join(f"{'host/other' if p == 'host' else p.replace('_', '-')} {t:.2f}"
                      for p, t in ms.items())
    how = (f"overlap on, {stats.discarded} lane-{unit}s discarded" if stats.overlap
           else "overlap off")
    return (f"{name} ms per {unit} (mean of {stats.rounds} launched, {how}): {parts}  = "
            f"{sum(ms.values()):.2f}; prefill {1e3 * stats.phases.get('prefill', 0.0):.1f} ms "
            + ("once" if stats.prefills <= 1 else f"in {stats.prefills} batches"))


def cost_line(ss, gs) -> str:
    ratio = ss.round_seconds / gs.round_seconds if gs.round_seconds else float("inf")
    return (f"round / greedy step = {ratio:.2f}: a round costs {ratio:.2f} greedy steps and "
            f"yields {ss.tokens_per_round:.2f} tokens per request (accepted {ss.accept_len:.2f}; "
            f"EOS and budgets cut the rest)")


def profile_kernels(gen, prompts, news, top: int = 18) -> None:
    """Run `gen` once more under torch.profiler and print its heaviest GPU kernels (those inside
    the CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen(prompts, news)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--n-requests", type=int, default=None,
                    help="requests served (default: GPU 16, CPU 8; past 16 rows they are admitted "
                         "as rows free up)")
    ap.add_argument("--steps", type=int, default=None, help="draft depth (default: GPU 3; CPU 5)")
    ap.add_argument("--topk", type=int, default=None,
                    help="draft width per step (default: GPU 4, CPU 2)")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="k, tree nodes verified per request, root included (default: GPU 8, CPU 6)")
    ap.add_argument("--no-compile", action="store_true",
                    help="GPU: eager layers inside the graphs (default: torch.compile'd)")
    ap.add_argument("--draft-compile", default=None, choices=["regions", "whole"],
                    help="GPU: compile the whole draft / draft-extend bodies (the default) or "
                         "only the head's layer in them")
    ap.add_argument("--draft-lm-head", default=None, choices=["bf16", "fp8", "fp8-fused"],
                    help="GPU: the lm_head the draft reads (default fp8-fused); verify keeps the "
                         "target's, so outputs stay exact")
    ap.add_argument("--fused", action="store_true",
                    help="GPU, --model llama: the target's decode steps and tree verifies of up to "
                         "FusedDecodePolicy().max_rows (64) tokens run in the fused per-layer "
                         "Triton kernels")
    ap.add_argument("--prefill", default=None, choices=["eager", "runner"],
                    help="the prompts' prefill: the prefill program (GPU default) or plain torch "
                         "calls (CPU default)")
    ap.add_argument("--draft-prefill", default=None, choices=["eager", "runner"],
                    help="the draft head's prefill, the same two ways")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (default 0: greedy, the oracle line "
                         "compares tokens); prints the target's mean next-token entropy at it")
    ap.add_argument("--spec-sampling", default="draws", choices=["draws", "rejection"],
                    help="EAGLE's acceptance rule when sampling (both exact; draws, the "
                         "default: plain sampling's tokens, checked by the last line)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each round back before queuing the next (default: overlap)")
    ap.add_argument("--distill-steps", type=int, default=None,
                    help="training steps of the head's distillation (default: the preset's)")
    ap.add_argument("--distill-seqs", type=int, default=None,
                    help="greedy sequences of the target the head is distilled on")
    ap.add_argument("--distill-depth", type=int, default=None,
                    help="train the head unrolled this many draft steps deep (1: teacher-forced)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: one more run of each under torch.profiler, heaviest kernels")
    args = ap.parse_args()
    for name in ("n_requests", "distill_steps", "distill_seqs", "distill_depth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not args.temperature >= 0:
        ap.error(f"--temperature must be >= 0; got {args.temperature}")
    return args


def pick(given, default):
    return default if given is None else given


CPU_INTRO = (
    "  first the draft head is distilled: one decoder layer trained for a few seconds to predict this\n"
    "  random target's own next token (no published head fits a random model; a draft is only as fast\n"
    "  as it is right). Then EAGLE and greedy serve the same requests. On a CPU a verify of k tokens\n"
    "  costs several greedy steps, so speedup_vs_greedy is near or below 1 here; on a GPU a verify\n"
    "  costs about one step and the runners replay CUDA graphs (H200: 2.26x Llama 1B, 1.97x DeepSeek).")


def build_engine(args, gpu: bool):
    """(engine, prompts, budgets, draft lm_head) for the arguments, the head distilled."""
    gpu_size, cpu_size, cpu_what = MODELS[args.model]
    device, backend, size = ("cuda", "cuda", gpu_size) if gpu else ("cpu", "reference", cpu_size)
    if not gpu:
        torch.set_num_threads(1)   # 2 OpenMP threads on 2 shared cores spin (~20x slower)
        print(f"no GPU: {cpu_what}, fp32, padgraph 'reference' backend on the CPU")
        print(CPU_INTRO)
    steps, topk, k = GPU_TREE[args.model] if gpu else (5, 2, 6)
    spec = SpecConfig(pick(args.steps, steps), pick(args.topk, topk), pick(args.draft_tokens, k))
    batch = WORKLOADS["gpu" if gpu else "cpu"]
    distill_kw = {k: v for k, v in (("steps", args.distill_steps), ("n_seq", args.distill_seqs),
                                    ("depth", args.distill_depth)) if v is not None}
    target, head, _ = setup(size, device, **distill_kw)
    if args.fused and gpu and args.model == "llama":
        from padgraph.backends.triton.fused_decode import FusedDecodePolicy
        target.fused = FusedDecodePolicy()
        print(f"target: decode steps and tree verifies of <= {target.fused.max_rows} tokens in "
              "the fused per-layer kernels")
    elif args.fused:
        print("--fused: a GPU Llama target's option; ignored here")
    lm_head = (args.draft_lm_head or DRAFT_LM_HEAD[args.model]) if gpu else "bf16"
    head.set_draft_lm_head(lm_head)
    prompts, news = workload(target.cfg.vocab_size, pick(args.n_requests, batch.n), 7,
                             batch.prompt_lens, batch.new_tokens)
    graphs = "runner" if gpu else "eager"
    engine = Engine(target, head, spec, backend=backend, max_bs=16,
                    max_context=batch.max_context, buckets=pg.Buckets.default(16),
                    overlap=not args.no_overlap, torch_compile=False if args.no_compile else None,
                    draft_compile=args.draft_compile or DRAFT_COMPILE[args.model],
                    prefill=args.prefill or graphs, draft_prefill=args.draft_prefill or graphs,
                    spec_sampling=args.spec_sampling)
    return engine, prompts, news, lm_head


@torch.no_grad()
def mean_entropy(target, reqs, params: SamplingParams) -> float:
    """The target's mean next-token entropy (nats) of the distribution sampled at `params`, over
    the positions that produced each request's output (dense forwards of prompt + output)."""
    total, n = 0.0, 0
    for r in reqs:
        seq = torch.tensor([r.prompt + r.output[:-1]], device=target.lm_head.weight.device)
        logits, _ = target.forward_dense(seq)
        logits = logits[0, len(r.prompt) - 1:].float()                  # [len(output), V]
        m = logits.shape[0]
        lane = lambda v, dt=torch.float32: torch.full((m,), v, dtype=dt, device=logits.device)  # noqa: E731
        p = sampling_probs(logits, lane(params.temperature), lane(params.top_k, torch.int32),
                           lane(params.top_p), lane(params.min_p)).double()
        total += float(-(p * p.clamp_min(1e-300).log()).sum())
        n += m
    return total / max(n, 1)


def main():
    args = parse_args()
    gpu = torch.cuda.is_available()
    w, prompts, news, lm_head = build_engine(args, gpu)
    spec, params = w.worker.spec, SamplingParams(temperature=args.temperature)   # seeds: the engine's
    with torch.no_grad():
        # compile (GPU: capture) and JIT outside the timed runs: the full batch and bs=1
        for gen in (w.generate_spec, w.generate_greedy):
            gen(prompts, [4] * len(prompts), sampling=params)
            gen(prompts[:1], [4], sampling=params)
        spec_reqs, ss = w.generate_spec(prompts, news, sampling=params)
        greedy, gs = w.generate_greedy(prompts, news, sampling=params)
    tol = TIE_TOL if gpu else 0.0
    match, ties, real = compare(greedy, spec_reqs, tie_tol=tol)
    plain = "greedy" if params.greedy else "plain sampling"
    print(f"EAGLE  steps={spec.steps} topk={spec.topk} k={spec.num_draft_tokens} "
          f"draft lm_head {lm_head}: {ss.tokens} tokens in {ss.seconds:.2f}s, "
          f"{ss.rounds} rounds launched")
    print(f"{plain}: {gs.tokens} tokens in {gs.seconds:.2f}s, {gs.rounds} steps launched")
    entropy = None if params.greedy else mean_entropy(w.worker.target, greedy, params)
    if entropy is not None:
        print(f"sampling at temperature {params.temperature} ({args.spec_sampling}): the target's "
              f"mean next-token entropy there {entropy:.2f} nats")
    checked = params.greedy or args.spec_sampling == "draws"
    line = oracle_line(match, ties, real)
    print((line if params.greedy else line.replace("greedy_match", "sampled_match"))
          + f"; tie tolerance {tol}" if checked else
          "token match not checked: rejection sampling draws other numbers than plain sampling "
          "(the same distribution)")
    if checked and (ties or real):
        print(f"first divergences at near-ties of the target's top-2 logits (rid, index, gap): "
              f"{ties}")
        print(f"other first divergences (rid, index, gap): {real}")
    if not gpu:
        print(CPU_TIMING_NOTE)
    print(HOST_NOTE.format(unit="round"))
    print(phase_line("EAGLE ", "round", ss, SPEC_PHASES))
    print(phase_line("greedy" if params.greedy else "plain ", "step", gs, GREEDY_PHASES))
    print(cost_line(ss, gs))
    if args.profile and gpu:
        with torch.no_grad():
            profile_kernels(w.generate_spec, prompts, news)
            profile_kernels(w.generate_greedy, prompts, news)
    speedup = ss.tokens_per_s / gs.tokens_per_s
    if params.greedy:
        print(f"tokens/s={ss.tokens_per_s:.1f} accept_len={ss.accept_len:.2f} "
              f"speedup_vs_greedy={speedup:.2f} greedy_match={match + len(ties)}/{len(greedy)}")
    else:
        tail = f" sampled_match={match + len(ties)}/{len(greedy)}" if checked else ""
        print(f"tokens/s={ss.tokens_per_s:.1f} accept_len={ss.accept_len:.2f} "
              f"speedup_vs_sampling={speedup:.2f} temperature={params.temperature} "
              f"entropy={entropy:.2f}{tail}")


if __name__ == "__main__":
    main()
