"""Output lifetimes, enforced (rule 6.2): with `copy_outputs=False` an output is lent to the
caller until the runner's next call, and a read after that raises `StaleOutputError`.

Each call's outputs are `Lent` tensors: views of the runner's output memory that carry the call's
`Lease`. The next call ends that lease; any torch operation on a tensor of an ended lease
(arithmetic, indexing, `.item()`, `.cpu()`, printing, passing it to another runner) raises
instead of reading what the later call wrote there. Operations on a live lease return plain
tensors, except views, which stay lent under the same lease (they alias the same memory).
The cost is on the caller's reads of outputs (a Python check per torch call on them), not on the
call path beyond one `as_subclass` per output.
"""
from __future__ import annotations

import torch

from .errors import StaleOutputError


class LentInput(Exception):
    """Plan.extents met a Lent tensor among a call's inputs: the runner unlends them and retries."""


class Lease:
    """One call's claim on its outputs: alive until the runner's next call ends it."""

    __slots__ = ("alive", "program", "call", "name")

    def __init__(self, program: str, call: int):
        self.alive, self.program, self.call, self.name = True, program, call, None

    def error(self, name: str | None) -> StaleOutputError:
        out = f"output {name!r}" if name else "an output"
        return StaleOutputError(
            f"program {self.program!r}: {out} of call {self.call} must be read before the runner's next "
            f"call, got a read after it: that call has overwritten its memory. Pass copy_outputs=True to "
            f"pg.compile, or .clone() what you keep before calling the runner again")


def _stale(args, kwargs) -> StaleOutputError | None:
    """The error of the first lent tensor of an ended lease among the arguments (one level deep)."""
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if type(a) is Lent:
            if not a._lease.alive:
                return a._lease.error(a._name)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if type(b) is Lent and not b._lease.alive:
                    return b._lease.error(b._name)
    return None


class Lent(torch.Tensor):
    """An output on loan until the runner's next call (see the module docstring)."""

    def __repr__(self, **kwargs) -> str:          # as a plain tensor prints (raises when stale)
        return unlend(self).__repr__(**kwargs)

    def __deepcopy__(self, memo):                 # a copy is the caller's own: a plain tensor
        return unlend(self).clone()

    def __reduce_ex__(self, protocol):            # pickled as the plain tensor it is now
        return unlend(self).clone().__reduce_ex__(protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        err = _stale(args, kwargs)
        if err is not None:
            raise err
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and type(result) is torch.Tensor:
            src = next((a for a in args if type(a) is Lent), None)
            if src is not None and result.layout == torch.strided and _shares(result, src):
                return lend(result, src._lease, src._name)
        return result


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0


def lend(t: torch.Tensor, lease: Lease, name: str | None) -> Lent:
    """`t` as a Lent tensor under `lease`."""
    u = t.as_subclass(Lent)
    u._lease, u._name = lease, name
    return u


def unlend(t):
    """A plain tensor for a Lent one whose lease is alive (raises when it ended); anything else as given."""
    if type(t) is not Lent:
        return t
    if not t._lease.alive:
        raise t._lease.error(t._name)
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor._make_subclass(torch.Tensor, t)
