"""The pack table: what every backend writes into each input's padded buffer, per bucket.

The Plan emits one `PackTable` per bucket; a backend only applies it. Each input is an entry
that sees its dense padded buffer as a grid of `rows x cols` elements and its raw tensor as the
top-left `raw rows x raw cols` of that grid:

    shape = F0 . P1 . F1 [. P2 . F2]      (P: padded dims, F: products of fixed dims)
    "rows"  one padded dim, F0 == 1:      rows = P1 (unit 1),   cols = F1 (not padded)
    "grid"  one padded dim, F0 > 1:       rows = F0 (fixed),    cols = P1*F1 (unit F1)
            two padded dims, F0 == 1:     rows = P1*F1 (unit F1), cols = P2*F2 (unit F2)
    "nd"    anything else (3+ padded dims, or 2 behind a fixed dim): torch ops, dim by dim

A lane outside the raw grid holds the pad: FILL writes the value; EDGE copies the last raw *unit*
along each padded level (a unit is one step of the padded dim: F1 rows, F2 elements), or the
default when a padded level has no raw unit. A raw count is `(scale * extent + offset) * unit`
with the extent of the level's axis (fixed levels: axis None, count = offset * unit).

`apply(entry, dst, src, extents)` below is the torch reference of that rule: the reference backend
pads through it, and the Triton pack kernel is tested against it. The table itself is pure data,
printable and built on any machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from .axes import as_affine
from .pads import Edge, Fill, as_number, stored

FILL, EDGE = "fill", "edge"


@dataclass(frozen=True)
class Level:
    """One level of the grid: its count at this bucket and where its raw count comes from."""

    total: int                 # rows (or elements per row) of the padded buffer
    axis: str | None = None    # axis whose raw extent sizes this level; None: fixed (raw = total)
    scale: int = 0
    offset: int = 0
    unit: int = 1              # rows (elements) per step of the padded dim

    def raw(self, extents: Mapping[str, int]) -> int:
        if self.axis is None:
            return self.total
        # a dim k*a + c with c < 0 is empty (not negative) at a raw extent of 0
        return max(0, self.scale * extents[self.axis] + self.offset) * self.unit

    def __str__(self) -> str:
        if self.axis is None:
            return f"{self.total}"
        src = self.axis if self.scale == 1 else f"{self.scale}*{self.axis}"
        src = src if self.offset == 0 else f"({src}{self.offset:+d})"
        return f"{self.total}<-{src}" + (f"*{self.unit}" if self.unit != 1 else "")


@dataclass(frozen=True)
class PackEntry:
    """How one input is written at one bucket (see the module docstring)."""

    name: str
    layout: str                # "rows" | "grid" | "nd"
    shape: tuple               # padded shape at this bucket (dense, row-major)
    rows: Level | None
    cols: Level | None
    mode: str                  # FILL | EDGE
    fill: int | float | bool   # FILL: the value; EDGE: the default for an empty level
    dims: tuple = ()           # padded dims (what "nd" pads along)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PackTable:
    """Every input's pack entry at one bucket, in declaration order."""

    bucket: int
    entries: tuple
    axes: tuple                # axis names, bucketed first: the order extents are written in

    def __str__(self) -> str:
        rows = [f"pack table, bucket {self.bucket}   (rows x cols; n<-axis: raw count from that extent)",
                f"  {'input':<18} {'layout':<6} {'shape':<18} {'rows':<14} {'cols':<14} pad"]
        for e in self.entries:
            pad = f"{e.mode}({e.fill!r})"
            rows.append(f"  {e.name:<18} {e.layout:<6} {str(e.shape):<18} {str(e.rows or '-'):<14} "
                        f"{str(e.cols or '-'):<14} {pad}")
        return "\n".join(rows)


def pack_table(program, bucket: int, capacity) -> PackTable:
    """The table at `bucket`; `capacity(axis, bucket)` is the Plan's."""
    entries = tuple(_entry(n, s, bucket, capacity) for n, s in program.inputs.items())
    return PackTable(bucket, entries, tuple(a.name for a in program.axes))


def _entry(name, spec, bucket, capacity) -> PackEntry:
    dims = [(i, a) for i, d in enumerate(spec.shape) if (a := as_affine(d)) is not None]
    shape = tuple(d if as_affine(d) is None else as_affine(d).at(capacity(as_affine(d).axis.name, bucket))
                  for d in spec.shape)
    mode, fill = _pad(spec.pad)
    fill = stored(fill, spec.dtype)       # as the dtype holds it: every writer fills this number
    rows, cols, layout = _levels(shape, dims)
    return PackEntry(name, layout, shape, rows, cols, mode, fill, tuple(i for i, _ in dims))


def _pad(pad) -> tuple[str, object]:
    if isinstance(pad, Edge):
        return EDGE, as_number(pad.default)
    if isinstance(pad, Fill):
        return FILL, as_number(pad.value)
    return FILL, 0             # no padded dim: every lane is raw


def _level(shape, dim, af, inner: int) -> Level:
    return Level(shape[dim] * inner, af.axis.name, af.scale, af.offset, inner)


def _levels(shape: tuple, dims: list) -> tuple[Level | None, Level | None, str]:
    numel = math.prod(shape)
    if not dims:
        return Level(1), Level(numel), "rows"
    first = dims[0][0]
    f0 = math.prod(shape[:first])
    if len(dims) == 1:
        f1 = math.prod(shape[first + 1:])
        if f0 == 1:
            return _level(shape, first, dims[0][1], 1), Level(f1), "rows"
        return Level(f0), _level(shape, first, dims[0][1], f1), "grid"
    if len(dims) == 2 and f0 == 1:
        second = dims[1][0]
        f1 = math.prod(shape[first + 1:second])
        f2 = math.prod(shape[second + 1:])
        return _level(shape, first, dims[0][1], f1), _level(shape, second, dims[1][1], f2), "grid"
    return None, None, "nd"


# ---- the torch reference of the pad rule ---------------------------------------------------

def apply(entry: PackEntry, dst: torch.Tensor, src: torch.Tensor, extents: Mapping[str, int]) -> None:
    """dst (dense, entry.shape) = src's raw values + pads, exactly as the pack kernel writes it."""
    if entry.layout == "nd":
        return _apply_nd(entry, dst, src)
    r_raw, c_raw = entry.rows.raw(extents), entry.cols.raw(extents)
    d2 = dst.view(entry.rows.total, entry.cols.total)           # [rows, cols]
    s2 = src.reshape(r_raw, c_raw)                               # [raw rows, raw cols]
    if entry.mode == FILL or r_raw == 0 or c_raw == 0:
        if r_raw < entry.rows.total or c_raw < entry.cols.total:
            d2.fill_(entry.fill)
        d2[:r_raw, :c_raw].copy_(s2)
        return
    r = _edge_index(entry.rows.total, r_raw, entry.rows.unit, dst.device)
    c = _edge_index(entry.cols.total, c_raw, entry.cols.unit, dst.device)
    d2, s2 = bit_view(d2), bit_view(s2)        # index_select has no uint16 / uint32 / float8 kernel
    d2.copy_(s2.index_select(0, r).index_select(1, c))


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """t's elements as same-size signed integers, so copies, wheres and compares work by bit
    pattern for every dtype (complex: its real and imaginary parts, a trailing dim of 2; bool as
    it is)."""
    if t.dtype == torch.bool:
        return t
    if t.dtype.is_complex:
        t = torch.view_as_real(t.contiguous() if t.stride() and 0 in t.stride() else t)
    return t.view(_INT_OF_SIZE[t.element_size()])


def _edge_index(total: int, raw: int, unit: int, device) -> torch.Tensor:
    """Source index of every lane: itself when raw, else the matching lane of the last raw unit."""
    i = torch.arange(total, device=device)
    return torch.where(i < raw, i, raw - unit + (i - raw) % unit)


def _apply_nd(entry: PackEntry, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Dim by dim (3+ padded dims): copy the raw block, then each padded dim's tail."""
    region = dst
    for d in range(src.dim()):
        region = region.narrow(d, 0, src.shape[d])
    region.copy_(src)
    if entry.mode == EDGE and any(src.shape[d] == 0 for d in entry.dims):
        dst.fill_(entry.fill)
        return
    for d in entry.dims:
        n_raw, n_all = src.shape[d], dst.shape[d]
        if n_raw == n_all:
            continue
        tail = dst.narrow(d, n_raw, n_all - n_raw)
        if entry.mode == FILL:
            tail.fill_(entry.fill)
        else:
            tail.copy_(dst.narrow(d, n_raw - 1, 1).expand_as(tail))


def padded(entry: PackEntry, src: torch.Tensor, extents: Mapping[str, int], device) -> torch.Tensor:
    """A fresh dense padded tensor for `entry` (the reference backend's view)."""
    out = torch.empty(entry.shape, dtype=src.dtype, device=device)
    apply(entry, out, src.to(device), extents)
    return out


def all_pad(entry: PackEntry, dst: torch.Tensor) -> None:
    """What compile writes before each warm-up run (every raw extent 0): pads, fixed inputs 0."""
    if entry.dims:
        dst.fill_(entry.fill)
    else:
        dst.zero_()
