"""The host work of a call, made cheaper without changing what it checks or guarantees.

- `Plan.extents`: a fast path (inputs declared alike compared by shape) must accept exactly what
  the per-input checks accept, with the same extents, and leave every rejection to them (same
  error, same message), on generated programs and inputs.
- The pinned ring (`staging._Ring`): copies fenced by one event per group of calls; a slot is
  never handed out for rewriting while a queued copy still reads it, whatever the GPU's pace and
  the streams used; and when the GPU keeps up it neither grows nor fences more than once a group.
- `RuntimeCopier` calls the runtime with untyped ctypes functions: every argument must arrive
  at its full width (pointers, sizes past 2**32, stream handles), checked against a stand-in
  runtime built from C where a compiler is present.
- On a GPU: the block the fast path writes is the one the per-input path writes.
"""
from __future__ import annotations

import collections
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import padgraph as pg
from padgraph.axes import as_affine
from padgraph.plan import OnDevice, Plan

# ---- Plan.extents: fast path == per-input checks ------------------------------------------------

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 2)
DIMS = [bs, bs + 1, bs * 2, tok, tok * 2 + 1, 2, 3]
DTYPES = [torch.int64, torch.int32, torch.float32, torch.bool]


@st.composite
def programs(draw):
    n = draw(st.integers(1, 5))
    inputs = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.sampled_from(DIMS), min_size=0, max_size=3)))
        if i == 0 and bs not in shape:
            shape = (bs,) + shape                  # the bucketed axis has a giver
        pad = 0 if any(not isinstance(d, int) for d in shape) else None
        inputs[f"in{i}"] = pg.Input(shape, draw(st.sampled_from(DTYPES)), pad=pad)
    return pg.Program("gen", inputs=inputs, outputs={"o": pg.Output((bs,), torch.float32)},
                      buckets=pg.Buckets([4, 8]))


def _size(d, ext):
    af = as_affine(d)
    return d if af is None else af.scale * ext[af.axis.name] + af.offset


FAULTS = ["none", "dtype", "dim", "rank", "device", "not_tensor", "disagree", "param", "other_shape"]   # bs 0: drawn below


@st.composite
def raws(draw, program):
    ext = {"bs": draw(st.integers(0, 9)), "tokens": draw(st.integers(0, 20))}
    raw = {n: torch.zeros(tuple(_size(d, ext) for d in s.shape), dtype=s.dtype) for n, s in program.inputs.items()}
    fault = draw(st.sampled_from(FAULTS))
    name = draw(st.sampled_from(sorted(raw)))
    t = raw[name]
    if fault == "dtype":
        raw[name] = t.to(torch.float64)
    elif fault == "dim" and t.dim():
        d = draw(st.integers(0, t.dim() - 1))
        shape = list(t.shape)
        shape[d] += draw(st.integers(1, 3))
        raw[name] = torch.zeros(shape, dtype=t.dtype)
    elif fault == "rank":
        raw[name] = t.unsqueeze(0)
    elif fault == "device":
        raw[name] = t.to("meta")
    elif fault == "not_tensor":
        raw[name] = t.tolist()
    elif fault == "param":
        raw[name] = torch.nn.Parameter(t, requires_grad=False)
    elif fault == "other_shape":                # another input's shape (inputs swapped, say)
        other = raw[draw(st.sampled_from(sorted(raw)))]
        raw[name] = torch.zeros(other.shape, dtype=t.dtype)
    elif fault == "disagree":
        ext2 = dict(ext, bs=ext["bs"] + 1)
        s = program.inputs[name]
        raw[name] = torch.zeros(tuple(_size(d, ext2) for d in s.shape), dtype=s.dtype)
    return raw


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:            # the same error type and message on both paths
        return (type(e).__name__, str(e))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_extents_fast_path_accepts_and_rejects_exactly_as_the_per_input_checks(data):
    program = data.draw(programs())
    plan = Plan(program)
    raw = data.draw(raws(program))
    device = data.draw(st.sampled_from([None, torch.device("cpu")]))
    allow_host = data.draw(st.booleans())
    assert _outcome(lambda: plan.extents(raw, device, allow_host)) == \
        _outcome(lambda: plan._extents_each(raw, device, allow_host))


def test_an_input_given_another_inputs_shape_is_judged_by_its_own_declaration():
    """Several groups of inputs declared alike: each input handed every other input's shape
    (swapped inputs) gets the per-input verdict, never the verdict of another group."""
    program = pg.Program("groups", inputs={"a": pg.Input((bs,), torch.float32, pad=0), "b": pg.Input((bs, 2), torch.float32, pad=0),
                                           "c": pg.Input((tok,), torch.float32, pad=0), "d": pg.Input((bs, 2), torch.float32, pad=0),
                                           "f": pg.Input((bs,), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))
    plan = Plan(program)
    good = {"a": (3,), "b": (3, 2), "c": (5,), "d": (3, 2), "f": (3,)}
    for name in good:
        for shape in set(good.values()):
            raw = {n: torch.zeros(shape if n == name else s) for n, s in good.items()}
            assert _outcome(lambda: plan.extents(raw)) == _outcome(lambda: plan._extents_each(raw, None, False)), (name, shape)


def test_the_fast_path_serves_valid_calls_with_the_per_input_extents():
    """Not vacuous: valid inputs take the fast path (inputs declared alike compared by shape)."""
    program = pg.Program("alike", inputs={"a": pg.Input((bs, 2), torch.int64, pad=0), "b": pg.Input((bs, 2), torch.int64, pad=0),
                                          "c": pg.Input((tok * 2 + 1,), torch.float32, pad=0),
                                          "d": pg.Input((bs, 2), torch.int32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))
    plan = Plan(program)
    assert [c.alike for c in plan._checks] == [None, 0, None, 0]
    raw = {"a": torch.zeros(3, 2, dtype=torch.int64), "b": torch.ones(3, 2, dtype=torch.int64),
           "c": torch.zeros(11), "d": torch.zeros(3, 2, dtype=torch.int32)}
    fast = plan._extents_fast(plan._tensors_of(raw), torch.device("cpu"))
    assert fast == {"bs": 3, "tokens": 5} == plan._extents_each(raw, torch.device("cpu"), False)
    assert list(fast) == list(plan._extents_each(raw, None, False))       # same key order (view cache keys)
    raw["b"] = torch.zeros(4, 2, dtype=torch.int64)            # b disagrees with a: the per-input error
    assert plan._extents_fast(plan._tensors_of(raw), None) is None
    with pytest.raises(pg.ContractValueError, match="'bs' must agree across inputs.*'a' gives bs=3 but 'b' gives bs=4"):
        plan.extents(raw)


def test_only_extents_checked_against_a_device_say_the_inputs_live_there():
    """`OnDevice` extents let the cuda staging skip asking each input where it lives: only the
    fast path with a device returns them, never the per-input path (which may admit host inputs)."""
    program = pg.Program("where", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((bs, 2), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))
    plan = Plan(program)
    raw = {"a": torch.arange(3), "b": torch.ones(3, 2)}
    cpu = torch.device("cpu")
    assert type(plan.extents(raw, cpu)) is OnDevice and plan.extents(raw, cpu) == {"bs": 3}
    assert type(plan.extents(raw)) is dict                     # no device to check against
    assert type(plan._extents_each(raw, cpu, False)) is dict
    raw["b"] = torch.nn.Parameter(raw["b"], requires_grad=False)      # admitted by the per-input path only
    assert type(plan.extents(raw, cpu)) is dict and plan.extents(raw, cpu) == {"bs": 3}
    assert type(plan.extents(raw, torch.device("meta"), allow_host=True)) is dict


# ---- the pinned ring: no slot rewritten while a queued copy reads it ----------------------------

class FakeGPU:
    """Streams of queued work run in order when told; a copier over them that records what it
    queues, and counts the host calls that cost a runtime call."""

    name = "fake"

    def __init__(self):
        self.queues = collections.defaultdict(collections.deque)     # stream -> ops, oldest first
        self.reading = collections.Counter()       # slot buffer id -> queued copies reading it
        self.stream = 0
        self.records = self.queries = self.copies = 0
        self.pending: dict = {}                    # event -> queued record not run yet

    def new_event(self):
        return object()

    def bind(self, dst, src):
        key = id(src)

        def send(nbytes):
            self.copies += 1
            self.reading[key] += 1
            self.queues[self.stream].append(("copy", key))
            return self.stream
        return send

    def current_stream(self):
        return self.stream

    def record(self, event, stream):
        self.records += 1
        self.pending[event] = self.pending.get(event, 0) + 1
        self.queues[stream].append(("event", event))

    def query(self, event):
        self.queries += 1
        return not self.pending.get(event)

    def run(self, stream, n):
        q = self.queues[stream]
        for _ in range(min(n, len(q))):
            kind, what = q.popleft()
            if kind == "copy":
                self.reading[what] -= 1
            else:
                self.pending[what] -= 1


@pytest.fixture
def ring_of(monkeypatch):
    from padgraph.backends.cuda import staging
    monkeypatch.setattr(staging, "_pinned", lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))

    def make(batch):
        gpu = FakeGPU()
        return gpu, staging._Ring(64, torch.zeros(64, dtype=torch.uint8), gpu, batch)
    return make


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.sampled_from([1, 2, 3, 8]),
       steps=st.lists(st.one_of(st.tuples(st.just("call"), st.integers(0, 1)),
                                st.tuples(st.just("gpu"), st.integers(0, 1), st.integers(0, 6))), max_size=120))
def test_a_slot_is_never_rewritten_while_a_queued_copy_reads_it(ring_of, batch, steps):
    gpu, ring = ring_of(batch)
    for step in steps:
        if step[0] == "gpu":
            gpu.run(step[1], step[2])
            continue
        gpu.stream = step[1]
        slot = ring.acquire()
        assert gpu.reading[id(slot.host)] == 0, "a slot handed out while a queued copy still reads it"
        ring.send(slot, 64)


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_gpu_that_keeps_up_costs_one_fence_a_group_and_no_growth(ring_of, batch):
    gpu, ring = ring_of(batch)
    calls = 10 * batch * 4
    for _ in range(calls):
        slot = ring.acquire()
        ring.send(slot, 64)
        gpu.run(0, 10**6)
    assert len(ring.slots) == batch + 1
    assert gpu.records == calls // batch and gpu.queries <= calls // batch + 1


def test_a_gpu_far_behind_grows_the_ring_and_a_stream_change_fences_the_open_group(ring_of):
    gpu, ring = ring_of(8)
    for _ in range(43):                 # nothing runs: every copy still queued (5 groups fenced, 3 calls open)
        ring.send(ring.acquire(), 64)
    assert len(ring.slots) == 43 and len({id(s) for s in ring.slots}) == 43
    gpu.run(0, 10**6)
    gpu.stream = 1
    records = gpu.records
    ring.send(ring.acquire(), 64)       # the group open on stream 0 gets its own fence on stream 0
    assert gpu.records == records + 1 and gpu.queues[0][-1][0] == "event"


def test_the_block_stages_host_inputs_unless_the_extents_say_they_are_on_the_device(monkeypatch):
    """CPU tensors stand for device ones here: with plain extents they are host inputs (staged into
    the slot, read from the device block), with `OnDevice` extents the kernel reads them in place."""
    from padgraph.backends.cuda import staging
    monkeypatch.setattr(staging, "_pinned", lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(staging, "copier", lambda device, prefer="cudart": FakeGPU())
    program = pg.Program("staged", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((bs, 2), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))
    plan = Plan(program)
    block = staging.CallBlock(plan, torch.device("cpu"), ["a", "b"])
    raw = {"a": torch.arange(5), "b": torch.arange(10.).view(5, 2)}
    for ext, in_place in [({"bs": 5}, False), (plan.extents(raw, torch.device("cpu")), True), ({"bs": 5}, False)]:
        slot = block.ring.slots[block.ring._turn]
        block.send(raw, ext)
        srcs = slot.raw[:16].view(np.int64).tolist()
        bounds = slot.raw[block.ext_off: block.ext_off + 8].view(np.int32).tolist()
        if in_place:
            assert srcs == [raw["a"].data_ptr(), raw["b"].data_ptr()]
        else:
            assert srcs == [block._dev_base + block.staging[n] for n in "ab"]
            for n in "ab":
                off = block.staging[n]
                nbytes = raw[n].numel() * raw[n].element_size()
                assert slot.raw[off: off + nbytes].tobytes() == raw[n].numpy().tobytes()
        assert bounds == [5, 5]


def test_the_block_is_sent_again_only_when_sources_bounds_or_stream_change(monkeypatch):
    """Device inputs at the addresses, bounds and stream of the last send: the device block already
    holds them, so no copy is queued. Anything else (a new address, a new bound, another stream, a
    host input, a device extent written after the send) sends it again."""
    from padgraph.backends.cuda import staging
    gpu = FakeGPU()
    monkeypatch.setattr(staging, "_pinned", lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    monkeypatch.setattr(staging, "copier", lambda device, prefer="cudart": gpu)
    program = pg.Program("memo", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((bs, 2), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))
    plan = Plan(program)
    block = staging.CallBlock(plan, torch.device("cpu"), ["a", "b"])
    raw = {"a": torch.arange(5), "b": torch.arange(10.).view(5, 2)}
    on_device = plan.extents(raw, torch.device("cpu"))          # OnDevice: CPU tensors stand for device ones
    other = {"a": raw["a"].clone(), "b": raw["b"]}
    shorter = {"a": raw["a"][:3], "b": raw["b"][:3]}

    def copies(raw, ext, dev=None):
        before = gpu.copies
        block.send(raw, ext)
        if dev is not None:
            block.send_device_extents(dev)
        return gpu.copies - before

    assert copies(raw, on_device) == 1
    assert copies(raw, on_device) == 0 and copies(raw, on_device) == 0
    assert copies(other, plan.extents(other, torch.device("cpu"))) == 1        # a new address
    assert copies(raw, on_device) == 1
    assert copies(shorter, plan.extents(shorter, torch.device("cpu"))) == 1    # a new bound (same addresses)
    assert copies(raw, on_device) == 1
    gpu.stream = 1
    assert copies(raw, on_device) == 1 and copies(raw, on_device) == 0          # another stream
    assert copies(raw, {"bs": 5}) == 1                                          # host inputs: staged
    assert copies(raw, on_device) == 1
    assert copies(raw, on_device, dev={}) == 0                                  # device extents written ...
    assert copies(raw, on_device) == 1                                          # ... so the next call sends
    slot = block.ring.slots[(block.ring._turn - 1) % len(block.ring.slots)]
    assert slot.raw[:16].view(np.int64).tolist() == [raw["a"].data_ptr(), raw["b"].data_ptr()]


# ---- RuntimeCopier against a stand-in runtime ---------------------------------------------------

FAKE_CUDART = r"""
#include <stddef.h>
#include <string.h>
void *last_dst, *last_src, *last_stream, *last_event, *record_stream; size_t last_n; int last_kind;
int query_status = 0, memcpy_status = 0;
const char *cudaGetErrorString(int e) { return e == 700 ? "an illegal memory access" : "other"; }
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
  last_dst = dst; last_src = (void *)src; last_n = n; last_kind = kind; last_stream = stream;
  if (n <= 64) memcpy(dst, src, n);
  return memcpy_status;
}
int cudaEventRecord(void *event, void *stream) { last_event = event; record_stream = stream; return 0; }
int cudaEventQuery(void *event) { last_event = event; return query_status; }
int cudaEventCreateWithFlags(void **event, unsigned flags) { *event = (void *)0x7f00deadbeefULL; return 0; }
int cudaEventDestroy(void *event) { return 0; }
"""


@pytest.fixture
def fake_runtime(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in runtime")
    src, lib = tmp_path / "fake_cudart.c", tmp_path / "libfake_cudart.so"
    src.write_text(FAKE_CUDART)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    from padgraph.backends.cuda import cudart
    return cudart, ctypes.CDLL(str(lib))


def test_the_untyped_runtime_calls_pass_every_argument_at_full_width(fake_runtime, monkeypatch):
    cudart, c = fake_runtime
    stream = 0x7f1234567890
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: stream, raising=False)
    copier = cudart.RuntimeCopier(cudart.typed(ctypes.CDLL(c._name)), torch.device("cuda", 0))
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    send = copier.bind(dst, src)
    for n in (48, 2**33 + 5, 48):
        assert send(n) == stream
        ptr = ctypes.c_void_p

        def got(name, t=ptr):
            return t.in_dll(c, name).value
        assert (got("last_dst"), got("last_src"), got("last_n", ctypes.c_size_t), got("last_kind", ctypes.c_int),
                got("last_stream")) == (dst.data_ptr(), src.data_ptr(), n, 1, stream)
    assert torch.equal(dst[:48], src[:48]) and not dst[48:].any()
    event = copier.new_event()
    copier.record(event, stream)
    assert (ptr.in_dll(c, "last_event").value, ptr.in_dll(c, "record_stream").value) == (event, stream)
    assert copier.query(event)
    ctypes.c_int.in_dll(c, "query_status").value = 600        # cudaErrorNotReady
    assert not copier.query(event)
    ctypes.c_int.in_dll(c, "query_status").value = 700
    with pytest.raises(RuntimeError, match="cudaEventQuery failed: an illegal memory access"):
        copier.query(event)
    ctypes.c_int.in_dll(c, "memcpy_status").value = 700
    with pytest.raises(RuntimeError, match="cudaMemcpyAsync failed: an illegal memory access"):
        send(8)


@pytest.mark.cuda
def test_a_call_that_sends_no_copy_reads_its_inputs_current_values():
    """The same input tensors call after call (no copy of the block): each replay reads what the
    tensors hold now, through bucket changes, device extents and another stream."""
    n = pg.Axis("n")
    program = pg.Program("memo_gpu", inputs={"a": pg.Input((n,), torch.int64, pad=0),
                                             "b": pg.Input((n, 2), torch.float32, pad=0)},
                         outputs={"o": pg.Output((n,), torch.float32, pad=0)}, buckets=pg.Buckets([4, 8]))
    runner = pg.compile(program, lambda x: {"o": x.a.float() + x.b.sum(-1)}, backend="cuda")
    a, b = torch.arange(7, device="cuda"), torch.ones(7, 2, device="cuda")
    for i in range(4):
        a.add_(1)
        b.mul_(2)
        k = 7 if i % 2 == 0 else 3
        out = runner(a=a[:k], b=b[:k]).o
        assert torch.equal(out, a[:k].float() + b[:k].sum(-1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a.add_(5)
        out = runner(a=a, b=b).o.clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, a.float() + b.sum(-1))
    a.add_(1)
    assert torch.equal(runner(a=a, b=b).o, a.float() + b.sum(-1))


# ---- on a GPU: the fast path writes the per-input path's block ----------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("copy", ["cudart", "torch"])
def test_the_block_sent_holds_every_source_and_extent(copy):
    from padgraph.backends.cuda import staging
    program = pg.Program("blk", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((bs, 3), torch.float32, pad=0),
                                        "c": pg.Input((bs,), torch.int32, pad=1)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))
    plan = Plan(program)
    block = staging.CallBlock(plan, torch.device("cuda", torch.cuda.current_device()), ["a", "b", "c"], copy)
    base = torch.arange(40., device="cuda").view(8, 5)
    cases = [
        {"a": torch.arange(5, device="cuda"), "b": torch.ones(5, 3, device="cuda"), "c": torch.ones(5, dtype=torch.int32, device="cuda")},
        {"a": torch.arange(5), "b": torch.ones(5, 3, device="cuda"), "c": torch.ones(5, dtype=torch.int32, device="cuda")},   # host
        {"a": torch.arange(5, device="cuda"), "b": base[:5, 1:4], "c": torch.ones(5, dtype=torch.int32, device="cuda")},      # strided
    ]
    for _ in range(3):                  # past the ring's first lap
        for raw in cases:
            block.send(raw, {"bs": 5})
            torch.cuda.synchronize()
            srcs = block.device_srcs[:3].tolist()
            for name, got in zip("abc", srcs):
                t = raw[name]
                if not t.is_cuda:
                    assert got == block._dev_base + block.staging[name]
                    assert torch.equal(block.staged(name, t).cpu(), t)
                elif t.is_contiguous():
                    assert got == t.data_ptr()
                else:
                    assert got == block.keep[0].data_ptr() and torch.equal(block.keep[0], t)
            assert block.device_ext.tolist() == [5] and block.device_dev.tolist() == [5]


@pytest.mark.cuda
@pytest.mark.parametrize("copy", ["cudart", "torch"])
@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_calls_queued_behind_a_busy_gpu_each_read_their_own_inputs(copy, where):
    """The GPU held back while 40 calls queue: every call's pack must still read that call's
    sources and extents (its slot not rewritten before its copy ran), and the ring grew."""
    program = pg.Program("queued", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((bs, 2), torch.float32, pad=0)},
                         outputs={"y": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([8, 16]))
    runner = pg.compile(program, lambda x: {"y": x.a.float() + x.b.sum(-1)}, backend="cuda", copy=copy, progress=False)
    gen = torch.Generator().manual_seed(0)
    raws = [{"a": torch.randint(0, 100, (n,), generator=gen), "b": torch.randn(n, 2, generator=gen)}
            for n in [int(v) for v in torch.randint(1, 17, (40,), generator=gen)]]
    raws = [{k: v.to(where) for k, v in r.items()} for r in raws]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))         # ~0.1 s of GPU time ahead of every call below
    got = [runner(**r).y.clone() for r in raws]
    torch.cuda.synchronize()
    for r, y in zip(raws, got):
        torch.testing.assert_close(y, (r["a"].float() + r["b"].sum(-1)).cuda())
    ring = runner.pack.block.ring
    assert len(ring.slots) > ring.batch + 1
