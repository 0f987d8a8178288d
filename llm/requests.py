"""A request and what it must be, checked before anything is written: the engine and the
Hugging Face client raise the same errors for the same bad request."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch


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


def sure_to_finish(r: Request) -> bool:
    """One token left: the round in flight finishes it (every round emits at least one)."""
    return r.max_new_tokens - len(r.output) <= 1


def may_finish(r: Request, max_emit: int) -> bool:
    """At most max_emit tokens left (a round emits up to max_emit): the round in flight may
    finish it."""
    return r.max_new_tokens - len(r.output) <= max_emit
