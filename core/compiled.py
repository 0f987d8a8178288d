"""One `torch.compile` of a body for the whole ladder (`pg.compile(..., torch_compile=...)`).

The body is traced once with every padded dim dynamic, so one compilation serves every bucket:
the wrapper hands dynamo the view's tensors (inputs, state, extents) rather than the view, marks
each padded dim with `maybe_mark_dynamic`, and rebuilds the view inside the traced function,
where `x.bucket` is the symbolic size of the bucketed axis. Torch specialises sizes 0 and 1, so
bucket 1 compiles one more graph (counted in `stats.recompiles`, never an error).
`torch_compile={"size_oblivious": True}` traces with torch's size-oblivious shapes instead
(`backed_size_oblivious`: a dynamic size is reasoned about without assuming it is not 1), so
bucket 1 replays the same graph and the ladder compiles once. It is opt-in: inductor cannot lower
some bodies under it (a slice of a dynamic dim whose bound it can then not decide fails the
compile), and a body must not branch on a padded size being 1. Inductor runs with its own CUDA
graphs off: a graph backend captures inductor's kernels into its own graphs. Every graph inductor
compiles is counted (`stats.compiles`); those after the first call are `stats.recompiles`.

Regional compilation (`torch_compile={"regions": model.layers, ...}`): instead of the whole body,
the forwards of the given modules are compiled, one `torch.compile` per module class, so the 16
identical layers of a model compile one graph that every layer reuses (parameters are graph
inputs, not constants). The rest of the body runs eagerly, which a graph backend captures like
the compiled kernels, so at replay it costs only its kernels. A region's tensor arguments whose
leading dim has one of the call's padded sizes are marked dynamic along it, and so is dim 0 of
batch-ordered state; other changing dims go through dynamo's automatic dynamic shapes (one more
compile the first time they change). Compile time drops by about the number of repeated layers.
Instances that differ in an int attribute dynamo specialises on each compile their own graph
(the graphs are identical, so all but the first hit inductor's FX graph cache): a client whose
layers index shared state by such an int (HF's `layer_idx` into its Cache) hands each layer its
own slice of the state instead.

Graph passes (`torch_compile={"passes": [p, ...]}`): each FX graph dynamo traces (the whole body's
or a region's) goes through `p(gm, example_inputs)` in order before inductor compiles it, e.g.
`padgraph.backends.triton.grouped_linear.group_linears`. A pass must keep what the graph computes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
import types
from typing import Callable, Iterable, Mapping

import torch

from .errors import ContractAttributeError, ContractKeyError, ContractValueError, mismatch
from .program import Program, padded_dims
from .view import PaddedView, read_only

_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune")


# torch_compile keys whose value must be a bool (None: torch's default), checked before dynamo sees them
_FLAGS = ("fullgraph", "dynamic", "size_oblivious")


def _options(program: Program, spec) -> dict:
    opts = {} if spec is True else dict(spec)
    for key in _FLAGS:
        v = opts.get(key)
        if v is not None and not isinstance(v, bool):
            raise ContractValueError(mismatch(program.name, None, f"torch_compile {key!r}", "True, False or None",
                                              f"{v!r} ({type(v).__name__})"))
    if not isinstance(opts.get("options") or {}, dict):
        raise ContractValueError(mismatch(program.name, None, "torch_compile 'options'",
                                          "a dict of inductor config patches", repr(opts["options"])))
    mode = opts.pop("mode", None) or "default"
    if mode not in _MODES:
        why = " (padgraph captures the CUDA graphs itself; inductor's own would nest inside them)" \
            if mode == "reduce-overhead" else ""
        raise ContractValueError(mismatch(program.name, None, "torch_compile mode", f"one of {list(_MODES)}{why}",
                                          repr(mode)))
    patches = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
    patches.update(opts.pop("options", None) or {})
    patches["triton.cudagraphs"] = False
    out = {"fullgraph": opts.pop("fullgraph", False), "dynamic": opts.pop("dynamic", None),
           "size_oblivious": bool(opts.pop("size_oblivious", False)),
           "patches": patches, "regions": _regions(program, opts.pop("regions", None)),
           "passes": _passes(program, opts.pop("passes", ()))}
    passed = set(inspect.signature(torch.compile).parameters) - {"model", "backend", "mode", "options"}
    unknown = sorted(k for k in opts if k not in passed)
    if unknown:
        raise ContractValueError(mismatch(program.name, None, "torch_compile options",
                                          f"among {sorted(passed | {'mode', 'options', 'passes', 'regions', 'size_oblivious'})}",
                                          f"unknown {unknown}"))
    return {**out, **opts}


def _passes(program: Program, passes) -> tuple:
    """Graph passes run on each FX graph dynamo traces, in order, before inductor compiles it:
    `p(gm, example_inputs)` rewrites `gm` in place (e.g. backends.triton.grouped_linear's
    `group_linears`)."""
    if not (callable(passes) or passes is None or isinstance(passes, Iterable)):
        raise ContractValueError(mismatch(program.name, None, "torch_compile passes",
                                          "a callable p(gm, example_inputs) or a list of them", repr(passes)))
    passes = (passes,) if callable(passes) else tuple(passes or ())
    bad = [p for p in passes if not callable(p)]
    if bad:
        raise ContractValueError(mismatch(program.name, None, "torch_compile passes",
                                          "callables p(gm, example_inputs)", repr(bad)))
    return passes


def _regions(program: Program, regions) -> list | None:
    """The modules to compile regionally: a module, a ModuleList or an iterable of modules."""
    if regions is None:
        return None
    mods = list(regions) if isinstance(regions, Iterable) else [regions]
    bad = [type(m).__name__ for m in mods if not isinstance(m, torch.nn.Module)]
    if not mods or bad:
        raise ContractValueError(mismatch(program.name, None, "torch_compile regions",
                                          "a non-empty nn.Module, ModuleList or iterable of modules",
                                          f"{type(regions).__name__}" + (f" holding {bad}" if bad else " (empty)")))
    mods = list({id(m): m for m in mods}.values())      # a module listed twice (tied layers): once
    ids = {id(m) for m in mods}
    nested = [f"{type(m).__name__} inside {type(outer).__name__}" for outer in mods
              for m in outer.modules() if m is not outer and id(m) in ids]
    if nested:
        raise ContractValueError(mismatch(program.name, None, "torch_compile regions",
                                          "modules none of which holds another (compile the outer one)",
                                          "; ".join(nested)))
    return mods


def _bucket_of(program: Program) -> Callable[[Mapping], object]:
    """The bucketed axis's size from an input that carries it (symbolic under tracing)."""
    root = program.bucket_axis
    for name, spec in program.inputs.items():
        for d, af in padded_dims(spec.shape):
            if af.axis is root:
                return lambda inputs, n=name, d=d, af=af: (inputs[n].shape[d] - af.offset) // af.scale
    raise ContractValueError(mismatch(program.name, None, "torch_compile", "an input along the bucketed axis", "none"))


class TracedView(PaddedView):
    """The padded view as dynamo traces it: buffers are plain attributes (`__getattr__` only
    answers names that are not buffers, with PaddedView's errors). A PaddedView to the body
    (`isinstance(x, pg.PaddedView)` holds, compiled or not)."""

    def __init__(self, program: str, bucket, buffers: Mapping, extents: Mapping):
        for name, value in buffers.items():     # setattr, not __dict__.update: dynamo traces it
            setattr(self, name, value)
        self.program, self.bucket, self._extents = program, bucket, extents
        self._names = tuple(buffers)            # set last: the view is read-only from here on

    def __setattr__(self, name: str, value) -> None:   # as PaddedView's (rule 2.7)
        if "_names" in self.__dict__:
            raise ContractAttributeError(read_only(self.program, name))
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise ContractAttributeError(read_only(self.program, name))

    def __getattr__(self, name: str):          # only for names that are not buffers (rule 2.7)
        if name.startswith("__") and name.endswith("__"):   # dunders: plain protocol probes
            raise AttributeError(name)
        if name in ("_names", "_extents"):                   # read before __init__ set them
            raise AttributeError(name)
        if torch.compiler.is_compiling():
            # dynamo traces only a builtin AttributeError out of __getattr__: with it, hasattr and
            # getattr(x, name, default) compile (else the body silently ran eagerly). Uncaught, it
            # reaches the caller as ContractAttributeError (the body re-run eagerly raises that);
            # caught inside the body, it is this AttributeError (SPEC 10.8)
            raise AttributeError(self._no_buffer(name))
        raise ContractAttributeError(self._no_buffer(name))

    def __getitem__(self, name: str):
        if name not in self._names:
            raise ContractKeyError(self._no_buffer(name))
        return getattr(self, name)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def _no_buffer(self, name) -> str:
        return (f"program {self.program!r}: the padded view's buffer must be one of "
                f"{sorted(self._names)}, got {name!r}")

    def extent(self, axis: str):
        if axis not in self._extents:
            raise ContractKeyError(f"program {self.program!r}: x.extent(axis) must name one of the "
                                   f"axes {sorted(self._extents)}, got {axis!r}")
        return self._extents[axis]


class CompiledBody:
    """Callable like the body (takes the padded view); counts inductor's compilations."""

    def __init__(self, program: Program, body: Callable, spec, stats, state=None):
        import torch._dynamo  # noqa: F401  (local: plain runners never import dynamo)
        opts = _options(program, spec)
        patches = opts.pop("patches")
        self.program, self.stats, self.state = program, stats, state
        self._dims = {n: [d for d, _ in padded_dims(s.shape)] for n, s in program.inputs.items()}
        self._inputs = tuple(program.inputs)
        bucket_of = _bucket_of(program)
        name = program.name

        regions, passes = opts.pop("regions"), opts.pop("passes")
        self._shapes = _shape_patch(opts.pop("size_oblivious"))

        def traced(inputs, state, extents):
            return body(TracedView(name, bucket_of(inputs), {**inputs, **state}, extents))
        # a code object of this runner's own: dynamo keys its cache and recompile limit by code
        # object, and every CompiledBody's `traced` would otherwise share one (a process with a
        # few whole-compiled runners, two graphs each, hit the limit of 8 and failed or fell back)
        traced = _with_code_name(traced, "padgraph_" + name)

        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx
            stats.compiles += 1
            if self._called:
                stats.recompiles += 1
            for p in passes:
                p(gm, example_inputs)
            return compile_fx(gm, example_inputs, config_patches=patches)

        self._called = False
        self._body = body
        self._fullgraph = bool(opts.get("fullgraph"))
        if regions is None:
            self._fn, self._regions = torch.compile(traced, backend=backend, **opts), None
        else:   # one compile per forward function: instances of one class share its graphs
            by_fn: dict = {}
            for m in regions:
                f = type(m).forward
                if f not in by_fn:
                    by_fn[f] = torch.compile(_own_code(f), backend=backend, **opts)
            self._regions = [(m, by_fn[type(m).forward]) for m in regions]
        # Dynamo's limit of 8 graphs per code object would silently run the rest of a ladder
        # eagerly (fullgraph: fail) once a body specialises more: per bucket (a Python loop over
        # x.bucket) or, in regions, per instance (HF's layer_idx; identical graphs hit inductor's
        # FX graph cache). Every bucket, and every region instance, may compile a few graphs;
        # each one is counted in stats.compiles.
        key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") \
            else "cache_size_limit"
        self._limit = {key: max(getattr(torch._dynamo.config, key), 64, 2 * len(program.buckets) + 8,
                                8 * len(regions or ()))}

    def _mark_dynamic(self, x: PaddedView) -> None:
        """Every padded dim of the view's inputs, and dim 0 of batch-ordered state (it follows
        the bucket), marked dynamic before dynamo sees them (regions: through closures too)."""
        for n, dims in self._dims.items():
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(x[n], d)
        if self.state is not None:
            for t in self.state.row_leaves(x.bucket):
                torch._dynamo.maybe_mark_dynamic(t, 0)

    def __call__(self, x: PaddedView):
        t0, compiled = time.perf_counter(), self.stats.compiles
        try:
            return self._call(x)
        finally:    # a call that compiled: its wall time is compile time (its own run is small)
            if self.stats.compiles != compiled:
                self.stats.compile_seconds += time.perf_counter() - t0

    def _call(self, x: PaddedView):
        self._mark_dynamic(x)
        if self._regions is not None:
            return self._call_regions(x)
        inputs = {n: x[n] for n in self._inputs}
        state = {n: x[n] for n in self.program.state}
        extents = {a.name: x.extent(a.name) for a in self.program.axes}
        try:
            with torch._dynamo.config.patch(**self._limit), self._shapes():
                out = self._fn(inputs, state, extents)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError) as e:
            return _traced_failure(e, self._fullgraph, lambda: self._body(x))
        self._called = True
        return out

    def _call_regions(self, x):
        """The body eagerly, each region module's forward swapped for its compiled one."""
        sizes = {x[n].shape[d] for n, dims in self._dims.items() for d in dims}
        saved = [(m, m.__dict__.get("forward")) for m, _ in self._regions]
        for m, fn in self._regions:
            m.forward = _RegionCall(fn, m, sizes, self._fullgraph)
        try:
            with torch._dynamo.config.patch(**self._limit), self._shapes():
                out = self._body(x)
        finally:
            for m, old in saved:
                if old is None:
                    del m.forward
                else:
                    m.forward = old
        self._called = True
        return out


def _shape_patch(size_oblivious: bool) -> Callable:
    """A context factory: torch's size-oblivious shape reasoning while dynamo traces the body."""
    import torch.fx.experimental._config as fx_config
    if not size_oblivious or not hasattr(fx_config, "backed_size_oblivious"):
        return contextlib.nullcontext
    return functools.partial(fx_config.patch, backed_size_oblivious=True)


def _own_code(f: Callable) -> Callable:
    """A function that calls `f`, with a code object of its own.

    Dynamo keys its compiled graphs and its automatic-dynamic memory by code object. A decorated
    forward shares one with every function that decorator wraps (transformers' `deprecate_kwarg`
    wraps HF's decoder layers and attention in one `wrapped_func`; its RoPE forwards share one
    `wrapper`). Compiled directly, such a region would share guards, the recompile limit and
    the size history with unrelated functions. The entry is traced first, and `f` is inlined.
    """
    def entry(self, *args, **kwargs):
        return f(self, *args, **kwargs)

    return functools.wraps(f)(_with_code_name(entry, "region_" + getattr(f, "__qualname__", "forward")))


def _with_code_name(fn: Callable, name: str) -> Callable:
    """`fn` (closure cells included) on a new code object of its own, named after `name`."""
    name = "".join(c if c.isalnum() else "_" for c in name)
    code = fn.__code__.replace(co_name=name, co_qualname=name) \
        if hasattr(fn.__code__, "co_qualname") else fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class _RegionCall:
    """A region module's compiled forward for one call: marks the padded leading dims first."""

    def __init__(self, fn, module, sizes, fullgraph=False):
        self.fn, self.module, self.sizes, self.fullgraph = fn, module, sizes, fullgraph

    def __call__(self, *args, **kwargs):
        for t in _tensors_in((args, kwargs)):
            if t.dim() and t.shape[0] in self.sizes:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            return self.fn(self.module, *args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.TorchRuntimeError) as e:
            return _traced_failure(e, self.fullgraph,
                                   lambda: type(self.module).forward(self.module, *args, **kwargs))


def _tensors_in(tree) -> list[torch.Tensor]:
    """The tensors of a region call's arguments: pytree leaves, and the tensor attributes of a
    dataclass leaf (a per-call metadata object such as an attention batch, which dynamo traces
    into like any argument)."""
    out = []
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += [v for v in vars(leaf).values() if isinstance(v, torch.Tensor)]
    return out


def _traced_failure(e: Exception, fullgraph: bool, eager: Callable):
    """What a trace that stopped on the code's own failure gives the caller (SPEC 10.8).

    - Unsupported from an observed exception (fullgraph: dynamo saw the code raise; nothing ran
      yet): the code run eagerly raises the very exception, or, where it catches it itself
      (hasattr), runs as it would eagerly. Any other Unsupported is fullgraph's own error.
    - TorchRuntimeError (an op failed on fake tensors, e.g. a shape mismatch; no op of that
      graph ran): under fullgraph nothing ran at all, so the eager run raises the op's error after
      the code's own state writes, as without compile (5.2, 10.6); otherwise an earlier graph
      may have run (re-running would write state twice), so the op's error is raised unwrapped.
    """
    if isinstance(e, torch._dynamo.exc.Unsupported):
        if not _observed(e):
            raise e
        return eager()
    if fullgraph:
        return eager()
    raise _unwrapped(e) from None


def _unwrapped(e: Exception) -> Exception:
    """The op's own exception inside dynamo's TorchRuntimeError (type and message as eagerly),
    with a note that it was found while tracing; e itself when it carries none."""
    inner, seen, c = None, set(), e
    while c is not None and id(c) not in seen:        # dynamo chains it as cause or context
        seen.add(id(c))
        if not isinstance(c, torch._dynamo.exc.TorchDynamoException):
            inner = c
        c = c.__cause__ or c.__context__
    if not isinstance(inner, Exception):
        return e
    if hasattr(inner, "add_note"):
        inner.add_note("raised while torch.compile traced the body: no op of this call ran after "
                       "the graph that failed (its state writes did not happen)")
    return inner


def _observed(e: Exception) -> bool:
    """A fullgraph trace that stopped because the traced code raises (dynamo's "Observed
    exception"): the code run eagerly raises the same exception."""
    observed = getattr(torch._dynamo.exc, "ObservedException", None)
    return observed is not None and isinstance(e.__cause__, observed)
