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
from padgraph.spec.generated import (DTYPES, LAYOUTS, RAW_FORMS, REC_DTYPES, REC_SINK, REC_WIDTHS, REC_WRITES,
                                     REJECTS, STATE_FORMS, Call, Recipe, build_program, max_bs, rec_rows)


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


def complex_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    """Complex outputs a `dtype` input may feed: float8 converts to complex64 only, since
    inductor's GPU code generation has no float8 -> float64 conversion (a compiled body would
    fail to build, for a reason that is not padgraph's)."""
    return [torch.complex64] if dtype.itemsize == 1 else [torch.complex64, torch.complex128]


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


def recurrent_inputs(draw, kind: str, dtype: torch.dtype) -> list:
    """Rule 7.9's inputs: the slot (pool only, padded with the sink), the fresh flag (padded True)
    and x, whose pad (any the dtype holds, nan included) only ever reaches a sink row."""
    out = [("r_slot", (("bs", 1, 0),), torch.int64, ("fill", REC_SINK))] if kind == "pool" else []
    out.append(("r_fresh", (("bs", 1, 0),), torch.bool, ("fill", True)))
    pad = (draw(st.sampled_from(["fill", "fill", "edge"])), draw(st.sampled_from(pad_values(dtype))))
    return out + [("r_x", (("bs", 1, 0), REC_WIDTHS[0]), dtype, pad)]


def rec_writes(dtype: torch.dtype) -> tuple:
    """How a pool body may write its rows back in `dtype`: torch's CPU `scatter_` on float16 and
    bfloat16 rewrites the bits of nan in rows it does not write (a released slot's nan), which
    would break 7.9.3 for a reason in the body, not the runner."""
    return tuple(w for w in REC_WRITES if not (w == "scatter" and dtype.itemsize == 2))


@st.composite
def recipes(draw, recurrent: str | None = None, state: str | None = None) -> Recipe:
    """A program and its body; `recurrent` / `state` fix what the draw would choose."""
    n_dep = draw(st.integers(0, 2))
    axes = tuple((f"t{i}", draw(st.integers(1, 3)), draw(st.integers(0, 2)), draw(st.booleans()))
                 for i in range(1, n_dep + 1))
    names = ["bs"] + [a[0] for a in axes]
    inputs = [draw(input_decl(f"i{j}", names)) for j in range(draw(st.integers(1, 4)))]
    for axis in names:
        if axis not in _carried(inputs):
            dtype = draw(st.sampled_from(DTYPES))
            inputs.append((f"c_{axis}", ((axis, 1, 0),), dtype, ("fill", draw(st.sampled_from(pad_values(dtype))))))
    state = state or draw(st.sampled_from(["none", "none", "sink", "rows"]))
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
                 for ct in [draw(st.sampled_from(complex_dtypes(dt)))])
    dev_axes = [a[0] for a in axes]
    outer = (draw(st.sampled_from(dev_axes)), draw(st.sampled_from([0, -1, 99]))) \
        if dev_axes and draw(st.booleans()) else ()
    state_dtype = draw(st.sampled_from([torch.int64, torch.float32, torch.bfloat16]))
    recurrent = recurrent or draw(st.sampled_from(["none", "none", "none", "none", "pool", "pool", "rows"]))
    rec = {}
    if recurrent != "none":
        rec_dtype = draw(st.sampled_from(REC_DTYPES))
        inputs += recurrent_inputs(draw, recurrent, rec_dtype)
        rec = dict(recurrent=recurrent, rec_form=draw(st.sampled_from(STATE_FORMS)), rec_dtype=rec_dtype,
                   rec_write=draw(st.sampled_from(rec_writes(rec_dtype))))
    ladder = draw(ladders())
    if max(_numel(dims, axes, ladder[-1] + 2) for _, dims, _, _ in inputs) > MAX_ELEMENTS:
        ladder = tuple(b for b in ladder if b <= 8) or (1, 2)      # nd inputs grow as bucket^3
    return Recipe(axes=axes, ladder=ladder, inputs=tuple(inputs), echo=echo, cplx=cplx, digest=digest,
                  ext_out=draw(st.booleans()), outer=outer, state=state,
                  state_form=draw(st.sampled_from(STATE_FORMS)), state_dtype=state_dtype, sinks=sinks,
                  grad_state=state == "rows" and state_dtype.is_floating_point and draw(st.booleans()),
                  mutate=tuple(n for n in names_in if draw(st.integers(0, 3)) == 3),
                  hook=draw(st.integers(0, 3)) == 3, copy_outputs=draw(st.booleans()),
                  overflow=draw(st.sampled_from(["eager", "eager", "error"])), **rec)


@st.composite
def call_lists(draw, recipe: Recipe) -> list[Call]:
    largest = recipe.ladder[-1]
    calls = []
    pool = RequestPool(recipe) if recipe.recurrent != "none" else None
    program = build_program(recipe) if pool else None
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
        rec = {}
        if pool is not None:
            size, on_ladder = O.bucket(program, dict(ext))
            runs = rej is None and (on_ladder or recipe.overflow == "eager")
            rec = pool.call(draw, ext[0][1], size if runs else None)
        calls.append(Call(ext=tuple(ext), dev=tuple(dev), forms=forms, seed=draw(st.integers(0, 2**31 - 1)),
                          reject=rej, **rec))
    return calls


class RequestPool:
    """The caller's side of recurrent state across a call sequence (rule 7.9). Pool: admission
    hands out the lowest free slot (a released slot first, so slots are reused), release returns
    a slot and fills its row with nan, and a request's first call is `fresh`. Rows: lane i owns
    row i; a row a padded lane or the caller may have written since its last raw lane is `fresh`
    on its next call (its value is unspecified, 7.7). Never a row whose value the oracle cannot
    know is read into arithmetic."""

    def __init__(self, recipe: Recipe):
        self.kind, self.rows = recipe.recurrent, rec_rows(recipe)
        self.free = [r for r in range(self.rows) if r != REC_SINK]
        self.started: dict[int, bool] = {}      # pool: live slot -> has it had a call that ran
        self.dirty: set[int] = set()            # rows: rows whose value a raw lane did not leave

    def call(self, draw, n: int, size: int | None) -> dict:
        """lanes and poison of a call of n raw lanes; size: the bucket it runs at (None: it does not run)."""
        poison = self._release(draw) if self.kind == "pool" else self._poison(draw)
        if self.kind == "pool":
            self._admit(n + draw(st.integers(0, 2)))
            slots = draw(st.permutations(sorted(self.started)))[:n]
            lanes = tuple((s, not self.started[s]) for s in slots)
        else:
            lanes = tuple((i, i in self.dirty or draw(st.booleans())) for i in range(n))
        if size is not None:
            self._ran(lanes, n, size)
        return {"lanes": lanes, "poison": poison}

    def _release(self, draw) -> tuple:
        if not self.started or draw(st.integers(0, 2)) != 2:
            return ()
        gone = draw(st.permutations(sorted(self.started)))[:draw(st.integers(1, len(self.started)))]
        for s in gone:
            del self.started[s]
        self.free = sorted(gone) + self.free
        return tuple(sorted(gone))

    def _admit(self, want: int) -> None:
        while self.free and len(self.started) < want:
            self.started[self.free.pop(0)] = False

    def _poison(self, draw) -> tuple:
        rows = tuple(sorted(set(draw(st.lists(st.integers(0, self.rows - 1), max_size=2)))))
        self.dirty.update(rows)
        return rows

    def _ran(self, lanes, n: int, size: int) -> None:
        if self.kind == "pool":
            self.started.update((row, True) for row, _ in lanes)
        else:
            self.dirty.difference_update(range(n))
            self.dirty.update(range(n, size))
