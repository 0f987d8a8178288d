"""The reference backend: the body runs eagerly on fresh padded tensors. The semantic oracle.

Every call builds a new padded copy of every input (so nothing a body or hook wrote earlier can
be seen), runs `prepare` and the body on that one view, and copies the outputs into a per-runner
output arena, so output lifetime matches the graph backends: views valid until the next call.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .padding import padded_copy
from .program import padded_dims
from .runtime import Runner
from .view import PaddedView


def make_view(runner: Runner, size: int, raw: Mapping[str, torch.Tensor], ext: Mapping[str, int],
              device: torch.device) -> PaddedView:
    """Fresh padded tensors of every input at `size`, bound state, and device extents."""
    plan, program = runner.plan, runner.program
    buffers: dict[str, object] = {}
    for name, spec in program.inputs.items():
        dims = [d for d, _ in padded_dims(spec.shape)]
        buffers[name] = padded_copy(raw[name].to(device), plan.shape(name, size), spec.pad, dims, device)
    buffers.update(runner.state.values)
    extents = {a: torch.tensor(n, dtype=torch.int32, device=device) for a, n in ext.items()}
    return PaddedView(program.name, size, buffers, extents)


def run_padded(runner: Runner, size: int, raw, ext, device) -> Mapping[str, torch.Tensor]:
    """prepare + body on one padded view at `size`; outputs checked against the declaration."""
    x = make_view(runner, size, raw, ext, device)
    if runner.prepare is not None:
        runner.prepare(x)
    outs = runner.body(x)
    runner.check_outputs(outs, size)
    return outs


class ReferenceRunner(Runner):
    """Eager execution at the bucket's padded shapes, on whatever device the inputs live on."""

    backend = "reference"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._arena: dict[str, torch.Tensor] | None = None

    def _run(self, bucket, raw, ext):
        outs = run_padded(self, bucket, raw, ext, self.device)
        return self._into_arena(outs, bucket)

    def run_at(self, size: int, **raw: torch.Tensor) -> Mapping[str, torch.Tensor]:
        """Run at a forced size >= the fitting one (pg.check compares sizes); outputs sliced, fresh."""
        ext = self.plan.extents(raw, self.device)
        if size < self.plan.fit(ext):
            raise ValueError(f"program {self.program.name!r}: size {size} does not hold extents {ext}")
        device = self.device or next(iter(raw.values())).device
        outs = run_padded(self, size, raw, ext, device)
        return self._finish({n: t.clone() for n, t in outs.items()}, ext)

    def _into_arena(self, outs, bucket):
        if self._arena is None:
            self._arena = {n: torch.empty(self.plan.largest_shape(n), dtype=s.dtype, device=outs[n].device)
                           for n, s in self.program.outputs.items()}
        views = {}
        for name, dims in self._out_dims.items():
            v = self._arena[name]
            shape = self.plan.shape(name, bucket)
            for d in dims:
                v = v.narrow(d, 0, shape[d])
            v.copy_(outs[name])
            views[name] = v
        return views
