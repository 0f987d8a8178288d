"""The one-launch pack: every input of a static program written into its padded buffer at once.

The Plan's pack table (`padgraph.pack`) says, per bucket and input, how the dense padded buffer
is a grid of rows x cols, where the raw values sit and what each padded lane holds. This module
encodes that table once per bucket into a device descriptor table (the column layout lives here
and nowhere else) and applies it in ONE launch. Per call only two small arrays change: the raw
source address of every job and the raw extent of every axis; the kernel derives every raw count
from the extents, so a captured pack reads new inputs at each replay.

The kernel copies bit patterns of 1, 2, 4 or 8 bytes (dtypes never matter: NaN payloads and -0.0
survive, one compiled kernel serves every dtype). Its torch reference is `padgraph.pack.apply`.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

import numpy as np
import torch

from padgraph import pack as P

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None
    tl = None

# The descriptor table's columns, one int64 each (the kernel reads them by these indices).
COLUMNS = ("dst", "r_total", "r_axis", "r_scale", "r_offset", "r_unit",
           "c_total", "c_axis", "c_scale", "c_offset", "c_unit", "elem_bytes", "mode", "fill")
COL = {name: i for i, name in enumerate(COLUMNS)}
DESC_WIDTH = len(COLUMNS)
MODE = {P.FILL: 0, P.EDGE: 1}

BLOCK = 1024                 # elements one program writes per loop step
NUM_WARPS = 4
MAX_PROGRAMS_PER_JOB = 1024  # grid x cap; programs loop over the rest of a long job
MAX_JOBS = 65535             # CUDA's limit on grid dimension y


def triton_available() -> bool:
    return triton is not None


def kernel_entries(table: P.PackTable) -> list[P.PackEntry]:
    """The entries the kernel packs ("rows" and "grid"); "nd" ones are left to torch."""
    return [e for e in table.entries if e.layout != "nd"]


# ---- the one encoder ---------------------------------------------------------------------------

_UINT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _value_key(value) -> tuple:
    # -0.0 == 0.0 and NaN != NaN, so floats are keyed by their bytes, not their value.
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return (float, struct.pack("<d", value))
    return (type(value), value)


@lru_cache(maxsize=1024)
def _fill_bits_cached(dtype: torch.dtype, key: tuple) -> int:
    value = struct.unpack("<d", key[1])[0] if key[0] is float else key[1]
    one = torch.empty(1, dtype=dtype).fill_(value)  # the conversion the reference's fill_ does
    n_bytes = one.element_size()
    bits = int(one.view(_UINT_OF_SIZE[n_bytes]).item())
    return bits & ((1 << (8 * n_bytes)) - 1)


def fill_bits(value, dtype: torch.dtype) -> int:
    """The bit pattern of `value` stored as `dtype`, as an int64 column value."""
    bits = _fill_bits_cached(dtype, _value_key(value))
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _level_cols(level: P.Level, axes: Sequence[str]) -> tuple[int, int, int, int, int]:
    if level.axis is None:
        return level.total, -1, 0, 0, 1
    return level.total, axes.index(level.axis), level.scale, level.offset, level.unit


def encode(entries: Sequence[P.PackEntry], axes: Sequence[str], dsts: Sequence[torch.Tensor]) -> np.ndarray:
    """The static descriptor table of `entries` ([n, DESC_WIDTH] int64), one row per entry."""
    rows = np.zeros((len(entries), DESC_WIDTH), dtype=np.int64)
    for i, (e, dst) in enumerate(zip(entries, dsts)):
        if e.layout == "nd":
            raise ValueError(f"pack entry {e.name!r}: layout 'nd' is packed with torch ops, not the kernel")
        if not dst.is_contiguous() or dst.numel() < e.numel:
            raise ValueError(f"pack entry {e.name!r}: dst must be contiguous with >= {e.numel} elements, "
                             f"got {tuple(dst.shape)} strides {dst.stride()}")
        rows[i] = (dst.data_ptr(), *_level_cols(e.rows, axes), *_level_cols(e.cols, axes),
                   dst.element_size(), MODE[e.mode], fill_bits(e.fill, dst.dtype))
    return rows


def describe(rows: np.ndarray) -> str:
    """The descriptor table as text (column names from COLUMNS)."""
    head = " ".join(f"{c:>10}" for c in COLUMNS[1:])
    return "\n".join([head] + [" ".join(f"{int(v):>10}" for v in r[1:]) for r in rows])


# ---- the kernel --------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _extent(ext, dev, a):
        """Axis a's raw extent: the host bound, or a device extent clamped into [0, bound]."""
        bound = tl.load(ext + a)
        return tl.minimum(tl.maximum(tl.load(dev + a), 0), bound).to(tl.int64)

    @triton.jit
    def _raw_count(total, axis, scale, offset, unit, ext, dev):
        e = _extent(ext, dev, tl.maximum(axis, 0))
        return tl.where(axis < 0, total, (scale * e + offset) * unit)

    @triton.jit
    def _host_count(total, axis, scale, offset, unit, ext):
        """A level's raw count at the host bound: the source's own size (its row stride for cols)."""
        bound = tl.load(ext + tl.maximum(axis, 0)).to(tl.int64)
        return tl.where(axis < 0, total, (scale * bound + offset) * unit)

    @triton.jit
    def _pack_job(dst, src, r_raw, r_tot, r_unit, c_raw, c_tot, c_unit, c_src, edge, fill, BLOCK: tl.constexpr):
        """This program's blocks of one job; dst/src are typed element pointers, dst dense.
        c_src: elements per source row (the host bound's raw cols; c_raw <= c_src when a device
        extent cuts the cols)."""
        pid = tl.program_id(0)
        lane = tl.arange(0, BLOCK)                                # [BLOCK]
        n_total = r_tot * c_tot
        first = pid.to(tl.int64) * BLOCK
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        take_edge = edge & (r_raw > 0) & (c_raw > 0)   # EDGE with no raw unit writes the default
        if c_raw == c_tot:   # whole rows: element offsets, no division
            n_raw = r_raw * c_tot
            unit = r_unit * c_tot
            for start in range(first, n_total, step):
                offs = start + lane
                in_total = offs < n_total
                if take_edge:
                    idx = tl.where(offs < n_raw, offs, n_raw - unit + (offs - n_raw) % unit)
                    read = in_total
                else:
                    idx = offs
                    read = in_total & (offs < n_raw)
                vals = tl.load(src + idx, mask=read, other=fill)
                tl.store(dst + offs, vals, mask=in_total)
        else:                # padded columns: lane (r, c) of the grid
            for start in range(first, n_total, step):
                offs = start + lane
                in_total = offs < n_total
                r = offs // c_tot
                c = offs - r * c_tot
                if take_edge:
                    rs = tl.where(r < r_raw, r, r_raw - r_unit + (r - r_raw) % r_unit)
                    cs = tl.where(c < c_raw, c, c_raw - c_unit + (c - c_raw) % c_unit)
                    read = in_total
                else:
                    rs = r
                    cs = c
                    read = in_total & (r < r_raw) & (c < c_raw)
                vals = tl.load(src + rs * c_src + cs, mask=read, other=fill)
                tl.store(dst + offs, vals, mask=in_total)

    @triton.jit
    def _pack_kernel(table, srcs, ext, dev, eff, n_axes, BLOCK: tl.constexpr, W: tl.constexpr):
        """grid (programs per job, n_jobs): program (p, j) writes blocks p, p + P, ... of job j;
        program (0, 0) also writes every axis's effective extent into `eff` (what x.extent reads)."""
        j = tl.program_id(1)
        if (tl.program_id(0) == 0) & (j == 0):
            for a in range(n_axes):
                tl.store(eff + a, _extent(ext, dev, a).to(tl.int32))
        desc = table + j * W                                      # this job's descriptor row
        r_tot = tl.load(desc + 1)
        c_tot = tl.load(desc + 6)
        if tl.program_id(0) * BLOCK >= r_tot * c_tot:
            return
        r_raw = _raw_count(r_tot, tl.load(desc + 2), tl.load(desc + 3), tl.load(desc + 4), tl.load(desc + 5), ext, dev)
        c_raw = _raw_count(c_tot, tl.load(desc + 7), tl.load(desc + 8), tl.load(desc + 9), tl.load(desc + 10), ext, dev)
        c_src = _host_count(c_tot, tl.load(desc + 7), tl.load(desc + 8), tl.load(desc + 9), tl.load(desc + 10), ext)
        r_unit = tl.load(desc + 5)
        c_unit = tl.load(desc + 10)
        elem_bytes = tl.load(desc + 11)
        edge = tl.load(desc + 12) == 1
        bits = tl.load(desc + 13)
        dst = tl.load(desc + 0)
        src = tl.load(srcs + j)
        if elem_bytes == 1:
            _pack_job(dst.to(tl.pointer_type(tl.int8)), src.to(tl.pointer_type(tl.int8)),
                      r_raw, r_tot, r_unit, c_raw, c_tot, c_unit, c_src, edge, bits.to(tl.int8), BLOCK)
        elif elem_bytes == 2:
            _pack_job(dst.to(tl.pointer_type(tl.int16)), src.to(tl.pointer_type(tl.int16)),
                      r_raw, r_tot, r_unit, c_raw, c_tot, c_unit, c_src, edge, bits.to(tl.int16), BLOCK)
        elif elem_bytes == 4:
            _pack_job(dst.to(tl.pointer_type(tl.int32)), src.to(tl.pointer_type(tl.int32)),
                      r_raw, r_tot, r_unit, c_raw, c_tot, c_unit, c_src, edge, bits.to(tl.int32), BLOCK)
        else:
            _pack_job(dst.to(tl.pointer_type(tl.int64)), src.to(tl.pointer_type(tl.int64)),
                      r_raw, r_tot, r_unit, c_raw, c_tot, c_unit, c_src, edge, bits, BLOCK)


def grid_programs(entries: Sequence[P.PackEntry]) -> int:
    """Programs per job for a table (sized by its largest job; programs loop over the rest)."""
    largest = max((e.numel for e in entries), default=0)
    return min(max(-(-largest // BLOCK), 1), MAX_PROGRAMS_PER_JOB)


def launch(table: torch.Tensor, srcs: torch.Tensor, ext: torch.Tensor, n_programs: int,
           dev: torch.Tensor | None = None, eff: torch.Tensor | None = None) -> None:
    """Run every job of a device table in one launch on the current stream (graph-capturable).

    table: [n_jobs, DESC_WIDTH] int64 (from `encode`); srcs: [>= n_jobs] int64 source addresses;
    ext: [n_axes] int32 raw extents (host bounds); dev: [n_axes] int32 device extents (each
    clamped into [0, ext]; default = ext); eff: [n_axes] int32, receives the extents used.
    Every address and count is read on the device at run time.
    """
    if triton is None:
        raise RuntimeError("the pack kernel needs Triton (not importable); use padgraph.pack.apply")
    n_jobs = table.shape[0]
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != DESC_WIDTH or not table.is_contiguous():
        raise ValueError(f"descriptor table must be a contiguous [n, {DESC_WIDTH}] int64 tensor, "
                         f"got {tuple(table.shape)} {table.dtype}")
    if n_jobs > MAX_JOBS or srcs.dtype != torch.int64 or srcs.numel() < n_jobs or ext.dtype != torch.int32:
        raise ValueError(f"pack launch: need n_jobs <= {MAX_JOBS}, int64 srcs of >= n_jobs and int32 "
                         f"extents, got {n_jobs} jobs, srcs {srcs.dtype}[{srcs.numel()}], ext {ext.dtype}")
    if n_jobs == 0:
        return
    dev = ext if dev is None else dev
    eff = torch.empty_like(ext) if eff is None else eff
    _pack_kernel[(n_programs, n_jobs)](table, srcs, ext, dev, eff, ext.numel(), BLOCK=BLOCK, W=DESC_WIDTH,
                                       num_warps=NUM_WARPS)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pack(table: P.PackTable, dsts: Mapping[str, torch.Tensor], srcs: Mapping[str, torch.Tensor],
         extents: Mapping[str, int], impl: str = "auto") -> None:
    """Apply a whole pack table eagerly (tests, eager use): dsts dense padded, srcs raw.

    impl: "auto" (the kernel on CUDA when Triton imports, else the torch reference), "triton",
    "reference". "nd" entries always take the torch reference.
    """
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"pack impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    device = next(iter(dsts.values())).device
    if impl == "auto":
        impl = "triton" if device.type == "cuda" and triton is not None else "reference"
    kernel = kernel_entries(table) if impl == "triton" else []
    for e in table.entries:
        if e not in kernel:
            P.apply(e, dsts[e.name], srcs[e.name].contiguous(), extents)
    if not kernel:
        return
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        raise ValueError(f"the Triton pack runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got {device}")
    keep = []
    for e in kernel:   # the kernel copies the destination's bytes from the source's address
        src, dst = srcs[e.name], dsts[e.name]
        want = e.rows.raw(extents) * e.cols.raw(extents)
        if src.numel() != want:
            raise ValueError(f"pack: source {e.name!r} has {src.numel()} elements, its raw extents "
                             f"{dict(extents)} give {want}")
        keep.append(src.to(dst.dtype).contiguous())   # converted as the reference's copy_ does
    rows = torch.from_numpy(encode(kernel, table.axes, [dsts[e.name] for e in kernel])).to(device)
    src_ptrs = torch.tensor([t.data_ptr() for t in keep], dtype=torch.int64).to(device)
    ext = torch.tensor([extents[a] for a in table.axes], dtype=torch.int32).to(device)
    launch(rows, src_ptrs, ext, grid_programs(kernel))
