"""Argument checks for padgraph.hf's public entry points: each raises padgraph's own error
(`ArgumentError`, a ContractValueError; `ArgumentTypeError`, a ContractTypeError) naming the
entry point, the argument, the value given and what is allowed."""
from __future__ import annotations

import numbers

import torch

from .errors import ArgumentError, ArgumentTypeError


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(where: str, arg: str, value, allowed: str, cls=ArgumentError):
    raise cls(f"{where}: {arg} must be {allowed}, got {_shown(value)}")


def integer(where: str, arg: str, value, minimum: int) -> int:
    """`value` as an int >= minimum; bools and floats (2.5, and 2.0 too) are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(where, arg, value, f"an int >= {minimum}", ArgumentTypeError)
    if value < minimum:
        fail(where, arg, value, f"an int >= {minimum}")
    return int(value)


def flag(where: str, arg: str, value) -> bool:
    if not isinstance(value, bool):
        fail(where, arg, value, "True or False", ArgumentTypeError)
    return value


def token_ids(where: str, arg: str, ids, vocab: int) -> None:
    """A 2-D int64 tensor [n >= 1, P >= 1] of ids in [0, vocab) (an id outside it would index
    the embedding out of bounds: on a GPU, an error that poisons the CUDA context)."""
    if not isinstance(ids, torch.Tensor):
        fail(where, arg, ids, "a torch.Tensor [n, prompt_len] of int64 token ids", ArgumentTypeError)
    if ids.dim() != 2 or ids.dtype != torch.int64:
        fail(where, arg, f"{tuple(ids.shape)} {ids.dtype}", "[n, prompt_len] int64")
    if ids.numel() == 0:
        fail(where, arg, f"shape {tuple(ids.shape)}", "non-empty (at least one prompt of at least one token)")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        fail(where, arg, f"ids in [{lo}, {hi}]", f"token ids in [0, vocab_size={vocab})")


def mask_of(where: str, arg: str, mask, shape: tuple) -> None:
    """A tensor of input_ids' shape holding 0s and 1s."""
    if not isinstance(mask, torch.Tensor):
        fail(where, arg, mask, "None or a torch.Tensor of 0s and 1s", ArgumentTypeError)
    if tuple(mask.shape) != shape:
        fail(where, arg, f"shape {tuple(mask.shape)}", f"input_ids' shape {shape}")
    if mask.is_floating_point() or mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        fail(where, arg, f"{mask.dtype} values {mask.unique().tolist()[:6]}", "an integer or bool tensor of 0s and 1s")
