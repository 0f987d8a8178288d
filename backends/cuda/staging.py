"""Static input storage and the per-call pack: the Plan decided what to copy and fill; this
module only carries it out.

Per call: one descriptor table (plus any raw inputs that live on the host) is written into a
pinned host buffer and sent to the device with ONE async copy; one pack launch (Triton) then
writes every flat input's raw rows and pad lanes and every axis extent. Inputs whose padded dim
is not the leading one (rare) are padded with torch ops instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from padgraph.padding import pad_into
from padgraph.pads import Edge
from padgraph.plan import Plan
from padgraph.program import padded_dims

from ..triton import pack as tpack

_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class _Flat:
    """An input whose padded bucket view is a contiguous prefix of its static storage."""

    name: str
    index: int          # row in the descriptor table
    row_elems: int
    host_offset: int    # byte offset of its host-staging slot
    host_bytes: int     # capacity of that slot (largest raw size)


class StaticInputs:
    """One static storage per input at the largest capacity; per-bucket views; device extents."""

    def __init__(self, plan: Plan, device: torch.device):
        self.plan, self.device = plan, device
        program = plan.program
        self.storage = {n: torch.empty(plan.largest_shape(n), dtype=s.dtype, device=device)
                        for n, s in program.inputs.items()}
        self.axes = [a.name for a in plan.axes]
        self.extent_store = torch.zeros(len(self.axes), dtype=torch.int32, device=device)
        self.extents = {a: self.extent_store[i] for i, a in enumerate(self.axes)}
        self._pad_dims = {n: [d for d, _ in padded_dims(s.shape)] for n, s in program.inputs.items()}
        self.flat, self.other = self._split(program)
        self._views = {b: self._bucket_views(b) for b in plan.buckets}

    def _split(self, program):
        flat, other, host_off = [], [], 0
        for name, spec in program.inputs.items():
            dims = self._pad_dims[name]
            nbytes = self.storage[name].numel() * self.storage[name].element_size()
            if dims in ([], [0]):
                row = math.prod(self.storage[name].shape[1:]) if self.storage[name].dim() else 1
                flat.append(_Flat(name, len(flat), row, host_off, nbytes))
            else:
                other.append((name, host_off, nbytes))
            host_off += _align(nbytes)
        self.host_bytes = host_off
        return flat, other

    def _bucket_views(self, bucket: int) -> dict[str, torch.Tensor]:
        views = {}
        for name, t in self.storage.items():
            shape = self.plan.shape(name, bucket)
            v = t
            for d in self._pad_dims[name]:
                v = v.narrow(d, 0, shape[d])
            views[name] = v
        return views

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        return self._views[bucket]

    def pad_dims(self, name: str) -> list[int]:
        return self._pad_dims[name]


class Packer:
    """Builds per-bucket descriptor tables once; per call patches sources, sizes and extents."""

    def __init__(self, static: StaticInputs, n_slots: int = 2):
        self.static = static
        program = static.plan.program
        self.n_jobs = len(static.flat) + len(static.axes)
        self.table_bytes = _align(self.n_jobs * tpack.DESC_WIDTH * 8)
        total = self.table_bytes + static.host_bytes
        pin = static.device.type == "cuda"
        # Two pinned slots: the host writes one while the previous call's copy may still read the other.
        self.slots = [torch.empty(total, dtype=torch.uint8, pin_memory=pin) for _ in range(n_slots)]
        self.events = [None] * n_slots
        self.slot_bytes = [s.numpy() for s in self.slots]
        self.tables = [s[: self.n_jobs * tpack.DESC_WIDTH * 8].view(torch.int64).numpy().reshape(self.n_jobs, -1)
                       for s in self.slots]
        self.device_buf = torch.empty(total, dtype=torch.uint8, device=static.device)
        self.device_table = self.device_buf[: self.n_jobs * tpack.DESC_WIDTH * 8].view(torch.int64).view(self.n_jobs, -1)
        self._turn = 0
        self._spans: dict = {}
        self._streams: dict = {}
        self._index = static.device.index
        self._base = {b: self._static_table(b, program) for b in static.plan.buckets}
        self.max_total = {b: int(self._base[b][:, tpack.COL_N_TOTAL].max()) for b in static.plan.buckets}

    def _static_table(self, bucket: int, program) -> np.ndarray:
        """Columns fixed per bucket: dst, n_total, row, elem bytes, mode, fill bits."""
        st = self.static
        tbl = np.zeros((self.n_jobs, tpack.DESC_WIDTH), dtype=np.int64)
        views = st.views(bucket)
        for f in st.flat:
            spec, v = program.inputs[f.name], views[f.name]
            pad = spec.pad
            edge = isinstance(pad, Edge)
            value = (pad.default if edge else pad.value) if pad is not None else 0
            tbl[f.index] = (v.data_ptr(), 0, 0, v.numel(), f.row_elems, v.element_size(),
                            tpack.EDGE if edge else tpack.FILL, tpack.fill_bits(value, v.dtype))
        for i, axis in enumerate(st.axes):
            e = st.extents[axis]
            tbl[len(st.flat) + i] = (e.data_ptr(), 0, 0, 1, 1, 4, tpack.CONST, 0)
        return tbl

    def encode(self, bucket: int, raw, ext) -> tuple[int, list]:
        """Fill a pinned slot for this call; return (bytes to send, tensors to keep alive)."""
        i = self._turn
        self._turn = (i + 1) % len(self.slots)
        if self.events[i] is not None:
            self.events[i].synchronize()  # normally long done: it guards the slot we reuse
        tbl, st = self.tables[i], self.static
        tbl[:] = self._base[bucket]
        keep, used = [], self.table_bytes
        dev_base = self.device_buf.data_ptr()
        for f in st.flat:
            t = raw[f.name]
            n = t.numel()
            if not t.is_cuda:
                off = self.table_bytes + f.host_offset
                used = max(used, self._stage(i, off, t))
                src = dev_base + off
            else:
                if not t.is_contiguous():
                    t = t.contiguous()
                    keep.append(t)
                src = t.data_ptr()
            row = tbl[f.index]
            row[tpack.COL_SRC] = src
            row[tpack.COL_N_RAW] = n
        base = len(st.flat)
        for j, axis in enumerate(st.axes):
            tbl[base + j, tpack.COL_FILL] = ext[axis]
        for name, off, _ in st.other:
            t = raw[name]
            if not t.is_cuda:
                used = max(used, self._stage(i, self.table_bytes + off, t))
        return i, used, keep

    def _stage(self, i: int, off: int, t: torch.Tensor) -> int:
        """Copy a host tensor's bytes into pinned slot i at `off` (numpy: no torch dispatch)."""
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self.slot_bytes[i][off: off + b.size] = b
        return off + b.size

    def send(self, i: int, used: int) -> None:
        """One async host-to-device copy of the table and the host-staged inputs."""
        pair = self._spans.get((i, used))
        if pair is None:  # sliced views cached: `used` takes few distinct values
            pair = self._spans[(i, used)] = (self.device_buf[:used], self.slots[i][:used])
        pair[0].copy_(pair[1], non_blocking=True)
        ev = self.events[i] = self.events[i] or torch.cuda.Event()
        torch._C._CudaEventBase.record(ev, self._current_stream())

    def _current_stream(self) -> torch.cuda.Stream:
        """The current stream, cached by its raw handle: torch.cuda.current_stream() costs µs."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        s = self._streams.get(raw)
        if s is None:
            s = self._streams[raw] = torch.cuda.current_stream(self.static.device)
        return s

    def launch(self, bucket: int) -> None:
        tpack.pack_launch(self.device_table, self.n_jobs, self.max_total[bucket])

    def pad_others(self, bucket: int, raw) -> None:
        """Torch-op padding for inputs whose padded dim is not the leading one."""
        st = self.static
        views = st.views(bucket)
        for name, off, _ in st.other:
            t = raw[name]
            if t.device.type == "cpu":
                t = self.device_buf[self.table_bytes + off:].narrow(0, 0, t.numel() * t.element_size()).view(t.dtype).view(t.shape)
            pad_into(views[name], t, st.plan.program.inputs[name].pad, st.pad_dims(name))

    def reference_pack(self, bucket: int, raw, ext) -> None:
        """The torch path for flat inputs (no Triton): same result, a few launches per input."""
        st = self.static
        views = st.views(bucket)
        for f in st.flat:
            t = raw[f.name]
            if t.device.type == "cpu":
                t = self.device_buf[self.table_bytes + f.host_offset:].narrow(0, 0, t.numel() * t.element_size()).view(t.dtype).view(t.shape)
            pad_into(views[f.name], t, st.plan.program.inputs[f.name].pad, st.pad_dims(f.name))
        st.extent_store.copy_(self.device_table[len(st.flat):, tpack.COL_FILL].to(torch.int32))
