"""Shadow verification (pg.Shadow) on the reference backend: silent on correct programs, and it
catches the hazards a reference run can show (a padded lane writing a non-sink row, metadata a
hook built from a raw buffer, raw lanes reading lanes past an extent) at the first sampled call
that exhibits them. The graph-only hazards (a Python scalar baked in at capture, a temporary
freed before the pack reads it) are tested on the GPU in test_cuda_shadow.py."""
import logging

import pytest
import torch

import padgraph as pg

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2, device_extent=True)


def _kv_program():
    return pg.Program("kv", inputs={"slot": pg.Input((bs,), torch.int64, pad=0), "v": pg.Input((bs,), torch.float32, pad=0)},
                      outputs={"o": pg.Output((bs,), torch.float32)}, state={"kv": pg.State(sink=0)},
                      buckets=pg.Buckets([4, 8]))


def _good(x):
    x.kv.index_copy_(0, x.slot, x.v)
    return {"o": x.v * 2}


def test_correct_program_verified_on_every_call_finds_nothing():
    r = pg.compile(_kv_program(), _good, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1))
    for n in (3, 7, 1, 8, 2):
        v = torch.randn(n)
        out = r(slot=torch.arange(n) + 8, v=v)
        torch.testing.assert_close(out.o, v * 2)
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (5, 0)


def test_sampling_first_per_bucket_then_every_nth():
    r = pg.compile(_kv_program(), _good, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=4, first=2))
    for n in (3, 3, 3, 3, 7, 7, 7, 7):
        r(slot=torch.arange(n) + 8, v=torch.randn(n))
    # bucket 4: calls 1, 2 (first) and 4 (every 4th); bucket 8: calls 5, 6 (first) and 8
    assert r.stats.shadow_calls == 6


def test_padded_lane_writing_a_non_sink_row_raises():
    def bad(x):
        x.kv.index_copy_(0, torch.where(x.slot == 0, torch.ones_like(x.slot), x.slot), x.v + 1)
        return {"o": x.v * 2}

    r = pg.compile(_kv_program(), bad, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1000))
    with pytest.raises(pg.ShadowMismatch, match=r"'kv'.*bucket 4.*\{'bs': 3\}.*state 'kv', row 1.*non-sink"):
        r(slot=torch.arange(3) + 8, v=torch.randn(3))


def test_metadata_from_a_raw_buffer_in_the_hook_raises_on_the_first_call_it_matters():
    program = pg.Program("meta", inputs={"v": pg.Input((bs,), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)},
                         state={"kv": pg.State(sink=0), "loc": pg.State()}, buckets=pg.Buckets([4, 8]))
    batch = {}

    def hook(x):                 # SGLang #25529: metadata from the raw out_cache_loc, tail left stale
        n = batch["loc"].shape[0]
        x.loc[:n].copy_(batch["loc"])

    def body(x):
        x.kv.index_copy_(0, x.loc[: x.bucket], x.v)
        return {"o": x.v + 0}

    state = {"kv": torch.zeros(64), "loc": torch.zeros(8, dtype=torch.int64)}
    r = pg.compile(program, body, state=state, prepare=hook, shadow=pg.Shadow(every=1000, first=1))
    batch["loc"] = torch.arange(6) + 10
    r(v=torch.randn(6))                      # bucket 8: every lane real, nothing stale yet
    batch["loc"] = torch.arange(3) + 40
    with pytest.raises(pg.ShadowMismatch, match="row 1[345].*non-sink"):
        r(v=torch.randn(3))                  # bucket 4: lane 3 reads the last call's slot 13


def test_raw_lanes_reading_lanes_past_a_device_extent_raise():
    program = pg.Program("ext", inputs={"c": pg.Input((bs,), torch.int8, pad=0), "t": pg.Input((tok,), torch.float32, pad=0.5)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([2, 4]))
    r = pg.compile(program, lambda x: {"o": x.c.float() + x.t.sum()}, shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match="output 'o'.*exact run"):
        r.call({"c": torch.zeros(2, dtype=torch.int8), "t": torch.ones(3)}, extents={"tok": torch.tensor(1, dtype=torch.int32)})


def test_on_mismatch_log_and_callable(caplog):
    def bad(x):
        x.kv.index_copy_(0, torch.where(x.slot == 0, torch.ones_like(x.slot), x.slot), x.v + 1)
        return {"o": x.v * 2}
    seen = []
    r = pg.compile(_kv_program(), bad, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1, on_mismatch=seen.append))
    out = r(slot=torch.arange(3) + 8, v=torch.ones(3))
    assert out.o.tolist() == [2.0, 2.0, 2.0] and len(seen) == 1 and isinstance(seen[0], pg.ShadowMismatch)
    r = pg.compile(_kv_program(), bad, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1, on_mismatch="log"))
    with caplog.at_level(logging.ERROR, logger="padgraph"):
        r(slot=torch.arange(3) + 8, v=torch.ones(3))
    assert any("non-sink" in m for m in caplog.messages) and r.stats.shadow_mismatches == 1


@pytest.mark.parametrize("kw", [{"every": 0}, {"first": -1}, {"on_mismatch": "warn"}, {"every": True}])
def test_shadow_options_are_checked(kw):
    with pytest.raises(pg.ContractError):
        pg.Shadow(**kw)
