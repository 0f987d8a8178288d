"""Capturing the ladder: largest bucket first, one pool, a side stream, GC frozen, no
per-capture gc.collect/empty_cache. Failures name the program and bucket and chain the cause."""
from __future__ import annotations

import gc
import logging
import sys
import time
from contextlib import contextmanager

import torch

from padgraph.capture import capture_scope
from padgraph.errors import CaptureError, where

log = logging.getLogger("padgraph.cuda")

_CAUSES = (
    "usual causes: a host sync in the body or hook (.item(), .cpu(), .tolist(), printing or "
    "branching on a CUDA tensor's value, torch.nonzero); data-dependent shapes (boolean-mask "
    "indexing, nonzero, unique, repeat_interleave without output_size); CPU tensors created in the "
    "body (torch.tensor(...) or torch.arange(...) without device=); a kernel that is not capturable")


@contextmanager
def frozen_gc():
    """Python's GC off during capture (a collection can free CUDA tensors mid-capture)."""
    enabled = gc.isenabled()
    gc.collect()       # once for the whole ladder, not per capture
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _progress(buckets, enabled):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return buckets
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return buckets
    return tqdm(buckets, desc="padgraph capture", unit="bucket", leave=False)


def _run_prepare(runner, bucket):
    if runner.prepare is not None:
        runner.prepare(runner.view(bucket))


def _run_body(runner, bucket):
    outs = runner.body(runner.view(bucket))
    runner.check_outputs(outs, bucket)
    return outs


def _capture_one(runner, bucket, warmup, stream):
    from .runner import _Bucket
    name = runner.program.name
    try:
        with torch.cuda.stream(stream):
            runner.pack_all_pad(bucket)
            for _ in range(warmup):
                _run_prepare(runner, bucket)
                _run_body(runner, bucket)
        stream.synchronize()
    except Exception as e:
        raise CaptureError(f"{where(name)}: the body failed in eager warm-up at bucket {bucket} "
                           f"(before capture): {type(e).__name__}: {e}") from e
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream):
            runner.pack_all_pad(bucket)
            _run_prepare(runner, bucket)  # eager, outside the graph: it runs before every replay
            graph.capture_begin(pool=runner.pool)
            try:
                runner.packs_in_graph(bucket)
                outs = runner.own_outputs(_run_body(runner, bucket))
            finally:
                graph.capture_end()
    except Exception as e:
        raise CaptureError(f"{where(name)}: CUDA graph capture failed at bucket {bucket}: "
                           f"{type(e).__name__}: {e}; {_CAUSES}") from e
    return _Bucket(graph, runner.view(bucket), dict(outs))


def pool_bytes(pool, device) -> int | None:
    """Bytes of allocator segments that belong to a graph pool (None if torch hides them)."""
    try:
        segs = torch.cuda.memory._snapshot(device)["segments"]
    except Exception:  # private API: fall back to the reserved-bytes delta
        return None
    key = tuple(pool)
    return sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", ())) == key)


def capture_ladder(runner, warmup: int, progress):
    """Capture every bucket, largest first, into runner.pool; record seconds and pool bytes."""
    torch.cuda.synchronize(runner.device)
    stream = torch.cuda.Stream(runner.device)
    stream.wait_stream(torch.cuda.current_stream(runner.device))
    graphs = {}
    base = torch.cuda.memory_reserved(runner.device)
    with frozen_gc(), capture_scope():
        for bucket in _progress(sorted(runner.plan.buckets, reverse=True), progress):
            t0 = time.perf_counter()
            graphs[bucket] = _capture_one(runner, bucket, warmup, stream)
            stream.synchronize()
            seconds = time.perf_counter() - t0
            in_pool = pool_bytes(runner.pool, runner.device)
            runner.stats.capture[bucket] = {
                "seconds": seconds,
                "pool_bytes": in_pool if in_pool is not None else torch.cuda.memory_reserved(runner.device) - base,
            }
    torch.cuda.current_stream(runner.device).wait_stream(stream)
    log.info("program %r: captured %d buckets in %.2f s", runner.program.name, len(graphs),
             sum(c["seconds"] for c in runner.stats.capture.values()))
    return graphs
