"""Unit tests of the shared call path (Runner), the reference backend, stats, pg.capturing()."""
import logging

import pytest
import torch

import padgraph as pg
from padgraph.capture import capture_scope

bs = pg.Axis("bs")


def _prog(buckets=(2, 4)):
    return pg.Program("rt", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, buckets=list(buckets))


def test_capturing_flag():
    assert not pg.capturing()
    with capture_scope():
        assert pg.capturing()
        with capture_scope():
            assert pg.capturing()
        assert pg.capturing()
    assert not pg.capturing()
    with pytest.raises(KeyError):
        with capture_scope():
            raise KeyError("x")
    assert not pg.capturing(), "restored after an exception"
    seen = []
    pg.compile(_prog(), lambda x: seen.append(pg.capturing()) or {"y": x.a + x.b})(a=torch.ones(2, dtype=torch.int64),
                                                                                   b=torch.ones(2, dtype=torch.int64))
    assert seen == [False], "the reference backend never captures"


def test_body_raising_leaves_caller_and_runner_intact():
    fail = [True]

    def body(x):
        x.a.fill_(-1)
        if fail[0]:
            raise ZeroDivisionError("user bug")
        return {"y": x.a + x.b}

    r = pg.compile(_prog(), body)
    a, b = torch.arange(3), torch.arange(3)
    with pytest.raises(ZeroDivisionError):
        r(a=a, b=b)
    assert torch.equal(a, torch.arange(3))
    fail[0] = False
    assert torch.equal(r(a=a, b=b).y, torch.arange(3) - 1)


def test_stats_and_repr():
    r = pg.compile(_prog(), lambda x: {"y": x.a + x.b})
    for n in (1, 2, 3, 5):
        r(a=torch.ones(n, dtype=torch.int64), b=torch.ones(n, dtype=torch.int64))
    s = r.stats
    assert dict(s.calls) == {2: 2, 4: 1} and dict(s.padded_lanes) == {2: 1, 4: 1} and s.eager_fallbacks == 1
    assert s.padding_fraction == pytest.approx(2 / 8)
    assert "eager fallbacks: 1" in s.table() and "reference" in repr(r) and "'rt'" in repr(r)


def test_overflow_warns_once_and_outputs_do_not_alias_state(caplog):
    p = pg.Program("ov", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, outputs={"y": pg.Output((bs,), torch.int64)},
                   state={"kv": pg.State()}, buckets=[2])
    kv = torch.zeros(8, dtype=torch.int64)

    def body(x):
        x.kv[: x.bucket].copy_(x.a)
        return {"y": x.kv[: x.bucket]}     # a view of state: the runner must hand out a copy

    r = pg.compile(p, body, state={"kv": kv})
    with pytest.warns(pg.OverflowWarning, match="past the largest bucket") as caught:
        for n in (3, 5, 2):
            out = r(a=torch.arange(n))
            assert out.y.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr(), f"bs={n}"
    assert sum(issubclass(w.category, pg.OverflowWarning) for w in caught) == 1


def test_first_call_checks_every_input_device():
    """Bug fixed: with no device= and no state, the first call took the first input's device
    without checking the others (a mixed-device call reached the body)."""
    r = pg.compile(_prog(), lambda x: {"y": x.a + x.b})
    with pytest.raises(pg.ContractValueError, match="'b'.*device"):
        r(a=torch.ones(2, dtype=torch.int64), b=torch.ones(2, dtype=torch.int64, device="meta"))
    assert r(a=torch.ones(2, dtype=torch.int64), b=torch.ones(2, dtype=torch.int64)).y.tolist() == [2, 2]


def test_outputs_mapping_and_copy_outputs():
    r = pg.compile(_prog(), lambda x: {"y": x.a + x.b}, copy_outputs=True)
    out = r(a=torch.ones(2, dtype=torch.int64), b=torch.ones(2, dtype=torch.int64))
    assert out.y is out["y"] and list(out) == ["y"]
    first = out.y
    r(a=torch.zeros(2, dtype=torch.int64), b=torch.zeros(2, dtype=torch.int64))
    assert first.tolist() == [2, 2]


def test_default_outputs_live_in_one_arena():
    """Default lifetime: the next call reuses the output storage (why copy_outputs exists), so an
    output read after it raises (rule 6.2) instead of showing the next call's values."""
    r = pg.compile(_prog(), lambda x: {"y": x.a + x.b})
    y1 = r(a=torch.ones(2, dtype=torch.int64), b=torch.ones(2, dtype=torch.int64)).y
    p1 = y1.untyped_storage().data_ptr()
    y2 = r(a=torch.zeros(3, dtype=torch.int64), b=torch.zeros(3, dtype=torch.int64)).y
    assert p1 == y2.untyped_storage().data_ptr()
    with pytest.raises(pg.StaleOutputError, match="'y' of call 1.*copy_outputs=True"):
        y1.untyped_storage()


def test_run_at_and_register_backend():
    from padgraph.reference import ReferenceRunner
    r = pg.compile(_prog(), lambda x: {"y": x.a * 0 + x.bucket})
    assert r.run_at(7, a=torch.ones(3, dtype=torch.int64), b=torch.ones(3, dtype=torch.int64))["y"].tolist() == [7, 7, 7]
    with pytest.raises(ValueError):
        r.run_at(2, a=torch.ones(3, dtype=torch.int64), b=torch.ones(3, dtype=torch.int64))

    class Mine(ReferenceRunner):
        backend = "mine"

    pg.register_backend("mine-test", Mine)
    assert "mine-test" in pg.backend_names() and isinstance(pg.compile(_prog(), lambda x: {"y": x.a}, backend="mine-test"), Mine)


def test_pad_repr_nan():
    """Bug fixed: Fill(nan) printed as Fill('nan')."""
    assert repr(pg.Fill(float("nan"))) == "Fill(nan)" and repr(pg.Fill(1)) == "Fill(1)"


def test_compile_for_a_device_this_machine_lacks_fails_at_compile():
    bs = pg.Axis("bs")
    prog = pg.Program("nodev", inputs={"v": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, buckets=pg.Buckets([1, 2]))
    if not torch.cuda.is_available():
        with pytest.raises(pg.ContractRuntimeError, match="'nodev'.*device.*cuda"):
            pg.compile(prog, lambda x: {"y": x.v}, backend="reference", device="cuda")
        with pytest.raises(pg.ContractRuntimeError, match="'nodev'.*cuda"):
            pg.compile(prog, lambda x: {"y": x.v}, backend="cuda")
    with pytest.raises(pg.ContractValueError, match="'nodev'.*device"):
        pg.compile(prog, lambda x: {"y": x.v}, backend="reference", device="nosuchdevice")


def test_a_call_rejected_by_the_state_guard_pins_no_device():
    bs = pg.Axis("bs")
    prog = pg.Program("pin", inputs={"v": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, state={"s": pg.State()},
                      buckets=pg.Buckets([1, 2]))
    s = torch.zeros(4)
    runner = pg.compile(prog, lambda x: {"y": x.v}, backend="reference", state={"s": s})
    runner.device = None               # as if compiled with nothing to take a device from
    s.resize_(8)
    with pytest.raises(pg.StateStorageError):
        runner(v=torch.arange(2))
    assert runner.device is None


def test_copies_of_lent_outputs_are_the_callers():
    """deepcopy / pickle of an output (or of all outputs) is a plain copy: the next call leaves it."""
    import copy
    import pickle
    r = pg.compile(_prog(), lambda x: {"y": x.a + x.b})
    out = r(a=torch.ones(2, dtype=torch.int64), b=torch.ones(2, dtype=torch.int64))
    kept = [copy.deepcopy(out.y), pickle.loads(pickle.dumps(out.y)), copy.deepcopy(out)["y"], out.y.clone()]
    r(a=torch.zeros(3, dtype=torch.int64), b=torch.zeros(3, dtype=torch.int64))
    assert all((k + 0).tolist() == [2, 2] for k in kept)
    with pytest.raises(pg.StaleOutputError):
        copy.deepcopy(out.y)


def test_an_input_named_self_passes_by_keyword():
    """`runner(self=...)`: the runner's own parameter is positional-only."""
    n = pg.Axis("n")
    prog = pg.Program("selfish", inputs={"self": pg.Input((n,), torch.float32, pad=0)},
                      outputs={"y": pg.Output((n,), torch.float32)}, buckets=pg.Buckets([2, 4]))
    r = pg.compile(prog, lambda x: {"y": getattr(x, "self") * 2}, copy_outputs=True)
    assert r(self=torch.ones(3)).y.tolist() == [2.0, 2.0, 2.0]
