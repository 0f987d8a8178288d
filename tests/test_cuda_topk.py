"""GPU tests of the draft's top-k + log-sum-exp kernels at Llama-3's vocabulary (128256): equal
to torch.topk / torch.logsumexp on fp32 and bf16 logits, inside a captured CUDA graph (new
logits and a new temperature at replay), and as an opaque op in an inductor graph; the fp8 draft
lm_head's scaled GEMM, and the fused fp8 lm_head + top-k kernel against its fp32 reference.

Run on a GPU: `pytest -m cuda tests/test_cuda_topk.py` (skipped without one).
"""

import pytest
import torch

from padgraph.backends.triton.topk import topk_logsumexp, topk_logsumexp_torch


pytestmark = pytest.mark.cuda
V = 128256


def _logits(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (3 * torch.randn(n, V, device="cuda", generator=g)).to(dtype)


@pytest.mark.parametrize("n,k", [(1, 1), (16, 4), (64, 4), (80, 8)])
def test_matches_torch_fp32(n, k):
    x, t = _logits(n, torch.float32, n + k), torch.tensor(6.1, device="cuda")
    v, i, lse = topk_logsumexp(x, k, t)
    want_v, want_i, want_lse = topk_logsumexp_torch(x, k, t)
    assert torch.equal(v, want_v) and torch.equal(i, want_i)      # distinct values (a.s.)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-4)


def test_matches_torch_bf16_with_ties():
    """bf16 logits tie often: the same values as torch, indices holding them, the lowest index
    first among equals."""
    x, t = _logits(64, torch.bfloat16, 7), torch.tensor(2.0, device="cuda")
    v, i, lse = topk_logsumexp(x, 4, t)
    want_v, _, want_lse = topk_logsumexp_torch(x, 4, t)
    assert torch.equal(v, want_v)
    assert torch.equal(x.float().gather(1, i), v)
    same = v[:, 1:] == v[:, :-1]
    assert (i[:, 1:][same] > i[:, :-1][same]).all()
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-4)


def test_replays_in_a_cuda_graph_with_new_logits_and_temperature():
    x, t = _logits(64, torch.bfloat16, 1), torch.tensor(1.0, device="cuda")
    topk_logsumexp(x, 4, t)                                    # JIT outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        v, i, lse = topk_logsumexp(x, 4, t)
    for seed, temp in ((2, 3.0), (3, 0.5)):
        x.copy_(_logits(64, torch.bfloat16, seed))
        t.fill_(temp)
        g.replay()
        want_v, _, want_lse = topk_logsumexp_torch(x, 4, t)
        assert torch.equal(v, want_v) and torch.equal(x.float().gather(1, i), v)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-4)


def test_opaque_in_an_inductor_graph():
    torch._dynamo.reset()
    x, t = _logits(16, torch.bfloat16, 4), torch.tensor(4.0, device="cuda")

    def probs(x, t):
        top, i, lse = topk_logsumexp(x.float(), 4, t)
        return torch.exp(t * top - lse[:, None]), i

    p, i = torch.compile(probs, fullgraph=True)(x, t)
    want_p, want_i = probs(x, t)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(p, want_p)


def test_fp8_draft_lm_head_on_the_gpu():
    """The e4m3 lm_head of a 1B-shaped head: bf16 logits near the target's, top-1 mostly the
    same; the draft's top-k over them runs (rowwise-scaled GEMM on sm90). Random hiddens over a
    random 128256-row lm_head have top-2 gaps of the order of the quantization error, so the
    top-1 agreement here (0.86 on the H200) is lower than on text-like logits; what decides is
    the accept length of the main job (3.46 with fp8 against 3.40 with bf16 in one run)."""
    from padgraph.llm.models.draft_head import fp8_logits
    from padgraph.llm.models.eagle_head import EagleHead
    from padgraph.llm.models.llama import LlamaConfig, LlamaModel
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.llama_1b(n_layers=1)).cuda().bfloat16().eval()
    head = EagleHead(target).cuda().bfloat16()
    head.set_draft_lm_head("fp8")
    h = torch.randn(64, target.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    want, got = target.logits(h), fp8_logits(h, head.fp8_weight, head.fp8_scale).float()
    assert (got - want).abs().max() / want.abs().max() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    p, ids = head.topk(h, 4)
    assert p.shape == ids.shape == (64, 4) and (p > 0).all() and (p.sum(-1) <= 1 + 1e-4).all()


@pytest.mark.parametrize("n", [16, 64, 100])
def test_fused_fp8_lm_head_topk_at_the_1b_shape(n):
    """The fused fp8 lm_head + top-k kernel at [n, 2048] x [128256, 2048] against its fp32
    reference: the same values and lse up to summation order, indices that hold them. The bound
    is 1e-3: Hopper's fp8 tensor cores accumulate with fewer mantissa bits than fp32 inside each
    BLOCK_H step, and the kernel promotes after every step; unpromoted (Triton's sm90 default)
    the whole hidden accumulated that way was 3.5e-3 off at n = 64 and 100."""
    from padgraph.llm.models.draft_head import fp8_rows
    from padgraph.backends.triton.lm_head_topk import fp8_lm_head_topk, fp8_lm_head_topk_torch
    g = torch.Generator(device="cuda").manual_seed(n)
    x8, sx = fp8_rows(torch.randn(n, 2048, device="cuda", generator=g))
    w8, sw = fp8_rows(0.02 * torch.randn(V, 2048, device="cuda", generator=g))
    sw = sw.t().contiguous()
    t = torch.tensor(6.0, device="cuda")
    v, i, lse = fp8_lm_head_topk(x8, sx, w8, sw, 4, t)
    want_v, _, want_lse = fp8_lm_head_topk_torch(x8, sx, w8, sw, 4, t)
    torch.testing.assert_close(v, want_v, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=1e-3)
    logits = (x8.float() @ w8.float().t()) * sx * sw
    torch.testing.assert_close(logits.gather(1, i), v, rtol=1e-3, atol=1e-3)
    assert ((i >= 0) & (i < V)).all()
