"""The pack table (core) and the one-launch pack kernel (Triton, interpreted on the CPU).

The kernel must write, bit for bit, what `padgraph.pack.apply` (its torch reference) writes, for
every layout the Plan emits: leading padded dim ("rows"), a padded dim behind fixed dims or two
padded dims ("grid"), affine dims (bs + 1, bs * k), EDGE with empty levels, every element size.
The reference itself is checked against an independent dim-by-dim clamp (`expected`).
"""
import math

import numpy as np
import pytest
import torch

import padgraph as pg
from padgraph import pack as P
from padgraph.backends.triton import pack as TP

needs_triton = pytest.mark.skipif(not TP.triton_available(), reason="triton not importable")

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 3)

SHAPES = {                                   # name -> (shape, expected layout)
    "leading": ((bs,), "rows"),
    "rows2d": ((bs, 5), "rows"),
    "plus1": ((bs + 1,), "rows"),
    "times3": ((bs * 3, 2), "rows"),
    "trailing": ((4, bs), "grid"),
    "middle": ((3, bs, 2), "grid"),
    "bs_tokens": ((bs, tok), "grid"),
    "bs_3_tok_2": ((bs, 3, tok, 2), "grid"),
    "fixed": ((7,), "rows"),
    "nd": ((2, bs, tok), "nd"),
}
DTYPE_PADS = [(torch.int64, 0), (torch.int32, -3), (torch.int16, 7), (torch.uint8, 200), (torch.bool, True),
              (torch.float32, float("nan")), (torch.bfloat16, -0.0), (torch.float16, 2.5), (torch.float64, 1e300)]


def program(dtype, pad):
    inputs = {n: pg.Input(s, dtype, pad=(pad if any(not isinstance(d, int) for d in s) else None))
              for n, (s, _) in SHAPES.items()}
    inputs["edge_lens"] = pg.Input((bs + 1,), torch.int32, pad=pg.Edge(default=-1))
    inputs["edge_grid"] = pg.Input((bs, tok), torch.int16, pad=pg.Edge(default=9))
    return pg.Program("pack", inputs=inputs, buckets=pg.Buckets([1, 2, 4, 8]))


def raw_inputs(prog, n, t, gen):
    plan = pg.Plan(prog)
    out = {}
    for name, spec in prog.inputs.items():
        shape = plan.raw_shape(name, {"bs": n, "tokens": t})
        vals = torch.randint(-100, 100, shape, generator=gen)
        if spec.dtype == torch.bool:
            vals = vals > 0
        out[name] = vals.to(spec.dtype)
    return out


def expected(raw, shape, mode, fill, dims):
    """Independent of core: clamp each padded dim's index (EDGE) or fill outside the raw box."""
    if not dims:
        return raw.clone()
    if mode == P.EDGE:
        if any(raw.shape[d] == 0 for d in dims):
            return torch.full(shape, fill, dtype=raw.dtype)
        idx = [torch.arange(s).clamp(max=raw.shape[d] - 1) if d in dims else torch.arange(s)
               for d, s in enumerate(shape)]
        return raw[torch.meshgrid(*idx, indexing="ij")]
    out = torch.full(shape, fill, dtype=raw.dtype)
    out[tuple(slice(0, s) for s in raw.shape)] = raw
    return out


def bits(t):
    return t.view(torch.uint8) if t.dtype != torch.bool else t.view(torch.uint8)


def test_layouts_are_the_documented_ones():
    table = pg.Plan(program(torch.int32, 0)).pack_table(4)
    got = {e.name: e.layout for e in table.entries}
    for name, (_, layout) in SHAPES.items():
        assert got[name] == layout, f"{name}: layout={got[name]}, but should be {layout}"
    text = str(table)
    assert "bs_tokens" in text and "grid" in text and "4<-bs" in text


@pytest.mark.parametrize("n,t", [(1, 0), (3, 5), (4, 12), (2, 1)], ids=["t0", "n3t5", "full", "n2t1"])
def test_reference_matches_an_independent_clamp(n, t):
    prog = program(torch.int32, -5)
    gen = torch.Generator().manual_seed(n * 10 + t)
    raw = raw_inputs(prog, n, t, gen)
    table = pg.Plan(prog).pack_table(4)
    ext = {"bs": n, "tokens": t}
    for e in table.entries:
        dst = torch.full(e.shape, 123, dtype=raw[e.name].dtype)
        P.apply(e, dst, raw[e.name], ext)
        want = expected(raw[e.name], e.shape, e.mode, e.fill, e.dims)
        assert torch.equal(dst, want), f"{e.name}: {dst.tolist()}, but should be {want.tolist()} [n={n} t={t}]"


@needs_triton
@pytest.mark.parametrize("dtype,pad", DTYPE_PADS, ids=[str(d).replace("torch.", "") for d, _ in DTYPE_PADS])
def test_kernel_equals_reference_every_layout_one_launch(dtype, pad):
    prog = program(dtype, pad)
    gen = torch.Generator().manual_seed(1)
    table = pg.Plan(prog).pack_table(8)
    for n, t in [(3, 7), (8, 24), (1, 0)]:
        raw = raw_inputs(prog, n, t, gen)
        ext = {"bs": n, "tokens": t}
        want = {e.name: torch.zeros(e.shape, dtype=raw[e.name].dtype) for e in table.entries}
        got = {e.name: torch.full(e.shape, 1, dtype=raw[e.name].dtype) for e in table.entries}  # poisoned
        TP.pack(table, want, raw, ext, impl="reference")
        TP.pack(table, got, raw, ext, impl="triton")
        for e in table.entries:
            assert torch.equal(bits(got[e.name]), bits(want[e.name])), \
                f"{e.name} ({e.layout})={got[e.name].tolist()}, but should be {want[e.name].tolist()} [n={n} t={t}]"


@needs_triton
def test_long_jobs_loop_past_the_grid():
    shape_bs = pg.Axis("bs")
    prog = pg.Program("long", inputs={"h": pg.Input((shape_bs, 1100), torch.float32, pad=0.5),
                                      "m": pg.Input((3, shape_bs), torch.int64, pad=pg.Edge())},
                      buckets=pg.Buckets([4]))
    table = pg.Plan(prog).pack_table(4)
    raw = {"h": torch.randn(3, 1100), "m": torch.arange(9).view(3, 3)}
    want = {e.name: torch.zeros(e.shape, dtype=raw[e.name].dtype) for e in table.entries}
    got = {e.name: torch.zeros(e.shape, dtype=raw[e.name].dtype) for e in table.entries}
    TP.pack(table, want, raw, {"bs": 3}, impl="reference")
    rows = torch.from_numpy(TP.encode(table.entries, table.axes, [got[e.name] for e in table.entries]))
    srcs = torch.tensor([raw["h"].data_ptr(), raw["m"].data_ptr()], dtype=torch.int64)
    TP.launch(rows, srcs, torch.tensor([3], dtype=torch.int32), n_programs=1)   # one program per job
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert got["m"][:, 3].tolist() == [2, 5, 8]


def test_encode_columns_are_the_documented_layout():
    prog = program(torch.int32, -3)
    table = pg.Plan(prog).pack_table(4)
    entries = TP.kernel_entries(table)
    dsts = [torch.zeros(e.shape, dtype=torch.int32) for e in entries]
    rows = TP.encode(entries, table.axes, dsts)
    by = {e.name: rows[i] for i, e in enumerate(entries)}
    r = by["bs_3_tok_2"]
    assert (r[TP.COL["r_total"]], r[TP.COL["r_axis"]], r[TP.COL["r_unit"]]) == (12, 0, 3)
    assert (r[TP.COL["c_total"]], r[TP.COL["c_axis"]], r[TP.COL["c_scale"]], r[TP.COL["c_unit"]]) == (24, 1, 1, 2)
    assert r[TP.COL["fill"]] == 2**32 - 3 and r[TP.COL["elem_bytes"]] == 4 and r[TP.COL["mode"]] == TP.MODE[P.FILL]
    f = by["fixed"]
    assert f[TP.COL["r_axis"]] == -1 and f[TP.COL["c_axis"]] == -1 and f[TP.COL["c_total"]] == 7
    assert "r_total" in TP.describe(rows)
    with pytest.raises(ValueError, match="nd"):
        TP.encode([e for e in table.entries if e.layout == "nd"], table.axes, [torch.zeros(64, dtype=torch.int32)])


@pytest.mark.parametrize("value,dtype,want", [(float("nan"), torch.float32, 0x7FC00000), (-0.0, torch.float32, 1 << 31),
                                              (-1, torch.int64, -1), (200, torch.uint8, 200), (True, torch.bool, 1)])
def test_fill_bits(value, dtype, want):
    got = TP.fill_bits(value, dtype)
    assert got == want or (dtype == torch.float32 and math.isnan(value) and (got & 0x7F800000) == 0x7F800000)


def test_all_pad_writes_pads_and_zeros_fixed_inputs():
    table = pg.Plan(program(torch.int32, -3)).pack_table(2)
    for e in table.entries:
        dst = torch.full(e.shape, 55, dtype=torch.int32)
        P.all_pad(e, dst)
        want = 0 if not e.dims else e.fill
        assert bool((dst == want).all()), f"{e.name}={dst.tolist()}, but should be all {want}"


def test_eager_pack_converts_and_checks_its_sources():
    """`pack(impl="triton")` copies the destination's bytes from the source's address: a source
    of another dtype is converted first (as the reference's copy_), one of the wrong size raises."""
    import padgraph as pg
    from padgraph.backends.triton import pack as TP
    bs_ = pg.Axis("bs")
    prog = pg.Program("p", inputs={"a": pg.Input((bs_, 3), torch.float32, pad=0.0)},
                      buckets=pg.Buckets([4]))
    table = pg.Plan(prog).pack_table(4)
    src = torch.arange(9, dtype=torch.float64).view(3, 3)
    want, got = {"a": torch.zeros(4, 3)}, {"a": torch.zeros(4, 3)}
    TP.pack(table, want, {"a": src}, {"bs": 3}, impl="reference")
    TP.pack(table, got, {"a": src}, {"bs": 3}, impl="triton")
    assert torch.equal(got["a"], want["a"])
    with pytest.raises(ValueError, match="source 'a' has 6 elements, its raw extents"):
        TP.pack(table, got, {"a": src[:2].float()}, {"bs": 3}, impl="triton")
