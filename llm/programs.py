"""The standard LLM runner programs, declared once with their pad values.

decode, target verify (k tree tokens per request), EAGLE multi-step draft (`steps`, `topk`),
EAGLE draft-extend (up to `steps + 1` tokens per request, packed along their own axis), the
target's extend over whole prompts (prefill: bucketed by packed tokens, not requests) and the
draft head's extend over the same packed prompts (draft prefill). The pad
values are the contract every runner of this family shares (spec/SPEC.md): `seq_lens` 1,
`out_cache_loc` the sink slot 0, `req_pool_indices` the reserved row 0, token ids, positions,
top-k and hidden states 0, accept lengths 1, tree mask all ones, `qo_indptr` repeats its last
value (padded requests own no tokens). No runner writes padding code of its own.

Sampling (`sampling=True`, what the worker declares): the programs that pick tokens (decode,
verify) also take each request's sampling parameters as padded per-request inputs —
`temperature` 0.0, `top_k` 0, `top_p` 1.0, `min_p` 0.0, `seed` 0 — so a padded lane is a greedy
lane: it draws a harmless token that is sliced away, and no parameter used at capture is ever
read by a live lane (every replay packs the live values or these pads).

Model-specific parts are parameters: `outputs` is a mapping of `pg.Output`s, or a function of the
program's axes (`RunnerAxes`) returning one, since output shapes name the same axis objects.
`programs(cfg, spec, ...)` fills them in for a target and draft head (the outputs the bodies in
`padgraph.llm.bodies` return).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Union

import torch

import padgraph as pg
from padgraph import Axis, Buckets, Edge, Input, Output, Program, State

from .config import SpecConfig
from .kv import CANARY, SINK


@dataclass(frozen=True)
class RunnerAxes:
    """The axes a runner program's outputs may use: `bs` (the requests) and, for draft-extend
    and extend, `tokens` (draft-extend: capacity `bs * (steps + 1)`; extend: the bucketed axis,
    with `bs` its dependent `reqs`)."""

    bs: Axis
    tokens: Axis | None = None


OutputsSpec = Union[Mapping[str, Output], Callable[[RunnerAxes], Mapping[str, Output]]]


def kv_state() -> dict[str, State]:
    """Default bound state: per-layer K/V pools (sink slot 0, canary slot 1) and req_to_token (sink
    row 0, canary row 1)."""
    return {n: State(sink=SINK, canary=CANARY) for n in ("k_cache", "v_cache", "req_to_token")}


def _program(name, inputs, outputs: OutputsSpec, axes: RunnerAxes, state, buckets) -> Program:
    outs = outputs(axes) if callable(outputs) else outputs
    return Program(name, inputs=inputs, outputs=dict(outs),
                   state=kv_state() if state is None else state, buckets=buckets)


def _per_request(bs: Axis) -> dict[str, Input]:
    return {
        "seq_lens": Input((bs,), torch.int32, pad=1),
        "req_pool_indices": Input((bs,), torch.int32, pad=0),   # reserved row 0
    }


def sampling_inputs(bs: Axis) -> dict[str, Input]:
    """Each request's sampling parameters (`padgraph.llm.sampling.SamplingParams` as lanes); the
    pads make a padded lane greedy (temperature 0) with every filter off."""
    return {
        "temperature": Input((bs,), torch.float32, pad=0.0),
        "top_k": Input((bs,), torch.int32, pad=0),
        "top_p": Input((bs,), torch.float32, pad=1.0),
        "min_p": Input((bs,), torch.float32, pad=0.0),
        "seed": Input((bs,), torch.int64, pad=0),
    }


SAMPLING_INPUTS = tuple(sampling_inputs(Axis("bs")))


def _check_pos(**kw) -> None:
    for n, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"runner program: {n} must be an int >= 1, got {v!r}")


def decode_program(outputs: OutputsSpec, *, buckets: Buckets | None = None,
                   state: Mapping[str, State] | None = None, name: str = "decode",
                   sampling: bool = False) -> Program:
    """One new token per request: its id, position, KV length after it, row, and target slot
    (sampling: and its sampling parameters, `sampling_inputs`)."""
    bs = Axis("bs")
    inputs = {
        "input_ids": Input((bs,), torch.int64, pad=0),
        "positions": Input((bs,), torch.int64, pad=0),
        **_per_request(bs),
        "out_cache_loc": Input((bs,), torch.int64, pad=0),      # sink slot 0
        **(sampling_inputs(bs) if sampling else {}),
    }
    return _program(name, inputs, outputs, RunnerAxes(bs), state, buckets)


def verify_program(k: int, outputs: OutputsSpec, *, buckets: Buckets | None = None,
                   state: Mapping[str, State] | None = None, name: str = "verify",
                   sampling: bool = False) -> Program:
    """Target verify: k tree tokens per request (request-major on `bs * k`) and the tree mask
    (sampling: and each request's sampling parameters, `sampling_inputs`).

    `seq_lens` is the prefix length before the tree (the tree occupies positions
    seq_lens .. seq_lens + k - 1 of the request's row).
    """
    _check_pos(k=k)
    bs = Axis("bs")
    inputs = {
        "input_ids": Input((bs * k,), torch.int64, pad=0),
        "positions": Input((bs * k,), torch.int64, pad=0),
        "out_cache_loc": Input((bs * k,), torch.int64, pad=0),
        **_per_request(bs),
        "tree_mask": Input((bs, k, k), torch.bool, pad=True),
        **(sampling_inputs(bs) if sampling else {}),
    }
    return _program(name, inputs, outputs, RunnerAxes(bs), state, buckets)


def draft_program(steps: int, topk: int, hidden_size: int, hidden_dtype: torch.dtype,
                  outputs: OutputsSpec, *, buckets: Buckets | None = None,
                  state: Mapping[str, State] | None = None, name: str = "eagle_draft") -> Program:
    """EAGLE multi-step draft from the last draft-extend's top-k and hidden state.

    `out_cache_loc` holds `steps * topk` draft slots per request, laid out per request, so a
    padded request's slots are a tail of sink slots. `verified_id` (the tree's root, pad 0) lets
    the body emit verify's inputs itself.
    """
    _check_pos(steps=steps, topk=topk, hidden_size=hidden_size)
    bs = Axis("bs")
    inputs = {
        "topk_p": Input((bs, topk), torch.float32, pad=0),
        "topk_index": Input((bs, topk), torch.int64, pad=0),
        "hidden_states": Input((bs, hidden_size), hidden_dtype, pad=0),
        "positions": Input((bs,), torch.int64, pad=0),
        **_per_request(bs),
        "out_cache_loc": Input((bs * (steps * topk),), torch.int64, pad=0),
        "verified_id": Input((bs,), torch.int64, pad=0),
    }
    return _program(name, inputs, outputs, RunnerAxes(bs), state, buckets)


def draft_extend_program(steps: int, hidden_size: int, hidden_dtype: torch.dtype,
                         outputs: OutputsSpec, *, buckets: Buckets | None = None,
                         state: Mapping[str, State] | None = None,
                         name: str = "eagle_draft_extend") -> Program:
    """EAGLE draft-extend: each request's accepted tokens (1 .. steps + 1), packed.

    Requests and tokens are padded separately: `tokens` has its own raw extent (the sum of the
    accept lengths) and capacity `bs * (steps + 1)`; `qo_indptr` repeats its last value, so a
    padded request owns no tokens.
    """
    _check_pos(steps=steps, hidden_size=hidden_size)
    bs = Axis("bs")
    tokens = Axis("tokens", capacity=bs * (steps + 1), device_extent=True)   # verify's packed length, on the GPU
    inputs = {
        "input_ids": Input((tokens,), torch.int64, pad=0),
        "positions": Input((tokens,), torch.int64, pad=0),
        "out_cache_loc": Input((tokens,), torch.int64, pad=0),
        "hidden_states": Input((tokens, hidden_size), hidden_dtype, pad=0),
        **_per_request(bs),
        "accept_lens": Input((bs,), torch.int32, pad=1),
        "qo_indptr": Input((bs + 1,), torch.int32, pad=Edge()),
    }
    return _program(name, inputs, outputs, RunnerAxes(bs, tokens), state, buckets)


def extend_program(outputs: OutputsSpec, *, buckets: Buckets | None = None,
                   state: Mapping[str, State] | None = None, name: str = "extend") -> Program:
    """Target extend (prefill): the batch's prompts packed request after request.

    The bucketed axis is `tokens` (the packed prompt tokens), so a graph serves every batch
    whose prompts sum to at most its bucket, however they are split into requests; `reqs` is a
    dependent axis of capacity `tokens` (every request owns at least one token). Padded tokens
    belong to no request (`qo_indptr` repeats its last value) and write the sink slot; padded
    requests own no tokens. Outputs use `RunnerAxes(bs=reqs, tokens=tokens)`.
    """
    tokens, reqs, inputs = _packed_prompts()
    return _program(name, inputs, outputs, RunnerAxes(reqs, tokens), state, buckets)


def _packed_prompts() -> tuple[Axis, Axis, dict[str, Input]]:
    """Prompts packed request after request: the bucketed `tokens`, the dependent `reqs` (every
    request owns at least one token) and the inputs every prompt program reads."""
    tokens = Axis("tokens")
    reqs = Axis("reqs", capacity=tokens)
    return tokens, reqs, {
        "input_ids": Input((tokens,), torch.int64, pad=0),
        "positions": Input((tokens,), torch.int64, pad=0),
        "out_cache_loc": Input((tokens,), torch.int64, pad=0),  # sink slot 0
        **_per_request(reqs),
        "qo_indptr": Input((reqs + 1,), torch.int32, pad=Edge()),
    }


def draft_prefill_program(hidden_size: int, hidden_dtype: torch.dtype, outputs: OutputsSpec, *,
                          buckets: Buckets | None = None, state: Mapping[str, State] | None = None,
                          name: str = "eagle_draft_prefill") -> Program:
    """EAGLE draft prefill: the draft head over the prompts the target has just prefilled,
    packed and bucketed as `extend_program`'s, with the target's hidden state per token and the
    target's first token per request (`verified_id`, pad 0), from which each request's first
    draft top-k and the draft's cache locations come. Padded tokens have hidden 0 and write
    the sink slot; padded requests own no tokens.
    """
    _check_pos(hidden_size=hidden_size)
    tokens, reqs, inputs = _packed_prompts()
    inputs.update(hidden_states=Input((tokens, hidden_size), hidden_dtype, pad=0),
                  verified_id=Input((reqs,), torch.int64, pad=0))
    return _program(name, inputs, outputs, RunnerAxes(reqs, tokens), state, buckets)


# ------------------------------------------------------------------ a model's programs

def _state_decl(cache_names) -> dict[str, pg.State]:
    """The runners' bound state: the caches (sink slot 0, canary slot 1) and req_to_token (sink row
    0, canary row 1)."""
    return {n: pg.State(sink=SINK, canary=CANARY) for n in (*cache_names, "req_to_token")}


def programs(cfg, spec: SpecConfig, hidden_dtype, buckets=None,
             cache_names=("k_cache", "v_cache"), sampling: bool = False,
             draft_cache_names=None) -> dict[str, pg.Program]:
    """The four EAGLE runner programs (decode, verify, draft, draft-extend) with this model's
    outputs and cache state names (the draft head's `draft_cache_names`, default the target's:
    a hybrid target's recurrent pools are not the head's); sampling: decode and verify take the
    requests' sampling parameters (the draft proposes its top-k whatever they are, so it takes
    none)."""
    H, k, S, topk = cfg.hidden_size, spec.num_draft_tokens, spec.steps, spec.topk
    O = pg.Output
    state = _state_decl(cache_names)
    draft_state = state if draft_cache_names is None else _state_decl(draft_cache_names)
    return {
        "decode": decode_program(lambda a: {
            "next_token": O((a.bs,), torch.int64), "top2_gap": O((a.bs,), torch.float32)},
            buckets=buckets, state=state, sampling=sampling),
        "verify": verify_program(k, lambda a: {
            "accept_len": O((a.bs,), torch.int32), "out_tokens": O((a.bs, S + 1), torch.int64),
            "bonus": O((a.bs,), torch.int64),
            "de_input_ids": O((a.bs * (S + 1),), torch.int64),
            "de_positions": O((a.bs * (S + 1),), torch.int64),
            "de_out_cache_loc": O((a.bs * (S + 1),), torch.int64),
            "de_hidden": O((a.bs * (S + 1), H), hidden_dtype),
            "de_qo_indptr": O((a.bs + 1,), torch.int32),
            "de_seq_lens": O((a.bs,), torch.int32)}, buckets=buckets, state=state,
            sampling=sampling),
        "draft": draft_program(S, topk, H, hidden_dtype, lambda a: {
            "draft_tokens": O((a.bs, k - 1), torch.int64),
            "tree_mask": O((a.bs, k, k), torch.bool),
            "depth": O((a.bs, k), torch.int64),
            "verify_input_ids": O((a.bs * k,), torch.int64),
            "verify_positions": O((a.bs * k,), torch.int64),
            "verify_out_cache_loc": O((a.bs * k,), torch.int64)}, buckets=buckets,
            state=draft_state),
        "draft_extend": draft_extend_program(S, H, hidden_dtype, lambda a: {
            "topk_p": O((a.bs, topk), torch.float32), "topk_index": O((a.bs, topk), torch.int64),
            "next_hidden": O((a.bs, H), hidden_dtype),
            "draft_out_cache_loc": O((a.bs * (S * topk),), torch.int64)}, buckets=buckets,
            state=draft_state),
    }


def extend_prefill_program(cfg, hidden_dtype, max_tokens: int,
                           cache_names=("k_cache", "v_cache")) -> pg.Program:
    """The prefill runner program (bucketed by packed prompt tokens, `prefill_buckets`)."""
    O = pg.Output
    return extend_program(lambda a: {
        "hidden": O((a.tokens, cfg.hidden_size), hidden_dtype),
        "last_hidden": O((a.bs, cfg.hidden_size), hidden_dtype)},
        buckets=prefill_buckets(max_tokens), state=_state_decl(cache_names), name="prefill")


def draft_prefill_runner_program(cfg, spec: SpecConfig, hidden_dtype, max_tokens: int,
                                 cache_names=("k_cache", "v_cache")) -> pg.Program:
    """The draft-prefill runner program, on the prefill program's ladder of packed tokens."""
    O, S, topk = pg.Output, spec.steps, spec.topk
    return draft_prefill_program(cfg.hidden_size, hidden_dtype, lambda a: {
        "topk_p": O((a.bs, topk), torch.float32), "topk_index": O((a.bs, topk), torch.int64),
        "next_hidden": O((a.bs, cfg.hidden_size), hidden_dtype),
        "draft_out_cache_loc": O((a.bs * (S * topk),), torch.int64)},
        buckets=prefill_buckets(max_tokens), state=_state_decl(cache_names),
        name="draft_prefill")


def prefill_buckets(max_tokens: int) -> pg.Buckets:
    """Packed-token ladder for the prefill program: 16, 24, 32, 48, 64, ... (powers of two and
    1.5x them), up to max_tokens: a batch pads by at most a third."""
    sizes = sorted({s for i in range(4, max(4, max_tokens.bit_length()) + 1)
                    for s in (1 << i, 3 << (i - 1)) if s <= max_tokens})
    return pg.Buckets(sizes + ([max_tokens] if not sizes or sizes[-1] != max_tokens else []))
