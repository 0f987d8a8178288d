"""Unit tests of Plan: per-bucket shapes, extent inference, O(1) bucket lookup, overflow."""
import random

import pytest
import torch

import padgraph as pg

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 4 + 2)


def _program(buckets=(1, 2, 4, 8)):
    return pg.Program("plan", inputs={"ids": pg.Input((tok,), torch.int64, pad=0), "seq_lens": pg.Input((bs,), torch.int32, pad=1),
                                      "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
                                      "topk": pg.Input((bs * 3, 2), torch.int64, pad=0), "w": pg.Input((5,), torch.float32)},
                      outputs={"y": pg.Output((bs, 7), torch.float32), "z": pg.Output((tok,), torch.int64)},
                      buckets=list(buckets))


def test_shapes():
    plan = pg.Plan(_program())
    assert plan.bucket_axis == "bs" and [a.name for a in plan.axes] == ["bs", "tok"]
    assert plan.capacity("bs", 4) == 4 and plan.capacity("tok", 4) == 18
    assert plan.shape("ids", 4) == (18,) and plan.shape("cu", 4) == (5,) and plan.shape("topk", 2) == (6, 2)
    assert plan.shape("w", 8) == (5,) and plan.shape("y", 2) == (2, 7) and plan.shape("z", 1) == (6,)
    assert plan.largest_shape("topk") == (24, 2)
    assert plan.raw_shape("cu", {"bs": 3, "tok": 0}) == (4,) and plan.raw_shape("z", {"bs": 3, "tok": 0}) == (0,)


def test_extents_are_inferred_device_free():
    plan = pg.Plan(_program())
    meta = lambda *s, dtype: torch.empty(s, dtype=dtype, device="meta")   # no data: only shapes are read
    raw = {"ids": meta(9, dtype=torch.int64), "seq_lens": meta(3, dtype=torch.int32), "cu": meta(4, dtype=torch.int32),
           "topk": meta(9, 2, dtype=torch.int64), "w": meta(5, dtype=torch.float32)}
    assert plan.extents(raw) == {"tok": 9, "bs": 3}
    assert plan.extents(raw, torch.device("meta")) == {"tok": 9, "bs": 3}
    with pytest.raises(pg.ContractValueError, match="device"):
        plan.extents(raw, torch.device("cpu"))


def _brute(program, ext):
    return next((b for b in program.buckets if all(a.cap(b) >= ext[a.name] for a in program.axes)), None)


def test_bucket_lookup_matches_brute_force():
    program = _program(pg.Buckets.default(512))
    plan = pg.Plan(program)
    rng = random.Random(0)
    for _ in range(2000):
        ext = {"bs": rng.randint(1, 530), "tok": rng.randint(0, 4 * 530)}
        assert plan.bucket_for(ext) == _brute(program, ext), ext
    for n in range(1, 514):
        assert plan.bucket_for({"bs": n, "tok": 0}) == _brute(program, {"bs": n, "tok": 0})


def test_bucket_lookup_is_a_table():
    """O(1): one table per axis indexed by the raw extent, sized by the largest capacity."""
    plan = pg.Plan(_program(pg.Buckets.default(256)))
    assert len(plan._tables["bs"]) == 257 and len(plan._tables["tok"]) == 4 * 256 + 2 + 1
    assert plan.bucket_for({"bs": 256, "tok": 1026}) == 256
    assert plan.bucket_for({"bs": 257, "tok": 0}) is None and plan.bucket_for({"bs": 1, "tok": 1027}) is None


def test_fit_and_overflow_error():
    plan = pg.Plan(_program())
    assert plan.fit({"bs": 9, "tok": 0}) == 9
    assert plan.fit({"bs": 1, "tok": 40}) == 10          # 4*10 + 2 >= 40
    assert plan.fit({"bs": 1, "tok": 0}) == 1
    err = plan.overflow_error({"bs": 2, "tok": 40})
    assert isinstance(err, pg.BucketOverflowError)
    for part in ("'plan'", "8", "'tok': 34", "'tok': 40", "['ids']"):
        assert part in str(err), str(err)


def test_zero_extent_of_bucketed_axis():
    plan = pg.Plan(_program())
    raw = {"ids": torch.zeros(0, dtype=torch.int64), "seq_lens": torch.zeros(0, dtype=torch.int32),
           "cu": torch.zeros(1, dtype=torch.int32), "topk": torch.zeros(0, 2, dtype=torch.int64), "w": torch.zeros(5)}
    with pytest.raises(pg.ContractValueError, match=">= 1"):
        plan.extents(raw)
