"""The fused tail (final RMSNorm + lm_head + argmax, `backends/triton/fused_tail.py`),
interpreted on CPU, against its torch reference and torch.argmax / topk's ranking; cuda-marked:
the full 128256 vocabulary against cuBLAS, with and without PDL, and under graph replay.

Sizes are awkward on purpose: vocabularies that are not a multiple of the chunk (a ragged last
chunk), H not a multiple of the K step, 20 rows (two row blocks of 16). The ranking cases put
chosen logits in one row through a one-hot input (RMSNorm of [4, 0, ...] over H 16 is [4, 0,
...] exactly with eps 0, so logits = 4 * lm_head[:, 0]): ties inside a chunk and across chunks,
NaN (torch.argmax: the first NaN), +-inf, a maximum in the ragged last chunk."""
import math

import pytest
import torch

from padgraph.backends.triton import fused_decode as fd
from padgraph.backends.triton import fused_tail as ft
from padgraph.errors import ContractValueError

DTYPES = [torch.float16, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=3e-2, atol=3e-2)


def _inputs(m, h, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, h, generator=g) * 2).to(dtype)
    norm_w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.1).to(dtype)
    return x, norm_w, w


@pytest.mark.parametrize("m,h,v,block_v", [(1, 80, 300, 32), (5, 100, 256, 64), (16, 64, 130, 16),
                                           (20, 48, 200, 32), (64, 48, 100, 32),
                                           (70, 48, 100, 32), (70, 48, 100, -32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_tail_matches_reference(m, h, v, block_v, dtype):
    """logits=True: the hidden and the fp32 logits of the reference (the lm_head's output
    rounded to the dtype, as `LlamaModel.logits`); logits=False: the same hidden, and ids / gap
    that are exactly `greedy_reference` of the kernel's own logits, and the reference's ids
    where its top two are apart. The sums of squares come as 16-column partials. 20 rows run
    in one 32-row block, 64 in one of 64, 70 in two of 64 (the second mostly masked); a
    negative block_v: tc_rows_as_m, the rows on the dots' M side."""
    x, norm_w, w = _inputs(m, h, v, dtype, seed=m)
    ssq = fd.ssq_partials_reference(x, 16)
    policy = fd.FusedDecodePolicy(tail_block_v=abs(block_v), tc_block_k=32,
                                  tc_rows_as_m=block_v < 0)
    full = ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=True, policy=policy, impl="triton")
    greedy = ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=False, policy=policy, impl="triton")
    ref = ft.lm_head_tail_reference(x, norm_w, 1e-5, w, logits=True)
    assert full.ids is None and greedy.logits is None and full.logits.dtype == torch.float32
    torch.testing.assert_close(full.hidden.float(), ref.hidden.float(), **_tol(dtype))
    torch.testing.assert_close(full.logits, ref.logits, **_tol(dtype))
    assert torch.equal(full.logits, full.logits.to(dtype).float())     # rounded to the dtype
    assert torch.equal(greedy.hidden, full.hidden)
    ids, gap = ft.greedy_reference(full.logits)
    assert torch.equal(greedy.ids, ids) and torch.equal(greedy.gap, gap)
    want_ids, want_gap = ft.greedy_reference(ref.logits)
    clear = want_gap > 2 * _tol(dtype)["atol"]
    assert clear.any() and (greedy.ids[clear] == want_ids[clear]).all()


def _one_hot_case(logits: torch.Tensor, dtype, rows: int = 1):
    """(x, ssq, norm_w, w) whose tail logits are `logits` [V] in each of `rows` rows."""
    h = 16
    x = torch.zeros(rows, h, dtype=dtype)
    x[:, 0] = 4.0
    w = torch.zeros(logits.shape[0], h, dtype=dtype)
    w[:, 0] = (logits / 4).to(dtype)
    return x, fd.ssq_partials_reference(x, 16), torch.ones(h, dtype=dtype), w


def _logits(v: int, at: dict, fill: float = 0.0) -> torch.Tensor:
    out = torch.full((v,), fill)
    for i, value in at.items():
        out[i] = value
    return out


V = 100          # chunks of 16: the last one (96..99) ragged
RANKING = {
    "tie inside a chunk": _logits(V, {3: 2.0, 4: 2.0, 60: 1.0}),
    "tie across chunks": _logits(V, {70: 3.0, 5: 3.0, 40: 3.0}),
    "second in another chunk": _logits(V, {17: 2.5, 90: 2.25, 18: 1.0}),
    "max in the ragged chunk": _logits(V, {99: 1.5, 0: 1.25}),
    "first NaN": _logits(V, {70: math.nan, 9: math.nan, 30: 5.0}),
    "NaN after the max": _logits(V, {2: 8.0, 50: math.nan}),
    "+inf twice": _logits(V, {80: math.inf, 40: math.inf}),
    "all -inf": _logits(V, {}, fill=-math.inf),
    "-inf but one": _logits(V, {98: -3.0}, fill=-math.inf),
    "all equal": _logits(V, {}, fill=0.5),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy on inf / NaN, as the cases mean
@pytest.mark.parametrize("case", list(RANKING))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tail_ranks_as_torch_argmax_and_topk(case, dtype):
    """ids = torch.argmax (the first maximum; the first NaN over everything), gap = top-1 minus
    top-2 of torch.topk (NaN where either is NaN or both are the same infinity), 3 rows."""
    logits = RANKING[case]
    x, ssq, norm_w, w = _one_hot_case(logits, dtype, rows=3)
    policy = fd.FusedDecodePolicy(tail_block_v=16, tc_block_k=16)
    got = ft.lm_head_tail(x, ssq, norm_w, 0.0, w, logits=False, policy=policy, impl="triton")
    full = ft.lm_head_tail(x, ssq, norm_w, 0.0, w, logits=True, policy=policy, impl="triton")
    torch.testing.assert_close(full.logits, logits.expand(3, V), equal_nan=True, rtol=0, atol=0)
    ids, gap = ft.greedy_reference(logits[None].expand(3, V))
    assert torch.equal(got.ids, ids), (got.ids, ids)
    torch.testing.assert_close(got.gap, gap, equal_nan=True, rtol=0, atol=0)


def test_the_greedy_tail_is_one_launch_more_than_the_logits_one(monkeypatch):
    """logits=True: the norm + lm_head kernel alone (the sampler reads its logits); logits=False:
    it and the per-row reduce, no [M, V] buffer allocated."""
    x, norm_w, w = _inputs(3, 32, 64, torch.float16)
    ssq = fd.ssq_partials_reference(x, 16)
    launched = []
    for name in ("_lm_head_kernel", "_argmax_reduce_kernel"):
        kernel = getattr(ft, name)
        monkeypatch.setattr(ft, name, _Counting(kernel, name, launched))
    ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=True, impl="triton")
    assert launched == ["_lm_head_kernel"]
    ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=False, impl="triton")
    assert launched == ["_lm_head_kernel", "_lm_head_kernel", "_argmax_reduce_kernel"]


class _Counting:
    """A kernel whose launches (`kernel[grid](...)`) are recorded by name."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def test_the_tail_refuses_what_it_cannot_take():
    x, norm_w, w = _inputs(3, 32, 64, torch.bfloat16)
    ssq = fd.ssq_partials_reference(x, 16)
    with pytest.raises(ContractValueError, match="'ssq'.*\\[P >= 1, 3\\] fp32"):
        ft.lm_head_tail(x, ssq[:, :2].contiguous(), norm_w, 1e-5, w, logits=False, impl="triton")
    with pytest.raises(ContractValueError, match="'lm_head'.*weight"):
        ft.lm_head_tail(x, ssq, norm_w, 1e-5, w[:, :16], logits=False, impl="triton")
    with pytest.raises(ContractValueError, match="fused_tail.*'lm_head'.*>= 2 rows"):
        ft.lm_head_tail(x, ssq, norm_w, 1e-5, w[:1], logits=False, impl="triton")
    with pytest.raises(ContractValueError, match="tail_block_v must be a power of two >= 16"):
        ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=False,
                        policy=fd.FusedDecodePolicy(tail_block_v=8), impl="triton")


# ------------------------------------------------------------------------------------ CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 4, 16, 40, 64, 70])
def test_cuda_tail_at_the_1b_vocab_matches_cublas_and_replays_bit_for_bit(m):
    """H 2048, V 128256 (1002 programs of 128 vocabulary rows, the rows in blocks of 16, 32 or
    64): logits close to cuBLAS's (the lm_head in bf16, upcast), ids equal where the top two are apart, ids / gap exactly the kernel logits'
    argmax and top-2 gap, the same bits with and without PDL, and under graph replay."""
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 2048, generator=g) * 2).to("cuda", torch.bfloat16)
    norm_w = (torch.rand(2048, generator=g) + 0.5).to("cuda", torch.bfloat16)
    w = (torch.randn(128256, 2048, generator=g) * 0.02).to("cuda", torch.bfloat16)
    ssq = fd.ssq_partials_reference(x, 16)
    ref = ft.lm_head_tail_reference(x, norm_w, 1e-5, w, logits=True)
    runs = {}
    for pdl in (False, True):
        policy = fd.FusedDecodePolicy(pdl=pdl)
        runs[pdl] = (ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=True, policy=policy),
                     ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=False, policy=policy))
    full, greedy = runs[True]
    for a, b in zip(runs[False], runs[True]):
        for p, q in ((a.hidden, b.hidden), (a.logits, b.logits), (a.ids, b.ids), (a.gap, b.gap)):
            assert p is None or torch.equal(p, q)
    torch.testing.assert_close(full.hidden.float(), ref.hidden.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(full.logits, ref.logits, rtol=2e-2, atol=2e-2)
    ids, gap = ft.greedy_reference(full.logits)
    assert torch.equal(greedy.ids, ids) and torch.equal(greedy.gap, gap)
    want_ids, want_gap = ft.greedy_reference(ref.logits)
    clear = want_gap > 0.05
    assert (greedy.ids[clear] == want_ids[clear]).all()
    if m >= 64:                 # the 64-row dots with the weights as their M side as well
        policy = fd.FusedDecodePolicy(tc_rows_as_m=False)
        full_m = ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=True, policy=policy)
        greedy_m = ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=False, policy=policy)
        torch.testing.assert_close(full_m.logits, ref.logits, rtol=2e-2, atol=2e-2)
        assert torch.equal(full_m.hidden, full.hidden)
        ids_m, gap_m = ft.greedy_reference(full_m.logits)
        assert torch.equal(greedy_m.ids, ids_m) and torch.equal(greedy_m.gap, gap_m)
        assert (greedy_m.ids[clear] == want_ids[clear]).all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ft.lm_head_tail(x, ssq, norm_w, 1e-5, w, logits=False)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.ids, greedy.ids) and torch.equal(out.gap, greedy.gap)
