"""The EAGLE example's settings per model family (`examples/eagle.py`, `bench.bench_eagle`):
which distillation preset on a GPU and on the CPU, the draft tree and draft compile on a GPU, and
the request batch served; `setup` builds a target and distils its head, `workload` draws the
requests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .distill import build, distill


# --model -> the draft bodies' compile (`WorkerOptions.draft_compile`): whole where it has run on a GPU
DRAFT_COMPILE = {"llama": "whole", "deepseek": "whole"}
# --model -> the lm_head the draft reads on a GPU (the CPU run reads the target's): its e4m3
# copy (half the bf16 bytes), read by the fused lm_head + top-k kernel, which takes the top-k in
# the GEMM's epilogue: the faster draft step at a draft's row counts, with the same accept
# length (results/topk.md; `draft_head.FUSED_MAX_ROWS` bounds it)
DRAFT_LM_HEAD = {"llama": "fp8-fused", "deepseek": "fp8-fused"}
# --model -> the draft tree on a GPU, (steps, topk, k). A shallow tree keeps a round near 1.5
# greedy steps at bs 1: every draft step is paid in every round, whatever the head accepts (a
# DeepSeek MTP draft step is a whole MLA + MoE layer). A deeper tree such as (5, 4, 10) gives
# more speedup where a head accepts as well as the distilled one does, at a dearer round
# (results/sweep_eagle.md, results/main_jobs.md; `--steps` / `--draft-tokens` choose it).
GPU_TREE = {"llama": (3, 4, 8), "deepseek": (3, 4, 8)}
# --model -> (GPU preset, CPU preset, what the CPU run says it is)
MODELS = {"llama": ("1b", "tiny", "tiny Llama-like target"),
          "deepseek": ("ds-lite", "ds-tiny", "tiny DeepSeek-like target (MLA + MoE, MTP head)")}


def setup(size: str, device: str, log=print, **distill_kw):
    """Target + distilled head for a preset of `distill.PRESETS` ("tiny", "1b", "ds-tiny", ...);
    distill_kw (e.g. steps, n_seq) override the preset's distillation settings."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    target, head, pre = build(size, device, dtype)
    info = distill(target, head, log=log, **{**pre, **distill_kw})
    return target, head, info


@dataclass(frozen=True)
class Workload:
    """A batch of n requests, prompt and output lengths uniform in [lo, hi): as they finish the
    batch shrinks through odd sizes, which the runners pad to their buckets."""
    n: int
    prompt_lens: tuple[int, int]
    new_tokens: tuple[int, int]
    max_context: int          # >= longest prompt + output + tree margin (+ steps + 1: overlap)


WORKLOADS = {"gpu": Workload(16, (4, 97), (16, 129), max_context=256),
             "cpu": Workload(8, (3, 25), (4, 41), max_context=96)}     # tiny: CI runs it


def workload(vocab: int, n: int, seed: int, prompt_lens=(5, 29), new_tokens=(8, 48)):
    """n prompts of different lengths with different output budgets (the batch shrinks)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(*prompt_lens, (n,), generator=g).tolist()
    news = torch.randint(*new_tokens, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (m,), generator=g).tolist() for m in lens], news
