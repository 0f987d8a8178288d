"""Tensor parallel: every rank replays the same bucket, with no per-step agreement protocol.

A body with collectives (an all-reduce per layer) pairs them up across ranks, so every rank must
run the same program at the same bucket on every call, or the collectives hang or mix buckets.
padgraph keeps that without a device-side handshake: the bucket is a pure function of the raw
extents (`Plan.bucket_for`), so ranks that receive the same raw batch pick the same bucket.
`broadcast` is how they receive it: the driver (rank 0) sends the scheduled batch over a CPU
(gloo) group, one message per step, and no rank waits for its GPU to learn the bucket.

`agree(runner, group)` is the debug check of that premise: when on, every call first all-gathers
(program, bucket, raw extents) over the CPU group and raises `RankDisagreementError` on every rank
when they differ, naming the ranks, their buckets and extents. Off (the default; on with
`PADGRAPH_CHECK_RANKS=1`) it returns the runner itself: nothing is added to the call path.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch.distributed as dist

from .errors import ContractValueError, where

ENV = "PADGRAPH_CHECK_RANKS"


class RankDisagreementError(ContractValueError):
    """Ranks of a tensor-parallel group called a program with different buckets or extents."""


def check_enabled() -> bool:
    """The default of `agree(..., enabled=)`: the environment variable PADGRAPH_CHECK_RANKS=1."""
    return os.environ.get(ENV, "") not in ("", "0")


def broadcast(obj, group=None, src: int = 0):
    """Rank `src`'s `obj` on every rank of `group` (a CPU/gloo group: host tensors, ints, lists
    and dataclasses of them travel pickled). Other ranks pass anything (None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=_global(src, group), group=group)
    return box[0]


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


# ------------------------------------------------------------------------------ agreement

def call_key(runner, raw: Mapping) -> tuple:
    """What must be equal on every rank for a call: (program, bucket, raw extents), or
    (program, "invalid", message) for raw inputs this runner would reject."""
    name = runner.program.name
    try:
        ext = runner.plan.extents(raw, None, True)
    except Exception as e:   # gathered, not raised: the other ranks must not wait on this one
        return (name, "invalid", f"{type(e).__name__}: {e}")
    bucket = runner.plan.bucket_for(ext)
    return (name, "overflow" if bucket is None else bucket, dict(ext))


def disagreement(keys: list[tuple]) -> str | None:
    """None when every rank's call key is equal, else a message naming each group of ranks."""
    groups: dict[tuple, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(_hashable(key), []).append(rank)
    if len(groups) == 1:
        return None
    named = len({k[0] for k in keys}) > 1        # ranks even differ on the program
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: "
             f"{_describe(keys[r[0]], named)}" for r in groups.values()]
    return (f"{where(keys[0][0])}: every rank of the tensor-parallel group must call with the same "
            f"bucket and raw extents (the body's collectives pair up across ranks), got "
            + "; ".join(parts)
            + ". Send every rank the same raw batch (padgraph.distributed.broadcast from rank 0)")


def _hashable(key: tuple) -> tuple:
    name, bucket, ext = key
    return (name, bucket, tuple(sorted(ext.items())) if isinstance(ext, dict) else ext)


def _describe(key: tuple, named: bool) -> str:
    name, bucket, ext = key
    head = f"program {name!r} " if named else ""
    if bucket == "invalid":
        return f"{head}raw inputs the runner rejects ({ext})"
    return f"{head}bucket {bucket} extents {ext}"


class AgreeingRunner:
    """A runner whose every call first checks, over a CPU group, that all ranks agree."""

    def __init__(self, runner, group=None):
        self.runner, self.group = runner, group

    def __call__(self, /, **raw):
        keys = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(keys, call_key(self.runner, raw), group=self.group)
        msg = disagreement(keys)
        if msg is not None:
            raise RankDisagreementError(msg)
        return self.runner(**raw)

    def __getattr__(self, name):          # stats, plan, program, ...: the runner's
        return getattr(self.runner, name)

    def __repr__(self) -> str:
        return f"<agree {self.runner!r}>"


def agree(runner, group=None, *, enabled: bool | None = None):
    """`runner`, checked for cross-rank agreement before every call when `enabled` (default:
    PADGRAPH_CHECK_RANKS=1); disabled, `runner` itself. `group`: a CPU (gloo) group of the
    tensor-parallel ranks (None = the default group)."""
    on = check_enabled() if enabled is None else enabled
    return AgreeingRunner(runner, group) if on else runner
