"""Every route by which a lent output can be read (rule 6.2), in both directions: on an output of an
ended lease it raises `StaleOutputError`; on a live one it gives the values a plain tensor gives,
and what it returns that does not alias the output stays the caller's after the next call.
Also: outputs carry no autograd (rule 10.5), `torch.compile` of a caller's function takes
outputs, and a read racing the next call on another thread never returns the later call's values.
Reference on CPU everywhere; the same cases on the cuda backend where a GPU is present."""
import copy
import pickle
import sys
import threading
import time

import numpy as np
import pytest
import torch

import padgraph as pg

bs = pg.Axis("bs")
PROGRAM = pg.Program("lent", inputs={"a": pg.Input((bs, 4), torch.float32, pad=0)},
                     outputs={"y": pg.Output((bs, 4), torch.float32), "k": pg.Output((3,), torch.int64)},
                     buckets=pg.Buckets([2, 4, 8]))


def body(x):
    return {"y": x.a * 2, "k": torch.arange(3, device=x.a.device) + x.a.sum().to(torch.int64) * 0}


BACKENDS = [pytest.param(("reference", "cpu"), id="reference-cpu"),
            pytest.param(("cuda", "cuda"), id="cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=BACKENDS)
def where(request):
    return request.param


def _runner(where, fn=body, **options):
    backend, device = where
    return pg.compile(PROGRAM, fn, backend=backend, **options), device


def _a(n, value, device):
    return torch.arange(n * 4, dtype=torch.float32, device=device).view(n, 4) + value


def _plain(t):
    return t.clone() if type(t) is torch.Tensor else t


# route -> fn(y) reading the output y; each gives a result comparable by `_values`
ROUTES = {
    "unbind": lambda y: y.unbind()[1] + 0,
    "unbind-dim1": lambda y: torch.unbind(y, 1)[2] * 1,
    "split": lambda y: y.split(1)[1] + 0,
    "chunk": lambda y: torch.chunk(y, 3)[0] + 0,
    "tensor_split": lambda y: torch.tensor_split(y, [1])[1] + 0,
    "for-row-in-y": lambda y: [row + 0 for row in y],
    "list(y)": lambda y: [r.sum() for r in list(y)],
    "len": lambda y: len(y),
    "tolist": lambda y: y.tolist(),
    "item": lambda y: y[0, 0].item(),
    "float": lambda y: float(y[1, 1]),
    "kwarg": lambda y: torch.add(torch.ones(4, device=y.device), other=y),
    "kwarg-in-list": lambda y: torch.cat(tensors=[torch.zeros(1, 4, device=y.device), y]),
    "nested-list": lambda y: torch.stack([y[0], y[1]]),
    "kwarg-out-of-where": lambda y: torch.where(y > 3, input=y, other=torch.zeros_like(y)),
    "new_tensor-self": lambda y: y.new_tensor([1.0, 2.0]) + y.sum(),
    "as_tensor-same": lambda y: torch.as_tensor(y) + 0,
    "detach": lambda y: y.detach() + 0,
    "data": lambda y: y.data + 0,
    "as_subclass": lambda y: y.as_subclass(torch.Tensor) + 0,
    "T": lambda y: y.T + 0,
    "repr": lambda y: repr(y).replace("Lent", "tensor"),
    "format": lambda y: f"{y[0]}",
    "deepcopy": lambda y: copy.deepcopy(y),
    "pickle": lambda y: pickle.loads(pickle.dumps(y)),
    "from_dlpack": lambda y: torch.from_dlpack(y) + 0,
    "cpu": lambda y: y.cpu() + 0,
    "numpy": lambda y: y.cpu().numpy().copy(),
    "np.asarray": lambda y: np.asarray(y.cpu()),
}


def _values(r):
    if isinstance(r, torch.Tensor):
        return ("tensor", r.cpu().tolist())
    if isinstance(r, np.ndarray):
        return ("array", r.tolist())
    if isinstance(r, (list, tuple)):
        return [_values(v) for v in r]
    return r


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_route_reads_a_live_output_as_a_plain_tensor(where, route):
    runner, device = _runner(where)
    a = _a(3, 1.0, device)
    want = ROUTES[route](a * 2)
    got = ROUTES[route](runner(a=a).y)
    assert _values(got) == _values(want), route


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_route_raises_on_a_stale_output(where, route):
    runner, device = _runner(where)
    y = runner(a=_a(3, 1.0, device)).y
    runner(a=_a(3, 100.0, device))
    with pytest.raises(pg.StaleOutputError, match="'lent'.*output 'y' of call 1.*copy_outputs=True"):
        ROUTES[route](y)


KEPT = {   # route -> views a caller keeps past the next call: each alias of the output
    "unbind": lambda y: list(y.unbind()),
    "split": lambda y: list(y.split([1, 2])),
    "chunk": lambda y: list(torch.chunk(y, 2, dim=1)),
    "tensor_split": lambda y: list(torch.tensor_split(y, 2)),
    "for-row-in-y": lambda y: [row for row in y],
    "broadcast_tensors": lambda y: [torch.broadcast_tensors(torch.zeros(3, 4, device=y.device), y)[1]],
    "view-of-view": lambda y: [y.unbind()[0][1:]],
    "detach": lambda y: [y.detach()],
    "data": lambda y: [y.data],
    "as_subclass": lambda y: [y.as_subclass(torch.Tensor)],
    "kwarg-view": lambda y: [torch.narrow(y, dim=0, start=1, length=1)],
}


@pytest.mark.parametrize("route", sorted(KEPT))
def test_views_kept_past_the_next_call_raise(where, route):
    """Views returned inside a tuple or list (or an iterator) stay lent under the output's lease:
    read after the next call they raise instead of showing its values."""
    runner, device = _runner(where)
    a = _a(3, 1.0, device)
    views = KEPT[route](runner(a=a).y)
    want = [v.tolist() for v in KEPT[route](a * 2)]
    assert [v.tolist() for v in views] == want
    runner(a=_a(3, 100.0, device))
    for v in views:
        with pytest.raises(pg.StaleOutputError):
            v.sum()


NEW_MEMORY = {   # results in memory of their own: the caller's, valid after any later call
    "sort": lambda y: list(torch.sort(y, dim=1, descending=True)),
    "topk": lambda y: list(y.topk(2)),
    "max-dim": lambda y: list(y.max(dim=1)),
    "unbind-of-clone": lambda y: list(y.clone().unbind()),
    "split-of-sum": lambda y: list((y + 1).split(1)),
    "cat": lambda y: [torch.cat([y, y])],
    "torch.tensor-of-live": lambda y: [torch.tensor(y.tolist(), device=y.device)],
    "numpy": lambda y: [torch.from_numpy(y.cpu().numpy())],
    "np.asarray": lambda y: [torch.from_numpy(np.asarray(y.cpu()))],
    "from_dlpack": lambda y: [torch.from_dlpack(y)],
    "deepcopy": lambda y: [copy.deepcopy(y)],
}


@pytest.mark.parametrize("route", sorted(NEW_MEMORY))
def test_results_in_their_own_memory_stay_the_callers(where, route):
    """No false alarm: what does not alias the output (numpy and dlpack exports are copies) keeps
    its values after later calls."""
    runner, device = _runner(where)
    a = _a(3, 1.0, device)
    kept = NEW_MEMORY[route](runner(a=a).y)
    want = [_plain(t).tolist() for t in NEW_MEMORY[route](a * 2)]
    for value in (100.0, -7.0):
        runner(a=_a(3, value, device))
    assert all(type(t) is torch.Tensor for t in kept), [type(t).__name__ for t in kept]
    assert [t.tolist() for t in kept] == want


def test_a_kept_view_of_the_next_call_is_live(where):
    runner, device = _runner(where)
    runner(a=_a(3, 1.0, device))
    rows = list(runner(a=_a(3, 5.0, device)).y)
    assert [r.tolist() for r in rows] == [r.tolist() for r in _a(3, 5.0, device) * 2]


# ---- torch.compile of a caller's function ------------------------------------------------------

@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_torch_compile_of_a_function_of_outputs(where, compiler):
    """A compiled function takes live outputs (one graph for every call's outputs), and raises
    StaleOutputError on a stale one instead of reading it. (Not "aot_eager": in this torch it
    fails on any tensor subclass input, a plain `class M(torch.Tensor): pass` included.)"""
    torch._dynamo.reset()
    runner, device = _runner(where)
    f = torch.compile(lambda y, k: (y * 2 + 1).sum(1) + k[:1], backend=compiler)
    for value in (0.0, 3.0, 9.0):
        out = runner(a=_a(3, value, device))
        got = f(out.y, k=out.k)
        assert type(got) is torch.Tensor
        assert got.tolist() == ((_a(3, value, device) * 2 * 2 + 1).sum(1)).tolist()
    y, k = out.y, out.k
    runner(a=_a(3, 1.0, device))
    with pytest.raises(Exception) as err:      # noqa: PT011 (which class is torch's choice: below)
        f(y, k=k)
    assert _stale_error(err.value), f"a stale output read by a compiled function must raise StaleOutputError, got {err.value!r}"


def _stale_error(e: BaseException) -> bool:
    """StaleOutputError, raised as itself or wrapped by dynamo (torch 2.11 wraps an error raised
    while it traces in InternalTorchDynamoError, its message and cause kept)."""
    while e is not None:
        if isinstance(e, pg.StaleOutputError) or ("StaleOutputError" in str(e) and "output 'y'" in str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def test_torch_compile_of_a_function_of_rows(where):
    torch._dynamo.reset()
    runner, device = _runner(where)
    f = torch.compile(lambda rows: [r.max() for r in rows], backend="eager")
    out = runner(a=_a(2, 4.0, device))
    assert [t.item() for t in f(list(out.y))] == [(4.0 + 3) * 2, (8.0 + 3) * 2]


# ---- autograd: outputs never carry it (rule 10.5) -----------------------------------------------

@pytest.mark.parametrize("copy_outputs", [False, True])
@pytest.mark.parametrize("n", [3, 9], ids=["ladder", "past-ladder"])
def test_outputs_carry_no_grad_when_the_body_enables_it(where, copy_outputs, n):
    backend, device = where
    w = torch.nn.Parameter(torch.eye(4, device=device) * 3)

    def grad_body(x):
        with torch.enable_grad():
            y = x.a @ w
            return {"y": y, "k": torch.arange(3, device=x.a.device) + (y.sum() * 0).to(torch.int64)}

    runner, _ = _runner(where, grad_body, copy_outputs=copy_outputs, overflow="eager")
    a = _a(n, 1.0, device)
    with pytest.warns(pg.OverflowWarning) if n > 8 else _nothing():
        out = runner(a=a)
    for name, t in out.items():
        assert not t.requires_grad and t.grad_fn is None, (name, t.requires_grad, t.grad_fn)
        row = t[:1]
        assert not row.requires_grad and row.grad_fn is None, name
    assert out.y.tolist() == (a * 3).tolist()
    assert w.grad is None and torch.is_grad_enabled()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- threads: a read never mixes two calls --------------------------------------------------------

def test_a_read_racing_the_next_call_never_returns_its_values(where):
    """One thread calls the runner with inputs filled with its call number; readers clone the
    last output. Each read either raises StaleOutputError or holds exactly the values of the call
    that produced it, never a later call's (the lease ends before the next call writes, and is
    checked again after the read)."""
    backend, device = where
    width = 1 << 15                  # copies long enough to overlap (torch drops the GIL in them)
    wide = pg.Program("wide", inputs={"a": pg.Input((bs, width), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs, width), torch.float32)}, buckets=pg.Buckets([8]))
    runner = pg.compile(wide, lambda x: {"y": x.a * 2}, backend=backend)
    n_calls = 300
    shared, bad, counts = {}, [], {"ok": 0, "stale": 0}
    done = threading.Event()
    big = torch.zeros(8, width, device=device)

    def writer():       # at least n_calls, and on until the readers have cloned some (a fast GPU
        call = 0        # can finish n_calls before a reader thread is scheduled), within 30 s
        deadline = time.monotonic() + 30
        while call < n_calls or (counts["ok"] < 20 and time.monotonic() < deadline):
            call += 1
            shared["out"] = (runner(a=big + call).y, call)
        done.set()

    def reader():
        while not done.is_set():
            if "out" not in shared:
                continue
            y, call = shared["out"]
            try:
                got = y.clone()
            except pg.StaleOutputError:
                counts["stale"] += 1
                continue
            counts["ok"] += 1
            if not bool((got == 2 * call).all()):
                bad.append((call, sorted(set(got.flatten().tolist()))))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not bad, f"reads holding another call's values: {bad[:5]}"
    assert counts["ok"] > 0, counts


def test_threads_that_each_call_and_read_never_hold_another_threads_values(where):
    """Several threads each call the runner and clone their own output: a clone holds the values
    of that thread's call, or raises StaleOutputError when another thread's call came between."""
    backend, device = where
    width = 1 << 15
    wide = pg.Program("wide", inputs={"a": pg.Input((bs, width), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs, width), torch.float32)}, buckets=pg.Buckets([8]))
    runner = pg.compile(wide, lambda x: {"y": x.a * 2}, backend=backend)
    bad, counts = [], {"ok": 0, "stale": 0}

    def caller(first: int):
        zeros = torch.zeros(8, width, device=device)
        for value in range(first, first + 400, 4):
            y = runner(a=zeros + value).y
            try:
                got = y.clone()
            except pg.StaleOutputError:
                counts["stale"] += 1
                continue
            counts["ok"] += 1
            if not bool((got == 2 * value).all()):
                bad.append((value, sorted(set(got.flatten().tolist()))[:4]))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not bad, f"clones holding another thread's values: {bad[:5]}"
    assert counts["ok"] > 0, counts


# how a caller takes an output out of the call's mapping -> the output
TAKEN = {
    "attribute": lambda out: out.y,
    "getitem": lambda out: out["y"],
    "get": lambda out: out.get("y"),
    "values": lambda out: out.values()[0],
    "items": lambda out: dict(out.items())["y"],
    "dict": lambda out: dict(out)["y"],
    "unpacked": lambda out: {**out}["y"],
    "pop": lambda out: out.pop("y"),
    "pop-default": lambda out: out.pop("y", None),
    "popitem": lambda out: dict([out.popitem(), out.popitem()])["y"],
    "setdefault": lambda out: out.setdefault("y", None),
}


@pytest.mark.parametrize("route", sorted(TAKEN))
def test_every_way_out_of_the_outputs_mapping_is_lent(where, route):
    runner, device = _runner(where)
    y = TAKEN[route](runner(a=_a(3, 1.0, device)))
    assert y.tolist() == (_a(3, 1.0, device) * 2).tolist()
    runner(a=_a(3, 100.0, device))
    with pytest.raises(pg.StaleOutputError, match="output 'y' of call 1"):
        y + 0


def test_popping_an_unknown_output_names_the_outputs(where):
    runner, device = _runner(where)
    out = runner(a=_a(2, 1.0, device))
    assert out.pop("nope", 7) == 7
    with pytest.raises(KeyError, match="outputs must be one of"):
        out.pop("nope")
