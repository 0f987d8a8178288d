"""The draft's top-k + log-sum-exp kernel (interpreted on CPU) against torch: awkward widths
(one chunk, a last chunk shorter than k, several chunks), ties to the lowest index, -inf logits,
bf16 and strided rows, a temperature read from the device, and under torch.compile."""

import pytest
import torch

from padgraph.backends.triton import topk as topk_mod
from padgraph.backends.triton.topk import BLOCK, topk_logsumexp, topk_logsumexp_torch


def _distinct(n, width, seed, dtype=torch.float32):
    """Rows of distinct values (a permutation, scaled into logit range), so indices are defined."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.stack([torch.randperm(width, generator=gen) for _ in range(n)]).float()
    return (x / width * 8 - 4).to(dtype)


def _check_against_torch(x, k, t):
    v, i, lse = topk_logsumexp(x, k, t, impl="triton")
    want_v, want_i, want_lse = topk_logsumexp_torch(x, k, t)
    assert v.dtype == torch.float32 and i.dtype == torch.int64 and lse.dtype == torch.float32
    assert v.shape == i.shape == (x.shape[0], k) and lse.shape == (x.shape[0],)
    assert torch.equal(v, want_v)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,width,k", [
    (3, 7, 1), (2, 7, 7), (4, 100, 4),            # one chunk, k = V
    (2, BLOCK, 8), (3, BLOCK + 2, 4),             # exactly one chunk; a last chunk of 2 < k
    (2, 3 * BLOCK + 1000, 5), (1, 128256, 4),     # several chunks; Llama-3's vocabulary
])
def test_topk_logsumexp_matches_torch(n, width, k):
    x = _distinct(n, width, seed=width + k)
    _check_against_torch(x, k, torch.tensor(3.7))


def test_bf16_and_strided_rows():
    """bf16 logits (values exact in fp32), and rows that are a column slice of a wider tensor."""
    wide = _distinct(3, 2 * BLOCK + 300, seed=1) * 0.5
    x = wide[:, 100:100 + BLOCK + 77]                        # stride(0) != width
    assert not x.is_contiguous()
    _check_against_torch(x, 6, torch.tensor(0.8))
    xb = _distinct(2, BLOCK + 9, seed=2).to(torch.bfloat16)  # ties possible in bf16: values only
    v, i, lse = topk_logsumexp(xb, 4, torch.tensor(2.0), impl="triton")
    want_v, _, want_lse = topk_logsumexp_torch(xb, 4, torch.tensor(2.0))
    assert torch.equal(v, want_v)
    assert torch.equal(xb.float().gather(1, i), v)           # the indices hold those values
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_index():
    """Equal values within a chunk and across chunks: the lowest indices, in order."""
    x = torch.zeros(2, 2 * BLOCK + 5)
    x[0, [9, 3, BLOCK + 1, 2 * BLOCK + 4]] = 5.0             # four equal maxima over three chunks
    x[1, :] = 1.0                                            # all equal
    v, i, _ = topk_logsumexp(x, 3, torch.tensor(1.0), impl="triton")
    assert i.tolist() == [[3, 9, BLOCK + 1], [0, 1, 2]]
    assert v.tolist() == [[5.0] * 3, [1.0] * 3]


def test_minus_inf_logits_and_a_row_of_them():
    """A masked vocabulary (-inf) is never picked over a finite logit; a row that is all -inf
    gives lse -inf (torch's value) and the lowest indices."""
    x = _distinct(3, BLOCK + 50, seed=3)
    x[0, : BLOCK + 47] = float("-inf")                       # 3 finite logits left, k = 4
    x[2] = float("-inf")
    v, i, lse = topk_logsumexp(x, 4, torch.tensor(1.5), impl="triton")
    want_v, want_i, want_lse = topk_logsumexp_torch(x, 4, torch.tensor(1.5))
    assert torch.equal(v, want_v)
    assert torch.equal(i[0, :3], want_i[0, :3]) and v[0, 3] == float("-inf")
    assert torch.equal(i[1], want_i[1])
    assert i[2].tolist() == [0, 1, 2, 3]
    assert torch.isfinite(lse[:2]).all() and lse[2] == float("-inf") == want_lse[2]
    torch.testing.assert_close(lse[:2], want_lse[:2], rtol=1e-5, atol=1e-5)


def test_temperature_is_read_from_the_tensor_each_call():
    """The scale is a device value (a captured graph follows a changed parameter)."""
    x = _distinct(2, 3000, seed=4)
    t = torch.tensor(1.0)
    _, _, a = topk_logsumexp(x, 2, t, impl="triton")
    t.fill_(4.0)
    _, _, b = topk_logsumexp(x, 2, t, impl="triton")
    torch.testing.assert_close(b, torch.logsumexp(4.0 * x, dim=-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, b)


def test_empty_batch_and_errors():
    v, i, lse = topk_logsumexp(torch.zeros(0, 50), 3, torch.tensor(1.0), impl="triton")
    assert v.shape == (0, 3) and i.shape == (0, 3) and lse.shape == (0,)
    with pytest.raises(ValueError, match="k must be"):
        topk_logsumexp(torch.zeros(2, 5), 6, torch.tensor(1.0), impl="triton")
    with pytest.raises(ValueError, match="k must be"):
        topk_logsumexp(torch.zeros(2, 5), 0, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"\[n, V\]"):
        topk_logsumexp(torch.zeros(5), 1, torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale"):
        topk_logsumexp(torch.zeros(2, 5), 1, torch.ones(2))


def test_large_k_falls_back_to_torch():
    x = _distinct(2, 500, seed=5)
    v, i, lse = topk_logsumexp(x, topk_mod.K_MAX + 1, torch.tensor(1.0), impl="triton")
    want = topk_logsumexp_torch(x, topk_mod.K_MAX + 1, torch.tensor(1.0))
    assert torch.equal(v, want[0]) and torch.equal(i, want[1])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_opaque_under_torch_compile(impl):
    """fullgraph compile: the op is one opaque node (shapes from its fake), the kernels (or the
    torch reference) run at call time, results equal the eager call."""
    torch._dynamo.reset()
    x = _distinct(3, BLOCK + 123, seed=6)
    t = torch.tensor(2.5)

    def draft_probs(x, t):
        top, i, lse = topk_logsumexp(x * 1.0, 4, t, impl=impl)
        return torch.exp(t * top - lse[:, None]), i

    p, i = torch.compile(draft_probs, fullgraph=True, backend="aot_eager")(x, t)
    want_p, want_i = draft_probs(x, t)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(p, want_p)


def test_autograd_runs_the_differentiable_reference():
    """The kernels have no backward: with grad recorded, the torch reference runs, so gradients
    reach the logits and the temperature (eager and compiled alike)."""
    x = _distinct(2, 300, seed=7).requires_grad_()
    t = torch.tensor(2.0, requires_grad=True)
    x2, t2 = x.detach().clone().requires_grad_(), t.detach().clone().requires_grad_()
    v, i, lse = topk_logsumexp(x, 3, t, impl="triton")
    (v.sum() + lse.sum()).backward()
    v2, i2, lse2 = topk_logsumexp_torch(x2, 3, t2)
    (v2.sum() + lse2.sum()).backward()
    assert torch.equal(i, i2) and torch.equal(x.grad, x2.grad)
    torch.testing.assert_close(t.grad, t2.grad)
    assert t.grad != 0
    torch._dynamo.reset()
    t.grad = None
    _, _, lse3 = torch.compile(lambda x, t: topk_logsumexp(x, 3, t), fullgraph=True,
                               backend="aot_eager")(x, t)
    lse3.sum().backward()
    torch.testing.assert_close(lse3, lse2.detach())
    assert t.grad is not None and t.grad != 0


@pytest.mark.parametrize("block,num_warps", [(16, 1), (512, 2), (1024, 1)])
def test_tuning_knobs_give_the_same_result(block, num_warps):
    """Chunk widths and warps the benchmark sweeps give torch's result: 63 chunks of 16
    columns, last chunks of 11 of 16 and 491 of 512 columns, one chunk of 1024."""
    from padgraph.backends.triton.topk import topk_logsumexp_triton
    x = _distinct(3, 1003, seed=block)
    t = torch.tensor(1.3)
    v, i, lse = topk_logsumexp_triton(x, 5, t, block=block, num_warps=num_warps)
    want_v, want_i, want_lse = topk_logsumexp_torch(x, 5, t)
    assert torch.equal(v, want_v) and torch.equal(i, want_i)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        topk_logsumexp_triton(x, 5, t, block=1000)


def test_infinite_and_nan_logits():
    """+inf logits: picked first, lse +inf (torch's); NaN rows: indices stay in [0, V), so a
    draft token never indexes past the embedding."""
    x = _distinct(3, BLOCK + 40, seed=8)
    x[0, [7, BLOCK + 3]] = float("inf")
    x[1] = float("nan")
    x[2, 100:200] = float("nan")
    v, i, lse = topk_logsumexp(x, 4, torch.tensor(2.0), impl="triton")
    want_v, want_i, want_lse = topk_logsumexp_torch(x, 4, torch.tensor(2.0))
    assert i[0, :2].tolist() == [7, BLOCK + 3] and torch.equal(v[0], want_v[0])
    assert lse[0] == float("inf") == want_lse[0]
    assert ((i >= 0) & (i < x.shape[1])).all()
    assert torch.isnan(lse[1:]).all() and torch.isnan(want_lse[1:]).all()
