"""Static input storage and the per-call bytes: the Plan's pack table decided what to write;
this module only carries it out.

Storage: one dense buffer per input at the largest capacity; a bucket's view of it is a dense
row-major prefix (`storage[:numel].view(shape)`), whichever dims are padded.

Per call the host writes one small block into a pinned slot and sends it with ONE async copy:

    [ src address per kernel job (int64) | raw extent per axis (int32) | host-resident raw inputs ]

The body's `x.extent(axis)` tensors are views of the extents in the device copy of that block, so
the copy itself writes them. Slots form a ring that never waits for the GPU: a slot whose copy has
not run yet is skipped by inserting a fresh slot (the ring only grows while the GPU is behind);
copies are fenced by one event per group of calls (`_Ring`).
"""
from __future__ import annotations

import collections
import logging
import math
import operator
import struct

import numpy as np
import torch

from padgraph import pack as P
from padgraph.plan import OnDevice, Plan, values_at
from padgraph.program import padded_dims

from ..triton import pack as tpack
from .cudart import copier

log = logging.getLogger("padgraph.cuda")

_ALIGN = 256
# dtypes numpy has no type for: staged through a same-size integer view
_NUMPY_VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8,
               torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StaticInputs:
    """One dense storage per input at the largest capacity, and its per-bucket views."""

    def __init__(self, plan: Plan, device: torch.device):
        self.plan, self.device = plan, device
        largest = plan.pack_table(plan.buckets[-1])
        # zeros, not empty: a fixed-shape input read before any call holds a defined value
        self.storage = {e.name: torch.zeros(e.numel, dtype=plan.program.inputs[e.name].dtype, device=device)
                        for e in largest.entries}
        # a dense prefix of the storage; made with set_ rather than as a view, so a traced body
        # (torch.compile) sees plain tensors of the bucket's shape, not views of the largest
        self._views = {b: {e.name: _prefix(self.storage[e.name], e.shape) for e in plan.pack_table(b).entries}
                       for b in plan.buckets}

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        return self._views[bucket]


def _prefix(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A dense tensor of `shape` over the first elements of t's storage (not a view of t)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), shape)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)


_IS_CPU = operator.attrgetter("is_cpu")
_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr


class _Slot:
    """One pinned copy of the per-call block; `seq`: the call whose copy last read it (0: none);
    `send(nbytes)`: queue the copy of its first bytes into the device block (bound once)."""

    __slots__ = ("host", "raw", "bytes", "seq", "send")

    def __init__(self, nbytes: int, device_buf: torch.Tensor, copier):
        self.host = _pinned(nbytes)
        self.raw = self.host.numpy()              # the block's bytes: host inputs staged into them
        self.bytes = memoryview(self.raw)         # the same, for CallBlock._write (packs faster)
        self.seq = 0
        self.send = copier.bind(device_buf, self.host)


# pinned bytes the ring may hold to fence copies in groups (a small block: up to 8 calls a fence)
_FENCED_BYTES = 1 << 20
_MAX_BATCH = 8


class _Ring:
    """The pinned slots a call's block is written into, and the fences that free them.

    A slot may be rewritten only once the copy that last read it has run. One event recorded on
    the copies' stream after every `batch` calls (and before the stream changes, so that a fence
    covers only copies queued ahead of it on its own stream) fences them all: one event record
    and one query per group of calls instead of per call. A slot whose fence the GPU has not
    passed is skipped by inserting a fresh one: the ring never waits for the GPU, it only grows
    while the GPU is behind."""

    def __init__(self, nbytes: int, device_buf: torch.Tensor, copier, batch: int):
        self.nbytes, self.device_buf, self.copier, self.batch = nbytes, device_buf, copier, batch
        self.slots = [self._new() for _ in range(batch + 1)]
        self._turn = 0
        self._seq = 0                # calls sent so far (a slot's seq is one of them)
        self._safe = 0               # every call up to this one has had its copy run
        self._fences: collections.deque = collections.deque()   # (event, last call it covers), oldest first
        self._open, self._n_open = None, 0      # stream of the calls sent since the last fence, their count
        self._events: list = []      # events of passed fences, reused

    def _new(self) -> _Slot:
        return _Slot(self.nbytes, self.device_buf, self.copier)

    def acquire(self) -> _Slot:
        """A slot no queued copy still reads."""
        i = self._turn
        slot = self.slots[i]
        if slot.seq > self._safe and not self._passed(slot.seq):
            slot = self._new()                      # the GPU is behind: grow rather than wait
            self.slots.insert(i, slot)
            if len(self.slots) in (16, 256, 4096):
                log.info("padgraph: %d pinned call slots (the GPU is many calls behind)", len(self.slots))
        self._turn = (i + 1) % len(self.slots)
        return slot

    def send(self, slot: _Slot, nbytes: int) -> None:
        """Queue the copy of the slot's first `nbytes`; fence the open group when it is full."""
        stream = slot.send(nbytes)
        if stream != self._open and self._open is not None:
            self._fence()                           # the open group's copies are on another stream
        slot.seq = self._seq = self._seq + 1
        self._open = stream
        self._n_open = n_open = self._n_open + 1
        if n_open >= self.batch:
            self._fence()

    def _fence(self) -> None:
        """An event after the open group's copies, on their stream (recorded later on that stream
        is still after them)."""
        if not self._n_open:
            return
        event = self._events.pop() if self._events else self.copier.new_event()
        self.copier.record(event, self._open)
        self._fences.append((event, self._seq))
        self._open, self._n_open = None, 0

    def _passed(self, seq: int) -> bool:
        """Whether call `seq`'s copy has run: the fences the GPU has passed, oldest first."""
        fences = self._fences
        while fences and self.copier.query(fences[0][0]):
            event, self._safe = fences.popleft()
            self._events.append(event)
        if seq > self._safe and seq > self._seq - self._n_open:
            self._fence()                           # its group is still open: fence it for next time
        return seq <= self._safe


class CallBlock:
    """The per-call block: its layout, the device copy, and the ring of pinned host slots."""

    def __init__(self, plan: Plan, device: torch.device, jobs: list[str], copy: str = "cudart"):
        program = plan.program
        self.copier = copier(device, copy)
        self.jobs, self.n_jobs = jobs, len(jobs)
        self.axes = [a.name for a in plan.axes]
        self.n_axes = len(self.axes)
        self.ext_off = _align(8 * max(self.n_jobs, 1))
        off = _align(self.ext_off + 8 * self.n_axes)
        self.header = off
        self.staging: dict[str, int] = {}           # input -> byte offset of its host staging
        for name, spec in program.inputs.items():
            self.staging[name] = off
            off += _align(math.prod(plan.largest_shape(name)) * spec.dtype.itemsize)
        self.nbytes = off
        self.device_buf = torch.zeros(off, dtype=torch.uint8, device=device)
        self.device_srcs = self.device_buf[: self.ext_off].view(torch.int64)
        both = self.device_buf[self.ext_off: self.ext_off + 8 * self.n_axes].view(torch.int32)
        self.device_ext, self.device_dev = both[: self.n_axes], both[self.n_axes:]   # bounds, device extents
        self.eff = torch.zeros(self.n_axes, dtype=torch.int32, device=device)     # the extents used
        self.extents = {a: self.eff[i] for i, a in enumerate(self.axes)}
        self._axis_index = {a: i for i, a in enumerate(self.axes)}
        # [srcs (int64) | pad | bounds, device extents (int32)] in one struct call per call
        self._write = struct.Struct(f"<{self.n_jobs}q{self.ext_off - 8 * self.n_jobs}x{2 * self.n_axes}i").pack_into
        batch = max(1, min(_MAX_BATCH, _FENCED_BYTES // self.nbytes))
        self.ring = _Ring(self.nbytes, self.device_buf, self.copier, batch)
        self.keep: list = []
        self.others = [n for n in program.inputs if n not in set(jobs)]   # packed by torch ops
        self._dev_base = self.device_buf.data_ptr()
        self._jobs_of, self._others_of = values_at(jobs), values_at(self.others)
        self._bounds_of = values_at(self.axes)
        # (sources, bounds, stream) of the block on the device when it was sent from device inputs
        # alone (no host input staged, no device extent written after it): a call with the same
        # three finds the block it needs in place, and queues no copy. The graph reads the block
        # on that stream, after that copy; `all_pad` and device extents, which write it, forget it.
        self.sent = None

    @property
    def slots(self) -> list[_Slot]:
        """The ring's pinned slots (more than `ring.batch + 1` once the GPU fell behind)."""
        return self.ring.slots

    # ---- one call -------------------------------------------------------------------------------
    def send(self, raw, ext) -> None:
        """Write srcs, extents and host inputs into a free slot; one async copy to the device.
        Extents given as `OnDevice` (validation saw every input on the device) spare asking each
        input where it lives."""
        if self.keep:
            self.keep = []        # this call's dense copies of strided device inputs (see below)
        jobs = self._jobs_of(raw)                 # the kernel jobs' tensors, in job order
        bounds = self._bounds_of(ext)
        if (type(ext) is not OnDevice and self._on_host(raw, jobs)) or not all(map(_CONTIGUOUS, jobs)):
            self.sent = None
            slot = self.ring.acquire()
            srcs, used = self._sources(slot, raw)
        else:                     # every input dense on the device: the kernel reads it in place
            sent = (tuple(map(_DATA_PTR, jobs)), bounds, self.copier.current_stream())
            if sent == self.sent:
                return            # the device block already holds these bytes, sent on this stream
            self.sent = sent
            slot = self.ring.acquire()
            srcs, used = sent[0], self.header
        self._write(slot.bytes, 0, *srcs, *bounds, *bounds)   # device extents default to the host ones
        self.ring.send(slot, used)

    def _on_host(self, raw, jobs) -> bool:
        """Whether an input is on the host (validation admits the runner's device or the CPU only)."""
        return any(map(_IS_CPU, jobs)) or bool(self.others and any(map(_IS_CPU, self._others_of(raw))))

    def _sources(self, slot: _Slot, raw) -> tuple[list[int], int]:
        """Each job's source address, host inputs staged into the slot; and the bytes to copy."""
        used = self.header
        srcs = []
        for name in self.jobs:
            t = raw[name]
            if t.is_cuda:
                srcs.append(t.data_ptr() if t.is_contiguous() else dense_source(t, self.keep))
            else:
                used = max(used, self._stage(slot, name, t))
                srcs.append(self._dev_base + self.staging[name])
        for name in self.others:
            t = raw[name]
            if not t.is_cuda:
                used = max(used, self._stage(slot, name, t))
        return srcs, used

    def send_device_extents(self, dev) -> None:
        """After send: each device extent (0-d int32 on the device) into its slot, device to device."""
        self.sent = None          # the block on the device now differs from the one sent
        for axis, t in dev.items():
            self.copier.copy_d2d(self.device_dev[self._axis_index[axis]], t)

    def effective(self) -> None:
        """eff = clamp(device extent, 0, bound), with torch ops (where the pack kernel does not run)."""
        torch.minimum(self.device_dev, self.device_ext, out=self.eff)
        self.eff.clamp_(min=0)

    def _stage(self, slot: _Slot, name: str, t: torch.Tensor) -> int:
        """Copy a host tensor's bytes into the slot (numpy: one torch call, not four)."""
        if not t.is_contiguous():
            t = t.contiguous()
        as_np = _NUMPY_VIEW.get(t.dtype)
        a = (t.view(as_np) if as_np is not None else t).numpy().reshape(-1).view(np.uint8)
        off = self.staging[name]
        slot.raw[off: off + a.size] = a
        return off + a.size

    def staged(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The device copy of host input `name` (valid after this call's send)."""
        off = self.staging[name]
        n = t.numel() * t.element_size()
        return self.device_buf[off: off + n].view(t.dtype).view(t.shape)


def dense_source(t: torch.Tensor, keep: list) -> int:
    """The address the pack reads a device input from: its own, or a dense copy's that `keep`
    holds until the next call. Without the reference a copy is freed at once, and the next
    input's copy takes the same block before the pack has read the first (the pack runs after
    every source is known). Freed at the next call, a block is only reused by work queued after
    this call's pack (the caching allocator is stream-ordered)."""
    if not t.is_contiguous():
        t = t.contiguous()
        keep.append(t)
    return t.data_ptr()


class Pack:
    """The pack of one runner, its strategy chosen once at compile:

    "in-graph"  Triton, no prepare hook: the kernel is captured into each bucket's graph, so a
                call is one async copy + replay;
    "eager"     Triton with a prepare hook (the hook must see the packed view): the kernel runs
                before the hook, outside the graph;
    "torch"     no Triton: torch ops per input (the reference of the table), outside the graph.
    Inputs whose layout is "nd" always take torch ops, outside the graph.
    """

    def __init__(self, plan: Plan, static: StaticInputs, device: torch.device, strategy: str, copy: str = "cudart"):
        self.plan, self.static, self.strategy = plan, static, strategy
        last = plan.pack_table(plan.buckets[-1])
        kernel = [e.name for e in last.entries if e.layout != "nd"] if strategy != "torch" else []
        self.torch_entries = {b: [e for e in plan.pack_table(b).entries if e.name not in kernel] for b in plan.buckets}
        self.block = CallBlock(plan, device, kernel, copy)
        self.tables, self.programs, self._self_srcs = {}, {}, {}
        for b in plan.buckets:
            entries = [e for e in plan.pack_table(b).entries if e.name in kernel]
            views = static.views(b)
            rows = tpack.encode(entries, plan.pack_table(b).axes, [views[e.name] for e in entries])
            self.tables[b] = torch.from_numpy(rows).to(device)
            self.programs[b] = tpack.grid_programs(entries)
            self._self_srcs[b] = torch.tensor([views[e.name].data_ptr() for e in entries], dtype=torch.int64,
                                              device=device)
        self.extents = self.block.extents
        # the strategy, bound once: no flag is tested on the call path. Where no kernel runs,
        # torch ops write the extents the body reads (x.extent).
        launch = self._launch if self.block.n_jobs else (lambda bucket: self.block.effective())
        self.in_graph = launch if strategy == "in-graph" else _nothing
        self._launch_after_send = launch if strategy != "in-graph" else _nothing
        # what a call runs after the copy, outside the graph: nothing where the graph does it all
        eager = strategy != "in-graph" or any(self.torch_entries.values())
        self._after_send = self._eager_pack if eager else _nothing_after
        # device extents without a host sync: the kernel clamps them; torch ops would need the value
        device_axes = {a.name for a in plan.axes if a.device_extent}
        nd_axes = {af.axis.name for e in last.entries if e.name not in kernel
                   for _, af in padded_dims(plan.program.inputs[e.name].shape)}
        self.native_device_extents = strategy != "torch" and not (device_axes & nd_axes)

    def describe(self, bucket: int) -> str:
        return f"strategy {self.strategy}, copies by {self.block.copier.name}\n{self.plan.pack_table(bucket)}"

    # ---- compile ------------------------------------------------------------------------------
    def all_pad(self, bucket: int) -> None:
        """Every lane its pad, fixed inputs 0, every extent 0 (before each warm-up and capture)."""
        views = self.static.views(bucket)
        for e in self.plan.pack_table(bucket).entries:
            P.all_pad(e, views[e.name])
        self.block.sent = None
        self.block.device_ext.zero_()
        self.block.device_dev.zero_()
        self.block.eff.zero_()
        if self.block.n_jobs:
            # the kernel too (compiled here, never first inside a capture): every job's source is
            # its own buffer, so fixed inputs copy onto themselves and padded ones read nothing
            self.block.device_srcs[: self.block.n_jobs].copy_(self._self_srcs[bucket])
            self._launch(bucket)

    # ---- call ---------------------------------------------------------------------------------
    def per_call(self, bucket: int, raw, ext, dev=None) -> None:
        self.block.send(raw, ext)
        if dev:
            self.block.send_device_extents(dev)
        self._after_send(bucket, raw, ext)

    def _eager_pack(self, bucket: int, raw, ext) -> None:
        """After the copy, outside the graph: the kernel (eager, torch strategies) and torch ops
        for the inputs the kernel does not pack."""
        self._launch_after_send(bucket)
        torch_entries = self.torch_entries[bucket]
        if torch_entries:
            views = self.static.views(bucket)
            for e in torch_entries:
                t = raw[e.name]
                src = t if t.is_cuda else self.block.staged(e.name, t)
                P.apply(e, views[e.name], src.contiguous(), ext)

    def _launch(self, bucket: int) -> None:
        b = self.block
        tpack.launch(self.tables[bucket], b.device_srcs, b.device_ext, self.programs[bucket], b.device_dev, b.eff)


def _nothing(bucket: int) -> None:
    return None


def _nothing_after(bucket: int, raw, ext) -> None:
    return None
