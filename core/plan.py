"""The ladder resolved: per-bucket shapes, raw-input validation, extent inference, bucket lookup.

Everything here is host-side and device-free: a Plan can be built and inspected with no GPU.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass
from typing import Mapping

import torch

from .axes import as_affine
from .errors import BucketOverflowError, ContractTypeError, ContractValueError, mismatch, where
from .lifetimes import Lent, LentInput
from .pack import PackTable, pack_table
from .program import Program, padded_dims


@dataclass(frozen=True)
class _InputCheck:
    """What a raw input must satisfy, precomputed once so validation is a short loop."""

    name: str
    dtype: torch.dtype
    shape: tuple
    rank: int
    fixed: tuple          # (dim, size) of int dimensions
    moving: tuple         # (dim, axis name, scale, offset) of padded dimensions
    # declared like an earlier input (same rank, fixed, moving): that input's number among the
    # inputs declared like no earlier one; this input's shape must equal that input's
    alike: int | None = None


class OnDevice(dict):
    """Extents (axis -> raw extent) of a call whose every input is a plain tensor on the device
    `Plan.extents` was given: what its fast path returns, so a backend need not ask each input
    again where it lives. Any other extents (a plain dict) promise nothing about the inputs."""

    __slots__ = ()


def _min_bucket_table(caps: list[int]) -> list[int]:
    """table[n] = index of the first bucket whose capacity holds n (caps are non-decreasing)."""
    table, i = [], 0
    for n in range(caps[-1] + 1):
        while caps[i] < n:
            i += 1
        table.append(i)
    return table


class Plan:
    """A Program with its ladder resolved. Built once per runner; every method is pure."""

    def __init__(self, program: Program):
        self.program = program
        self.buckets = tuple(program.buckets)
        self.axes = program.axes
        self.bucket_axis = self.axes[0].name
        self._checks = _link_same_shapes([_input_check(n, s) for n, s in program.inputs.items()])
        self._names = frozenset(program.inputs)
        self._n_names = len(self._names)
        self._tensors_of = values_at([c.name for c in self._checks])     # raw -> its tensors, in check order
        # the fast path, one function per program (with a device to match, and without one),
        # written on its first call: a Plan only asked for shapes never pays for it
        self._fast_on = functools.partial(_first_fast, self, True)
        self._fast_any = functools.partial(_first_fast, self, False)
        # axis name -> [raw extent -> bucket index]; O(1) lookup on the call path.
        self._tables = {a.name: _min_bucket_table([a.cap(b) for b in self.buckets]) for a in self.axes}
        self._affine = {a.name: a.capacity for a in self.axes}
        self._packs: dict[int, PackTable] = {}

    def pack_table(self, bucket: int) -> PackTable:
        """What a backend writes into every input's padded buffer at `bucket` (any size >= 1)."""
        t = self._packs.get(bucket)
        if t is None:
            t = self._packs[bucket] = pack_table(self.program, bucket, self.capacity)
        return t

    # ---- shapes -------------------------------------------------------------------------
    def capacity(self, axis: str, bucket: int) -> int:
        cap = self._affine[axis]
        return bucket if cap is None else cap.at(bucket)

    def shape(self, name: str, bucket: int) -> tuple[int, ...]:
        """Padded shape of an input or output at a bucket."""
        spec = self.program.inputs.get(name) or self.program.outputs[name]
        return tuple(_dim(d, lambda a: self.capacity(a, bucket)) for d in spec.shape)

    def raw_shape(self, name: str, extents: Mapping[str, int]) -> tuple[int, ...]:
        spec = self.program.inputs.get(name) or self.program.outputs[name]
        return tuple(_dim(d, extents.__getitem__) for d in spec.shape)

    def largest_shape(self, name: str) -> tuple[int, ...]:
        return self.shape(name, self.buckets[-1])

    # ---- validation and extents ---------------------------------------------------------
    def extents(self, raw: Mapping[str, object], device: torch.device | None = None,
                allow_host: bool = False) -> dict[str, int]:
        """Check raw inputs against the declaration and infer one raw extent per axis (as
        `OnDevice` when every input is a plain tensor on `device`)."""
        if len(raw) != self._n_names or type(raw) is not dict:     # a dict of the right size: its keys below
            if raw.keys() != self._names:
                self._bad_names(raw)
        try:
            tensors = self._tensors_of(raw)
        except KeyError:                # a name missing: an unknown one took its place
            if raw.keys() != self._names:
                self._bad_names(raw)
            raise
        ext = (self._fast_on if device is not None else self._fast_any)(tensors, device)
        return ext if ext is not None else self._extents_each(raw, device, allow_host)

    def _extents_fast(self, tensors: tuple, device) -> dict[str, int] | None:
        """The extents where every input is a plain tensor of its dtype on `device` (any device
        when None) with a shape the declaration accepts; None for anything else (`_extents_each`
        then raises, or accepts a host input or another call's output). See `_fast_extents`."""
        return (self._fast_on if device is not None else self._fast_any)(tensors, device)

    def _extents_each(self, raw: Mapping[str, object], device, allow_host: bool) -> dict[str, int]:
        """Every input checked on its own: the extents, or the error rule 2 names for the first
        input that breaks the declaration."""
        ext: dict[str, int] = {}
        for c in self._checks:
            t = raw[c.name]
            if type(t) is not torch.Tensor or t.dtype is not c.dtype or t.ndim != c.rank \
                    or (device is not None and t.device != device):
                if type(t) is Lent:
                    raise LentInput(c.name)      # the runner hands over plain aliases (or stale errors)
                if not isinstance(t, torch.Tensor) or t.dtype != c.dtype or t.dim() != c.rank \
                        or (device is not None and t.device != device):
                    self._check_tensor(c, t, device, allow_host)   # raises, or accepts a host input
            shp = t.shape
            for d, size in c.fixed:
                if shp[d] != size:
                    raise ContractValueError(mismatch(self.program.name, c.name, f"dim {d} of shape {c.shape}", size, f"{tuple(shp)}"))
            for d, axis, scale, offset in c.moving:
                n = shp[d] if scale == 1 and offset == 0 else self._solve(c, shp, d, axis, scale, offset)
                old = ext.get(axis)
                if old is None:
                    ext[axis] = n
                elif old != n:
                    self._disagree(raw, axis, c.name, n, old)
        if ext[self.bucket_axis] < 1:
            giver = next(c.name for c in self._checks for m in c.moving if m[1] == self.bucket_axis)
            raise ContractValueError(mismatch(self.program.name, giver,
                                              f"raw extent of bucketed axis {self.bucket_axis!r}", ">= 1", 0))
        return ext

    def _solve(self, c: _InputCheck, shp, d: int, axis: str, scale: int, offset: int) -> int:
        """n with scale * n + offset == shp[d], n >= 0; else the error rule 2.3 names."""
        m = shp[d] - offset
        n = m // scale
        if n < 0 or n * scale != m:
            raise ContractValueError(mismatch(
                self.program.name, c.name, f"dim {d}", f"{c.shape[d]!r} for some {axis} >= 0",
                f"{shp[d]} in shape {tuple(shp)}"))
        return n

    def _disagree(self, raw, axis: str, name: str, n: int, old: int):
        first = next(c.name for c in self._checks for m in c.moving if m[1] == axis)
        raise ContractValueError(
            f"{where(self.program.name, name)}: raw extent of axis {axis!r} must agree across inputs; "
            f"input {first!r} gives {axis}={old} but {name!r} gives {axis}={n} (shape {tuple(raw[name].shape)})")

    def _check_tensor(self, c: _InputCheck, t, device, allow_host) -> None:
        if not isinstance(t, torch.Tensor):
            raise ContractTypeError(mismatch(self.program.name, c.name, "the value", "a torch.Tensor", type(t).__name__))
        if t.dtype != c.dtype:
            raise ContractTypeError(mismatch(self.program.name, c.name, "dtype", c.dtype, t.dtype))
        if t.dim() != len(c.shape):
            raise ContractValueError(mismatch(self.program.name, c.name, f"rank of {c.shape}", len(c.shape), f"{t.dim()} (shape {tuple(t.shape)})"))
        if device is not None and t.device != device and not (allow_host and t.device.type == "cpu"):
            exp = f"{device}" + (" or cpu" if allow_host else "")
            raise ContractValueError(mismatch(self.program.name, c.name, "device", exp, t.device))

    def _bad_names(self, raw: Mapping) -> None:
        missing = sorted(self._names - raw.keys())
        unknown = sorted(raw.keys() - self._names, key=repr)    # keys may mix types
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unknown:
            parts.append(f"unknown {unknown}")
        raise ContractTypeError(
            f"{where(self.program.name)}: inputs must be exactly {sorted(self._names)}; {', '.join(parts)}")

    # ---- buckets ------------------------------------------------------------------------
    def bucket_for(self, extents: Mapping[str, int]) -> int | None:
        """Smallest bucket whose capacity holds every axis's raw extent; None past the ladder."""
        i = 0
        for axis, n in extents.items():
            table = self._tables[axis]
            if n >= len(table):
                return None
            j = table[n]
            if j > i:
                i = j
        return self.buckets[i]

    def fit(self, extents: Mapping[str, int]) -> int:
        """Smallest whole size of the bucketed axis that holds every extent (ladder or not)."""
        n = 1
        for axis, e in extents.items():
            cap = self._affine[axis]
            need = e if cap is None else -(-(e - cap.offset) // cap.scale)
            n = max(n, need)
        return n

    def overflow_error(self, extents: Mapping[str, int]) -> BucketOverflowError:
        largest = self.buckets[-1]
        over = {a: n for a, n in extents.items() if n > self.capacity(a, largest)}
        caps = {a: self.capacity(a, largest) for a in over}
        carriers = sorted({c.name for c in self._checks for m in c.moving if m[1] in over})
        return BucketOverflowError(
            f"{where(self.program.name)}: raw extents must fit the largest bucket {largest} "
            f"(capacities {caps}), got {over} from inputs {carriers}; enlarge the ladder or compile "
            f"with overflow='eager'")


def _dim(d, extent_of) -> int:
    af = as_affine(d)
    return d if af is None else af.at(extent_of(af.axis.name))


def _link_same_shapes(checks: list[_InputCheck]) -> tuple[_InputCheck, ...]:
    """Each check with `alike` set where an earlier input is declared alike (see _InputCheck)."""
    firsts: dict[tuple, int] = {}         # (rank, fixed, moving) -> number of its first input
    out = []
    for c in checks:
        key = (c.rank, c.fixed, c.moving)
        out.append(dataclasses.replace(c, alike=firsts.get(key)))
        firsts.setdefault(key, len(firsts))
    return tuple(out)


def _first_fast(plan: Plan, on_device: bool, tensors: tuple, device) -> dict[str, int] | None:
    """The fast path's first call: write its function, keep it on the plan, call it."""
    fast = _fast_extents(plan._checks, plan.bucket_axis, on_device)
    setattr(plan, "_fast_on" if on_device else "_fast_any", fast)
    return fast(tensors, device)


def _fast_extents(checks: tuple[_InputCheck, ...], bucket_axis: str, on_device: bool):
    """`fast(tensors, device) -> extents or None`: the per-input checks of `_extents_each` for
    calls that pass them, written out for this program's inputs as straight-line code (no loop,
    no unpacking of check records: the call path's largest Python cost). An input declared like
    an earlier one only has its shape compared with that one's: both accept the same shapes and
    give the same extents. None for anything else, the per-input path then decides; the extents
    come in the per-input path's key order (the first input that carries each axis), as
    `OnDevice` where every input was checked on `device` (`on_device`)."""
    env = {"Tensor": torch.Tensor, "OnDevice": OnDevice, "new": dict.__new__}
    lines = ["def fast(tensors, device):"]
    if checks:
        lines.append(f"    {''.join(f't{i}, ' for i in range(len(checks)))}= tensors")
    leaders = []                        # input number of each input declared like no earlier one
    axes: dict[str, str] = {}           # axis -> the local holding its extent
    for i, c in enumerate(checks):
        env[f"D{i}"] = c.dtype
        test = f"type(t{i}) is not Tensor or t{i}.dtype is not D{i}" + (f" or t{i}.device != device" if on_device else "")
        if c.alike is not None:         # declared like an earlier input: the same shape
            lines.append(f"    if {test} or t{i}.shape != s{leaders[c.alike]}:\n        return None")
        else:
            leaders.append(i)
            lines += [f"    if {test}:\n        return None", f"    s{i} = t{i}.shape"]
            lines += _shape_lines(f"s{i}", c, axes)
    if bucket_axis not in axes:         # no input carries the bucketed axis: the per-input path
        lines.append("    return None")
    else:
        lines.append(f"    if {axes[bucket_axis]} < 1:\n        return None")
        if on_device:                   # every input checked on `device`: extents that say so
            lines += ["    ext = new(OnDevice)", *(f"    ext[{a!r}] = {n}" for a, n in axes.items()), "    return ext"]
        else:
            lines.append("    return {" + ", ".join(f"{a!r}: {n}" for a, n in axes.items()) + "}")
    exec("\n".join(lines), env)        # noqa: S102 (source built above from the declaration only)
    return env["fast"]


def _shape_lines(shp: str, c: _InputCheck, axes: dict[str, str]) -> list[str]:
    """Lines checking shape `shp` (a local) against input `c`'s declaration, each padded dim's
    extent into a local; `axes` (axis -> the local of its first extent) gains the new axes.
    Sizes are validated ints (pg.Input, pg.Axis), written as int literals."""
    lines = [f"    if len({shp}) != {c.rank}:\n        return None"]
    lines += [f"    if {shp}[{d}] != {int(size)}:\n        return None" for d, size in c.fixed]
    for d, axis, scale, offset in c.moving:
        n, scale, offset = f"n_{shp}_{d}", int(scale), int(offset)
        if scale == 1 and offset == 0:
            lines.append(f"    {n} = {shp}[{d}]")
        elif scale == 1:
            lines.append(f"    {n} = {shp}[{d}] - {offset}\n    if {n} < 0:\n        return None")
        else:                           # n with scale * n + offset == the dim, n >= 0 (rule 2.3)
            lines.append(f"    m = {shp}[{d}] - {offset}\n    {n} = m // {scale}")
            lines.append(f"    if {n} < 0 or {n} * {scale} != m:\n        return None")
        if axis in axes:                # every dim on one axis gives the same extent
            lines.append(f"    if {n} != {axes[axis]}:\n        return None")
        else:
            axes[axis] = n
    return lines


def values_at(names: list[str]):
    """mapping -> the tuple of its values at `names`, in one C call where it can (the call path
    reads a call's inputs and extents by it; itemgetter of one name is not a tuple)."""
    if len(names) == 1:
        name = names[0]
        return lambda m: (m[name],)
    return operator.itemgetter(*names) if names else (lambda m: ())


def _input_check(name: str, spec) -> _InputCheck:
    fixed = tuple((i, d) for i, d in enumerate(spec.shape) if isinstance(d, int))
    moving = tuple((i, a.axis.name, a.scale, a.offset) for i, a in padded_dims(spec.shape))
    return _InputCheck(name, spec.dtype, spec.shape, len(spec.shape), fixed, moving)
