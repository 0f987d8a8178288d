"""Hypothesis strategies of the generated cases: programs (`recipes`) and call sequences
(`call_lists`), as the plain data `generated.Recipe` / `generated.Call` that `generated.run_case`
runs. Sizes stay bounded (an input holds at most MAX_ELEMENTS at the largest size a call reaches)
so that many programs run at once on one GPU.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from padgraph.spec import oracle as O
from padgraph.spec.generated import (DTYPES, LAYOUTS, RAW_FORMS, REJECTS, STATE_FORMS, Call, Recipe, max_bs)


def pad_values(dtype: torch.dtype) -> list:
    """Pads a `dtype` input may declare (SPEC 2.7), each dtype's limits included."""
    if dtype == torch.bool:
        return [False, True]
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return sorted({0, 1, 7, info.min, info.max, -1 if info.min < 0 else 2})
    info = torch.finfo(dtype)
    cands = [0.0, -0.0, 1.5, -2.25, info.max, -info.max, info.tiny, float("nan"), float("inf"),
             float("-inf"), -3.4028235e38, 3.4028235e38, 65504.0, 65519.0, 448.0, 449.0, 57344.0,
             3.39e38, -3.39e38]
    return [v for v in cands if _holds(v, dtype)]


def _holds(v: float, dtype: torch.dtype) -> bool:
    s = O.stored(v, dtype)
    if math.isfinite(v):
        return math.isfinite(s)
    return (math.isnan(v) and math.isnan(s)) or s == v


@st.composite
def ladders(draw) -> tuple:
    if draw(st.integers(0, 99)) == 99:    # now and then a long ladder (up to 512 buckets)
        n = draw(st.sampled_from([64, 200, 512]))
        return tuple(range(1, n + 1))
    return tuple(sorted(draw(st.lists(st.integers(1, 24), min_size=1, max_size=5, unique=True))))


@st.composite
def padded_dim(draw, axes: list[str]):
    axis = draw(st.sampled_from(axes))
    scale, offset = draw(st.sampled_from([(1, 0), (1, 0), (1, 1), (2, 0), (3, 1), (4, 0)]))
    return (axis, scale, offset)


@st.composite
def input_decl(draw, name: str, axes: list[str]):
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(DTYPES))
    f = st.integers(0, 3).map(lambda n: n if n else draw(st.sampled_from([0, 1])))
    e = padded_dim(axes)
    dims = {
        "1d": lambda: (draw(e),),
        "rows": lambda: (draw(e), *draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))),
        "grid1": lambda: (draw(st.integers(2, 4)), draw(e), *draw(st.lists(f, max_size=1))),
        "grid2": lambda: (draw(e), *draw(st.lists(f, max_size=1)), draw(e), *draw(st.lists(f, max_size=1))),
        "nd": lambda: draw(st.sampled_from([(draw(e), draw(e), draw(e)), (draw(st.integers(2, 3)), draw(e), draw(e))])),
        "fixed": lambda: tuple(draw(st.lists(f, min_size=1, max_size=2))),
        "indptr": lambda: (("bs", 1, 1),),
    }[layout]()
    if layout == "fixed":
        return (name, dims, dtype, None)
    if layout == "indptr":
        return (name, dims, dtype, ("edge", draw(st.sampled_from(pad_values(dtype)))))
    kind = draw(st.sampled_from(["fill", "fill", "edge"]))
    return (name, dims, dtype, (kind, draw(st.sampled_from(pad_values(dtype)))))


MAX_ELEMENTS = 1 << 20     # per input at the largest size a call reaches (memory of many runs at once)


def _numel(dims, axes, size: int) -> int:
    caps = {"bs": size, **{name: scale * size + offset + 1 for name, scale, offset, _ in axes}}
    return math.prod(d if isinstance(d, int) else d[1] * caps[d[0]] + d[2] for d in dims)


def _carried(inputs) -> set:
    return {d[0] for _, dims, _, _ in inputs for d in dims if not isinstance(d, int)}


@st.composite
def recipes(draw) -> Recipe:
    n_dep = draw(st.integers(0, 2))
    axes = tuple((f"t{i}", draw(st.integers(1, 3)), draw(st.integers(0, 2)), draw(st.booleans()))
                 for i in range(1, n_dep + 1))
    names = ["bs"] + [a[0] for a in axes]
    inputs = [draw(input_decl(f"i{j}", names)) for j in range(draw(st.integers(1, 4)))]
    for axis in names:
        if axis not in _carried(inputs):
            dtype = draw(st.sampled_from(DTYPES))
            inputs.append((f"c_{axis}", ((axis, 1, 0),), dtype, ("fill", draw(st.sampled_from(pad_values(dtype))))))
    state = draw(st.sampled_from(["none", "none", "sink", "rows"]))
    sinks = draw(st.sampled_from([(0,), (0,), (0, 1)]))
    if state == "sink":
        inputs.append(("slot", (("bs", 1, 0),), torch.int64, ("fill", sinks[-1])))
    names_in = [n for n, *_ in inputs]
    echo = tuple((n, draw(st.sampled_from(["clone", "clone", "alias"])),
                  draw(st.sampled_from(pad_values(dt))))
                 for n, _, dt, _ in inputs if draw(st.booleans()))
    digest = tuple(n for n, dims, _, _ in inputs if dims and draw(st.booleans()))
    cplx = tuple((n, ct, draw(st.sampled_from([0.0, -2.25, float("nan"), float("inf")])))
                 for n, _, dt, _ in inputs if dt.is_floating_point and draw(st.integers(0, 2)) == 2
                 for ct in [draw(st.sampled_from([torch.complex64, torch.complex128]))])
    dev_axes = [a[0] for a in axes]
    outer = (draw(st.sampled_from(dev_axes)), draw(st.sampled_from([0, -1, 99]))) \
        if dev_axes and draw(st.booleans()) else ()
    state_dtype = draw(st.sampled_from([torch.int64, torch.float32, torch.bfloat16]))
    ladder = draw(ladders())
    if max(_numel(dims, axes, ladder[-1] + 2) for _, dims, _, _ in inputs) > MAX_ELEMENTS:
        ladder = tuple(b for b in ladder if b <= 8) or (1, 2)      # nd inputs grow as bucket^3
    return Recipe(axes=axes, ladder=ladder, inputs=tuple(inputs), echo=echo, cplx=cplx, digest=digest,
                  ext_out=draw(st.booleans()), outer=outer, state=state,
                  state_form=draw(st.sampled_from(STATE_FORMS)), state_dtype=state_dtype, sinks=sinks,
                  grad_state=state == "rows" and state_dtype.is_floating_point and draw(st.booleans()),
                  mutate=tuple(n for n in names_in if draw(st.integers(0, 3)) == 3),
                  hook=draw(st.integers(0, 3)) == 3, copy_outputs=draw(st.booleans()),
                  overflow=draw(st.sampled_from(["eager", "eager", "error"])))


@st.composite
def call_lists(draw, recipe: Recipe) -> list[Call]:
    largest = recipe.ladder[-1]
    calls = []
    for _ in range(draw(st.integers(1, 5))):
        ext = [("bs", draw(st.integers(1, max_bs(recipe))))]
        dev = []
        for name, scale, offset, device_extent in recipe.axes:
            n = draw(st.integers(0, scale * largest + offset + 1))
            ext.append((name, n))
            if device_extent and draw(st.booleans()):
                dev.append((name, draw(st.integers(-1, n + 1))))
        forms = tuple((n, draw(st.sampled_from(RAW_FORMS))) for n, *_ in recipe.inputs)
        rej = draw(st.sampled_from(REJECTS)) if draw(st.integers(0, 6)) == 6 else None
        calls.append(Call(ext=tuple(ext), dev=tuple(dev), forms=forms, seed=draw(st.integers(0, 2**31 - 1)),
                          reject=rej))
    return calls
