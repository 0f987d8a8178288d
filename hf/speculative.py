"""EAGLE speculative decoding of a Hugging Face model: `Decoder(model, ..., draft=Eagle())`.

The model becomes a padgraph.llm target (`Target(model, ..., draft=True)`), an EAGLE head is
built on it and distilled from the model's own greedy outputs at `Decoder(...)` (as the main job
does, `head_for`), and padgraph.llm's engine runs the same programs as the main job (`engine.py`):
prefill, draft, verify, draft-extend, each a padgraph runner. Greedy verification keeps the tokens
the model's own greedy decoding gives (bf16 near-ties of the top two logits excepted, as for any
two kernels); sampled rows go through padgraph.llm's exact speculative sampling, so they follow
the model's sampling distribution whatever the head proposes.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from padgraph.llm import SpecConfig
from padgraph.llm.distill import DistillOptions, distill
from padgraph.llm.models import EagleHead

from . import arguments


@dataclass(frozen=True)
class Eagle:
    """EAGLE for `Decoder(..., draft=Eagle(...))`.

    spec: the draft tree (steps, top-k, tokens verified per round).
    distill: `padgraph.llm.distill.DistillOptions` fields (corpus, steps, learning rate, ...).
    head: a trained head over `padgraph.hf.Target(model, max_context, draft=True)`; None distils one.
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
                           "padgraph.hf.Target(model, max_context, draft=True)", arguments.ArgumentTypeError)


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


def head_for(target, eagle: Eagle):
    """(the EAGLE head over `target`, the distillation's report or None): `eagle.head` where
    given, else a head distilled from the model's own greedy outputs (seeded, the model frozen)."""
    if eagle.head is not None:
        return eagle.head, None
    head = EagleHead(target).to(target.lm_head.weight.device)
    with torch.random.fork_rng(devices=[]), frozen(target.hf):
        torch.manual_seed(0)
        report = distill(target, head, log=eagle.log or (lambda *a: None), **{"n_check": 0, **eagle.distill})
    return head, report
