"""topk_logsumexp: a row holding a NaN gives lse NaN, as torch's logsumexp, also where a chunk
holds NaN and no finite logit (rows narrower than a chunk, a last partial chunk, -inf with NaN):
the merge keeps a chunk whose max is -inf when its sum is NaN."""
import pytest
import torch

from padgraph.backends.triton.topk import topk_logsumexp, topk_logsumexp_torch


def _rows(V):
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(V))
    x[0] = float("nan")                        # all NaN
    x[1] = float("-inf")
    x[1, V // 2] = float("nan")                # -inf and one NaN
    x[2, : V // 2] = float("-inf")
    x[2, V // 2:] = float("nan")               # -inf then NaN
    return x


@pytest.mark.parametrize("V,k", [(7, 1), (7, 7), (300, 4), (600, 3)])
def test_nan_row_gives_nan_lse(V, k):
    x = _rows(V)
    v, i, lse = topk_logsumexp(x, k, torch.tensor(1.0), impl="triton")
    _, _, want = topk_logsumexp_torch(x, k, torch.tensor(1.0))
    assert torch.isnan(want).all()
    assert ((i >= 0) & (i < V)).all()          # holds
    assert torch.isnan(lse).all(), f"lse {lse.tolist()} (torch: {want.tolist()})"
