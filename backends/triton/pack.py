"""The one-launch pack: copy every input of a static program into its padded static buffer.

Before each replay, every static input buffer must hold the caller's raw values followed by its
declared pad value (DESIGN.md, contract rule 1). Doing that with one `copy_` and one `fill_` per
buffer costs two launches per input; this module does it for all inputs in one kernel launch.

Each input is one *job*: a flat destination (the static buffer's padded view) and a flat source
(the caller's raw tensor). A job is described to the kernel by one row of int64 *descriptors* in a
device table, so the kernel never needs to know dtypes: it copies bit patterns of 1, 2, 4 or 8
bytes. The torch reference `pack_reference` beside it is the semantic oracle and the fallback
where Triton is absent.

    dst[:n_raw]        = src[:n_raw]
    dst[n_raw:n_total] = FILL:  fill value
                         EDGE:  the last raw row repeated (fill value when n_raw == 0)
    dst[:n_total]      = CONST: fill value (no source)
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None
    tl = None

DESC_WIDTH = 8  # int64 columns of one job descriptor
# descriptor columns
COL_DST, COL_SRC, COL_N_RAW, COL_N_TOTAL, COL_ROW, COL_ELEM_BYTES, COL_MODE, COL_FILL = range(8)
# modes
FILL, EDGE, CONST = 0, 1, 2
MODES = {FILL: "FILL", EDGE: "EDGE", CONST: "CONST"}

BLOCK = 1024  # elements one program writes per loop step (8 per thread at 4 warps)
NUM_WARPS = 4
MAX_PROGRAMS_PER_JOB = 1024  # grid x cap; programs loop over the rest of a long job
MAX_JOBS = 65535  # CUDA's limit on grid dimension y


@dataclass
class PackJob:
    """One input to pack: `dst[:n_total]` gets `src[:n_raw]` then the pad described by `mode`."""

    dst: torch.Tensor  # contiguous; a flat view is fine
    src: torch.Tensor | None  # contiguous, dst's dtype; None only for CONST
    n_raw: int  # elements copied from src
    n_total: int  # elements of dst written
    row_elems: int = 1  # elements per row: EDGE repeats the last raw row
    mode: int = FILL
    fill_value: bool | int | float = 0


# ---------------------------------------------------------------------------------------------
# host side: checks and descriptors
# ---------------------------------------------------------------------------------------------


def _check_job(i: int, job: PackJob) -> None:
    """Raise a ValueError naming the job unless it describes in-bounds, well-formed work."""
    where = f"pack job {i}"
    if job.mode not in MODES:
        raise ValueError(f"{where}: mode must be one of {MODES}, got {job.mode!r}")
    if not job.dst.is_contiguous():
        raise ValueError(f"{where}: dst must be contiguous, got strides {job.dst.stride()}")
    if not 0 <= job.n_raw <= job.n_total <= job.dst.numel():
        raise ValueError(
            f"{where}: need 0 <= n_raw <= n_total <= dst.numel(), "
            f"got n_raw={job.n_raw}, n_total={job.n_total}, dst.numel()={job.dst.numel()}"
        )
    if job.row_elems < 1:
        raise ValueError(f"{where}: row_elems must be >= 1, got {job.row_elems}")
    if job.mode == EDGE and job.n_raw % job.row_elems:
        raise ValueError(
            f"{where}: EDGE repeats whole rows, so n_raw must be a multiple of row_elems, "
            f"got n_raw={job.n_raw}, row_elems={job.row_elems}"
        )
    if job.mode != CONST:
        _check_src(where, job)
    try:
        fill_bits(job.fill_value, job.dst.dtype)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{where}: fill value {job.fill_value!r} is not a {job.dst.dtype}: {e}") from e


def _check_src(where: str, job: PackJob) -> None:
    src = job.src
    if src is None:
        raise ValueError(f"{where}: {MODES[job.mode]} reads a source, got src=None")
    if src.dtype != job.dst.dtype:
        raise ValueError(f"{where}: src dtype must be dst's {job.dst.dtype}, got {src.dtype}")
    if src.device != job.dst.device:
        raise ValueError(f"{where}: src device must be dst's {job.dst.device}, got {src.device}")
    if not src.is_contiguous():
        raise ValueError(f"{where}: src must be contiguous, got strides {src.stride()}")
    if src.numel() < job.n_raw:
        raise ValueError(f"{where}: src has {src.numel()} elements, n_raw={job.n_raw}")


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
    one = torch.empty(1, dtype=dtype).fill_(value)  # the conversion pack_reference's fill_ does
    n_bytes = one.element_size()
    bits = int(one.view(_UINT_OF_SIZE[n_bytes]).item())
    return bits & ((1 << (8 * n_bytes)) - 1)  # zero-extend


def fill_bits(value, dtype: torch.dtype) -> int:
    """The bit pattern of `value` stored as `dtype`, zero-extended to a non-negative int64."""
    bits = _fill_bits_cached(dtype, _value_key(value))
    return bits - (1 << 64) if bits >= 1 << 63 else bits  # int64 column: 8-byte patterns wrap


def encode_jobs(jobs: list[PackJob], out: torch.Tensor | np.ndarray) -> None:
    """Write one descriptor row per job into `out[:len(jobs)]` (host memory, int64)."""
    if tuple(out.shape[1:]) != (DESC_WIDTH,) or out.shape[0] < len(jobs):
        raise ValueError(f"descriptor table must be [>= {len(jobs)}, {DESC_WIDTH}], got {tuple(out.shape)}")
    rows = np.empty((len(jobs), DESC_WIDTH), dtype=np.int64)
    for i, job in enumerate(jobs):
        _check_job(i, job)
        rows[i] = (
            job.dst.data_ptr(),
            0 if job.mode == CONST else job.src.data_ptr(),
            0 if job.mode == CONST else job.n_raw,
            job.n_total,
            job.row_elems,
            job.dst.element_size(),
            job.mode,
            fill_bits(job.fill_value, job.dst.dtype),
        )
    if isinstance(out, torch.Tensor):
        if out.dtype != torch.int64 or out.device.type != "cpu":
            raise ValueError(f"descriptor table must be a CPU int64 tensor, got {out.dtype} on {out.device}")
        out[: len(jobs)] = torch.from_numpy(rows)
    else:
        out[: len(jobs)] = rows


# ---------------------------------------------------------------------------------------------
# the torch reference: the semantic oracle, and the fallback without Triton
# ---------------------------------------------------------------------------------------------


def pack_reference(jobs: list[PackJob]) -> None:
    """Pack every job with plain torch ops (a few launches per job, no host sync)."""
    for i, job in enumerate(jobs):
        _check_job(i, job)
        dst = job.dst.view(-1)[: job.n_total]  # [n_total]
        if job.mode == CONST:
            dst.fill_(job.fill_value)
            continue
        src = job.src.view(-1)[: job.n_raw]  # [n_raw]
        dst[: job.n_raw].copy_(src)
        tail = dst[job.n_raw :]  # [n_total - n_raw]
        if job.mode == FILL or job.n_raw == 0:
            tail.fill_(job.fill_value)
        else:
            last_row = src[job.n_raw - job.row_elems :]  # [row_elems]
            idx = torch.arange(tail.numel(), device=dst.device) % job.row_elems
            tail.copy_(last_row[idx])


# ---------------------------------------------------------------------------------------------
# the kernel
# ---------------------------------------------------------------------------------------------

if triton is not None:
    _EDGE: tl.constexpr = tl.constexpr(EDGE)
    _CONST: tl.constexpr = tl.constexpr(CONST)

    @triton.jit
    def _pack_job(dst, src, n_raw, n_total, row_elems, mode, fill, BLOCK: tl.constexpr):
        """Loop this program over its blocks of one job; dst/src are typed element pointers.

        Every access is masked. (An earlier version took unmasked 16-byte vector paths for whole
        blocks; on the H200 the alignment hints leaked into the masked path and single-element
        jobs came out wrong, so it was removed: metadata jobs are tiny and launch-bound anyway.)
        """
        pid = tl.program_id(0)
        n_progs = tl.num_programs(0)
        lane = tl.arange(0, BLOCK)  # [BLOCK]
        n_raw = tl.where(mode == _CONST, 0, n_raw)  # CONST reads no source, whatever n_raw says
        row = tl.maximum(row_elems, 1)
        take_edge = (mode == _EDGE) & (n_raw >= row)  # EDGE with no whole raw row falls back to fill
        first = pid.to(tl.int64) * BLOCK
        step = n_progs.to(tl.int64) * BLOCK
        for start in range(first, n_total, step):
            offs = start + lane  # [BLOCK] element offsets
            in_total = offs < n_total
            if take_edge:  # padded lane i reads src[n_raw - row + (i - n_raw) % row]
                idx = tl.where(offs < n_raw, offs, n_raw - row + (offs - n_raw) % row)
                read = in_total
            else:
                idx = offs
                read = in_total & (offs < n_raw)
            vals = tl.load(src + idx, mask=read, other=fill)
            tl.store(dst + offs, vals, mask=in_total)

    @triton.jit
    def _pack_kernel(table, BLOCK: tl.constexpr, DESC: tl.constexpr):
        """grid (programs per job, n_jobs): program (p, j) writes blocks p, p + P, ... of job j."""
        desc = table + tl.program_id(1) * DESC  # this job's descriptor row
        n_total = tl.load(desc + 3)
        if tl.program_id(0) * BLOCK >= n_total:  # a block past this job's end: nothing to do
            return
        dst = tl.load(desc + 0)
        src = tl.load(desc + 1)
        n_raw = tl.load(desc + 2)
        row = tl.load(desc + 4)
        elem_bytes = tl.load(desc + 5)
        mode = tl.load(desc + 6)
        bits = tl.load(desc + 7)
        # Bit patterns only: the element size picks the pointer type, the dtype never matters,
        # so NaN payloads and -0.0 survive and one compiled kernel serves every dtype.
        if elem_bytes == 1:
            i8 = tl.pointer_type(tl.int8)
            _pack_job(dst.to(i8), src.to(i8), n_raw, n_total, row, mode, bits.to(tl.int8), BLOCK)
        elif elem_bytes == 2:
            i16 = tl.pointer_type(tl.int16)
            _pack_job(dst.to(i16), src.to(i16), n_raw, n_total, row, mode, bits.to(tl.int16), BLOCK)
        elif elem_bytes == 4:
            i32 = tl.pointer_type(tl.int32)
            _pack_job(dst.to(i32), src.to(i32), n_raw, n_total, row, mode, bits.to(tl.int32), BLOCK)
        else:
            i64 = tl.pointer_type(tl.int64)
            _pack_job(dst.to(i64), src.to(i64), n_raw, n_total, row, mode, bits, BLOCK)


def triton_available() -> bool:
    return triton is not None


def pack_launch(table: torch.Tensor, n_jobs: int, max_total: int, impl: str = "auto") -> None:
    """Run every job of `table[:n_jobs]` ([n, DESC_WIDTH] int64, on the device) in one launch.

    `max_total` (host-known, >= every job's n_total) only sizes the grid: programs loop, so a job
    longer than it is still written in full. No host sync, no recompilation between calls; it
    launches on the current device and stream (so it can be captured into a CUDA graph: every
    address and size is read from the table at run time, patch the table and replay).
    `impl`: "auto" or "triton" (a table of raw addresses can only be run by the kernel; without
    Triton, pack the `PackJob`s with `pack_reference`).
    """
    if impl not in ("auto", "triton"):
        raise ValueError(f"pack_launch impl must be 'auto' or 'triton', got {impl!r}; "
                         "for the torch path call pack_reference(jobs)")
    if triton is None:
        raise RuntimeError("pack_launch needs Triton (not importable); use pack_reference(jobs)")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != DESC_WIDTH:
        raise ValueError(f"descriptor table must be [n, {DESC_WIDTH}] int64, "
                         f"got {tuple(table.shape)} {table.dtype}")
    if not 0 <= n_jobs <= min(table.shape[0], MAX_JOBS) or not table.is_contiguous():
        raise ValueError(f"n_jobs must be in [0, min(rows={table.shape[0]}, {MAX_JOBS})] "
                         f"of a contiguous table, got n_jobs={n_jobs}")
    if n_jobs == 0 or max_total <= 0:
        return
    n_progs = min(triton.cdiv(max_total, BLOCK), MAX_PROGRAMS_PER_JOB)
    _pack_kernel[(n_progs, n_jobs)](table, BLOCK=BLOCK, DESC=DESC_WIDTH, num_warps=NUM_WARPS)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_triton_device(jobs: list[PackJob], device: torch.device) -> None:
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        raise ValueError(f"the Triton pack runs on CUDA tensors (or CPU ones under "
                         f"TRITON_INTERPRET=1), got {device}")
    for i, job in enumerate(jobs):
        if job.dst.device != device:
            raise ValueError(f"pack job {i}: all jobs must share device {device}, got {job.dst.device}")


def pack(jobs: list[PackJob], impl: str = "auto") -> None:
    """Encode `jobs` into a device table and pack them in one launch (tests, eager use).

    impl: "auto" (Triton on CUDA when importable, else the torch reference), "triton", "reference".
    """
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"pack impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    if not jobs:
        return
    device = jobs[0].dst.device
    if impl == "auto":
        impl = "triton" if device.type == "cuda" and triton is not None else "reference"
    if impl == "reference":
        pack_reference(jobs)
        return
    _check_triton_device(jobs, device)
    host = torch.empty((len(jobs), DESC_WIDTH), dtype=torch.int64, pin_memory=device.type == "cuda")
    encode_jobs(jobs, host)
    table = host.to(device, non_blocking=True)  # pinned: no host sync
    pack_launch(table, len(jobs), max(job.n_total for job in jobs), impl="triton")
