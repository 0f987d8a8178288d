"""Generated conformance cases: programs, raw inputs and call sequences drawn by hypothesis,
every backend judged against the oracle (`oracle.py`).

A case is plain data, so a failure prints as a runnable reproduction:

    Recipe    the declaration (axes, ladder, inputs in every layout the Terms know, every dtype,
              pads at each dtype's limits, outputs, state as tensors and pytrees, options) and
              what the body does (echo, alias, digest, extents, an outer product over two axes,
              sink or batch-ordered state writes, scribbling over its inputs, a prepare hook);
    Call      one call: extents per axis, device extents, the memory layout of each raw input
              (offset, transposed, strided, expanded, aliased, on the host), a seed for values,
              and whether it is a call SPEC rejects.

`run_case(recipe, calls, backend=..., device=..., **options)` compiles the recipe, runs the calls
and asserts after each: outputs bit for bit as the oracle says, outputs never require grad, bound
state as the oracle left its copy (sink rows aside), rejected calls raise padgraph's own error and
change nothing, outputs of `copy_outputs=True` calls stay as they were.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from hypothesis import strategies as st

import padgraph as pg

from padgraph.spec import oracle as O

DTYPES = (torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16,
          torch.float32, torch.float64)
LAYOUTS = ("1d", "rows", "grid1", "grid2", "nd", "fixed", "indptr")
RAW_FORMS = ("contig", "offset", "transposed", "strided", "expand", "host", "alias")
STATE_FORMS = ("tensor", "dict", "list", "nested", "dataclass", "keyed", "unkeyed", "custom")
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


@dataclass(frozen=True)
class Call:
    ext: tuple                      # (axis, raw extent) for every axis
    dev: tuple = ()                 # (axis, device extent value) for device axes passed this call
    forms: tuple = ()               # (input, raw form)
    seed: int = 0
    reject: str | None = None


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


def build_program(recipe: Recipe) -> pg.Program:
    axes = _axis_objects(recipe)
    inputs = {n: pg.Input(tuple(_dim(axes, d) for d in dims), dt, pad=None if pad is None else _pad(pad))
              for n, dims, dt, pad in recipe.inputs}
    shapes = {n: spec.shape for n, spec in inputs.items()}
    dtypes = {n: spec.dtype for n, spec in inputs.items()}
    outputs = {f"e_{n}": pg.Output(shapes[n], dtypes[n], pad=pad) for n, _, pad in recipe.echo}
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
                               **_custom(recipe))
    elif recipe.state == "rows":
        state["kv"] = pg.State(rows=axes["bs"], **_custom(recipe))
        outputs["s_out"] = pg.Output((axes["bs"],), recipe.state_dtype)
    if recipe.hook:
        state["h"] = pg.State()
    return pg.Program("gen", inputs=inputs, outputs=outputs, state=state, buckets=pg.Buckets(list(recipe.ladder)))


def _custom(recipe: Recipe) -> dict:
    return {"flatten": _own_flatten, "unflatten": _own_unflatten} if recipe.state_form == "custom" else {}


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
    if recipe.hook:
        out["h"] = torch.full((4,), -5, dtype=torch.int64, device=device)
    return out


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
        for n in recipe.digest:
            outs[f"d_{n}"] = digest(x[n])
        if recipe.ext_out:
            outs["ext"] = torch.stack([x.extent(a) for a in axis_names])
        if recipe.outer:
            outs["outer"] = _outer(x, *caps[recipe.outer[0]], recipe.outer[0])
        if recipe.state != "none":
            outs.update(_write_state(recipe, x))
        for n in recipe.mutate:
            _scribble(x[n])
        return outs

    return body


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
        form = forms.get(name, "contig")
        if name == "slot" and form in ("alias", "expand"):
            form = "offset"          # slots stay distinct rows: another input's bits are no slots
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


# ---- one case, judged by the oracle -------------------------------------------------------------
COUNTS = {"programs": 0, "calls": 0, "rejected": 0}


def run_case(recipe: Recipe, calls, *, backend: str = "reference", device="cpu", counts: dict | None = None,
             **options) -> None:
    """Compile `recipe` on `backend`, run `calls`, assert every rule the oracle models.
    counts: a dict whose programs / calls / rejected entries this case adds to."""
    counts = {"programs": 0, "calls": 0, "rejected": 0} if counts is None else counts
    device = torch.device(device)
    if options.get("pack") == "in-graph" and recipe.hook:
        recipe = dataclasses.replace(recipe, hook=False)     # a hook needs the packed view before the replay
    program = build_program(recipe)
    body, hook = make_body(recipe), make_hook(recipe)
    state = make_state(recipe, device)
    mirror = clone_state(state)
    runner = pg.compile(program, body, backend=backend, state=state, prepare=hook, device=device,
                        copy_outputs=recipe.copy_outputs, overflow=recipe.overflow, **options)
    counts["programs"] += 1
    same_state(recipe, state, mirror, "after compile (rule 10: compile leaves state as it found it)")
    kept = []
    for i, call in enumerate(calls):
        case = f"call {i} of {len(calls)}: {call}"
        raw = make_raw(recipe, call, device, host_ok=runner.allow_host_inputs)
        if call.reject is not None:
            _rejected(runner, reject(raw, call.reject, recipe), case)
            same_state(recipe, state, mirror, f"{case} (rule 2.5: a rejected call changes nothing)")
            counts["rejected"] += 1
            continue
        expected = _expect(recipe, program, raw, call, mirror, body, hook, device)
        dev = {a: torch.tensor(v, dtype=torch.int32, device=device) for a, v in call.dev}
        if expected is None:        # past the ladder with overflow="error"
            _rejected(runner, raw, case, pg.BucketOverflowError, extents=dev or None)
            continue
        out = runner.call(raw, extents=dev or None)
        scribble_after(raw, dev)    # the caller reuses its tensors at once (stream-ordered)
        same_outputs(out, expected, case)
        same_state(recipe, state, mirror, case)
        counts["calls"] += 1
        if recipe.copy_outputs:
            kept.append((case, out, expected))
            for old_case, old, old_expected in kept:
                same_outputs(old, old_expected, f"{old_case}, read after {case} (rule 6: copy_outputs=True)")


def _expect(recipe, program, raw, call, mirror, body, hook, device):
    """The oracle's outputs for a call (mirror state written as the body writes it), or None when
    SPEC rejects the call as past the ladder."""
    ext = O.extents(program, raw)
    eff = O.effective(program, ext, dict(call.dev))
    size, on_ladder = O.bucket(program, ext)
    if not on_ladder and recipe.overflow == "error":
        return None
    snapshot = {n: t.detach().clone() for n, t in raw.items()}
    x = O.view(program, size, snapshot, eff, state_at(recipe, mirror, size), device)
    with torch.no_grad():
        if hook is not None:
            hook(x)
        return O.finish(program, body(x), ext, eff)


def state_at(recipe: Recipe, state: dict, size: int) -> dict:
    """Rule 7c: batch-ordered state as the body sees it, every leaf cut to rows [0, size)."""
    if recipe.state != "rows":
        return state
    out = dict(state)
    a, b = leaves(state["kv"])[:2] if recipe.state_form != "tensor" else (state["kv"], None)
    out["kv"] = wrap_state(recipe.state_form, a[:size], None if b is None else b[:size])
    return out


def _rejected(runner, raw, case, cls=pg.ContractError, extents=None) -> None:
    try:
        runner.call(raw, extents=extents)
    except cls:
        return
    except Exception as e:  # noqa: BLE001 - the point: any other error is a finding
        raise AssertionError(f"error={type(e).__name__}: {e}, but should be {cls.__name__} [{case}]") from e
    raise AssertionError(f"call returned, but should raise {cls.__name__} [{case}]")


def scribble_after(raw: dict, dev: dict) -> None:
    """Change every writable raw tensor and device extent in place right after the call."""
    seen = set()
    for t in list(raw.values()) + list(dev.values()):
        if id(t) in seen or 0 in t.stride() or t.numel() == 0:
            continue
        seen.add(id(t))
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            _int_view(t).bitwise_xor_(0x55)


def same_outputs(out, expected: dict, case: str) -> None:
    assert set(out) == set(expected), f"outputs={sorted(out)}, but should be {sorted(expected)} [{case}]"
    for name, want in expected.items():
        got = out[name]
        assert not got.requires_grad, f"{name}.requires_grad=True, but should be False (rule 10.5) [{case}]"
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), (
            f"{name}={tuple(got.shape)} {got.dtype}, but should be {tuple(want.shape)} {want.dtype} [{case}]")
        g, w = O.bits(got), O.bits(want)
        if not torch.equal(g, w):
            lane = (g != w).nonzero()[0].tolist()
            raise AssertionError(f"{name}[{lane}]={got.cpu()[tuple(lane[:got.dim()])]!r}, but should be "
                                 f"{want[tuple(lane[:want.dim()])]!r} (bits differ at lane {lane}) [{case}]")


def same_state(recipe: Recipe, state: dict, mirror: dict, case: str) -> None:
    for name in state:
        for i, (got, want) in enumerate(zip(leaves(state[name]), leaves(mirror[name]))):
            g, w = O.bits(got), O.bits(want)
            if name == "kv" and recipe.state == "sink":
                keep = torch.ones(g.shape[0], dtype=torch.bool)
                keep[list(recipe.sinks)] = False
                g, w = g[keep], w[keep]
            if not torch.equal(g, w):
                row = (g != w).nonzero()[0].tolist()
                raise AssertionError(f"state {name} leaf {i} (non-sink) differs at {row}: "
                                     f"got {g[row[0]].tolist()}, but should be {w[row[0]].tolist()} [{case}]")


def repro(recipe: Recipe, calls, backend: str, device, options: dict) -> str:
    """A runnable reproduction of a case (printed by the suite with a shrunk failure)."""
    text = (f"import torch\nfrom padgraph.spec.generated import Recipe, Call, run_case\n"
            f"run_case({recipe!r},\n         {list(calls)!r},\n         backend={backend!r}, "
            f"device={str(device)!r}{''.join(f', {k}={v!r}' for k, v in options.items())})")
    for word in ("nan", "inf"):
        text = text.replace(f" {word}", f" float('{word}')").replace(f"-{word}", f"-float('{word}')")
    return text


# ---- strategies ---------------------------------------------------------------------------------
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
    dev_axes = [a[0] for a in axes]
    outer = (draw(st.sampled_from(dev_axes)), draw(st.sampled_from([0, -1, 99]))) \
        if dev_axes and draw(st.booleans()) else ()
    state_dtype = draw(st.sampled_from([torch.int64, torch.float32, torch.bfloat16]))
    ladder = draw(ladders())
    if max(_numel(dims, axes, ladder[-1] + 2) for _, dims, _, _ in inputs) > MAX_ELEMENTS:
        ladder = tuple(b for b in ladder if b <= 8) or (1, 2)      # nd inputs grow as bucket^3
    return Recipe(axes=axes, ladder=ladder, inputs=tuple(inputs), echo=echo, digest=digest,
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
