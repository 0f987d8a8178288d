"""The declaration: inputs, outputs and bound state of a static program, and its ladder.

A Program is frozen data: it can be built, printed and validated with no GPU and runs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

from .axes import Affine, Axis, Dim, as_affine
from .buckets import Buckets
from .errors import ContractError, ContractTypeError, ContractValueError, mismatch
from .pads import Pad, as_number, as_pad, is_number, pad_problem


def _check_shape(shape, owner: str) -> tuple:
    if not isinstance(shape, tuple):
        raise ContractTypeError(f"{owner}: shape must be a tuple of ints and axes, got {shape!r}")
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, Axis, Affine)):
            raise ContractTypeError(f"{owner}: a dimension must be an int, an Axis or an axis expression, got {d!r}")
        if isinstance(d, int) and d < 0:
            raise ContractValueError(f"{owner}: a fixed dimension must be >= 0, got {d}")
    return shape


def padded_dims(shape: tuple) -> list[tuple[int, Affine]]:
    """(dim index, affine) for each dimension that moves with an axis."""
    return [(i, a) for i, d in enumerate(shape) if (a := as_affine(d)) is not None]


@dataclass(frozen=True)
class Input:
    """A static input: shape over ints and axes, dtype, and the pad policy of its padded lanes."""

    shape: tuple
    dtype: torch.dtype
    pad: Pad | int | float | bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "pad", as_pad(self.pad))   # checked against dtype by Program

    @property
    def padded(self) -> bool:
        return bool(padded_dims(self.shape))


@dataclass(frozen=True)
class Output:
    """A static output; sliced to raw extents along its padded axes after each call.

    `pad`: what its lanes past a device-resident extent hold (`runner.call(..., extents=)`): the
    host slices to the host-known bound, and lanes between the device extent and it hold `pad`.
    """

    shape: tuple
    dtype: torch.dtype
    pad: int | float | bool = 0

    def __post_init__(self):
        object.__setattr__(self, "pad", as_number(self.pad))   # a numpy scalar as its number


@dataclass(frozen=True)
class State:
    """Bound state the body reads and writes: a tensor or a pytree of tensors, e.g. a KV cache.

    `sink`: the row(s) of dim 0 that padded lanes may write (slot 0, request row 0), or None.
    Checked by Program (ints >= 0) and at bind time (< dim 0 of every bound tensor).
    `rows`: the bucketed axis, for batch-ordered state (a model's own cache with one row per
    request): dim 0 of every leaf follows that axis, raw lane i owns row i, padded lanes own rows
    [n, bucket), and the body sees every leaf cut to rows [0, bucket) (the structure rebuilt
    around those views, once per bucket).
    `flatten` / `unflatten`: for an object torch's pytree does not know (e.g. a library's cache
    class): flatten(obj) -> (list of tensors, context); unflatten(tensors, context) -> an object
    of the same kind over those tensors.
    `canary`: row(s) of dim 0 that no lane of any call may write (a reserved slot): the runner
    fills them with a sentinel and checks them after every run of the body (padgraph/canary.py).
    """

    sink: int | tuple[int, ...] | None = None
    rows: object = None
    flatten: object = None
    unflatten: object = None
    canary: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.sink, list):
            object.__setattr__(self, "sink", tuple(self.sink))
        if isinstance(self.canary, list):
            object.__setattr__(self, "canary", tuple(self.canary))

    @property
    def sink_rows(self) -> tuple[int, ...]:
        if self.sink is None:
            return ()
        rows = tuple(self.sink) if isinstance(self.sink, tuple) else (self.sink,)
        return tuple(as_number(r) for r in rows)     # np.int64(0) as 0; others as given

    @property
    def canary_rows(self) -> tuple[int, ...]:
        if self.canary is None:
            return ()
        rows = tuple(self.canary) if isinstance(self.canary, tuple) else (self.canary,)
        return tuple(as_number(r) for r in rows)


def _freeze(d: Mapping | None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Program:
    """A static program: named inputs, outputs, state, and the ladder of its bucketed axis."""

    name: str
    inputs: Mapping[str, Input]
    outputs: Mapping[str, Output] = field(default_factory=dict)
    state: Mapping[str, State] = field(default_factory=dict)
    buckets: Buckets | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            cls = ContractValueError if isinstance(self.name, str) else ContractTypeError
            raise cls(f"Program name must be a non-empty str, got {self.name!r} ({type(self.name).__name__})")
        for attr in ("inputs", "outputs", "state"):
            table = getattr(self, attr)
            if table is not None and not isinstance(table, Mapping):
                raise ContractTypeError(mismatch(self.name, None, attr, "a mapping name -> pg."
                                                 + {"inputs": "Input", "outputs": "Output", "state": "State"}[attr]
                                                 + "(...) (a dict)", f"{table!r} ({type(table).__name__})"))
            object.__setattr__(self, attr, _freeze(table))
        object.__setattr__(self, "buckets", _ladder(self.name, self.buckets))
        _validate(self)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """Every axis used by the inputs, the bucketed one first, in declaration order."""
        seen: dict[int, Axis] = {}
        for spec in self.inputs.values():
            for _, a in padded_dims(spec.shape):
                seen.setdefault(id(a.axis), a.axis)
        return tuple(sorted(seen.values(), key=lambda a: not a.bucketed))

    @property
    def bucket_axis(self) -> Axis:
        return self.axes[0]

    def axis(self, name: str) -> Axis:
        for a in self.axes:
            if a.name == name:
                return a
        raise ContractValueError(f"program {self.name!r}: no axis {name!r}; axes are {[a.name for a in self.axes]}")

    def __str__(self) -> str:
        lines = [f"Program {self.name!r}  buckets={list(self.buckets)}"]
        for n, s in self.inputs.items():
            lines.append(f"  in    {n:<18} {_fmt(s.shape):<18} {str(s.dtype):<16} pad={s.pad!r}")
        for n, s in self.outputs.items():
            lines.append(f"  out   {n:<18} {_fmt(s.shape):<18} {s.dtype}")
        for n, s in self.state.items():
            lines.append(f"  state {n:<18} " + (f"rows={s.rows.name}" if s.rows is not None else f"sink={s.sink!r}"))
        return "\n".join(lines)


def _fmt(shape: tuple) -> str:
    return "(" + ", ".join(repr(d) for d in shape) + ")"


def _ladder(name, buckets) -> Buckets:
    """The program's Buckets; a malformed ladder's error gains the program's name."""
    if buckets is None:
        return Buckets.default()
    if isinstance(buckets, Buckets):
        return buckets
    try:
        return Buckets(buckets)
    except ContractError as e:
        raise type(e)(f"program {name!r}, buckets: {str(e).removeprefix('Buckets: ')}") from None


# The view reads these as attributes of its own (x.bucket, x.extent); Outputs is a dict, so
# `out.items` would be dict.items, never an output named "items".
_VIEW_NAMES = frozenset({"bucket", "extent", "program", "raw_extents"})
_DICT_METHODS = frozenset(n for n in dir(dict) if not n.startswith("_"))


def _validate(p: Program) -> None:
    if not p.inputs:
        raise ContractValueError(f"program {p.name!r}: declares no inputs; a static program needs at least one")
    _validate_names(p)
    for n, s in p.inputs.items():
        _validate_buffer(p, n, s, Input, "input")
        _validate_input(p, n, s)
    for n, s in p.outputs.items():
        _validate_buffer(p, n, s, Output, "output")
        pad = as_number(s.pad)
        problem = pad_problem(as_pad(pad) if is_number(pad) else pad, s.dtype)
        if problem is None and not is_number(pad):
            problem = (ContractTypeError, "a number", f"{s.pad!r} ({type(s.pad).__name__})")
        if problem is not None:
            cls, expected, got = problem
            raise cls(mismatch(p.name, n, f"pad {s.pad!r}", expected, got, kind="output"))
    for n, s in p.state.items():
        _validate_state(p, n, s)
    _validate_axes(p)
    for n, s in p.state.items():
        if s.rows is not None and s.rows is not p.bucket_axis:
            raise ContractValueError(mismatch(p.name, n, "rows", f"the program's bucketed axis {p.bucket_axis.name!r}",
                                              repr(s.rows), kind="state"))


def _validate_names(p: Program) -> None:
    for kind, table in (("input", p.inputs), ("output", p.outputs), ("state", p.state)):
        for n in table:
            if not isinstance(n, str):
                raise ContractTypeError(mismatch(p.name, None, f"every {kind} name", "a str", f"{n!r} ({type(n).__name__})"))
    names = list(p.inputs) + list(p.outputs) + list(p.state)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ContractValueError(f"program {p.name!r}: names must be unique across inputs, outputs and state, got {dup} twice")
    for n in names:
        if not n.isidentifier() or n.startswith("_") or n in _VIEW_NAMES:
            raise ContractValueError(f"program {p.name!r}: buffer name {n!r} must be an identifier, not start with '_' and not be one of {sorted(_VIEW_NAMES)}")
        if n in _DICT_METHODS:
            raise ContractValueError(
                f"program {p.name!r}: buffer name {n!r} must not be a method of the Outputs dict "
                f"{sorted(_DICT_METHODS)}, got {n!r}: `out.{n}` would be dict.{n}, not the buffer. Rename it")


def _validate_buffer(p, n, s, cls, kind) -> None:
    if not isinstance(s, cls):
        raise ContractTypeError(f"program {p.name!r}, {kind} {n!r}: must be pg.{cls.__name__}(...), got {type(s).__name__}")
    _check_shape(s.shape, f"program {p.name!r}, {kind} {n!r}")
    if not isinstance(s.dtype, torch.dtype):
        raise ContractTypeError(f"program {p.name!r}, {kind} {n!r}: dtype must be a torch.dtype, got {s.dtype!r}")


def _validate_input(p: Program, n: str, s: Input) -> None:
    if s.dtype.is_complex:
        raise ContractTypeError(mismatch(
            p.name, n, "dtype", "real (bool, an integer or a float)", f"{s.dtype}: the pack copies 1-, 2-, 4- "
            "or 8-byte bit patterns, so complex128 cannot be packed; pass real and imaginary parts as two inputs "
            "(or a trailing dim of 2)"))
    if s.padded and s.pad is None:
        raise ContractValueError(
            f"program {p.name!r}, input {n!r}: shape {_fmt(s.shape)} has a padded axis, so it must declare "
            f"pad= (a number, pg.Fill(v) or pg.Edge()); there is no 'leave as is'")
    problem = None if s.pad is None else pad_problem(s.pad, s.dtype)
    if problem is not None:
        cls, expected, got = problem
        raise cls(mismatch(p.name, n, f"pad {s.pad!r}", expected, got))


def _validate_canary(p: Program, n: str, s) -> None:
    """Canary rows: ints >= 0, none a sink row, none in a batch-ordered state (its rows are the lanes')."""
    for row in s.canary_rows:
        if isinstance(row, bool) or not isinstance(row, int):
            raise ContractTypeError(mismatch(p.name, n, "canary", "an int or a tuple of ints (rows of dim 0)",
                                             f"{s.canary!r} ({type(row).__name__} {row!r})", kind="state"))
        if row < 0 or row in s.sink_rows:
            raise ContractValueError(mismatch(p.name, n, "canary rows", ">= 0 and none of the sink rows "
                                              f"{list(s.sink_rows)} (padded lanes write sinks)", repr(s.canary), kind="state"))
    if s.canary_rows and s.rows is not None:
        raise ContractValueError(mismatch(p.name, n, "canary with rows=", "None (every row of a batch-ordered state "
                                          "belongs to a lane)", repr(s.canary), kind="state"))


def _validate_state(p: Program, n: str, s) -> None:
    if not isinstance(s, State):
        raise ContractTypeError(f"program {p.name!r}, state {n!r}: must be pg.State(...), got {type(s).__name__}")
    for row in s.sink_rows:
        if isinstance(row, bool) or not isinstance(row, int):
            raise ContractTypeError(mismatch(p.name, n, "sink", "an int or a tuple of ints (rows of dim 0)",
                                             f"{s.sink!r} ({type(row).__name__} {row!r})", kind="state"))
        if row < 0:
            raise ContractValueError(mismatch(p.name, n, "sink rows", ">= 0 (rows of dim 0)", repr(s.sink), kind="state"))
    _validate_canary(p, n, s)
    if s.rows is not None:
        if not isinstance(s.rows, Axis) or not s.rows.bucketed:
            raise ContractValueError(mismatch(p.name, n, "rows", "the bucketed axis (an Axis without capacity)",
                                              repr(s.rows), kind="state"))
        if s.sink is not None:
            raise ContractValueError(mismatch(p.name, n, "sink with rows=", "None (padded lanes of a batch-ordered "
                                              "state own rows [n, bucket); they need no sink)", repr(s.sink), kind="state"))
    if (s.flatten is None) != (s.unflatten is None) or not all(f is None or callable(f) for f in (s.flatten, s.unflatten)):
        raise ContractTypeError(mismatch(p.name, n, "flatten / unflatten", "both callables or both None",
                                         f"{s.flatten!r} / {s.unflatten!r}", kind="state"))


def _validate_axes(p: Program) -> None:
    axes = p.axes
    if not axes:
        raise ContractValueError(f"program {p.name!r}: no input has a padded axis, so there is nothing to bucket")
    roots = [a for a in axes if a.bucketed]
    if len(roots) != 1:
        raise ContractValueError(
            f"program {p.name!r}: exactly one bucketed axis (an Axis without capacity) must be used, got "
            f"{[a.name for a in roots]}; give the others capacity=<expression of the bucketed axis>")
    root = roots[0]
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise ContractValueError(f"program {p.name!r}: two different axes share a name in {names}")
    for a in axes:
        if not a.bucketed and a.capacity.axis is not root:
            raise ContractValueError(
                f"program {p.name!r}, axis {a.name!r}: capacity must be an expression of the bucketed axis "
                f"{root.name!r}, got {a.capacity!r}")
        if a.cap(p.buckets[0]) < 1:
            raise ContractValueError(
                f"program {p.name!r}, axis {a.name!r}: capacity must be >= 1 at every bucket, got {a.cap(p.buckets[0])} at bucket {p.buckets[0]}")
    for kind, table in (("input", p.inputs), ("output", p.outputs)):
        for n, s in table.items():
            _validate_sizes(p, n, s, kind)
    known = {id(a) for a in axes}
    for n, s in p.outputs.items():
        for _, af in padded_dims(s.shape):
            if id(af.axis) not in known:
                raise ContractValueError(
                    f"program {p.name!r}, output {n!r}: axis {af.axis.name!r} is used by no input, so its raw "
                    f"extent cannot be known; axes of the inputs are {names}")


def _validate_sizes(p: Program, n: str, s, kind: str) -> None:
    """A padded dimension with a negative offset (`bs - 1`) must not be negative at the smallest
    bucket, where each axis has its smallest capacity."""
    for d, af in padded_dims(s.shape):
        size = af.at(af.axis.cap(p.buckets[0]))
        if size < 0:
            raise ContractValueError(mismatch(p.name, n, f"dimension {d} ({af!r})",
                                              ">= 0 at every bucket (the axis at its smallest capacity)",
                                              f"{size} at bucket {p.buckets[0]}", kind=kind))
