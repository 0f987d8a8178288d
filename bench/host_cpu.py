"""The host steps of a call that need no GPU, timed on the CPU (µs per step, 10th percentile).

bench_host's program (8 inputs along `bs`, a tiny body) through the reference backend: what the
cuda backend's call path shares with it (validation and extents, state guard, aliasing check,
bucket lookup, cached output views, lending) runs the same code with CPU tensors. The cuda
staging (`CallBlock.send`: srcs + extents + one async copy) is timed with a copier that copies
nothing and "device" inputs on the meta device, so what is timed is its Python work alone.

    python -m bench.host_cpu [--bs 27] [--tree PATH]     # PATH: another checkout, timed the same way
"""
from __future__ import annotations

import argparse
import json
import sys
import timeit

if "--tree" in sys.argv:               # before anything imports padgraph
    from bench import tree
    tree.use(sys.argv[sys.argv.index("--tree") + 1])

import torch  # noqa: E402

import padgraph as pg  # noqa: E402
from padgraph.backends.cuda import staging  # noqa: E402
from bench.bench_host import TinyStep, raw_batch  # noqa: E402
from bench.bench_runner import decode_program  # noqa: E402


def host_us(fn, sample_s: float = 1e-4, repeat: int = 300) -> float:
    """The 10th percentile of µs per call over short samples: on a shared CPU a long sample
    mostly times the other processes' slices, a short one often none."""
    n = 1
    while timeit.timeit(fn, number=n) < sample_s:
        n *= 2
    samples = sorted(timeit.repeat(fn, number=n, repeat=repeat))
    return samples[repeat // 10] / n * 1e6


class _NoCopy:
    """A copier that copies nothing: the staging's host work without a device."""

    name = "none"

    def new_event(self):
        return object()

    def bind(self, dst, src):
        return lambda nbytes: 0

    def current_stream(self):
        return 0

    def record(self, event, stream):
        pass

    def query(self, event):
        return True


def staging_block(plan):
    """A CallBlock on the CPU (plain host slots, the copier above), or None where this tree's
    staging cannot be built without CUDA."""
    if not hasattr(staging, "_pinned"):
        return None
    staging.copier = lambda device, prefer="cudart": _NoCopy()
    staging._pinned = lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8)
    jobs = list(plan.program.inputs)
    return staging.CallBlock(plan, torch.device("cpu"), jobs)


def resend(block, raw, ext) -> None:
    """block.send as for inputs at new addresses (meta tensors all sit at address 0): the block
    is written and copied."""
    if hasattr(block, "sent"):
        block.sent = None
    block.send(raw, ext)


def host_only_runner(program, body):
    """The cuda runner's call path on the CPU, its inputs on the meta device standing for the
    GPU's: the shared Runner around a `_run` that lends a bucket's fixed outputs (no staging,
    no replay), as CudaGraphRunner does after its replay."""
    from padgraph.runtime import Runner

    class HostOnly(Runner):
        backend = "host-only"
        allow_host_inputs, cache_output_views = True, True

        def __init__(self):
            super().__init__(program, body, device="meta")
            self._outs = {b: {n: torch.zeros(self.plan.shape(n, b), dtype=s.dtype, device="meta")
                              for n, s in program.outputs.items()} for b in self.plan.buckets}

        def _run(self, bucket, raw, ext):
            if hasattr(self, "_end_lease"):
                self._end_lease()
            return self._outs[bucket]

    return HostOnly()


def steps(bs: int) -> dict[str, float]:
    step = TinyStep()
    runner = pg.compile(decode_program(), step.body, backend="reference", device="cpu")
    raw = raw_batch(bs, torch.device("cpu"))
    runner(**raw)
    ext = runner.plan.extents(raw, runner.device, True)
    bucket = runner.plan.bucket_for(ext)
    outs = {n: torch.zeros(runner.plan.shape(n, bucket), dtype=s.dtype) for n, s in runner.program.outputs.items()}
    out = {
        "validate+extents": host_us(lambda: runner.plan.extents(raw, runner.device, True)),
        "state guard": host_us(runner.state.check),
        "aliasing check": host_us(lambda: runner._check_aliasing(raw)),
        "bucket lookup": host_us(lambda: runner.plan.bucket_for(ext)),
        "slice outputs (cached views)": host_us(lambda: runner._finish_cached(outs, ext, bucket)),
        "lend outputs": host_us(lambda: runner._lend(runner._finish_cached(outs, ext, bucket))),
    }
    host_only = host_only_runner(runner.program, step.body)
    on_meta = {n: t.to("meta") for n, t in raw.items()}
    out["whole call, no staging or replay (meta inputs)"] = host_us(lambda: host_only(**on_meta))
    block = staging_block(runner.plan)
    if block is not None:
        out["srcs + extents + copy (Python work)"] = host_us(lambda: resend(block, on_meta, ext))
        out["srcs + extents, the same sources as the last call (no copy)"] = host_us(lambda: block.send(on_meta, ext))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bs", type=int, default=27)
    ap.add_argument("--tree", help="time the padgraph of this checkout instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = steps(args.bs)
    print(json.dumps({"padgraph": pg.__file__, "bs": args.bs, "us": {k: round(v, 3) for k, v in res.items()}}))


if __name__ == "__main__":
    main()
