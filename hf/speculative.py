"""EAGLE speculative decoding of a Hugging Face model: `Decoder(model, ..., draft=Eagle())`.

The model becomes a padgraph.llm target (`Target`), an EAGLE head is built on it and distilled
from the model's own greedy outputs at `Decoder(...)` (as the main job does), and padgraph.llm's
engine runs the same programs as the main job: prefill, draft, verify, draft-extend, each a
padgraph runner. Greedy verification keeps the tokens the model's own greedy decoding gives
(bf16 near-ties of the top two logits excepted, as for any two kernels); sampled rows go through
padgraph.llm's exact speculative sampling, so they follow the model's sampling distribution
whatever the head proposes. A call's end tokens travel with its requests (`stop_token_ids`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from padgraph.llm import Engine, SpecConfig
from padgraph.llm.distill import DistillOptions, distill
from padgraph.llm.models import EagleHead

from . import arguments
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

    def __post_init__(self):
        where = "padgraph.hf.Eagle"
        if not isinstance(self.spec, SpecConfig):
            arguments.fail(where, "spec", self.spec, "a padgraph.llm.SpecConfig", arguments.ArgumentTypeError)
        if not isinstance(self.distill, Mapping):
            arguments.fail(where, "distill", self.distill, "a mapping of DistillOptions fields",
                           arguments.ArgumentTypeError)
        check_distill(where, self.distill)
        if self.log is not None and not callable(self.log):
            arguments.fail(where, "log", self.log, "None or a callable", arguments.ArgumentTypeError)
        if self.head is not None and not hasattr(self.head, "target"):
            arguments.fail(where, "head", type(self.head).__name__, "None or an EAGLE head built over "
                           "padgraph.hf.Target(model, max_context)", arguments.ArgumentTypeError)


# DistillOptions fields that count something, and the least each may be. steps: OneCycle's
# learning-rate warm-up is 10 % of the steps, and needs two of them (fewer divides by zero)
DISTILL_MIN = {"n_seq": 1, "prompt_len": 1, "gen_len": 1, "gen_batch": 1, "steps": 20, "batch": 1,
               "depth": 1, "check_depth": 1, "n_check": 0}


def check_distill(where: str, options: Mapping) -> None:
    """Every key a DistillOptions field; counts ints of at least `DISTILL_MIN`; lr a positive number."""
    fields = {f.name for f in dataclasses.fields(DistillOptions)}
    for key, value in options.items():
        arg = f"distill[{key!r}]"
        if key not in fields:
            arguments.fail(where, "a distill key", key, f"a DistillOptions field, one of {sorted(fields)}")
        if key in DISTILL_MIN:
            arguments.integer(where, arg, value, DISTILL_MIN[key])
        elif key == "lr" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            arguments.fail(where, arg, value, "a positive number")
        elif key == "n_hot" and value is not None:
            arguments.integer(where, arg, value, 1)
        elif key == "early_stop":
            arguments.flag(where, arg, value)


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
    return max_len + spec.margin + spec.overlap_margin


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
        # a call's end tokens travel with its requests (SamplingParams.stop_token_ids): a call may
        # give other ones than the model's generation config
        self.engine = Engine(self.target, head, eagle.spec, backend=backend, max_bs=max_batch,
                             max_context=context, **engine_options)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan, seeds: list[int]):
        """New tokens [n, plan.max_new_tokens] (a row that ended at an end token filled with it) and
        run stats. plan: `generation.Plan` (every row's sampling parameters and end tokens); seeds:
        each row's random stream. Sampled rows follow the model's sampling distribution exactly
        (padgraph.llm's speculative acceptance); greedy rows keep the model's greedy tokens."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        n_new = plan.max_new_tokens
        params = [dataclasses.replace(plan.params, seed=s, stop_token_ids=plan.eos, max_new_tokens=n_new)
                  for s in seeds]
        reqs, stats = self.engine.generate_spec(prompts, [n_new] * len(prompts), sampling=params)
        rows = [r.output + r.output[-1:] * (n_new - len(r.output)) for r in reqs]   # short: ended early
        return torch.tensor(rows, dtype=torch.int64, device=input_ids.device), stats
