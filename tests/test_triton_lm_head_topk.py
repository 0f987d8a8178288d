"""The fused fp8 lm_head + top-k kernel (interpreted on CPU) against its torch reference. Inputs
are small integers in e4m3 with power-of-two scales, so every logit is exact in fp32 whatever the
summation order, and values, indices (ties to the lowest) and lse can be compared exactly."""
import pytest
import torch

from padgraph.backends.triton.lm_head_topk import (
    fp8_lm_head_topk, fp8_lm_head_topk_torch, fp8_lm_head_topk_triton)


def _case(n, V, H, seed):
    g = torch.Generator().manual_seed(seed)
    x8 = torch.randint(-4, 5, (n, H), generator=g).float().to(torch.float8_e4m3fn)
    w8 = torch.randint(-8, 9, (V, H), generator=g).float().to(torch.float8_e4m3fn)
    sx = 2.0 ** torch.randint(-3, 1, (n, 1), generator=g).float()
    sw = 2.0 ** torch.randint(-6, -3, (1, V), generator=g).float()
    return x8, sx, w8, sw


def _stable_topk(x8, sx, w8, sw, k):
    logits = (x8.float() @ w8.float().t()) * sx * sw
    return logits, torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("n,V,H,k", [(1, 7, 32, 1), (5, 300, 64, 4), (17, 1000, 48, 8),
                                     (70, 257, 160, 3)])
def test_matches_the_reference(n, V, H, k):
    """One chunk, a last chunk of 44 columns, a hidden that is not a multiple of the dot step
    (48, 160), more rows than a row block (70 > 64)."""
    x8, sx, w8, sw = _case(n, V, H, seed=n + V)
    t = torch.tensor(1.7)
    v, i, lse = fp8_lm_head_topk(x8, sx, w8, sw, k, t, impl="triton")
    want_v, _, want_lse = fp8_lm_head_topk_torch(x8, sx, w8, sw, k, t)
    logits, want_i = _stable_topk(x8, sx, w8, sw, k)
    assert torch.equal(v, want_v)
    assert torch.equal(i, want_i)                  # integer logits tie often: lowest index first
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_tuning_knobs_and_errors():
    x8, sx, w8, sw = _case(3, 500, 64, seed=1)
    t = torch.tensor(1.0)
    ref = fp8_lm_head_topk_torch(x8, sx, w8, sw, 4, t)
    for block_v, block_h in ((32, 32), (256, 64)):
        got = fp8_lm_head_topk_triton(x8, sx, w8, sw, 4, t, block_v=block_v, block_h=block_h)
        assert torch.equal(got[0], ref[0])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_lm_head_topk(x8.float(), sx, w8, sw, 4, t)
    with pytest.raises(ValueError, match="one value a row"):
        fp8_lm_head_topk(x8, sx[:2], w8, sw, 4, t)
    with pytest.raises(ValueError, match="k must be"):
        fp8_lm_head_topk(x8, sx, w8, sw, 501, t)
    v, i, lse = fp8_lm_head_topk(x8[:0], sx[:0], w8, sw, 4, t, impl="triton")
    assert v.shape == (0, 4) and lse.shape == (0,)


def test_opaque_under_torch_compile():
    torch._dynamo.reset()
    x8, sx, w8, sw = _case(4, 300, 32, seed=2)
    t = torch.tensor(2.0)

    def probs(x8, sx, w8, sw, t):
        top, i, lse = fp8_lm_head_topk(x8, sx, w8, sw, 3, t, impl="triton")
        return torch.exp(t * top - lse[:, None]), i

    p, i = torch.compile(probs, fullgraph=True, backend="aot_eager")(x8, sx, w8, sw, t)
    want_p, want_i = probs(x8, sx, w8, sw, t)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(p, want_p)
