"""Generated conformance cases: programs, raw inputs and call sequences drawn by hypothesis,
every backend judged against the oracle (`oracle.py`).

A case is plain data (drawn by `strategies.py`), so a failure prints as a runnable reproduction:

    Recipe    the declaration (axes, ladder, inputs in every layout the Terms know, every dtype,
              pads at each dtype's limits, outputs, state as tensors and pytrees, options) and
              what the body does (echo, alias, digest, extents, an outer product over two axes,
              sink or batch-ordered state writes, recurrent state read-modify-written per lane
              (rule 7.9), scribbling over its inputs, a prepare hook);
    Call      one call: extents per axis, device extents, the memory layout of each raw input
              (offset, transposed, strided, expanded, aliased, on the host), a seed for values,
              whether it is a call SPEC rejects, and for recurrent state each raw lane's slot and
              `fresh` flag and the slots the caller released (and filled with nan) before it.

`cases.run_case(recipe, calls, backend=..., device=...)` judges one against the oracle.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

import padgraph as pg

from padgraph.spec import oracle as O

DTYPES = (torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16,
          torch.float32, torch.float64)
LAYOUTS = ("1d", "rows", "grid1", "grid2", "nd", "fixed", "indptr")
RAW_FORMS = ("contig", "offset", "transposed", "strided", "expand", "host", "alias")
STATE_FORMS = ("tensor", "dict", "list", "nested", "dataclass", "keyed", "unkeyed", "custom")
REC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REC_WRITES = ("index_copy", "scatter", "index_put")
REC_WIDTHS = (3, 2)             # columns of the recurrent state's two leaves (a conv window, an SSM state)
REC_DECAY = (0.5, 0.25)         # h <- decay * h + x per leaf: a power of two, so exact in every dtype
REC_SINK = 0
REJECTS = ("dtype", "missing", "unknown", "rank", "disagree")


# ---- state containers of every kind a user binds ------------------------------------------------
@dataclass
class DataCache:
    k: torch.Tensor
    v: torch.Tensor


class KeyedCache:
    """A class registered with torch's pytree, key functions included."""

    def __init__(self, k, v):
        self.k, self.v = k, v


class PlainCache(KeyedCache):
    """A class registered with torch's pytree without `flatten_with_keys_fn`."""


class OwnCache(KeyedCache):
    """A class padgraph learns through pg.State(flatten=, unflatten=)."""


def _kv(c):
    return [c.k, c.v], None


pytree.register_pytree_node(KeyedCache, _kv, lambda kids, _: KeyedCache(*kids),
                            flatten_with_keys_fn=lambda c: ([(pytree.GetAttrKey("k"), c.k),
                                                              (pytree.GetAttrKey("v"), c.v)], None))
pytree.register_pytree_node(PlainCache, _kv, lambda kids, _: PlainCache(*kids))


def _own_flatten(c):
    return [c.k, c.v], None


def _own_unflatten(kids, _):
    return OwnCache(*kids)


def wrap_state(form: str, a: torch.Tensor, b: torch.Tensor):
    """Two leaves in the structure `form` names (`tensor`: only the first)."""
    return {"tensor": lambda: a, "dict": lambda: {"k": a, "v": b}, "list": lambda: [a, b],
            "nested": lambda: {"layers": [(a,), {"v": b}]}, "dataclass": lambda: DataCache(a, b),
            "keyed": lambda: KeyedCache(a, b), "unkeyed": lambda: PlainCache(a, b),
            "custom": lambda: OwnCache(a, b)}[form]()


def leaves(value) -> list[torch.Tensor]:
    if isinstance(value, OwnCache):
        return [value.k, value.v]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [value.k, value.v]
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


# ---- the case as data ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """A program and what its body does; every field is a plain value (the repr is runnable)."""

    axes: tuple = ()                # dependent axes: (name, scale, offset, device_extent)
    ladder: tuple = (1, 2, 4)
    inputs: tuple = ()              # (name, dims, dtype, pad); dim: int or (axis, scale, offset); pad: ("fill"|"edge", v)
    echo: tuple = ()                # (input, "clone"|"alias", output pad)
    cplx: tuple = ()                # (float input, complex dtype, output pad): complex(v, -v), zeros +0.0
    digest: tuple = ()              # inputs whose rows are summed as int64 bit patterns
    ext_out: bool = False
    outer: tuple = ()               # (axis, pad): int64 (bs, axis) output
    state: str = "none"             # "none" | "sink" | "rows"
    state_form: str = "tensor"
    state_dtype: torch.dtype = torch.int64
    sinks: tuple = (0,)
    grad_state: bool = False        # rows state leaves as Parameters (requires_grad)
    mutate: tuple = ()              # inputs the body scribbles over after reading
    hook: bool = False
    copy_outputs: bool = False
    overflow: str = "eager"
    recurrent: str = "none"         # "none" | "pool" (sink 0, slot input r_slot) | "rows": state `rec`
    rec_form: str = "tensor"
    rec_dtype: torch.dtype = torch.float32
    rec_write: str = "index_copy"   # how a pool body writes rows back: index_copy_ | scatter_ | index_put_


@dataclass(frozen=True)
class Call:
    ext: tuple                      # (axis, raw extent) for every axis
    dev: tuple = ()                 # (axis, device extent value) for device axes passed this call
    forms: tuple = ()               # (input, raw form)
    seed: int = 0
    reject: str | None = None
    lanes: tuple = ()               # recurrent state: (row, fresh) per raw lane (pool: the slot)
    poison: tuple = ()              # recurrent rows the caller fills with nan before the call (released slots)


def _axis_objects(recipe: Recipe) -> dict[str, pg.Axis]:
    bs = pg.Axis("bs")
    axes = {"bs": bs}
    for name, scale, offset, dev in recipe.axes:
        axes[name] = pg.Axis(name, capacity=bs * scale + offset, device_extent=dev)
    return axes


def _dim(axes, d):
    if isinstance(d, int):
        return d
    name, scale, offset = d
    a = axes[name]
    return a if (scale, offset) == (1, 0) else a * scale + offset


def _pad(p):
    kind, v = p
    return pg.Edge(v) if kind == "edge" else pg.Fill(v)


def state_rows(recipe: Recipe) -> int:
    """Rows of every state leaf: the sinks, then a row per lane any call can reach."""
    return len(recipe.sinks) + 2 * max_bs(recipe) + 4


def max_bs(recipe: Recipe) -> int:
    return recipe.ladder[-1] + 2


def rec_rows(recipe: Recipe) -> int:
    """Rows of the recurrent state: the sink and a slot per lane of the largest call, plus free
    slots for admission to choose from (pool); every row an eager size past the ladder reaches (rows)."""
    return max_bs(recipe) + 4


def build_program(recipe: Recipe) -> pg.Program:
    axes = _axis_objects(recipe)
    inputs = {n: pg.Input(tuple(_dim(axes, d) for d in dims), dt, pad=None if pad is None else _pad(pad))
              for n, dims, dt, pad in recipe.inputs}
    shapes = {n: spec.shape for n, spec in inputs.items()}
    dtypes = {n: spec.dtype for n, spec in inputs.items()}
    outputs = {f"e_{n}": pg.Output(shapes[n], dtypes[n], pad=pad) for n, _, pad in recipe.echo}
    for n, dtype, pad in recipe.cplx:
        outputs[f"z_{n}"] = pg.Output(shapes[n], dtype, pad=pad)
    for n in recipe.digest:
        outputs[f"d_{n}"] = pg.Output(shapes[n][:1], torch.int64)
    if recipe.ext_out:
        outputs["ext"] = pg.Output((len(axes),), torch.int32)
    if recipe.outer:
        axis, pad = recipe.outer
        outputs["outer"] = pg.Output((axes["bs"], axes[axis]), torch.int64, pad=pad)
    state = {}
    if recipe.state == "sink":
        state["kv"] = pg.State(sink=recipe.sinks if len(recipe.sinks) > 1 else recipe.sinks[0],
                               **_custom(recipe.state_form))
    elif recipe.state == "rows":
        state["kv"] = pg.State(rows=axes["bs"], **_custom(recipe.state_form))
        outputs["s_out"] = pg.Output((axes["bs"],), recipe.state_dtype)
    if recipe.recurrent != "none":
        rows = {"rows": axes["bs"]} if recipe.recurrent == "rows" else {"sink": REC_SINK}
        state["rec"] = pg.State(**rows, **_custom(recipe.rec_form))
        outputs["r_out"] = pg.Output((axes["bs"], REC_WIDTHS[0]), recipe.rec_dtype)
    if recipe.hook:
        state["h"] = pg.State()
    return pg.Program("gen", inputs=inputs, outputs=outputs, state=state, buckets=pg.Buckets(list(recipe.ladder)))


def _custom(form: str) -> dict:
    return {"flatten": _own_flatten, "unflatten": _own_unflatten} if form == "custom" else {}


def make_state(recipe: Recipe, device) -> dict:
    """Fresh bound state (deterministic values, never zeros)."""
    out = {}
    if recipe.state != "none":
        rows, w = state_rows(recipe), 3
        base = torch.arange(rows * w, dtype=torch.float64).view(rows, w) * 0.5 - 7
        a = base.to(recipe.state_dtype).to(device)
        b = (base * 3).to(recipe.state_dtype).to(device)
        if recipe.grad_state and recipe.state_dtype.is_floating_point:
            a, b = torch.nn.Parameter(a), torch.nn.Parameter(b)
        out["kv"] = wrap_state(recipe.state_form, a, b)
    if recipe.recurrent != "none":
        out["rec"] = wrap_state(recipe.rec_form, *_rec_initial(recipe, device))
    if recipe.hook:
        out["h"] = torch.full((4,), -5, dtype=torch.int64, device=device)
    return out


def _rec_initial(recipe: Recipe, device) -> list[torch.Tensor]:
    """[rows, width] per leaf: small dyadic values, so the recurrence on them stays exact."""
    rows = rec_rows(recipe)
    return [(torch.arange(rows * w, dtype=torch.float64).view(rows, w) * 0.25 - 3 + k).to(recipe.rec_dtype).to(device)
            for k, w in enumerate(REC_WIDTHS)]


def clone_state(state: dict) -> dict:
    """A deep copy of bound state (the oracle's own)."""
    def dup(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, OwnCache):
            return OwnCache(dup(v.k), dup(v.v))
        if isinstance(v, (DataCache, KeyedCache)):
            return type(v)(dup(v.k), dup(v.v))
        if isinstance(v, dict):
            return {k: dup(c) for k, c in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(dup(c) for c in v)
        return copy.deepcopy(v)
    return {n: dup(v) for n, v in state.items()}


# ---- the body -----------------------------------------------------------------------------------
def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(O._INT_OF_SIZE[t.element_size()])


def digest(t: torch.Tensor) -> torch.Tensor:
    """[dim 0] int64: each row's element bit patterns summed (pads included)."""
    v = (t if t.dtype == torch.bool else _int_view(t)).to(torch.int64)
    return v.flatten(1).sum(1) if v.dim() > 1 else v


def make_body(recipe: Recipe):
    axis_names = ["bs"] + [a[0] for a in recipe.axes]
    caps = {name: (scale, offset) for name, scale, offset, _ in recipe.axes}

    def body(x):
        outs = {}
        for n, mode, _ in recipe.echo:
            outs[f"e_{n}"] = x[n] if mode == "alias" else x[n].clone()
        for n, dtype, _ in recipe.cplx:
            outs[f"z_{n}"] = complex_of(x[n], dtype)
        for n in recipe.digest:
            outs[f"d_{n}"] = digest(x[n])
        if recipe.ext_out:
            outs["ext"] = torch.stack([x.extent(a) for a in axis_names])
        if recipe.outer:
            outs["outer"] = _outer(x, *caps[recipe.outer[0]], recipe.outer[0])
        if recipe.state != "none":
            outs.update(_write_state(recipe, x))
        if recipe.recurrent != "none":
            outs["r_out"] = _recur(recipe, x)
        for n in recipe.mutate:
            _scribble(x[n])
        return outs

    return body


def complex_of(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """complex(v, -v) as `dtype`, every zero part +0.0: `v + 0.0` and `0.0 - v` are +0.0 for
    either zero in IEEE arithmetic, where `-v` keeps a sign that a compiler may compute as
    `0 - v` instead (eager and inductor then differ only in the sign of a zero). NaN stays NaN;
    its payload may still differ, which the judge allows for these outputs."""
    real = torch.float64 if dtype == torch.complex128 else torch.float32
    v = v.to(real)
    return torch.complex(v + 0.0, 0.0 - v)


def _outer(x, scale: int, offset: int, axis: str):
    """[bs, axis] int64 from the bucket and the axis's extent (tests masking along two axes)."""
    dev = x.extent("bs").device
    rows = torch.arange(x.bucket, device=dev, dtype=torch.int64)[:, None] * 1000
    cols = torch.arange(scale * x.bucket + offset, device=dev, dtype=torch.int64)[None, :]
    return rows + cols + x.extent(axis).to(torch.int64) * 7


def _scribble(t: torch.Tensor) -> None:
    """Overwrite every lane in place (bools flipped, anything else bit-inverted)."""
    if t.dtype == torch.bool:
        t.logical_not_()
    else:
        _int_view(t).bitwise_not_()


def _write_state(recipe: Recipe, x) -> dict:
    kv = leaves(x.kv)
    if recipe.state == "sink":
        slot = x.slot
        vals = (slot * 3 + x.extent("bs")).to(recipe.state_dtype)[:, None]
        for leaf in kv:
            leaf.index_put_((slot,), vals.expand(-1, leaf.shape[1]))
        return {}
    lanes = torch.arange(kv[0].shape[0], device=kv[0].device, dtype=torch.int64) * 5 + x.extent("bs")
    vals = lanes.to(recipe.state_dtype)[:, None]
    for leaf in kv:
        leaf.copy_(vals.expand_as(leaf))
    return {"s_out": kv[0][:, 0].clone()}


def rec_step(h: torch.Tensor, x: torch.Tensor, fresh: torch.Tensor, decay: float) -> torch.Tensor:
    """[lanes, w]: one recurrent update. A fresh lane starts from zeros by selection, never by
    arithmetic on its row (a released slot may hold nan, and nan * 0 is nan)."""
    return decay * torch.where(fresh[:, None], torch.zeros_like(h), h) + x[:, :h.shape[1]]


def _recur(recipe: Recipe, x) -> torch.Tensor:
    """Read-modify-write of every leaf of `rec` per lane (pool: at the lane's slot; rows: lane i's
    row i); returns the first leaf's new rows, [bucket, width]."""
    new_rows = []
    for leaf, decay in zip(leaves(x.rec), REC_DECAY):
        if recipe.recurrent == "rows":
            new = rec_step(leaf, x.r_x, x.r_fresh, decay)        # leaf: rows [0, bucket)
            leaf.copy_(new)
        else:
            new = rec_step(leaf.index_select(0, x.r_slot), x.r_x, x.r_fresh, decay)
            _write_rows(recipe.rec_write, leaf, x.r_slot, new)
        new_rows.append(new)
    return new_rows[0]


def _write_rows(how: str, leaf: torch.Tensor, slot: torch.Tensor, new: torch.Tensor) -> None:
    if how == "scatter":
        leaf.scatter_(0, slot[:, None].expand_as(new), new)
    elif how == "index_put":
        leaf.index_put_((slot,), new)
    else:
        leaf.index_copy_(0, slot, new)


def make_hook(recipe: Recipe):
    if not recipe.hook:
        return None
    first = recipe.inputs[0][0]

    def prepare(x):
        x.h.fill_(x.bucket)
        x.h[1].copy_(x.extent("bs"))
        x.h[2].copy_(digest(x[first].reshape(1, -1)).sum())
    return prepare


# ---- raw inputs ---------------------------------------------------------------------------------
def raw_shape(recipe: Recipe, dims, ext: dict) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else d[1] * ext[d[0]] + d[2] for d in dims)


def raw_values(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns (NaN payloads, -0.0, infinities, subnormals), bools as 0/1."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def slots(recipe: Recipe, n: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct non-sink rows for the raw lanes of a sink-state program."""
    first = len(recipe.sinks)
    return (torch.randperm(state_rows(recipe) - first, generator=gen)[:n] + first).to(torch.int64)


REC_INPUTS = ("r_slot", "r_fresh", "r_x")


def _rec_raw(name: str, call: Call, shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A recurrent input's raw values: the call's slots and fresh flags, and x as multiples of
    1/8 in [-8, 8] (the recurrence never overflows nor leaves the normal range)."""
    if name == "r_slot":
        return torch.tensor([row for row, _ in call.lanes], dtype=torch.int64)
    if name == "r_fresh":
        return torch.tensor([fresh for _, fresh in call.lanes], dtype=torch.bool)
    return (torch.randint(-64, 65, shape, generator=gen, dtype=torch.int64).to(torch.float64) / 8).to(dtype)


def in_form(v: torch.Tensor, form: str, device) -> torch.Tensor:
    """The same values in another memory layout (or on the host)."""
    if form == "host":
        return v.clone()
    v = v.to(device)
    if form == "offset":
        base = torch.empty(v.numel() + 3, dtype=v.dtype, device=device)
        base[3:].copy_(v.reshape(-1))
        return base[3:].view(v.shape)
    if form == "transposed" and v.dim() >= 2:
        return v.transpose(0, -1).contiguous().transpose(0, -1)
    if form == "strided" and v.dim() >= 1:
        base = torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype, device=device)
        base[..., ::2] = v
        return base[..., ::2]
    if form == "expand" and v.dim() >= 1 and v.shape[0] >= 1:
        return v[:1].expand(v.shape)
    return v


def make_raw(recipe: Recipe, call: Call, device, host_ok: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(call.seed)
    ext, forms = dict(call.ext), dict(call.forms)
    raw = {}
    for name, dims, dtype, _ in recipe.inputs:
        shape = raw_shape(recipe, dims, ext)
        v = slots(recipe, shape[0], gen) if name == "slot" else raw_values(shape, dtype, gen)
        if name in REC_INPUTS:
            v = _rec_raw(name, call, shape, dtype, gen)
        form = forms.get(name, "contig")
        if name in ("slot", "r_slot", "r_fresh") and form in ("alias", "expand"):
            form = "offset"          # slots stay distinct rows and flags the call's: another input's bits are neither
        if name == "r_x" and form == "alias":
            form = "offset"          # another input's bits may be nan: the recurrence stays exact
        if form == "host" and not host_ok:
            form = "contig"
        if form == "alias":
            twin = next((t for n, t in raw.items() if t.dtype == dtype and t.shape == shape), None)
            if twin is not None:
                raw[name] = twin
                continue
        raw[name] = in_form(v, form, device)
    return raw


def reject(raw: dict, kind: str, recipe: Recipe) -> dict:
    """A call SPEC rejects (rules 2.1-2.3), built from a valid one."""
    bad = dict(raw)
    name, dims, dtype, _ = recipe.inputs[-1]
    t = raw[name]
    if kind == "missing":
        del bad[name]
    elif kind == "unknown":
        bad["not_declared"] = t
    elif kind == "rank":
        bad[name] = t.reshape(*t.shape, 1)
    elif kind == "disagree" and _carriers(recipe, "bs") >= 2 and any(not isinstance(d, int) and d[0] == "bs" for d in dims):
        d = next(i for i, d in enumerate(dims) if not isinstance(d, int) and d[0] == "bs")
        shape = list(t.shape)
        shape[d] += dims[d][1]          # one more lane of bs than the other inputs say
        bad[name] = torch.zeros(shape, dtype=t.dtype, device=t.device)
    else:
        other = torch.float32 if dtype != torch.float32 else torch.int32
        bad[name] = torch.zeros(t.shape, dtype=other, device=t.device)
    return bad


def _carriers(recipe: Recipe, axis: str) -> int:
    return sum(any(not isinstance(d, int) and d[0] == axis for d in dims) for _, dims, _, _ in recipe.inputs)
