"""The one-launch pack: kernel (under TRITON_INTERPRET=1 on CPU) == torch reference, bitwise.

Every case poisons dst with random bytes first, so a lane the pack should have written but did
not, or one past n_total it should have left alone, shows up; and every case compares the source
against a clone taken before, so a write into the caller's tensor shows up too.
"""
import math

import numpy as np
import pytest
import torch

from padgraph.backends.triton import pack as P
from padgraph.backends.triton.pack import CONST, DESC_WIDTH, EDGE, FILL, PackJob

needs_triton = pytest.mark.skipif(not P.triton_available(), reason="triton not importable")

# Without a GPU, conftest sets TRITON_INTERPRET=1 and the kernel runs on CPU tensors; with one,
# the same cases run compiled on it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# (dtype, fill value): every element size; NaN and -0.0 must survive bit for bit
DTYPE_FILLS = [
    (torch.bool, True),
    (torch.int8, -7),  # 0xF9: sign bits must not leak into the int64 descriptor
    (torch.int32, -123456),
    (torch.int64, -(2**62) - 5),
    (torch.float16, math.nan),
    (torch.float16, -0.0),
    (torch.bfloat16, math.nan),
    (torch.bfloat16, -0.0),
    (torch.float32, -0.0),
    (torch.float64, math.nan),
]

# (n_raw, n_total, row_elems): awkward sizes around BLOCK = 1024
SHAPES = [
    (0, 37, 1),  # nothing raw
    (37, 37, 1),  # nothing padded
    (1, 37, 1),  # one raw element
    (0, 0, 1),  # an empty job
    (96 * 2, 96 * 5, 96),  # rows of 96
    (96, 96 * 4, 96),  # a single raw row
    (0, 96 * 3, 96),  # rows, nothing raw: EDGE falls back to the fill value
    (1823, 2600, 1),  # a whole raw block, then raw meets pad inside a block, then a partial one
    (700, 4200, 1),  # whole blocks of pad only
    (1030, 2049, 1),  # the last block holds a single element
    (96 * 12, 96 * 40, 96),  # EDGE across several blocks
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` reinterpreted as integers of its element size, for bitwise comparison."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def random_values(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, denormals); bools stay 0/1."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().to(DEVICE)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(DEVICE)


def poisoned(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)


def make_job(dtype, mode, n_raw, n_total, row, fill, gen, offset=0) -> PackJob:
    """A job whose dst and src are views `offset` elements into larger buffers (0: aligned)."""
    dst = poisoned(offset + n_total + 5, dtype, gen)[offset:]  # 5 lanes past n_total must survive
    src = None if mode == CONST else random_values(offset + n_raw + 3, dtype, gen)[offset:]
    return PackJob(dst, src, n_raw, n_total, row, mode, fill)


def expected_dst(job: PackJob, before: torch.Tensor) -> torch.Tensor:
    """What dst must hold, built independently of pack_reference (on the CPU, element by element)."""
    out = bits(before.cpu()).clone().view(before.dtype)  # a bool clone() would normalise poison
    src = None if job.src is None else job.src.cpu()
    fill = torch.empty(1, dtype=out.dtype).fill_(job.fill_value)
    if job.mode == CONST:
        out[: job.n_total] = fill
        return out
    out[: job.n_raw] = src[: job.n_raw]
    for i in range(job.n_raw, job.n_total):
        if job.mode == EDGE and job.n_raw > 0:
            out[i] = src[job.n_raw - job.row_elems + (i - job.n_raw) % job.row_elems]
        else:
            out[i] = fill[0]
    return out


def clone_misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of flat `t` with the same address modulo 16 (`clone()` would align it)."""
    shift = (t.data_ptr() % 16) // t.element_size()
    out = torch.empty(t.numel() + shift, dtype=t.dtype, device=t.device)[shift:]  # fresh: 16-aligned
    assert out.data_ptr() % 16 == t.data_ptr() % 16
    out.view(torch.uint8).copy_(t.view(torch.uint8))  # a bool copy_ would normalise poison bytes
    return out


def clone_jobs(jobs: list[PackJob]) -> list[PackJob]:
    return [PackJob(clone_misaligned(j.dst), j.src, j.n_raw, j.n_total, j.row_elems, j.mode, j.fill_value)
            for j in jobs]


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = bits(got.cpu()), bits(want.cpu())
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: differs at {bad}, got {got[bad].tolist()}, should be {want[bad].tolist()}")


def check_kernel_equals_reference(jobs: list[PackJob], max_total: int | None = None) -> None:
    """Run kernel and reference on copies of the same poisoned dsts; all must agree bitwise."""
    src_before = [None if j.src is None else j.src.clone() for j in jobs]
    ref_jobs, tri_jobs = clone_jobs(jobs), clone_jobs(jobs)
    P.pack_reference(ref_jobs)
    if max_total is None:
        P.pack(tri_jobs, impl="triton")
    else:
        table = torch.zeros((len(jobs), DESC_WIDTH), dtype=torch.int64)
        P.encode_jobs(tri_jobs, table)
        P.pack_launch(table.to(DEVICE), len(jobs), max_total, impl="triton")
    for i, (job, ref, tri, src) in enumerate(zip(jobs, ref_jobs, tri_jobs, src_before)):
        case = f"job {i} {job.dst.dtype} {P.MODES[job.mode]} n_raw={job.n_raw} n_total={job.n_total} row={job.row_elems}"
        assert_same_bits(ref.dst, expected_dst(job, job.dst), f"reference, {case}")
        assert_same_bits(tri.dst, ref.dst, f"kernel vs reference, {case}")
        if src is not None:
            assert_same_bits(job.src, src, f"source written, {case}")


# ---------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("mode", [FILL, EDGE, CONST], ids=["fill", "edge", "const"])
@pytest.mark.parametrize("dtype,fill", DTYPE_FILLS, ids=[f"{d}-{v}".replace("torch.", "") for d, v in DTYPE_FILLS])
def test_kernel_matches_reference_all_shapes_one_launch(dtype, fill, mode):
    gen = torch.Generator().manual_seed(1)
    jobs = [make_job(dtype, mode, *shape, fill, gen, offset) for shape in SHAPES for offset in (0, 1)]
    check_kernel_equals_reference(jobs)


@needs_triton
@pytest.mark.parametrize("offset", [0, 1, 3], ids=["aligned", "off1", "off3"])
def test_mixed_dtypes_modes_and_alignments_in_one_launch(offset):
    gen = torch.Generator().manual_seed(2)
    jobs = []
    for k, (dtype, fill) in enumerate(DTYPE_FILLS):
        mode = (FILL, EDGE, CONST)[k % 3]
        n_raw, n_total, row = SHAPES[(k * 3) % len(SHAPES)]
        jobs.append(make_job(dtype, mode, n_raw, n_total, row, fill, gen, offset=offset + k % 2))
    check_kernel_equals_reference(jobs)


@needs_triton
@pytest.mark.parametrize("max_total", [1, 1024, 2049])
def test_max_total_below_n_total_only_shrinks_the_grid(max_total):
    """Programs loop over blocks, so a small grid still writes every element of every job."""
    gen = torch.Generator().manual_seed(3)
    jobs = [make_job(torch.bfloat16, FILL, 3000, 5000, 1, -0.0, gen),
            make_job(torch.int32, EDGE, 96 * 30, 96 * 50, 96, 1, gen, offset=1),
            make_job(torch.int64, CONST, 0, 2100, 1, -1, gen)]
    check_kernel_equals_reference(jobs, max_total=max_total)


@needs_triton
def test_only_the_first_n_jobs_run():
    gen = torch.Generator().manual_seed(4)
    jobs = [make_job(torch.int32, FILL, 3, 10, 1, 9, gen) for _ in range(3)]
    before = [j.dst.clone() for j in jobs]
    table = torch.zeros((3, DESC_WIDTH), dtype=torch.int64)
    P.encode_jobs(jobs, table)
    table = table.to(DEVICE)
    P.pack_launch(table, 2, 10, impl="triton")
    assert_same_bits(jobs[2].dst, before[2], "job 2 is past n_jobs")
    assert_same_bits(jobs[1].dst, expected_dst(jobs[1], before[1]), "job 1")
    P.pack_launch(table, 0, 10, impl="triton")  # nothing to do, no launch


def test_reference_edge_row_of_96_by_hand():
    src = torch.arange(96 * 2, dtype=torch.int32)  # two raw rows
    dst = torch.full((96 * 4,), -5, dtype=torch.int32)
    P.pack_reference([PackJob(dst, src, 96 * 2, 96 * 4, 96, EDGE, 0)])
    last = torch.arange(96, 96 * 2, dtype=torch.int32)
    assert torch.equal(dst, torch.cat([src, last, last]))


def test_auto_picks_reference_on_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("auto must not launch the kernel for CPU tensors")

    monkeypatch.setattr(P, "pack_launch", no_kernel)
    dst = torch.zeros(4, dtype=torch.int64)
    P.pack([PackJob(dst, torch.tensor([7]), 1, 4, 1, FILL, 2)])
    assert dst.tolist() == [7, 2, 2, 2]


@pytest.mark.parametrize("as_numpy", [False, True], ids=["torch", "numpy"])
def test_encode_jobs_columns_and_fill_bits(as_numpy):
    dst16, src16 = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    jobs = [
        PackJob(dst16, src16, 3, 8, 1, FILL, math.nan),
        PackJob(torch.zeros(4, dtype=torch.float16), None, 0, 4, 1, CONST, -0.0),
        PackJob(torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), 2, 4, 2, EDGE, True),
        PackJob(torch.zeros(4, dtype=torch.int8), torch.ones(4, dtype=torch.int8), 1, 4, 1, FILL, -1),
        PackJob(torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64), 1, 4, 1, FILL, -1),
        PackJob(torch.zeros(4, dtype=torch.float32), torch.ones(4), 1, 4, 1, FILL, np.float32(-0.0)),
    ]
    out = np.zeros((7, DESC_WIDTH), np.int64) if as_numpy else torch.zeros((7, DESC_WIDTH), dtype=torch.int64)
    P.encode_jobs(jobs, out)
    rows = np.asarray(out).tolist()
    assert rows[0] == [dst16.data_ptr(), src16.data_ptr(), 3, 8, 1, 2, FILL, 0x7FC0]
    assert rows[1][1:] == [0, 0, 4, 1, 2, CONST, 0x8000]  # CONST: no source, nothing raw
    assert rows[2][2:] == [2, 4, 2, 1, EDGE, 1]
    assert rows[3][7] == 0xFF  # zero-extended, not sign-extended
    assert rows[4][7] == -1  # all 64 bits set
    assert rows[5][7] == 0x80000000  # numpy -0.0 keeps its sign through the cache
    assert rows[6] == [0] * DESC_WIDTH  # rows past the jobs untouched


@pytest.mark.parametrize(
    "job, message",
    [
        (PackJob(torch.zeros(8), torch.zeros(8), 5, 4), "n_raw <= n_total"),
        (PackJob(torch.zeros(8), torch.zeros(8), 2, 9), "n_total <= dst.numel()"),
        (PackJob(torch.zeros(8), torch.zeros(2), 3, 8), "src has 2 elements"),
        (PackJob(torch.zeros(8), None, 3, 8), "src=None"),
        (PackJob(torch.zeros(8), torch.zeros(8, dtype=torch.float64), 3, 8), "dtype"),
        (PackJob(torch.zeros(8), torch.zeros(8), 3, 8, 2, EDGE), "multiple of row_elems"),
        (PackJob(torch.zeros(8), torch.zeros(8), 3, 8, 0), "row_elems must be >= 1"),
        (PackJob(torch.zeros(8, dtype=torch.int8), torch.zeros(8, dtype=torch.int8), 3, 8, 1, FILL, 300), "fill value 300"),
        (PackJob(torch.zeros(8, 2).t(), torch.zeros(8), 3, 8), "contiguous"),
        (PackJob(torch.zeros(8), torch.zeros(8), 3, 8, 1, 7), "mode"),
    ],
)
def test_bad_jobs_raise_before_anything_is_written(job, message):
    dst_before = job.dst.clone()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        P.pack_reference([job])
    with pytest.raises(ValueError, match="pack job 0"):
        P.encode_jobs([job], torch.zeros((1, DESC_WIDTH), dtype=torch.int64))
    assert torch.equal(job.dst, dst_before)


@needs_triton
def test_pack_launch_rejects_a_malformed_table():
    with pytest.raises(ValueError, match="int64"):
        P.pack_launch(torch.zeros((2, DESC_WIDTH), dtype=torch.int32), 2, 8)
    with pytest.raises(ValueError, match="n_jobs"):
        P.pack_launch(torch.zeros((2, DESC_WIDTH), dtype=torch.int64), 3, 8)
    with pytest.raises(ValueError, match="pack_reference"):
        P.pack_launch(torch.zeros((2, DESC_WIDTH), dtype=torch.int64), 2, 8, impl="reference")
