"""Unit tests of the declaration: axes, affine dims, pads, Program validation and printing."""
import dataclasses

import pytest
import torch

import padgraph as pg
from padgraph.axes import Affine, as_affine
from padgraph.pads import as_pad

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 4)


def test_affine_expressions():
    assert (bs + 1).at(3) == 4 and (bs * 4).at(3) == 12 and (2 * bs + 1).at(3) == 7 and (1 + bs).at(0) == 1
    assert ((bs + 1) * 2).at(3) == 8
    assert (bs * 4).solve(12) == 3 and (bs * 4).solve(13) is None and (bs + 1).solve(0) is None
    assert (bs + 1).solve(1) == 0
    assert repr(bs * 4 + 1) == "bs*4+1" and repr(bs + 1) == "bs+1"
    with pytest.raises(TypeError):
        bs * 1.5
    with pytest.raises(TypeError):
        bs + True
    with pytest.raises(ValueError):
        Affine(bs, scale=0)


def test_axes():
    assert bs.bucketed and not tok.bucketed
    assert bs.cap(8) == 8 and tok.cap(8) == 32
    assert pg.Axis("t2", capacity=bs).cap(5) == 5            # an Axis as capacity means 1*bs
    assert as_affine(4) is None and as_affine(bs) == Affine(bs)
    with pytest.raises(ValueError):
        pg.Axis("not an identifier")
    with pytest.raises(TypeError):
        pg.Axis("t", capacity=4)
    with pytest.raises(ValueError, match="'t2'.*'tok'"):
        pg.Axis("t2", capacity=tok * 2)                        # capacity must be in the bucketed axis


def test_pads():
    assert as_pad(1) == pg.Fill(1) and as_pad(0.5) == pg.Fill(0.5) and as_pad(True) == pg.Fill(True)
    assert as_pad(None) is None and as_pad(pg.Edge()) == pg.Edge()
    assert repr(pg.Fill(float("nan"))) == "Fill(nan)"
    # a policy is plain data: a bad one is kept as given, for pg.Program to reject naming the input
    assert as_pad("zero") == "zero" and pg.Fill("x").value == "x" and pg.Edge(None).default is None
    with pytest.raises(pg.ContractTypeError, match="'bad'.*'a'.*'zero'"):
        pg.Program("bad", inputs={"a": pg.Input((bs,), torch.int64, pad="zero")})
    with pytest.raises(pg.ContractTypeError, match="'bad'.*'a'.*'x'"):
        pg.Program("bad", inputs={"a": pg.Input((bs,), torch.int64, pad=pg.Fill("x"))})


def _prog(**kw):
    base = dict(inputs={"ids": pg.Input((tok,), torch.int64, pad=0), "seq_lens": pg.Input((bs,), torch.int32, pad=1),
                        "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()), "w": pg.Input((3, 4), torch.float32)},
                outputs={"logits": pg.Output((bs, 10), torch.float32)}, state={"kv": pg.State(sink=0)},
                buckets=[1, 2, 4])
    base.update(kw)
    return pg.Program("prog", **base)


def test_program_is_frozen_data():
    p = _prog()
    assert [a.name for a in p.axes] == ["bs", "tok"] and p.bucket_axis is bs
    assert isinstance(p.buckets, pg.Buckets) and list(p.buckets) == [1, 2, 4]
    assert p.inputs["seq_lens"].pad == pg.Fill(1) and not p.inputs["w"].padded
    with pytest.raises(TypeError):
        p.inputs["x"] = p.inputs["w"]                          # read-only mapping
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "other"
    assert p.axis("tok") is tok
    with pytest.raises(pg.ContractValueError, match="'nope'"):
        p.axis("nope")
    assert p.state["kv"].sink_rows == (0,) and pg.State(sink=(0, 1)).sink_rows == (0, 1) and pg.State().sink_rows == ()
    assert list(pg.Program("d", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}).buckets) == list(pg.Buckets.default())


def test_program_prints():
    text = str(_prog())
    for part in ("'prog'", "ids", "(tok(cap=bs*4))", "bs+1", "Edge", "Fill(1)", "logits", "sink=0", "[1, 2, 4]"):
        assert part in text, f"{part!r} missing from:\n{text}"


@pytest.mark.parametrize("kw,err,part", [
    (dict(inputs={"a": pg.Input((tok,), torch.int64, pad=0)}), pg.ContractValueError, "without capacity"),   # tok alone: no root
    (dict(inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((pg.Axis("bs"),), torch.int64, pad=0)}),
     pg.ContractValueError, r"\['bs', 'bs'\]"),
    (dict(inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((pg.Axis("t", capacity=bs),), torch.int64, pad=0),
                  "c": pg.Input((pg.Axis("t", capacity=bs * 2),), torch.int64, pad=0)}), pg.ContractValueError, "share a name"),
    (dict(inputs={"a": pg.Input((pg.Axis("r"),), torch.int64, pad=0), "b": pg.Input((bs,), torch.int64, pad=0)}),
     pg.ContractValueError, "exactly one bucketed axis"),
    (dict(inputs={"a": pg.Input((bs,), torch.int64, pad=0), "t": pg.Input((pg.Axis("t", capacity=bs + -1),), torch.int64, pad=0)}),
     pg.ContractValueError, "capacity must be >= 1"),
    (dict(inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, outputs={"y": pg.Input((bs,), torch.int64, pad=0)}),
     pg.ContractTypeError, "pg.Output"),
    (dict(inputs={"_a": pg.Input((bs,), torch.int64, pad=0)}), pg.ContractValueError, "'_a'"),
    (dict(inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, buckets=[4, 2]), ValueError, "sorted"),
])
def test_program_validation(kw, err, part):
    with pytest.raises(err, match=part):
        pg.Program("bad", **kw)
