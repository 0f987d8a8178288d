"""A custom backend: a Runner subclass, registered by name, judged by the conformance suite.

    python examples/custom_backend.py
    PYTHONPATH=examples python -m padgraph.spec --backend custom_backend:TimingRunner

A backend implements one hook, `_run(bucket, raw, ext)`: run the program's body for this call at
the bucket's padded shapes and return its outputs. Everything around it is the neutral core's:
validation, the bucket lookup, padding, slicing the outputs back to raw extents, state guards.
This one extends the reference backend (eager, the semantic oracle) with a per-bucket timer; a
real one would capture or compile per bucket (the cuda backend captures a CUDA graph each).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

import padgraph as pg
from padgraph.reference import ReferenceRunner


class TimingRunner(ReferenceRunner):
    """The reference backend, plus wall time per bucket."""

    backend = "timing"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds: dict[int, float] = defaultdict(float)

    def _run(self, bucket, raw, ext):
        t0 = time.perf_counter()
        try:
            return super()._run(bucket, raw, ext)
        finally:
            self.seconds[bucket] += time.perf_counter() - t0


def main():
    pg.register_backend("timing", TimingRunner)
    bs = pg.Axis("bs")
    program = pg.Program("scale", inputs={"x": pg.Input((bs, 4), torch.float32, pad=0.0)},
                         outputs={"y": pg.Output((bs, 4), torch.float32)},
                         buckets=pg.Buckets([1, 2, 4, 8]))
    runner = pg.compile(program, lambda x: {"y": 2 * x.x}, backend="timing")
    for n in (1, 3, 3, 7):                                     # raw batch sizes
        y = runner(x=torch.ones(n, 4)).y
        assert y.shape == (n, 4) and bool((y == 2).all())
    print(runner.stats.table())
    print({b: f"{1e6 * s:.0f} us" for b, s in sorted(runner.seconds.items())})


if __name__ == "__main__":
    main()
