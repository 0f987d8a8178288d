"""Rule 11: device-resident extents (`runner.call(raw, extents={axis: n})`).

An axis declared `device_extent=True` may take its raw extent from a 0-d int32 device tensor
(a previous program's valid length) instead of the host shapes, which then only bound it: the
bucket follows the bound; lanes past the extent (clamped into [0, bound]) hold pads; x.extent
returns it; output lanes past it hold the output's pad; a call is the same as a host call with
the inputs cut to it. The cuda backend makes no host sync for it.
"""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 3, device_extent=True)
OUT_PAD = -9


def program():
    return pg.Program(
        "devext",
        inputs={"ids": pg.Input((tok,), torch.int64, pad=0), "loc": pg.Input((tok,), torch.int64, pad=0),
                "h": pg.Input((tok, 2), torch.float32, pad=0.5), "lens": pg.Input((bs,), torch.int32, pad=1)},
        outputs={"y": pg.Output((tok,), torch.int64, pad=OUT_PAD), "n": pg.Output((bs,), torch.int64),
                 "g": pg.Output((tok, 2), torch.float32, pad=0.0)},
        state={"seen": pg.State(), "ext": pg.State(), "kv": pg.State(sink=0)},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body(x):
    S.write_probe(x.seen, x.ids)
    x.ext.copy_(x.extent("tokens").reshape(1).long())
    x.kv.index_put_((x.loc,), x.ids.to(x.kv.dtype))          # padded lanes: loc pad 0 = the sink
    return {"y": x.ids * 10 + 1, "n": x.lens.long() + x.extent("tokens").long(), "g": x.h * 2}


def _state(device):
    cap = 3 * S.LADDER[-1]
    return {"seen": S.probe((cap,), torch.int64, device), "ext": torch.zeros(1, dtype=torch.int64, device=device),
            "kv": torch.zeros(64, dtype=torch.int64, device=device)}


def _raw(n, m, device, seed):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(1, 50, (m,), generator=g).to(device),
            "loc": (torch.randperm(63, generator=g)[:m] + 1).to(device),
            "h": torch.randn(m, 2, generator=g).to(device),
            "lens": torch.randint(1, 9, (n,), generator=g).int().to(device)}


CASES = [("e<m", 3, 7, 4), ("e=0", 2, 5, 0), ("e=m", 4, 9, 9), ("e>m-clamped", 2, 4, 11), ("e<0-clamped", 1, 3, -2)]


@pytest.mark.parametrize("case,n,m,e", CASES, ids=[c[0] for c in CASES])
def test_r11_1_device_extent_pads_outputs_and_state(compile, device, case, n, m, e):
    st = _state(device)
    runner = compile(program(), body, state=st)
    raw = _raw(n, m, device, n * 7 + m)
    out = runner.call(raw, extents={"tokens": torch.tensor(e, dtype=torch.int32, device=device)})
    eff = min(max(e, 0), m)
    b = S.fit(program(), {"bs": n, "tokens": m})
    ids = raw["ids"].cpu()
    want_seen = torch.zeros(3 * b, dtype=torch.int64)
    want_seen[:eff] = ids[:eff]
    S.assert_equal("ids as the body saw them", S.read_probe(st["seen"], (3 * b,)), want_seen, case)
    S.assert_equal("x.extent('tokens')", int(st["ext"].item()), eff, case)
    want_y = torch.full((m,), OUT_PAD, dtype=torch.int64)
    want_y[:eff] = ids[:eff] * 10 + 1
    S.assert_equal("y (lanes past the device extent hold the output pad)", out.y.cpu(), want_y, case)
    S.assert_equal("n", out.n.cpu(), raw["lens"].cpu().long() + eff, case)
    want_g = torch.zeros(m, 2)
    want_g[:eff] = raw["h"].cpu()[:eff] * 2
    S.assert_close("g", out.g.cpu(), want_g, case)
    kv = st["kv"].cpu()
    want_kv = torch.zeros(64, dtype=torch.int64)
    want_kv[raw["loc"].cpu()[:eff]] = ids[:eff]
    S.assert_equal("kv rows past the sink", kv[1:], want_kv[1:], f"{case}: lanes past the device extent write the sink only")


def test_r11_2_equals_a_host_call_with_inputs_cut(compile, reference, device):
    runner = compile(program(), body, state=_state(device))
    ref = reference(program(), body, state=_state(device))
    for i, (n, m, e) in enumerate([(3, 8, 5), (8, 24, 17), (1, 3, 1), (5, 10, 0)]):
        raw = _raw(n, m, device, 100 + i)
        got = runner.call(raw, extents={"tokens": torch.tensor(e, dtype=torch.int32, device=device)})
        cut = {k: (v[:e] if k != "lens" else v) for k, v in raw.items()}
        want = ref(**cut)
        S.assert_equal("y[:e]", got.y[:e].cpu(), want.y.cpu(), f"n={n} m={m} e={e}")
        S.assert_equal("n", got.n.cpu(), want.n.cpu(), f"n={n} m={m} e={e}")


def test_r11_3_device_extents_are_validated(compile, device):
    runner = compile(program(), body, state=_state(device))
    raw = _raw(2, 4, device, 1)
    bad = [{"bs": torch.tensor(1, dtype=torch.int32, device=device)},                  # not a device axis
           {"tokens": torch.tensor([1], dtype=torch.int32, device=device)},            # not 0-d
           {"tokens": torch.tensor(1, dtype=torch.int64, device=device)},              # not int32
           {"tokens": 3}]
    for ext in bad:
        with pytest.raises(pg.ContractError, match="'devext'"):
            runner.call(raw, extents=ext)
    S.assert_equal("stats.calls after rejected calls", dict(runner.stats.calls), {}, "rejected")


def test_r11_4_device_extent_needs_a_dependent_axis():
    with pytest.raises(pg.ContractValueError, match="device_extent"):
        pg.Axis("bs2", device_extent=True)


@pytest.mark.needs_cuda
def test_r11_5_no_host_sync_for_a_device_extent(compile, device):
    runner = compile(program(), body, state=_state(device))
    raws = [_raw(n, m, device, n + m) for n, m in [(2, 6), (5, 12), (8, 24)]]
    lens = [torch.tensor(m // 2, dtype=torch.int32, device=device) for _, m in [(2, 6), (5, 12), (8, 24)]]
    for raw, e in zip(raws, lens):
        runner.call(raw, extents={"tokens": e})
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for raw, e in zip(raws, lens):
            runner.call(raw, extents={"tokens": e})
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()


def _grid_program():
    t = pg.Axis("tokens", capacity=bs * 3, device_extent=True)
    return pg.Program("devgrid", inputs={"ids": pg.Input((t,), torch.int64, pad=0), "lens": pg.Input((bs,), torch.int32, pad=1),
                                         "g": pg.Input((2, t), torch.int32, pad=7)},
                      outputs={"y": pg.Output((t,), torch.int64, pad=-1), "n": pg.Output((bs,), torch.int64)},
                      buckets=pg.Buckets([1, 2, 4]))


def _grid_body(x):
    return {"y": x.ids * 2 + x.g.sum(0), "n": x.lens.long() + x.extent("tokens")}


@pytest.mark.parametrize("copy", [False, True], ids=["views", "copies"])
def test_r11_6_on_and_past_the_ladder_with_a_trailing_padded_dim(compile, device, copy):
    runner = compile(_grid_program(), _grid_body, copy_outputs=copy)
    for n, m, e in [(2, 5, 3), (6, 15, 9), (6, 15, 40), (1, 2, 0), (4, 12, 12)]:   # bs 6: past the ladder
        raw = {"ids": torch.arange(m, device=device) + 1, "lens": torch.ones(n, dtype=torch.int32, device=device),
               "g": torch.ones(2, m, dtype=torch.int32, device=device)}
        out = runner.call(raw, extents={"tokens": torch.tensor(e, dtype=torch.int32, device=device)})
        eff = min(max(e, 0), m)
        want = torch.full((m,), -1, dtype=torch.int64)
        want[:eff] = (torch.arange(eff) + 1) * 2 + 2
        case = f"n={n} m={m} e={e} copy={copy}"
        S.assert_equal("y", out.y.cpu(), want, case)
        S.assert_equal("n", out.n.cpu(), torch.full((n,), 1 + eff, dtype=torch.int64), case)
