"""A request and what it must be, checked before anything is written: the engine and the
Hugging Face client raise the same errors for the same bad request."""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import padgraph as pg

from .sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def prompt_ids(i: int, prompt, vocab: int) -> torch.Tensor:
    """Request i's prompt as a 1-d int64 tensor of token ids in [0, vocab), or TypeError (not
    integers: floats, bools, strings) / ValueError (empty, not 1-d, out of range)."""
    try:
        ids = torch.as_tensor(prompt)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"request {i}: the prompt must be a sequence of integer token ids; got "
                        f"{type(prompt).__name__}") from None
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"request {i}: the prompt must be a non-empty 1-d sequence of token ids; "
                         f"got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"request {i}: prompt token ids must be integers; got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"request {i}: prompt token ids must be in [0, {vocab}); got "
                         f"{lo if lo < 0 else hi}")
    return ids.to(torch.int64)


def budget(i: int, n, name: str = "max_new_tokens") -> int:
    """Request i's output budget as an int >= 1, or TypeError (not an int; a bool) / ValueError."""
    try:
        if isinstance(n, bool):
            raise TypeError
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"request {i}: {name} must be an int; got {n!r}") from None
    if n < 1:
        raise ValueError(f"request {i}: {name} must be >= 1; got {n}")
    return n


def sampling_of(n: int, sampling) -> list[SamplingParams]:
    """One `SamplingParams` per request from a call's `sampling=`: None (greedy), one value for
    every request, or a sequence of n (None entries greedy); ContractTypeError /
    ContractValueError naming the request otherwise."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or SamplingParams()] * n
    if isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence):
        raise pg.ContractTypeError(f"sampling must be a SamplingParams, a sequence of them (one "
                                   f"per request) or None; got {type(sampling).__name__}")
    if len(sampling) != n:
        raise pg.ContractValueError(f"{n} prompts but {len(sampling)} sampling parameters")
    for i, p in enumerate(sampling):
        if p is not None and not isinstance(p, SamplingParams):
            raise pg.ContractTypeError(f"request {i}: sampling must be a SamplingParams or None; "
                                       f"got {type(p).__name__}")
    return [p or SamplingParams() for p in sampling]


def request_seed(engine_seed: int, rid: int) -> int:
    """The seed of request `rid` whose parameters give none: a splitmix64 mix of the engine's
    seed and the id, in [0, 2**63) (an int64 lane), so reruns of a call reproduce and
    neighbouring ids get unrelated streams."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + rid + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    row: int = 0
    slots: list[int] = field(default_factory=list)
    done: bool = False
    gaps: list[float] = field(default_factory=list)   # greedy: target's top-1 minus top-2 logit
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0                   # the stream it draws from (params.seed, or the engine's mix)

    def stops_at(self, token: int) -> bool:
        """Whether `token` is one of the request's stop tokens (emitted, then it finishes)."""
        return token in self.params.stop_token_ids


def sure_to_finish(r: Request) -> bool:
    """One token left: the round in flight finishes it (every round emits at least one)."""
    return r.max_new_tokens - len(r.output) <= 1


def may_finish(r: Request, max_emit: int) -> bool:
    """At most max_emit tokens left (a round emits up to max_emit): the round in flight may
    finish it."""
    return r.max_new_tokens - len(r.output) <= max_emit
