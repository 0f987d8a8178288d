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

    @property
    def tree_positions(self) -> int:
        """Positions from seq_len on that one round writes: verify's k tree tokens or the
        draft's steps * topk nodes, whichever are more."""
        return max(self.num_draft_tokens, self.steps * self.topk)

    @property
    def margin(self) -> int:
        """Positions a request reserves past prompt + max_new_tokens. A round that starts at
        seq_len s touches positions < s + tree_positions = s + margin - 1. A request still
        running after a round has emitted seq_len - prompt + 1 < max_new_tokens tokens, so real
        rounds start at s <= prompt + max_new - 2, inside `prompt + max_new + margin`."""
        return self.tree_positions + 1

    @property
    def overlap_margin(self) -> int:
        """Positions more an overlapped loop needs: a finished request runs one more round, which
        starts up to steps + 1 (one round's accepted tokens) further on. (Greedy's extra step
        writes position prompt + max_new - 1: inside `margin` anyway.)"""
        return self.steps + 1

    def reservation(self, n_tokens: int, overlap: bool = False) -> int:
        """Positions a request of n_tokens (prompt + max_new_tokens) may touch: n_tokens +
        `margin`, + `overlap_margin` where an overlapped loop may run a round past its end."""
        return n_tokens + self.margin + (self.overlap_margin if overlap else 0)


@dataclass(frozen=True)
class WorkerOptions:
    """How an `Engine` and its `Worker` serve (the keywords `Engine(...)` and `Worker(...)` take
    besides the backend).

    max_bs: requests running at once (the graphs' largest bucket, default ladder up to it).
    max_context bounds prompt + max_new_tokens + the tree margin per request (checked at
    admission); with overlap a request reserves `overlap_margin` more positions where they fit.
    overlap: queue round N+1 before reading round N back (`Engine`'s loop); False runs the plain
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
    head's prefill the same two ways. seed: the engine's seed; a request whose `SamplingParams`
    has no seed draws from one derived from it and the request's id
    (`padgraph.llm.requests.request_seed`), so a rerun of the same call samples the same tokens.
    sampling: decode and verify take the requests' sampling parameters (one graph serves greedy
    and sampled requests together); False declares today's greedy programs without them (no fp32
    [bs * k, V] logits in verify) and the engine refuses a request with temperature > 0.
    spec_sampling: how verify accepts draft tokens for sampled requests; both are exact (the
    emitted tokens follow the target's sampling distribution whatever the draft proposes) and
    give greedy lanes greedy verification's tokens. "draws" (default): one draw per tree node
    with decode's keys (one fused `sample` call over the tree), the path walked from the root
    while a draw equals a child's token: the emitted tokens are the ones plain sampling draws
    at those positions, token for token. "rejection": speculative sampling, recursive over a
    node's children (`padgraph.llm.sampling.verify_tree_sampled`, acceptance and residual draws
    on their own streams): the same distribution and, for a draft proposing its top-k (one-hot
    proposals), the same acceptance, through other draws, at the cost of the full [bs, k, V]
    probabilities (the walk over the tree's levels and children reads only the children's
    probabilities, then draws once per request from the residual).
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
    seed: int = 0
    sampling: bool = True
    spec_sampling: str = "draws"

    def __post_init__(self):
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise pg.ContractTypeError(f"WorkerOptions.seed must be an int; got {self.seed!r}")
        for name, allowed in (("draft_compile", ("regions", "whole")),
                              ("prefill", ("eager", "runner")),
                              ("draft_prefill", ("eager", "runner")),
                              ("spec_sampling", ("draws", "rejection")),
                              ("sampling", (True, False))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be {' or '.join(map(repr, allowed))}; "
                                 f"got {getattr(self, name)!r}")
