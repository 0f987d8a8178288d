"""The ContractError family: every error padgraph raises about a program's contract.

Each class also subclasses the builtin it refines, so `except ValueError` keeps working in
caller code. Messages name the program, the buffer, what must hold and what was given.
"""
from __future__ import annotations


class ContractError(Exception):
    """Base of every padgraph contract error."""


class ContractValueError(ContractError, ValueError):
    """A value (shape, extent, ladder, option) breaks the declared contract."""


class ContractTypeError(ContractError, TypeError):
    """A value of the wrong kind: dtype, a non-tensor input, a bad declaration type."""


class ContractRuntimeError(ContractError, RuntimeError):
    """The contract cannot be kept at run time (state storage moved, capture failed, ...)."""


class ContractKeyError(ContractError, KeyError):
    """A name that is not declared: an axis of `x.extent(...)`, a buffer of `x[...]`."""

    def __str__(self) -> str:
        # KeyError shows repr(arg) (quotes and escapes); a contract message reads as written
        return str(self.args[0]) if self.args else ""


class ContractAttributeError(ContractError, AttributeError):
    """An attribute that names no declared buffer, e.g. `x.nope` on a padded view (hasattr works)."""


class BucketOverflowError(ContractValueError):
    """A raw extent is past the largest bucket and the runner was built with overflow="error"."""


class StateStorageError(ContractRuntimeError):
    """A bound state tensor no longer has the storage, shape or strides it was bound with."""


class CaptureError(ContractRuntimeError):
    """A backend could not capture the body for a bucket."""


class StaleOutputError(ContractRuntimeError):
    """An output read after the runner's next call overwrote it (copy_outputs=False)."""


class ShadowMismatch(ContractRuntimeError):
    """A shadow-verified call's replay differs from the eager padded path (pg.Shadow)."""


class CanaryError(ContractRuntimeError):
    """A canary row of bound state (pg.State(canary=...)) was written: no lane of any call may write it."""


class OverflowWarning(UserWarning):
    """A call past the ladder ran eagerly (overflow="eager"): once per runner, counted in stats."""


def where(program: str, buffer: str | None = None, kind: str = "input") -> str:
    """The 'program ..., input ...' prefix every message starts with."""
    head = f"program {program!r}"
    return f"{head}, {kind} {buffer!r}" if buffer is not None else head


def mismatch(program: str, buffer: str | None, what: str, expected, got, kind: str = "input") -> str:
    """Uniform 'expected vs given' message: `<where>: <what> must be <expected>, got <got>`."""
    return f"{where(program, buffer, kind)}: {what} must be {expected}, got {got}"
