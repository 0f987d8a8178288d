"""What a speculative round drafts and verifies (`SpecConfig`) and how a worker serves
(`WorkerOptions`): frozen values, checked when built."""
from __future__ import annotations

from dataclasses import dataclass

import padgraph as pg


@dataclass(frozen=True)
class SpecConfig:
    steps: int = 4          # draft depth (steps - 1 draft forwards)
    topk: int = 4           # expansion width per step
    num_draft_tokens: int = 8   # k: tree nodes verified per request, root included

    def __post_init__(self):
        for name in ("steps", "topk", "num_draft_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"SpecConfig.{name} must be an int; got {v!r}")
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"SpecConfig: steps and topk must be >= 1; got steps={self.steps}, "
                             f"topk={self.topk}")
        if not 2 <= self.num_draft_tokens <= self.n_candidates + 1:
            raise ValueError(
                f"SpecConfig: num_draft_tokens (k, root included) must be in 2 .. "
                f"{self.n_candidates + 1}: the root plus at most the {self.n_candidates} "
                f"candidates that steps={self.steps}, topk={self.topk} draft (topk + "
                f"(steps - 1) * topk**2); got {self.num_draft_tokens}")

    @property
    def n_candidates(self) -> int:
        """Draft tokens a round scores: topk at the first step, topk**2 at each later one."""
        return self.topk + (self.steps - 1) * self.topk ** 2

    @property
    def n_path(self) -> int:
        return self.steps + 1


@dataclass(frozen=True)
class WorkerOptions:
    """How a `Worker` serves (the keywords `Worker(...)` takes besides the backend).

    max_bs: requests running at once (the graphs' largest bucket, default ladder up to it).
    max_context bounds prompt + max_new_tokens + the tree margin per request (checked at
    admission); with overlap the worker reserves `overlap_margin` more positions where they fit.
    overlap: queue round N+1 before reading round N back (`Engine._loop`); False runs the plain
    loop (read back, then queue the next). tail_sync (with overlap): read the round in flight
    back before queuing the next when it may finish every running request, so a batch's end runs
    no round discarded whole. torch_compile: compile the decoder layers inside the runners; None:
    on for "cuda", off for "reference" (the eager oracle). draft_compile (with torch_compile):
    "regions" compiles the head's layer in draft and draft-extend, "whole" their whole bodies
    (tree expansion, top-k, tree build included: fewer, fused launches per draft step).
    prefill: "eager" runs the target's extend over the prompts as plain torch calls; "runner"
    through the "prefill" program (one graph per bucket of packed prompt tokens,
    `prefill_buckets`), followed by the lm_head of the requests' last rows. prefill_tokens: the
    top of that ladder (default max_bs * max_context, all a batch can hold). draft_prefill: the
    head's prefill the same two ways.
    """
    max_bs: int = 16
    max_context: int = 512
    eos_id: int | None = None
    buckets: pg.Buckets | None = None
    compile_options: dict | None = None
    overlap: bool = True
    torch_compile: bool | None = None
    draft_compile: str = "regions"
    prefill: str = "eager"
    prefill_tokens: int | None = None
    draft_prefill: str = "eager"
    tail_sync: bool = True

    def __post_init__(self):
        for name, allowed in (("draft_compile", ("regions", "whole")),
                              ("prefill", ("eager", "runner")),
                              ("draft_prefill", ("eager", "runner"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be {' or '.join(map(repr, allowed))}; "
                                 f"got {getattr(self, name)!r}")
