"""One `torch.compile` of a body for the whole ladder (`pg.compile(..., torch_compile=...)`).

The body is traced once with every padded dim dynamic, so one compilation serves every bucket:
the wrapper hands dynamo the view's tensors (inputs, state, extents) rather than the view, marks
each padded dim with `maybe_mark_dynamic` (torch specialises sizes 0 and 1, so a bucket whose
padded dim is 1 — bucket 1 — compiles one more graph: counted in `stats.recompiles`, never an
error), and rebuilds the view inside the traced function,
where `x.bucket` is the symbolic size of the bucketed axis. Inductor runs with its own CUDA
graphs off: a graph backend captures inductor's kernels into its own graphs. Every graph inductor
compiles is counted (`stats.compiles`); those after the first call are `stats.recompiles`.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from .errors import ContractValueError, mismatch
from .program import Program, padded_dims

_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune")


def _options(program: Program, spec) -> dict:
    opts = {} if spec is True else dict(spec)
    mode = opts.pop("mode", None) or "default"
    if mode not in _MODES:
        why = " (padgraph captures the CUDA graphs itself; inductor's own would nest inside them)" \
            if mode == "reduce-overhead" else ""
        raise ContractValueError(mismatch(program.name, None, "torch_compile mode", f"one of {list(_MODES)}{why}",
                                          repr(mode)))
    patches = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
    patches.update(opts.pop("options", None) or {})
    patches["triton.cudagraphs"] = False
    return {"fullgraph": opts.pop("fullgraph", False), "dynamic": opts.pop("dynamic", None),
            "patches": patches, **opts}


def _bucket_of(program: Program) -> Callable[[Mapping], object]:
    """The bucketed axis's size from an input that carries it (symbolic under tracing)."""
    root = program.bucket_axis
    for name, spec in program.inputs.items():
        for d, af in padded_dims(spec.shape):
            if af.axis is root:
                return lambda inputs, n=name, d=d, af=af: (inputs[n].shape[d] - af.offset) // af.scale
    raise ContractValueError(mismatch(program.name, None, "torch_compile", "an input along the bucketed axis", "none"))


class TracedView:
    """The padded view as dynamo traces it: plain attributes (no __getattr__ indirection)."""

    def __init__(self, program: str, bucket, buffers: Mapping, extents: Mapping):
        for name, value in buffers.items():     # setattr, not __dict__.update: dynamo traces it
            setattr(self, name, value)
        self.program, self.bucket, self._extents = program, bucket, extents

    def __getitem__(self, name: str):
        return getattr(self, name)

    def extent(self, axis: str):
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

        def traced(inputs, state, extents):
            return body(TracedView(name, bucket_of(inputs), {**inputs, **state}, extents))

        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx
            stats.compiles += 1
            if self._called:
                stats.recompiles += 1
            return compile_fx(gm, example_inputs, config_patches=patches)

        self._called = False
        self._fn = torch.compile(traced, backend=backend, **opts)

    def __call__(self, x: PaddedView):
        inputs = {n: x[n] for n in self._inputs}
        for n, dims in self._dims.items():
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(inputs[n], d)
        if self.state is not None:        # batch-ordered state: dim 0 follows the bucket
            for t in self.state.row_leaves(x.bucket):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        state = {n: x[n] for n in self.program.state}
        extents = {a.name: x.extent(a.name) for a in self.program.axes}
        out = self._fn(inputs, state, extents)
        self._called = True
        return out

