"""The engine behind a `Decoder`: padgraph.llm's `Engine` over the model as a `Target`, with an
EAGLE head (`Decoder(..., draft=Eagle())`) or without.

Both run padgraph.llm's one serving stack: its admission (each request's row of the
request-to-token table and the slots of its reservation), its prefill (the Target's
`forward_extend`), its sampler (`SamplingParams` per request: greedy at temperature 0, HF's
warpers otherwise, a random stream keyed by the request's seed and the token's position) and its
stop tokens (`stop_token_ids`: a call's end tokens travel with its requests). Without a head the
rounds are the decode program's (`generate_greedy`: one token per request, bucketed by requests,
the body the model's forward); with one, EAGLE's (`generate_spec`: draft, verify, draft-extend).
"""
from __future__ import annotations

import dataclasses

import torch

from padgraph.llm import Engine, SpecConfig

from .generation import Plan

# plain decoding's reservation: the least margin a SpecConfig gives (no tree is ever drafted)
PLAIN = SpecConfig(steps=1, topk=1, num_draft_tokens=2)


class Served:
    """A Decoder's engine: `Engine(target, head, spec, ...)` serving `max_batch` requests of at
    most `max_len` positions (prompt and output). options: `WorkerOptions` fields
    (torch_compile, buckets, compile_options, ...)."""

    def __init__(self, target, head, spec: SpecConfig, *, max_batch: int, max_len: int, backend: str,
                 options: dict):
        self.target, self.head = target, head
        self.engine = Engine(target, head, spec, backend=backend, max_bs=max_batch,
                             max_context=spec.reservation(max_len, overlap=True), sampling=True, **options)

    @property
    def worker(self):
        return self.engine.worker

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, plan: Plan, seeds: list[int]):
        """New tokens [n, plan.max_new_tokens] (a row that ended at an end token filled with it) and
        the run's stats. plan: every row's sampling parameters and end tokens; seeds: each row's
        random stream. Greedy rows keep the model's greedy tokens; sampled rows follow its
        sampling distribution (with a head: through padgraph.llm's exact speculative acceptance)."""
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        n_new = plan.max_new_tokens
        params = [dataclasses.replace(plan.params, seed=s, stop_token_ids=plan.eos, max_new_tokens=n_new)
                  for s in seeds]
        run = self.engine.generate_spec if self.head is not None else self.engine.generate_greedy
        reqs, stats = run(prompts, [n_new] * len(prompts), sampling=params)
        rows = [r.output + r.output[-1:] * (n_new - len(r.output)) for r in reqs]   # short: ended early
        return torch.tensor(rows, dtype=torch.int64, device=input_ids.device), stats
