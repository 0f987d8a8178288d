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
    with pytest.raises(ValueError, match="powers of two >= 16; got 1, 24, 256"):
        gemv(x, w, block_n=24)
