"""The reference backend: the body runs eagerly on fresh padded tensors. The semantic oracle.

Every call builds a new padded copy of every input (so nothing a body or hook wrote earlier can
be seen), runs `prepare` and the body on that one view, and copies the outputs into a per-runner
output arena, so output lifetime matches the graph backends: views valid until the next call.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch

from .eager import run_padded
from .runtime import Runner


class ReferenceRunner(Runner):
    """Eager execution at the bucket's padded shapes, on whatever device the inputs live on."""

    backend = "reference"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._arena: dict[str, torch.Tensor] | None = None

    def _run(self, bucket, raw, ext):
        outs = run_padded(self, bucket, raw, ext, self.device)
        return self._into_arena(outs, bucket)

    @torch.no_grad()
    def run_at(self, size: int, **raw: torch.Tensor) -> Mapping[str, torch.Tensor]:
        """Run at a forced size >= the fitting one (pg.check compares sizes); outputs sliced, fresh."""
        ext = self.plan.extents(raw, self.device)
        if size < self.plan.fit(ext):
            raise ValueError(f"program {self.program.name!r}: size {size} does not hold extents {ext}")
        device = self.device or next(iter(raw.values())).device
        outs = run_padded(self, size, raw, ext, device)
        return self._finish({n: t.clone() for n, t in outs.items()}, ext, lend_=False)

    def _into_arena(self, outs, bucket):
        """Copy the outputs into the runner's arena (one flat buffer per output at the largest
        size; a bucket's output is a dense prefix of it)."""
        if self._arena is None:
            self._arena = {n: torch.empty(math.prod(self.plan.largest_shape(n)), dtype=s.dtype, device=outs[n].device)
                           for n, s in self.program.outputs.items()}
        views = {}
        self._end_lease()       # the copies below rewrite the outputs lent so far
        for name, flat in self._arena.items():
            shape = self.plan.shape(name, bucket)
            v = flat[: math.prod(shape)].view(shape)
            v.copy_(outs[name])
            views[name] = v
        return views
