"""Unit tests of pg.check: leakage, state writes outside sinks, nondeterminism, and clean bodies."""
import torch

import padgraph as pg
from padgraph.check import default_sample

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2)


def _program(name="chk", sink=0, pad_loc=0):
    return pg.Program(name, inputs={"a": pg.Input((bs,), torch.float32, pad=0), "loc": pg.Input((bs,), torch.int64, pad=pad_loc),
                                    "ids": pg.Input((tok,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32), "z": pg.Output((tok,), torch.int64)},
                      state={"kv": pg.State(sink=sink)}, buckets=[1, 2, 4, 8])


def _sample(gen):
    n = int(torch.randint(1, 9, (), generator=gen))
    n_tok = int(torch.randint(0, 2 * n + 1, (), generator=gen))
    return {"a": torch.randn(n, generator=gen), "loc": torch.randperm(15, generator=gen)[:n] + 1,
            "ids": torch.randint(0, 9, (n_tok,), generator=gen)}


def clean(x):
    x.kv.index_copy_(0, x.loc, x.a)
    return {"y": x.a * 2, "z": x.ids + 1}


def test_clean_body_is_ok():
    kv = torch.zeros(16)
    res = pg.check(_program(), clean, state={"kv": kv}, sample=_sample, trials=8)
    assert res.ok and res.trials == 8 and "no findings" in str(res), str(res)
    assert torch.equal(kv, torch.zeros(16)), "pg.check must restore state"


def test_leaky_body():
    def leaky(x):
        out = clean(x)
        out["y"] = out["y"] + x.a.mean()          # every raw lane reads the pads
        return out

    res = pg.check(_program(), leaky, state={"kv": torch.zeros(16)}, sample=_sample, trials=8)
    assert not res.ok and {f.kind for f in res.findings} >= {"pad-leakage"}
    assert all(f.buffer == "output 'y'" for f in res.findings if f.kind == "pad-leakage"), str(res)
    assert "pad-leakage" in str(res)


def test_state_write_outside_sinks():
    """Padded lanes' loc pad is row 15: their writes land on a row no raw lane targets."""
    res = pg.check(_program(pad_loc=15), clean, state={"kv": torch.full((16,), -1.0)}, sample=_sample, trials=8)
    assert "state-write" in {f.kind for f in res.findings}, str(res)
    assert any("[15]" in f.detail for f in res.findings if f.kind == "state-write"), str(res)
    ok = pg.check(_program(sink=(0, 15), pad_loc=15), clean, state={"kv": torch.full((16,), -1.0)}, sample=_sample, trials=8)
    assert ok.ok, str(ok)                                        # row 15 declared a sink


def test_state_leakage():
    def writes_bucket(x):
        x.kv[15].fill_(float(x.bucket))           # state content depends on the bucket
        return clean(x)

    res = pg.check(_program(), writes_bucket, state={"kv": torch.zeros(16)}, sample=_sample, trials=8)
    assert "state-leakage" in {f.kind for f in res.findings}, str(res)


def test_nondeterminism():
    calls = [0]

    def flaky(x):
        calls[0] += 1
        out = clean(x)
        out["z"] = out["z"] + calls[0]
        return out

    res = pg.check(_program(), flaky, state={"kv": torch.zeros(16)}, sample=_sample, trials=3)
    assert "nondeterminism" in {f.kind for f in res.findings}, str(res)


def test_default_sample_and_prepare():
    gen = torch.Generator().manual_seed(0)
    p = pg.Program("s", inputs={"a": pg.Input((bs,), torch.float32, pad=0), "m": pg.Input((bs, tok), torch.bool, pad=False),
                                "i": pg.Input((tok,), torch.int32, pad=0)}, outputs={"y": pg.Output((bs,), torch.float32)},
                   buckets=[2, 4])
    for _ in range(20):
        raw = default_sample(p, gen)
        n, t = raw["a"].shape[0], raw["i"].shape[0]
        assert 1 <= n <= 4 and 0 <= t <= 2 * n and raw["m"].shape == (n, t) and raw["m"].dtype == torch.bool
    seen = []
    res = pg.check(p, lambda x: {"y": x.a * 1}, prepare=lambda x: seen.append(x.bucket), trials=4)
    assert res.ok and seen
