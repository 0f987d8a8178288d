"""Rule 7: bound state keeps its storage; state persists; padded lanes write only sinks."""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
SLOTS = 32


def program(pad_loc=0, name="kvwrite"):
    """A decode-like store: row loc[i] of kv takes val[i]; padded lanes' loc is the pad (sink 0)."""
    return pg.Program(
        name,
        inputs={"loc": pg.Input((bs,), torch.int64, pad=pad_loc), "val": pg.Input((bs, 2), torch.float32, pad=0)},
        outputs={"y": pg.Output((bs,), torch.float32)},
        state={"kv": pg.State(sink=0), "calls": pg.State()},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body(x):
    x.kv.index_copy_(0, x.loc, x.val)
    x.calls.add_(1)
    return {"y": x.kv.index_select(0, x.loc).sum(1)}


def _state(device):
    return {"kv": torch.full((SLOTS, 2), -1.0, device=device), "calls": torch.zeros(1, dtype=torch.int64, device=device)}


def _raw(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randperm(SLOTS - 1, generator=g)[:n] + 1            # distinct rows, never the sink
    return {"loc": loc.to(device), "val": torch.randn(n, 2, generator=g).to(device)}


@pytest.mark.parametrize("bind,named", [({}, "kv"), ({"extra": None}, "extra"), ({"kv": [1, 2]}, "kv")],
                         ids=["missing", "unknown", "not-a-tensor"])
def test_r7_1_binding(compile, device, bind, named):
    st = _state(device)
    st = {k: v for k, v in st.items() if k != "kv"} if bind == {} else dict(st, **bind)
    with pytest.raises(pg.ContractError) as e:
        compile(program(), body, state=st)
    for part in ("'kvwrite'", named):
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", named)


MOVES = {
    "set_": lambda t: t.set_(torch.zeros_like(t)),
    "resize_": lambda t: t.resize_(SLOTS * 4, 2).fill_(3.0),
    "data=": lambda t: setattr(t, "data", torch.zeros_like(t)),
    "transpose_": lambda t: t.t_(),
}


@pytest.mark.parametrize("how", list(MOVES))
def test_r7_2_storage_changed_under_bound_state(compile, device, how):
    st = _state(device)
    runner = compile(program(), body, state=st)
    st["calls"].zero_()   # a graph backend's warm-up and capture ran the body: SPEC 7.5
    runner(**_raw(3, device, seed=0))
    MOVES[how](st["kv"])
    moved = st["kv"].clone()
    with pytest.raises(pg.StateStorageError) as e:
        runner(**_raw(3, device, seed=1))
    for part in ("'kvwrite'", "'kv'"):
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", how)
    S.assert_equal("calls after the refused call", int(st["calls"][0]), 1, how)
    S.assert_equal("kv after the refused call", st["kv"], moved, how)
    # re-compiling with the tensor as it now is works
    if how != "transpose_":
        st["kv"] = torch.full((SLOTS, 2), -1.0, device=device)
        runner = compile(program(), body, state=st)
        raw = _raw(4, device, seed=2)
        out = runner(**raw)
        S.assert_close("y after re-compiling", out.y, raw["val"].sum(1), how)


def test_r7_2_list_state_storage_changed(compile, device):
    bs_ = pg.Axis("bs")
    prog = pg.Program("layers", inputs={"a": pg.Input((bs_,), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs_,), torch.float32)}, state={"kvs": pg.State()},
                      buckets=pg.Buckets([2, 4]))
    kvs = [torch.zeros(8, device=device) for _ in range(3)]

    def body2(x):
        for t in x.kvs:
            t[: x.bucket].add_(x.a)
        return {"y": x.kvs[2][: x.bucket] * 1}

    runner = compile(prog, body2, state={"kvs": kvs})
    runner(a=torch.ones(2, device=device))
    kvs[1].set_(torch.zeros(8, device=device))
    with pytest.raises(pg.StateStorageError) as e:
        runner(a=torch.ones(2, device=device))
    assert "'kvs'" in str(e.value), S.msg("message", str(e.value), "naming state 'kvs'", "list state")


def test_r7_2_and_7_3_values_persist_and_in_place_writes_are_seen(compile, device):
    st = _state(device)
    runner = compile(program(), body, state=st)
    st["calls"].zero_()   # a graph backend's warm-up and capture ran the body: SPEC 7.5
    raw = _raw(3, device, seed=0)
    runner(**raw)
    st["kv"][raw["loc"][0]] += 10.0                      # a value write by the caller: allowed, seen
    st["kv"][0] = 0.0
    loc1 = torch.tensor([int(raw["loc"][0])], device=device)
    out = runner(loc=loc1, val=torch.tensor([[1.0, 2.0]], device=device))
    S.assert_equal("calls counted in state", int(st["calls"][0]), 2, "two calls")
    S.assert_close("y", out.y, torch.tensor([3.0]), "the second call's own write")
    S.assert_close("kv rows of the first call", st["kv"][raw["loc"][1:]].cpu(), raw["val"][1:].cpu(), "persisted")


@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9])
def test_r7_4_padded_lanes_write_only_sinks(compile, device, n):
    st = _state(device)
    runner = compile(program(), body, state=st)
    before = st["kv"].clone()
    raw = _raw(n, device, seed=n)
    out = runner(**raw)
    changed = set((st["kv"] != before).any(1).nonzero().flatten().tolist())
    allowed = set(raw["loc"].tolist()) | {0}
    assert changed <= allowed, S.msg("kv rows written", sorted(changed), f"a subset of {sorted(allowed)}", f"bs={n}")
    S.assert_close("raw rows of kv", st["kv"][raw["loc"]].cpu(), raw["val"].cpu(), f"bs={n}")
    S.assert_close("y", out.y, raw["val"].sum(1), f"bs={n}")


def _sample(device):
    def sample(gen):
        n = int(torch.randint(1, S.LADDER[-1] + 1, (), generator=gen))
        return _raw(n, device, seed=int(torch.randint(0, 1 << 30, (), generator=gen)))
    return sample


def test_r7_4_check_reports_writes_outside_sinks(device):
    ok = pg.check(program(), body, state=_state(device), sample=_sample(device), trials=6)
    assert ok.ok, S.msg("pg.check findings (pad = sink row 0)", str(ok), "none", "r7.4")
    bad = pg.check(program(pad_loc=5, name="kvwrite_bad"), body, state=_state(device), sample=_sample(device), trials=6)
    kinds = {f.kind for f in bad.findings}
    assert "state-write" in kinds, S.msg("pg.check finding kinds (pad = row 5, no sink)", sorted(kinds), "with 'state-write'", "r7.4")
