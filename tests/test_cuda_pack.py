"""The one-launch pack on the GPU: realistic and random jobs vs the torch reference (bitwise), no
host sync in the launch, graph capture with the table patched between replays, and timing.

Run with `pytest -s tests/test_cuda_pack.py` to see the timing lines.
"""
import math
import random
import statistics
import time

import pytest
import torch

from padgraph.backends.triton import pack as P
from padgraph.backends.triton.pack import CONST, DESC_WIDTH, EDGE, FILL, PackJob

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not P.triton_available(), reason="triton not importable"),
]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.bool, torch.int8, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]
FILLS = {torch.bool: [True, False], torch.int8: [-7, 0], torch.int32: [1, -123456],
         torch.int64: [0, -(2**62) - 5]}
FLOAT_FILLS = [0.0, -0.0, math.nan, -math.inf, 1.5]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def random_bits(n: int, dtype: torch.dtype, gen: torch.Generator, device="cuda") -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included); bools stay 0/1."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen, device=device).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen, device=device).view(dtype)


def poisoned_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Same size, same address modulo 16, random bytes."""
    shift = (t.data_ptr() % 16) // t.element_size()
    out = torch.empty(t.numel() + shift, dtype=t.dtype, device=t.device)[shift:]
    n = t.numel() * t.element_size()
    out.view(torch.uint8).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen, device=t.device))
    return out


def check(jobs: list[PackJob], gen: torch.Generator) -> None:
    """Kernel and reference on identically poisoned dsts: bitwise equal; sources untouched."""
    src_before = [None if j.src is None else j.src.clone() for j in jobs]
    ref = [PackJob(poisoned_like(j.dst, gen), j.src, j.n_raw, j.n_total, j.row_elems, j.mode, j.fill_value)
           for j in jobs]
    tri = [PackJob(poisoned_like(j.dst, gen), j.src, j.n_raw, j.n_total, j.row_elems, j.mode, j.fill_value)
           for j in jobs]
    for r, t in zip(ref, tri):
        t.dst.view(torch.uint8).copy_(r.dst.view(torch.uint8))  # a bool copy_ would normalise poison
    P.pack_reference(ref)
    P.pack(tri, impl="triton")
    torch.cuda.synchronize()
    for i, (r, t, s) in enumerate(zip(ref, tri, src_before)):
        case = f"job {i} {r.dst.dtype} {P.MODES[r.mode]} n_raw={r.n_raw} n_total={r.n_total} row={r.row_elems}"
        assert torch.equal(bits(t.dst), bits(r.dst)), case
        if s is not None:
            assert torch.equal(bits(jobs[i].src), bits(s)), f"source written, {case}"


def realistic_jobs(raw_bs: int, bucket: int, gen: torch.Generator, hidden: int = 4096) -> list[PackJob]:
    """A draft-extend-like call: metadata of a batch <= 256 and one bf16 hidden-state buffer."""
    def job(dtype, n_raw, n_total, mode=FILL, fill=0, row=1):
        dst = torch.empty(n_total, dtype=dtype, device="cuda")
        src = None if mode == CONST else random_bits(n_raw, dtype, gen)
        return PackJob(dst, src, n_raw, n_total, row, mode, fill)

    return [
        job(torch.int64, raw_bs * 4, bucket * 4),  # input_ids, tokens = 4 per request
        job(torch.int64, raw_bs * 4, bucket * 4),  # positions
        job(torch.int32, raw_bs, bucket, fill=1),  # seq_lens
        job(torch.int32, raw_bs, bucket),  # req_pool_indices: reserved row 0
        job(torch.int64, raw_bs * 4, bucket * 4),  # out_cache_loc: sink slot 0
        job(torch.int32, raw_bs + 1, bucket + 1, mode=EDGE),  # cu_lens
        job(torch.int32, 0, 1, mode=CONST, fill=raw_bs),  # the raw extent, a 0-d int32
        job(torch.bfloat16, raw_bs * hidden, bucket * hidden, row=hidden),  # hidden [tok, 4096]
    ]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw_bs,bucket", [(1, 1), (3, 4), (37, 40), (200, 256), (256, 256)])
def test_realistic_jobs_match_reference(raw_bs, bucket):
    gen = torch.Generator(device="cuda").manual_seed(raw_bs)
    check(realistic_jobs(raw_bs, bucket, gen), gen)


def random_job(rng: random.Random, gen: torch.Generator) -> PackJob:
    dtype = rng.choice(DTYPES)
    fill = rng.choice(FILLS.get(dtype, FLOAT_FILLS))
    mode = rng.choice([FILL, FILL, EDGE, CONST])
    row = rng.choice([1, 1, 3, 96, 4096])
    n_rows_total = rng.choice([0, 1, 2, 7, 33, 256, 1000]) if row < 4096 else rng.choice([1, 3, 64])
    n_total = row * n_rows_total
    n_raw = row * rng.randint(0, n_rows_total) if mode == EDGE else rng.randint(0, n_total)
    offset = rng.choice([0, 0, 1, 5])  # misaligned views exercise the scalar paths
    dst = torch.empty(n_total + offset + 3, dtype=dtype, device="cuda")[offset:]
    src = None if mode == CONST else random_bits(n_raw + offset + 2, dtype, gen)[offset:]
    return PackJob(dst, src, n_raw, n_total, row, mode, fill)


@pytest.mark.parametrize("seed", range(20))
def test_random_jobs_match_reference(seed):
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_jobs = rng.choice([1, 2, 8, 40, 300])
    check([random_job(rng, gen) for _ in range(n_jobs)], gen)


def _device_table(jobs: list[PackJob]) -> torch.Tensor:
    host = torch.empty((len(jobs), DESC_WIDTH), dtype=torch.int64)
    P.encode_jobs(jobs, host)
    return host.cuda()


def test_launch_makes_no_host_sync():
    gen = torch.Generator(device="cuda").manual_seed(0)
    jobs = realistic_jobs(37, 40, gen)
    table = _device_table(jobs)
    max_total = max(j.n_total for j in jobs)
    P.pack_launch(table, len(jobs), max_total)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            P.pack_launch(table, len(jobs), max_total)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_pack_convenience_makes_no_host_sync():
    gen = torch.Generator(device="cuda").manual_seed(0)
    jobs = realistic_jobs(37, 40, gen)
    P.pack(jobs)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        P.pack(jobs)  # pinned host table + non_blocking copy
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_captured_pack_reads_the_table_at_replay():
    """Addresses live in device memory, so one captured launch serves new sources every call."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    jobs = realistic_jobs(3, 40, gen)
    table = _device_table(jobs)
    max_total = max(j.n_total for j in jobs)
    P.pack_launch(table, len(jobs), max_total)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        P.pack_launch(table, len(jobs), max_total)
    for raw_bs in (1, 40, 17):
        new = realistic_jobs(raw_bs, 40, gen)
        for old, nw in zip(jobs, new):  # same static dsts, new raw sources and sizes
            nw.dst = old.dst
        table.copy_(_device_table(new))
        for j in jobs:
            j.dst.view(torch.uint8).fill_(0xA5)
        graph.replay()
        want = [PackJob(j.dst.clone().fill_(0), j.src, j.n_raw, j.n_total, j.row_elems, j.mode, j.fill_value)
                for j in new]
        P.pack_reference(want)
        torch.cuda.synchronize()
        for i, (j, w) in enumerate(zip(new, want)):
            assert torch.equal(bits(j.dst), bits(w.dst)), f"raw_bs={raw_bs} job {i}"


def _host_us_per_launch(fn, n: int = 2000) -> float:
    """Median host time of one call; syncs every 100 calls keep the launch queue short."""
    times = []
    for k in range(n):
        if k % 100 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _device_us(fn, per_graph: int = 20, n_replays: int = 50) -> float:
    """Device time of one call: `per_graph` calls captured back to back, so no launch gaps."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n_replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (n_replays * per_graph)


@pytest.mark.parametrize("raw_bs,bucket", [(3, 256), (200, 256)])
def test_timing(raw_bs, bucket):
    gen = torch.Generator(device="cuda").manual_seed(2)
    jobs = realistic_jobs(raw_bs, bucket, gen)
    table = _device_table(jobs)
    max_total = max(j.n_total for j in jobs)
    n_jobs = len(jobs)

    def launch():
        P.pack_launch(table, n_jobs, max_total)

    def reference():
        P.pack_reference(jobs)

    moved = sum(j.n_total * j.dst.element_size() + (0 if j.src is None else j.n_raw * j.dst.element_size())
                for j in jobs)
    n_ref_launches = sum(1 if j.mode == CONST or j.n_raw in (0, j.n_total) else 2 for j in jobs)
    print(
        f"\n[pack timing] raw_bs={raw_bs} bucket={bucket} jobs={n_jobs} bytes moved={moved / 1e6:.2f} MB"
        f"  torch {torch.__version__} triton {P.triton.__version__} {torch.cuda.get_device_name()}"
        f"\n  pack_launch  host {_host_us_per_launch(launch):6.1f} us/call (median)"
        f"   device {_device_us(launch):6.2f} us/call (1 launch)"
        f"\n  reference    host {_host_us_per_launch(reference, 300):6.1f} us/call (median)"
        f"   device {_device_us(reference):6.2f} us/call (>= {n_ref_launches} launches)"
    )
