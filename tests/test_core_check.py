"""Unit tests of pg.check: leakage, state writes outside sinks, nondeterminism, and clean bodies;
the exact baseline (no padded lane on any axis), equal-value writes seen through poisoned state,
grouped reports, list-state element labels, and the default sampler's errors and hints."""
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


def _sample_off_sinks(gen):
    """_sample with raw lanes targeting rows 1..14 only (row 15 may be declared a sink)."""
    raw = _sample(gen)
    raw["loc"] = torch.randperm(14, generator=gen)[:raw["a"].shape[0]] + 1
    return raw


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
    ok = pg.check(_program(sink=(0, 15), pad_loc=15), clean,
                  state={"kv": torch.full((16,), -1.0)}, sample=_sample_off_sinks, trials=8)
    assert ok.ok, str(ok)                                        # row 15 declared a sink
    # a raw lane whose target is a sink row has its write replaced by the padded lanes': reported
    bad = pg.check(_program(sink=(0, 15), pad_loc=15), clean, state={"kv": torch.full((16,), -1.0)},
                   sample=_sample, trials=8)
    assert "state-leakage" in {f.kind for f in bad.findings}, str(bad)


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


# ---- the exact baseline, equal-value writes, grouping, list state, the sampler -----------------
tokens = pg.Axis("tokens", capacity=bs * 4)
SLOTS = 64


def _tok_program(pad_loc=0, name="tokloc"):
    """Draft-extend-like: out_cache_loc lives on the tokens axis (capacity 4*bs), sink slot 0."""
    return pg.Program(name, inputs={"a": pg.Input((bs,), torch.float32, pad=0),
                                    "out_cache_loc": pg.Input((tokens,), torch.int64, pad=pad_loc),
                                    "val": pg.Input((tokens,), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)},
                      state={"kv": pg.State(sink=0)}, buckets=[1, 2, 4, 8])


def _tok_sample(gen):
    n = int(torch.randint(1, 9, (), generator=gen))
    n_tok = int(torch.randint(0, 4 * n, (), generator=gen))        # < 4n: padded tokens even at size n
    return {"a": torch.randn(n, generator=gen), "out_cache_loc": torch.randperm(SLOTS - 2, generator=gen)[:n_tok] + 1,
            "val": torch.randn(n_tok, generator=gen)}


def tok_body(x):
    x.kv.index_copy_(0, x.out_cache_loc, x.val)
    return {"y": x.a * 2}


def test_tokens_axis_correct_pad_is_ok():
    res = pg.check(_tok_program(), tok_body, state={"kv": torch.full((SLOTS,), -1.0)}, sample=_tok_sample, trials=8)
    assert res.ok, str(res)


def test_tokens_axis_wrong_pad_is_a_state_write():
    """Padded token lanes write row 63 at every size, the tightest too: only an exact baseline sees it."""
    res = pg.check(_tok_program(pad_loc=SLOTS - 1), tok_body, state={"kv": torch.full((SLOTS,), -1.0)},
                   sample=_tok_sample, trials=8)
    writes = [f for f in res.findings if f.kind == "state-write"]
    assert writes and all(f.buffer == "state 'kv'" and f.rows == (SLOTS - 1,) for f in writes), str(res)


def test_exact_run_sees_raw_tensors():
    seen = []

    def body(x):
        seen.append((x.bucket, x.out_cache_loc.shape[0], int(x.extent("tokens"))))
        return tok_body(x)

    raw = {"a": torch.ones(3), "out_cache_loc": torch.tensor([1, 2, 3, 4, 5]), "val": torch.ones(5)}
    pg.check(_tok_program(), body, state={"kv": torch.zeros(SLOTS)}, sample=lambda g: raw, trials=1)
    assert seen[0] == (3, 5, 5), seen                  # no padded lane on either axis
    padded = [s for s in seen if s != (3, 5, 5) and s != (0, 0, 0)]
    assert padded and all(n == 4 * b and e in (0, 5) for b, n, e in padded), seen
    assert all(b >= 3 for b, _, e in padded if e == 5), seen       # the raw lanes' sizes
    # every bucket once with every lane padded, and once the exact run with no lane at all
    assert {b for b, _, e in padded if e == 0} == {1, 2, 4, 8} and seen.count((0, 0, 0)) == 1, seen


def test_padded_lane_writing_an_equal_value_is_found():
    """kv holds 0 and padded lanes write val's pad 0 to row 15: the row's contents never change."""
    res = pg.check(_program(pad_loc=15), clean, state={"kv": torch.zeros(16)}, sample=_sample, trials=6)
    writes = [f for f in res.findings if f.kind == "state-write"]
    assert writes and all(f.rows == (15,) for f in writes), str(res)


def test_raw_lanes_writing_equal_values_are_no_finding():
    """Raw lanes often write the value already there (0 onto 0): still targets, not findings."""
    def sample(gen):
        raw = _sample(gen)
        return dict(raw, a=torch.randint(0, 2, raw["a"].shape, generator=gen).float())

    res = pg.check(_program(), clean, state={"kv": torch.zeros(16)}, sample=sample, trials=8)
    assert res.ok, str(res)


def test_findings_grouped_with_counts():
    res = pg.check(_program(pad_loc=15), clean, state={"kv": torch.full((16,), -1.0)}, sample=_sample, trials=6)
    n = sum(f.kind == "state-write" for f in res.findings)
    trials = len({f.trial for f in res.findings if f.kind == "state-write"})
    text = str(res)
    assert n > 1 and f"[state-write] state 'kv': {n} findings over {trials} trial" in text, text
    assert text.count("[state-write]") == 1 and "e.g. rows [15]" in text, text
    hidden = len(res.findings) - len(res.groups())
    assert f"{hidden} of {len(res.findings)} findings not shown" in text, text


def test_many_groups_say_how_many_are_hidden():
    from padgraph.check import MAX_GROUPS
    fs = [pg.Finding("pad-leakage", f"output 'o{i}'", "raw lanes differ", {"bs": 1}, 2, trial=0)
          for i in range(MAX_GROUPS + 3) for _ in range(2)]
    text = str(pg.CheckResult("many", 1, fs))
    assert f"{len(fs)} findings in {MAX_GROUPS + 3} groups" in text, text
    assert "3 more groups (6 findings) not shown" in text, text


def test_list_state_findings_name_the_element():
    def body(x):
        for t in x.kv:
            t.index_copy_(0, x.loc, x.a)
        return {"y": x.a * 2, "z": x.ids + 1}

    kv = [torch.full((16,), -1.0) for _ in range(4)]
    res = pg.check(_program(pad_loc=15), body, state={"kv": kv}, sample=_sample, trials=4)
    buffers = {f.buffer for f in res.findings if f.kind == "state-write"}
    assert buffers == {f"state 'kv[{i}]'" for i in range(4)}, str(res)
    assert "state 'kv[3]'" in str(res)
    assert pg.check(_program(sink=(0, 15), pad_loc=15), body, state={"kv": kv},
                    sample=_sample_off_sinks, trials=4).ok


def _gather_program():
    return pg.Program("gather", inputs={"ids": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)}, state={"emb": pg.State()}, buckets=[1, 2, 4])


def gather(x):
    return {"y": x.emb[x.ids * 10]}               # only ids == 0 is a valid row of emb


def test_body_error_under_default_sampler_points_to_sample():
    res = pg.check(_gather_program(), gather, state={"emb": torch.randn(5)}, trials=6)
    errors = [f for f in res.findings if f.kind == "body-error"]
    assert errors and "IndexError" in errors[0].detail and "sample=" in errors[0].detail, str(res)
    assert "sample=" in str(res) and "'ids'" in str(res), str(res)


def test_body_error_under_callers_sampler_propagates():
    bad = lambda gen: {"ids": torch.tensor([1, 2])}    # noqa: E731
    try:
        pg.check(_gather_program(), gather, state={"emb": torch.randn(5)}, sample=bad, trials=2)
    except IndexError as e:
        assert "trial 0" in "".join(getattr(e, "__notes__", ["trial 0"])), e
    else:
        raise AssertionError("an IndexError under the caller's sampler should propagate")


def test_findings_under_default_sampler_with_int_inputs_carry_the_hint():
    res = pg.check(_program(pad_loc=3), clean, state={"kv": torch.zeros(16)}, trials=6)
    assert not res.ok and any("sample=" in n and "'loc'" in n for n in res.notes), str(res)


def test_body_shaped_by_bucket_falls_back_to_the_tightest_size():
    """x.ids.view(x.bucket, 2) holds at every bucket (tok capacity 2*bs) but not on raw tensors."""
    def body(x):
        return {"y": x.a * 2, "z": (x.ids.view(x.bucket, 2) + 1).flatten()}

    res = pg.check(_program(), body, state={"kv": torch.zeros(16)}, sample=_sample, trials=4)
    assert res.ok and any("exact run" in n for n in res.notes), str(res)
