"""EAGLE speculative decoding of a Hugging Face model: `Decoder(model, ..., draft=Eagle())`.

The model becomes a padgraph.llm target (`Target`), an EAGLE head is built on it and distilled
from the model's own greedy outputs at `Decoder(...)` (as the main job does), and padgraph.llm's
engine runs the same programs as the main job: prefill, draft, verify, draft-extend, each a
padgraph runner. Greedy verification keeps the tokens the model's own greedy decoding gives
(bf16 near-ties of the top two logits excepted, as for any two kernels).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from padgraph.llm import Engine, SpecConfig
from padgraph.llm.distill import distill
from padgraph.llm.models import EagleHead

from .target import Target


@dataclass(frozen=True)
class Eagle:
    """EAGLE for `Decoder(..., draft=Eagle(...))`.

    spec: the draft tree (steps, top-k, tokens verified per round).
    distill: `padgraph.llm.distill.DistillOptions` fields (corpus, steps, learning rate, ...).
    head: a trained head over `padgraph.hf.Target(model, max_context)`; None distils one.
    log: where distillation reports (None: silent).
    """

    spec: SpecConfig = field(default_factory=lambda: SpecConfig(steps=3, topk=4, num_draft_tokens=8))
    distill: Mapping[str, Any] = field(default_factory=dict)
    head: Any = None
    log: Any = None


@contextlib.contextmanager
def frozen(model):
    """The model's parameters without requires_grad for the duration (the head trains through the
    model's embedding and lm_head, which must neither change nor collect gradients), restored after."""
    before = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in before:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in before:
            p.requires_grad_(flag)


def context_for(max_len: int, spec: SpecConfig) -> int:
    """Positions a request may touch: prompt + output, one round's tree, and the extra round an
    overlapped loop runs past a request's end (`Worker`'s reservation)."""
    return max_len + max(spec.num_draft_tokens, spec.steps * spec.topk) + 1 + spec.steps + 1


class Speculative:
    """The engine behind a Decoder with a draft head. engine_options: `WorkerOptions` fields
    (torch_compile, buckets, compile_options, ...)."""

    def __init__(self, model, eagle: Eagle, *, max_batch: int, max_len: int, backend: str, engine_options: dict):
        self.model, self.max_batch, self.max_len = model, max_batch, max_len
        context = context_for(max_len, eagle.spec)
        self.target = Target(model, context) if eagle.head is None else eagle.head.target
        head = eagle.head
        self.distilled = None
        if head is None:
            head = EagleHead(self.target).to(self.target.lm_head.weight.device)
            with torch.random.fork_rng(devices=[]), frozen(model):
                torch.manual_seed(0)
                self.distilled = distill(self.target, head, log=eagle.log or (lambda *a: None),
                                         **{"n_check": 0, **eagle.distill})
        eos = model.generation_config.eos_token_id
        self.engine = Engine(self.target, head, eagle.spec, backend=backend, max_bs=max_batch,
                             max_context=context, eos_id=eos if isinstance(eos, int) else None, **engine_options)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int):
        """New tokens [n, max_new_tokens] (a row that ended at EOS filled with EOS) and run stats."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        reqs, stats = self.engine.generate_spec(prompts, [max_new_tokens] * len(prompts))
        rows = [r.output + r.output[-1:] * (max_new_tokens - len(r.output)) for r in reqs]   # short: ended at EOS
        return torch.tensor(rows, dtype=torch.int64, device=input_ids.device), stats
