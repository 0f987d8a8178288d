"""Deliberately broken backends: the conformance suite must fail on each (tests/test_conformance.py).

StaleTailRunner keeps one static buffer per input, as a graph backend does, but writes the pad
values only when a buffer is first made: a later, smaller call leaves the earlier call's values
(or the body's in-place writes) in the tail — the historical stale-tail bug.

StaleLaneRunner pads every input correctly but one kind: a 1-d int64 input along the bucketed
axis (a slot / lane table) is kept from call to call and only its raw lanes are rewritten, so its
padded lanes hold earlier calls' slots — live requests' rows, which the padded lanes then
read-modify-write. The stale-lane bug of hybrid-model engines (padded rows of a graph batch
writing live recurrent state).
"""
import torch

from padgraph import pack
from padgraph.program import padded_dims
from padgraph.reference import ReferenceRunner
from padgraph.view import PaddedView
from padgraph.eager import run_padded


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


class StaleLaneRunner(ReferenceRunner):
    backend = "stale-lane"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tables = {}       # input -> [lanes] int64: the lane table as the last calls left it

    def _run(self, bucket, raw, ext):
        def body(x):
            for name, spec in self.program.inputs.items():
                if spec.dtype == torch.int64 and len(spec.shape) == 1 and padded_dims(spec.shape):
                    self._stale(name, x[name], raw[name].shape[0])
            return self.body(x)
        return self._into_arena(run_padded(self, bucket, raw, ext, self.device, body=body), bucket)

    def _stale(self, name, lanes, n):
        """Padded lanes [n, bucket) take the table's values; the table keeps every lane seen."""
        table = self._tables.get(name)
        if table is not None:
            m = min(table.shape[0], lanes.shape[0])
            lanes[n:m] = table[n:m].to(lanes.device)
        if table is None or table.shape[0] < lanes.shape[0]:
            self._tables[name] = lanes.clone()
        else:
            table[:lanes.shape[0]] = lanes
