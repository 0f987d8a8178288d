"""Capturing the ladder: largest bucket first, one pool, a side stream, Python's GC off, no
per-capture gc.collect/empty_cache, cuBLAS workspaces allocated inside the pool (see
`clear_cublas_workspaces`). It takes the runner's steps as closures, never the runner.

Per bucket: (all-pad, warm-up run) x warmup, then all-pad + the eager pre-capture step, then
capture of the in-graph step. Failures name program, bucket and cause, and chain the original;
a failed capture is always ended, so the process (and the next compile) stays usable.
"""
from __future__ import annotations

import gc
import logging
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from padgraph.capture import capture_scope
from padgraph.errors import CaptureError, where

log = logging.getLogger("padgraph.cuda")

_CAUSES = (
    "usual causes: a host sync in the body or hook (.item(), .cpu(), .tolist(), printing or "
    "branching on a CUDA tensor's value, torch.nonzero); data-dependent shapes (boolean-mask "
    "indexing, nonzero, unique, repeat_interleave without output_size); CPU tensors created in the "
    "body (torch.tensor(...) or torch.arange(...) without device=); a kernel that is not capturable")


@dataclass(frozen=True)
class Steps:
    """What capture needs of a runner, as closures over its buffers."""

    reset: Callable[[int], None]              # every input lane its pad (before each run)
    warm: Callable[[int], object]             # one eager run (hook + body) for warm-up
    before_capture: Callable[[int], None]     # eager, outside the graph (the prepare hook)
    record: Callable[[int], Mapping]          # what goes into the graph; returns its outputs


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    outputs: Mapping[str, torch.Tensor]


@contextmanager
def gc_disabled():
    """No collection during capture (it could free CUDA tensors mid-capture). gc.freeze() is
    left alone, so an application's frozen generation is as it was."""
    enabled = gc.isenabled()
    gc.collect()        # once for the whole ladder, not per capture
    gc.disable()
    try:
        yield
    finally:
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


def _user_frame(err: BaseException) -> str:
    """The innermost frame outside torch and padgraph: where the body did it."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if "/torch/" not in f.filename and "/padgraph/" not in f.filename
              and "/backends/cuda/" not in f.filename and "/core/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} ({f.line})"


def diagnose(steps: Steps, bucket: int, stream) -> str:
    """Re-run the body eagerly with CUDA sync checks on: name a host sync and where it is."""
    if not hasattr(torch.cuda, "set_sync_debug_mode"):
        return ""
    old = torch.cuda.get_sync_debug_mode()
    try:
        with torch.cuda.stream(stream):
            steps.reset(bucket)
            torch.cuda.set_sync_debug_mode("error")
            try:
                steps.warm(bucket)
            finally:
                torch.cuda.set_sync_debug_mode(old)
    except RuntimeError as e:
        if "synchroniz" in str(e):
            return f"cause: the body or hook makes a host-device sync{_user_frame(e)}: {e}"
    except Exception:
        return ""
    return ""


def _warm(steps: Steps, name: str, bucket: int, warmup: int, stream) -> None:
    try:
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                steps.reset(bucket)
                steps.warm(bucket)
        stream.synchronize()
    except Exception as e:
        # the body's own error, of the type and message an eager call raises (rule 10.7): a
        # ContractError of the view stays one on every backend; the note says where it came from
        if hasattr(e, "add_note"):   # Python >= 3.11
            e.add_note(f"{where(name)}: raised by the body in eager warm-up at bucket {bucket} "
                       f"(compile, before capture)")
        raise


def _end(graph) -> BaseException | None:
    try:
        graph.capture_end()
    except Exception as e:  # the capture was invalidated: ended anyway, the stream is usable
        return e
    return None


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (what torch's own cudagraph trees do around a capture).

    torch keeps one workspace per (cuBLAS handle, stream), allocated by the first matmul on that
    stream. A graph embeds the address of the workspace its matmuls used. Made in the warm-up, that
    workspace belongs to the ordinary allocator and to torch's cache; anything that clears the cache
    later (torch.compile's cudagraph trees when they record, the destruction of another graph captured
    on the same stream) frees it while our graphs still use it, and their replays then write into
    memory the allocator has handed to someone else, or fault. Cleared right before capture, the
    workspace is allocated during the capture, inside the ladder's pool, which lives as long as the
    graphs; cleared again after, no later eager work on this stream reuses a block of that pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def capture_one(steps: Steps, name: str, bucket: int, pool, stream, warmup: int) -> Captured:
    _warm(steps, name, bucket, warmup, stream)
    graph = torch.cuda.CUDAGraph()
    failure = None
    with torch.cuda.stream(stream):
        steps.reset(bucket)
        steps.before_capture(bucket)
        stream.synchronize()            # the warm-up's matmuls are done with the old workspace
        clear_cublas_workspaces()       # so the capture allocates its own, in the pool
        graph.capture_begin(pool=pool)
        try:
            outs = steps.record(bucket)
        except Exception as e:   # the body's own error, not capture_end's "previous error"
            failure = e
        ended = _end(graph)
        failure = failure or ended
        clear_cublas_workspaces()
    if failure is not None:
        torch.cuda.synchronize()
        cause = diagnose(steps, bucket, stream) or _CAUSES
        raise CaptureError(f"{where(name)}: CUDA graph capture failed at bucket {bucket}: "
                           f"{type(failure).__name__}: {failure}; {cause}") from failure
    return Captured(graph, dict(outs))


def pool_bytes(pool, device) -> int | None:
    """Bytes of allocator segments that belong to a graph pool (None if torch hides them)."""
    try:
        segs = torch.cuda.memory._snapshot(device)["segments"]
    except Exception:  # private API: fall back to the reserved-bytes delta
        return None
    key = tuple(pool)
    return sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", ())) == key)


def capture_ladder(steps: Steps, buckets, *, name: str, pool, device, warmup: int, progress,
                   stats: dict) -> dict[int, Captured]:
    """Capture every bucket, largest first, into `pool`; stats[bucket] = seconds and pool bytes."""
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graphs = {}
    base = torch.cuda.memory_reserved(device)
    with gc_disabled(), capture_scope(), torch.no_grad():
        for bucket in _progress(sorted(buckets, reverse=True), progress):
            t0 = time.perf_counter()
            graphs[bucket] = capture_one(steps, name, bucket, pool, stream, warmup)
            stream.synchronize()
            in_pool = pool_bytes(pool, device)
            stats[bucket] = {"seconds": time.perf_counter() - t0,
                             "pool_bytes": in_pool if in_pool is not None else torch.cuda.memory_reserved(device) - base}
    torch.cuda.current_stream(device).wait_stream(stream)
    log.info("program %r: captured %d buckets in %.2f s", name, len(graphs), sum(c["seconds"] for c in stats.values()))
    return graphs
