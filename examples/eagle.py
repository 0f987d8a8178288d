"""EAGLE speculative decoding end to end: distil a head, serve a batch, compare with greedy.

    python examples/eagle.py --model llama        # or --model deepseek (MLA + MoE, MTP head)

On a GPU: the Llama-3.2-1B-shaped target (deepseek: DeepSeek-V2-Lite widths, 6 layers, 16
experts; random weights, bf16) on the "cuda" backend, serving 16 requests of varied prompt and
output lengths; the target's decoder layers and the whole draft / draft-extend bodies
(`--draft-compile regions`: only the head's layer in them) are torch.compile'd once for the
whole ladder and captured in
padgraph's graphs (`--no-compile`: eager; `--profile`: the kernels per round). On the CPU: a
tiny target, fp32, on the "reference" backend, 8 short requests (it says so). Before the last
line: time per phase of a round (draft, verify, draft-extend, host/other) and of a greedy step,
and what a round costs in greedy steps. The last line is
`tokens/s=… accept_len=… speedup_vs_greedy=… greedy_match=N/N`.

Both loops run with overlap scheduling (round N+1 queued before round N is read back; see
spec_decode); `--no-overlap` runs both without it, for comparison. "host" is the time the host
spends waiting for the previous round's readback and processing it (emit, retire finished
requests) — with overlap, while the next round is already queued; on a GPU the phases are CUDA
events on the stream, so there it is the stream's time from the end of a round's kernels to the
host's mark: the readback copies plus any time the GPU waited for the host.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import padgraph as pg
from distill import build, distill
from spec_decode import SpecConfig, Worker


# --model -> the draft bodies' compile (Worker's draft_compile): whole where it has run on a GPU
DRAFT_COMPILE = {"llama": "whole", "deepseek": "whole"}
# --model -> the lm_head the draft reads on a GPU (the CPU run reads the target's): its e4m3
# copy, read by the fused lm_head + top-k kernel (H200, Llama: draft 0.84 ms a round against
# 0.91 unfused, the same accept length)
DRAFT_LM_HEAD = {"llama": "fp8-fused", "deepseek": "fp8-fused"}
# --model -> the draft tree on a GPU, (steps, topk, k). Llama: (3, 4, 8) from the tree sweep
# (examples/sweep_eagle.py, H200, one process): against (5, 4, 8) it gave 2.03x / 1.35x greedy at
# bs 1 / 16 instead of 1.92x / 1.16x, a round of 1.41 greedy steps at bs 1 instead of 1.69 (accept
# 3.02 against 3.48: two draft steps fewer cost less than the half token they found). DeepSeek:
# (3, 4, 8) too (main job, H200, 2026-12-02): its MTP draft step is one MLA + MoE layer, 0.31 ms
# at bs 16, so two steps fewer took the round from 4.33 ms (2.22 greedy steps) to 3.41 (1.75) and
# the main job from 1.24x to 1.49x greedy (accept 3.50 -> 2.99).
GPU_TREE = {"llama": (3, 4, 8), "deepseek": (3, 4, 8)}
# --model -> (GPU preset, CPU preset, what the CPU run says it is)
MODELS = {"llama": ("1b", "tiny", "tiny Llama-like target"),
          "deepseek": ("ds-lite", "ds-tiny", "tiny DeepSeek-like target (MLA + MoE, MTP head)")}


def setup(size: str, device: str, log=print, **distill_kw):
    """Target + distilled head for a preset of distill.PRESETS ("tiny", "1b", "ds-tiny", ...);
    distill_kw (e.g. steps, n_seq) override the preset's distillation settings."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    target, head, pre = build(size, device, dtype)
    info = distill(target, head, log=log, **{**pre, **distill_kw})
    return target, head, info


@dataclass(frozen=True)
class Batch:
    """A batch of n requests, prompt and output lengths uniform in [lo, hi): as they finish the
    batch shrinks through odd sizes, which the runners pad to their buckets."""
    n: int
    prompt_lens: tuple[int, int]
    new_tokens: tuple[int, int]
    max_context: int          # >= longest prompt + output + tree margin (+ steps + 1: overlap)


BATCH = {"gpu": Batch(16, (4, 97), (16, 129), max_context=256),
         "cpu": Batch(8, (3, 25), (4, 41), max_context=96)}     # tiny: CI runs it


def workload(vocab: int, n: int, seed: int, prompt_lens=(5, 29), new_tokens=(8, 48)):
    """n prompts of different lengths with different output budgets (the batch shrinks)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(*prompt_lens, (n,), generator=g).tolist()
    news = torch.randint(*new_tokens, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (m,), generator=g).tolist() for m in lens], news


# bf16 near-tie tolerance for the oracle. The lm_head writes bf16 logits, so two paths that
# compute the same logit differ by whole ulps at its magnitude: ulp = 2**-7 for |x| in [1, 2),
# 2**-6 in [2, 4). Measured on the CPU in bf16 (same prefix, target logits through the decode
# path vs chain trees through the verify path): max |diff| 0.0078 (1 ulp) on the 1B shape at
# init_std 0.008 (|logit| <= 2.05), 0.035 at the old 0.02 (|logit| <= 5.3). Two logits that
# each move by d can swap only if their gap is <= 2d; allowing the GPU kernels 2 ulps each at
# |logit| in [2, 4) gives 4 * 2**-6.
TIE_TOL = 4 * 2 ** -6


def first_divergences(refs, outs, ref_gaps, tie_tol: float, ids=None):
    """The oracle on token lists. Per request, the first index where `outs` and `refs` differ and
    the reference's top-2 logit gap there; only that first divergence is judged (afterwards the
    two runs continue from different prefixes). Returns (n exact, near ties [(id, index, gap)]
    with gap <= tie_tol, other divergences): a request "matches" when exact or a near tie. One
    output a strict prefix of the other is a length bug, never a tie (gap inf)."""
    match, ties, real = 0, [], []
    for n, (ref, out) in enumerate(zip(refs, outs)):
        rid = ids[n] if ids is not None else n
        if ref == out:
            match += 1
            continue
        i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if i is None:
            real.append((rid, min(len(ref), len(out)), float("inf")))
            continue
        gap = ref_gaps[n][i] if ref_gaps is not None and i < len(ref_gaps[n]) else float("inf")
        (ties if gap <= tie_tol else real).append((rid, i, round(gap, 4)))
    return match, ties, real


def compare(greedy, spec, tie_tol: float):
    """`first_divergences` of speculative requests against greedy ones (ids: the requests' rid)."""
    return first_divergences([g.output for g in greedy], [s.output for s in spec],
                             [g.gaps for g in greedy], tie_tol, [g.rid for g in greedy])


def oracle_line(match, ties, real) -> str:
    n = match + len(ties) + len(real)
    return (f"greedy_match={match + len(ties)}/{n} (exact {match}, first divergence at a "
            f"top-2 near-tie {len(ties)}, other {len(real)})")


SPEC_PHASES = ("draft", "verify", "draft_extend", "host")
GREEDY_PHASES = ("decode", "host")
CPU_TIMING_NOTE = ("timing on the CPU: 'reference' backend, fp32, tiny sizes, one thread, "
                   "perf_counter. These show how this run's time splits (mostly PyTorch op "
                   "dispatch and the reference backend's per-call work, little arithmetic), "
                   "not an H200's; on a GPU the phases come from CUDA events.")


def phase_line(name: str, unit: str, stats, phases) -> str:
    """Mean ms per round (or step) launched in each phase, their sum, and the one-off prefill.
    host/other: waiting for the previous readback + processing it (module docstring)."""
    ms = {p: 1e3 * stats.phases.get(p, 0.0) / max(stats.rounds, 1) for p in phases}
    parts = "  ".join(f"{'host/other' if p == 'host' else p.replace('_', '-')} {t:.2f}"
                      for p, t in ms.items())
    how = (f"overlap on, {stats.discarded} lane-{unit}s discarded" if stats.overlap
           else "overlap off")
    return (f"{name} ms per {unit} (mean of {stats.rounds} launched, {how}): {parts}  = "
            f"{sum(ms.values()):.2f}; prefill {1e3 * stats.phases.get('prefill', 0.0):.1f} ms "
            + ("once" if stats.prefills <= 1 else f"in {stats.prefills} batches"))


HOST_NOTE = ("host/other = the host waiting for the previous {unit}'s readback + emitting and "
             "retiring (with overlap the next {unit} is already queued meanwhile; on a GPU: the "
             "stream's wait for the host)")


def cost_line(ss, gs) -> str:
    ratio = ss.round_seconds / gs.round_seconds if gs.round_seconds else float("inf")
    return (f"round / greedy step = {ratio:.2f}: a round costs {ratio:.2f} greedy steps and "
            f"yields {ss.tokens_per_round:.2f} tokens per request (accepted {ss.accept_len:.2f}; "
            f"EOS and budgets cut the rest)")


def profile_kernels(name: str, gen, prompts, news, top: int = 18) -> None:
    """Run `gen` once more under torch.profiler and print its GPU kernels (those inside the CUDA
    graphs included): kernels and kernel-µs per round, and the `top` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    from bench.common import kernel_lines, kernel_table
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, stats = gen(prompts, news)
        torch.cuda.synchronize()
    per = f"{'round' if name == 'EAGLE' else 'step'} ({stats.rounds} launched)"
    print("\n".join(kernel_lines(kernel_table(prof.events(), stats.rounds, top), name, per)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--n-requests", type=int, default=None,
                    help="requests served (default: GPU 16, CPU 8; past 16 rows they are admitted "
                         "as rows free up)")
    ap.add_argument("--steps", type=int, default=None,
                    help="draft depth (default: GPU 3; CPU 5)")
    ap.add_argument("--topk", type=int, default=None,
                    help="draft width per step (default: GPU 4, CPU 2)")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="k, tree nodes verified per request, root included (default: GPU 8, CPU 6)")
    ap.add_argument("--no-compile", action="store_true",
                    help="GPU: HF-style eager layers inside the graphs (default: each decoder layer "
                         "torch.compile'd once for the whole ladder)")
    ap.add_argument("--draft-compile", default=None, choices=["regions", "whole"],
                    help="GPU: compile the whole draft / draft-extend bodies (fewer, fused launches "
                         "per draft step: the default) or only the head's layer in them")
    ap.add_argument("--draft-lm-head", default=None, choices=["bf16", "fp8", "fp8-fused"],
                    help="GPU: the lm_head the draft reads: the target's own (bf16) or an e4m3 "
                         "copy with row scales (half the bytes); fp8-fused (the default): that "
                         "copy read by one kernel with the top-k in its epilogue. Verify keeps "
                         "the target's, so outputs stay exact")
    ap.add_argument("--prefill", default=None, choices=["eager", "runner"],
                    help="the prompts' prefill: the prefill program on the worker's backend (GPU "
                         "default: CUDA graphs per bucket of packed prompt tokens, layers "
                         "compiled as in decode), or plain torch calls (CPU default). Both "
                         "count in the timing")
    ap.add_argument("--draft-prefill", default=None, choices=["eager", "runner"],
                    help="the draft head's prefill after the target's: the draft-prefill program "
                         "on the worker's backend (GPU default: graphs on the prefill ladder, the "
                         "head's layer compiled as in the draft), or plain torch calls (CPU "
                         "default)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="read each round back before queuing the next (default: overlap)")
    ap.add_argument("--distill-steps", type=int, default=None,
                    help="training steps of the draft head's distillation (default: the preset's, "
                         "300 at the GPU sizes)")
    ap.add_argument("--distill-seqs", type=int, default=None,
                    help="greedy sequences of the target the head is distilled on (default: the "
                         "preset's, 256 at the GPU sizes)")
    ap.add_argument("--distill-depth", type=int, default=None,
                    help="train the draft head unrolled this many draft steps deep (1: teacher-"
                         "forced only, as EAGLE; default: the preset's)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: after the timed runs, one more of each under torch.profiler; print "
                         "the kernels per round / step and the heaviest ones")
    args = ap.parse_args()
    for name in ("n_requests", "distill_steps", "distill_seqs", "distill_depth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    gpu = torch.cuda.is_available()
    gpu_size, cpu_size, cpu_what = MODELS[args.model]
    device, backend, size = ("cuda", "cuda", gpu_size) if gpu else ("cpu", "reference", cpu_size)
    if not gpu:
        torch.set_num_threads(1)   # 2 OpenMP threads on 2 shared cores spin (~20x slower)
        print(f"no GPU: {cpu_what}, fp32, padgraph 'reference' backend on the CPU")
    steps, topk, k = GPU_TREE[args.model] if gpu else (5, 2, 6)
    pick = lambda given, default: default if given is None else given   # noqa: E731  (0 stays 0)
    spec = SpecConfig(pick(args.steps, steps), pick(args.topk, topk), pick(args.draft_tokens, k))
    batch = BATCH["gpu" if gpu else "cpu"]
    distill_kw = {k: v for k, v in (("steps", args.distill_steps), ("n_seq", args.distill_seqs),
                                    ("depth", args.distill_depth)) if v is not None}
    target, head, _ = setup(size, device, **distill_kw)
    draft_lm_head = (args.draft_lm_head or DRAFT_LM_HEAD[args.model]) if gpu else "bf16"
    head.set_draft_lm_head(draft_lm_head)
    prompts, news = workload(target.cfg.vocab_size, pick(args.n_requests, batch.n), 7,
                             batch.prompt_lens, batch.new_tokens)
    w = Worker(target, head, spec, backend=backend, max_bs=16, max_context=batch.max_context,
               buckets=pg.Buckets.default(16), overlap=not args.no_overlap,
               torch_compile=False if args.no_compile else None,
               draft_compile=args.draft_compile or DRAFT_COMPILE[args.model],
               prefill=args.prefill or ("runner" if gpu else "eager"),
               draft_prefill=args.draft_prefill or ("runner" if gpu else "eager"))
    with torch.no_grad():
        # compile (GPU: capture) and JIT outside the timed runs: the full batch and bs=1
        for gen in (w.generate_spec, w.generate_greedy):
            gen(prompts, [4] * len(prompts))
            gen(prompts[:1], [4])
        spec_reqs, ss = w.generate_spec(prompts, news)
        greedy, gs = w.generate_greedy(prompts, news)
    match, ties, real = compare(greedy, spec_reqs, tie_tol=0.0 if not gpu else TIE_TOL)
    print(f"EAGLE  steps={spec.steps} topk={spec.topk} k={spec.num_draft_tokens} "
          f"draft lm_head {draft_lm_head}: "
          f"{ss.tokens} tokens in {ss.seconds:.2f}s, {ss.rounds} rounds launched")
    print(f"greedy: {gs.tokens} tokens in {gs.seconds:.2f}s, {gs.rounds} steps launched")
    print(oracle_line(match, ties, real) + f"; tie tolerance {0.0 if not gpu else TIE_TOL}")
    if ties or real:
        print(f"first divergences at near-ties of the target's top-2 logits (rid, index, gap): "
              f"{ties}")
        print(f"other first divergences (rid, index, gap): {real}")
    if not gpu:
        print(CPU_TIMING_NOTE)
    print(HOST_NOTE.format(unit="round"))
    print(phase_line("EAGLE ", "round", ss, SPEC_PHASES))
    print(phase_line("greedy", "step", gs, GREEDY_PHASES))
    print(cost_line(ss, gs))
    if args.profile and gpu:
        with torch.no_grad():
            profile_kernels("EAGLE", w.generate_spec, prompts, news)
            profile_kernels("greedy", w.generate_greedy, prompts, news)
    print(f"tokens/s={ss.tokens_per_s:.1f} accept_len={ss.accept_len:.2f} "
          f"speedup_vs_greedy={ss.tokens_per_s / gs.tokens_per_s:.2f} "
          f"greedy_match={match + len(ties)}/{len(greedy)}")


if __name__ == "__main__":
    main()
