"""The small-batch linear kernel (interpreted on CPU) against an fp64 x @ w.T: awkward sizes
(M 1 / 3 / 16, N and K not multiples of the tiles), the prefetching variant, split-K through
the fp32 workspace with splits that get no K at all, bf16 and fp32, a strided x, and the
argument checks."""
import pytest
import torch

from padgraph.backends.triton.gemv import MAX_M, gemv


def _check(m, n, k, dtype, **kw):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    want = (x.double() @ w.double().T)
    got = gemv(x, w, impl="triton", **kw)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * k ** 0.5)


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 17, 300), (16, 64, 48), (5, 33, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_a_matmul(m, n, k, dtype):
    _check(m, n, k, dtype, block_n=16, block_k=32)


@pytest.mark.parametrize("split_k", [2, 3, 7])
def test_split_k_sums_every_share_once(split_k):
    # K = 100 in tiles of 32: 4 tiles; 7 splits leave some splits without a tile
    _check(3, 40, 100, torch.float32, block_n=16, block_k=32, split_k=split_k)


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 17, 300), (16, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetching_pdl_variant(m, n, k, dtype):
    # pdl=True reads w one tile ahead (on CPU without the grid-dependency wait): the tile past
    # the last one is masked, K below one tile leaves the loop a single step
    _check(m, n, k, dtype, block_n=16, block_k=32, pdl=True)
    with pytest.raises(ValueError, match="split_k 1"):
        gemv(torch.randn(m, k), torch.randn(n, k), impl="triton", split_k=2, pdl=True)


def test_wider_tiles_and_a_strided_x():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 2 * 96, generator=g)
    x = base[:, ::2]                                   # stride(1) == 2: copied to contiguous
    w = torch.randn(70, 96, generator=g)
    got = gemv(x, w, impl="triton", block_n=32, block_k=64)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)


def test_torch_impl_and_checks():
    x, w = torch.randn(2, 8), torch.randn(5, 8)
    torch.testing.assert_close(gemv(x, w, impl="torch"), x @ w.T)
    torch.testing.assert_close(gemv(x, w), x @ w.T)           # auto on the CPU: torch
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_M + 1, 8), w)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        gemv(x, torch.randn(5, 9))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, torch.randn(8, 5).T)
    with pytest.raises(ValueError, match="split_k"):
        gemv(x, w, split_k=0)


def test_bench_gemv_report_lines():
    """bench_gemv's table from one measured row (the GPU run writes it; here its format)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import bench_gemv
    cfgs = [dict(block_n=16, block_k=256, split_k=1, err=1e-3, ok=True, us=5.0),
            dict(block_n=32, block_k=256, split_k=2, err=2e-3, ok=True, us=4.0)]
    row = dict(shape="o", n=2048, k=2048, bs=1, cublas_us=5.7, cublas_gbs=1472.0,
               cublas_of_copy=0.35, gemv_gbs=2097.0, gemv_of_copy=0.49, speedup=5.7 / 4.0,
               best=cfgs[1], configs=cfgs)
    meta = dict(gpu="GPU", date="d", torch="t", triton="tr", command="c", copy_GBps=4251.0,
                n_configs=2)
    md = bench_gemv.markdown(meta, [row])
    line = [ln for ln in md.splitlines() if ln.startswith("| o |")][0]
    assert "2048 x 2048" in line and "1.43x" in line and "32 / 256 / 2" in line and "2.0e-03" in line
    assert len(bench_gemv.CONFIGS) == 27 and all(c["block_n"] >= 16 for c in bench_gemv.CONFIGS)
    # the chain section: the floor ratios, the shapes that took gemv, a variant that failed
    chain = [dict(bs=1, weight_bytes=2.47e9, floor_us=585.0, cublas_us=838.0, mixed_us=813.0,
                  isolated_sum_us=817.0, picks={"qkv": "F.linear", "down": {"block_n": 64}},
                  mixed_rel_err=1.8e-2, cublas_over_floor=838 / 585, mixed_over_floor=813 / 585,
                  variants={"gemv_split1": dict(us=873.0, over_floor=873 / 585, rel_err=1e-2),
                            "gemv_split1_pdl": dict(error="TypeError: launch_pdl")})]
    md = bench_gemv.markdown(meta, [row], chain)
    line = [ln for ln in md.splitlines() if ln.startswith("| 1 | 585 |")][0]
    assert "838 (1.43)" in line and "813 (1.39)" in line and "| down |" in line
    assert "| 1 | gemv_split1 | 873 | 1.49 |" in md and "failed: TypeError: launch_pdl" in md
