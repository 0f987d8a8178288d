"""Timing on a GPU for the kernel benchmarks: events, graph replays over rotating cases, copy bandwidth."""
from __future__ import annotations

import itertools
import time

import torch

from bench.attention_config import DTYPE

def bench_us(fn, rep=100) -> float:
    """Median time of fn in µs (do_bench warms up and flushes L2 before each call); on CPU
    (--smoke) a plain wall-clock median of a few calls."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e6
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def rotating(fns):
    """One callable that runs fns[0], fns[1], ... in turn (cache-set rotation)."""
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def graph_of(fn):
    """Capture fn in a CUDA graph after a warm-up on a side stream; returns graph.replay
    (on CPU: fn itself)."""
    if not torch.cuda.is_available():
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def profile_replays(replay, reps: int):
    """torch.profiler's events (GPU kernels only) of `reps` calls of `replay` queued back to
    back, after one call outside the profile."""
    from torch.profiler import ProfilerActivity, profile
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    return prof.events()


def in_graph_us(fns, calls, flush) -> float:
    """µs a call of fns (cycled) takes inside one CUDA graph of `calls` calls, each call after
    flush() (an L2-sized write), less the same graph of flushes alone (CPU: plain loops)."""
    def body(with_calls):
        def run():
            for i in range(calls):
                flush()
                if with_calls:
                    fns[i % len(fns)]()
        return run
    both = bench_us(graph_of(body(True)), rep=50)
    flushes = bench_us(graph_of(body(False)), rep=50)
    return max(both - flushes, 0.0) / calls


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    n = (1 << 29) if device.type == "cuda" else (1 << 20)
    x = torch.randn(n, dtype=DTYPE, device=device)  # 1 GiB on the GPU
    y = torch.empty_like(x)
    t_us = bench_us(lambda: y.copy_(x))
    nbytes = 2 * x.numel() * x.element_size()
    del x, y
    return nbytes / (t_us * 1e-6)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
