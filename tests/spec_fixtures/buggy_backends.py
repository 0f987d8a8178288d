"""Deliberately broken backends: the conformance suite must fail on each (tests/test_conformance.py).

StaleTailRunner keeps one static buffer per input, as a graph backend does, but writes the pad
values only when a buffer is first made: a later, smaller call leaves the earlier call's values
(or the body's in-place writes) in the tail — the historical stale-tail bug.
"""
import torch

from padgraph import pack
from padgraph.program import padded_dims
from padgraph.reference import ReferenceRunner
from padgraph.view import PaddedView


class StaleTailRunner(ReferenceRunner):
    backend = "stale-tail"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._static = {}

    def _run(self, bucket, raw, ext):
        buffers = {}
        for name, spec in self.program.inputs.items():
            dims = [d for d, _ in padded_dims(spec.shape)]
            shape = self.plan.shape(name, bucket)
            if name not in self._static:
                big = torch.empty(self.plan.largest_shape(name), dtype=spec.dtype, device=self.device)
                entry = self.plan.pack_table(self.plan.buckets[-1]).entries[list(self.program.inputs).index(name)]
                pack.apply(entry, big, raw[name].contiguous(), ext)   # padded once, at "capture"
                self._static[name] = big
            view = self._static[name]
            for d in dims:
                view = view.narrow(d, 0, shape[d])
            region = view
            for d in range(raw[name].dim()):
                region = region.narrow(d, 0, raw[name].shape[d])
            region.copy_(raw[name])                                # raw lanes only: the bug
            buffers[name] = view
        buffers.update(self.state.values)
        extents = {a: torch.tensor(n, dtype=torch.int32, device=self.device) for a, n in ext.items()}
        x = PaddedView(self.program.name, bucket, buffers, extents)
        if self.prepare is not None:
            self.prepare(x)
        outs = self.body(x)
        self.check_outputs(outs, bucket)
        return self._into_arena(outs, bucket)
