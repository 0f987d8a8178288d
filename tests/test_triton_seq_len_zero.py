"""seq_lens[r] == 0: the request attends to nothing, and the decode / tree-verify / MLA decode /
MLA verify kernels give 0 for its rows, as the torch references do (split 0 runs with no tile
and writes the zero; the other splits and the merge skip the row). `fill_uninitialized_memory`
(NaN fill of torch.empty) makes a missed row deterministic."""
import contextlib

import pytest
import torch

from padgraph.backends.triton.attention import (
    decode_attention, decode_attention_reference, tree_verify_attention,
    tree_verify_attention_reference)
from padgraph.backends.triton.attention_mla import (
    mla_decode_attention, mla_tree_verify_attention)


@contextlib.contextmanager
def nan_filled_empty():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]   # cpu: the interpreter


def close(out, ref, zero_rows):
    """The seq_len-0 rows exactly 0 (NaN if never written); the others as the fp32 reference, to
    the interpreter's fp32 rounding on the CPU and to TF32 dot products on a GPU."""
    assert ref[zero_rows].abs().sum() == 0
    assert out[zero_rows].isnan().sum() == 0 and out[zero_rows].abs().sum() == 0, out[zero_rows]
    tol = 1e-4 if out.device.type == "cpu" else 5e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def paged(lens, n_kv, hd, seed=0, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    n_slots = sum(lens) + 1
    k = torch.randn(n_slots, n_kv, hd, generator=g)
    v = torch.randn(n_slots, n_kv, hd, generator=g)
    r2t = torch.zeros(len(lens) + 1, max(lens + [1]), dtype=torch.int32)
    perm = (torch.randperm(sum(lens), generator=g) + 1).tolist()
    for r, n in enumerate(lens):
        r2t[r + 1, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    rows = torch.arange(1, len(lens) + 1, dtype=torch.int32)
    return tuple(t.to(dev) for t in (k, v, r2t, rows, torch.tensor(lens, dtype=torch.int32)))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_seq_len_zero_gives_zero(num_splits, dev):
    k, v, r2t, rows, sl = paged([0, 70], 1, 16, dev=dev)
    q = torch.randn(2, 2, 16).to(dev)
    ref = decode_attention_reference(q, k, v, r2t, rows, sl)
    with nan_filled_empty():
        out = decode_attention(q, k, v, r2t, rows, sl, num_splits=num_splits, impl="triton")
    close(out, ref, 0)


@pytest.mark.parametrize("dev", DEVICES)
def test_tree_verify_seq_len_zero_gives_zero(dev):
    K = 2
    k, v, r2t, rows, sl = paged([0, 9], 1, 16, dev=dev)
    mask = torch.tril(torch.ones(2, K, K, dtype=torch.bool)).to(dev)
    q = torch.randn(2 * K, 2, 16).to(dev)
    ref = tree_verify_attention_reference(q, k, v, r2t, rows, sl, mask)
    with nan_filled_empty():
        out = tree_verify_attention(q, k, v, r2t, rows, sl, mask, num_splits=2, impl="triton")
    close(out, ref, slice(0, K))


@pytest.mark.parametrize("dev", DEVICES)
def test_mla_decode_seq_len_zero_gives_zero(dev):
    r, rope = 16, 16
    lat, _, r2t, rows, sl = paged([0, 40], 1, r + rope, dev=dev)
    q = torch.randn(2, 2, r + rope).to(dev)
    ref = mla_decode_attention(q, lat, r2t, rows, sl, r, 0.2, impl="torch")
    with nan_filled_empty():
        out = mla_decode_attention(q, lat, r2t, rows, sl, r, 0.2, num_splits=2, impl="triton")
    close(out, ref, 0)


@pytest.mark.parametrize("dev", DEVICES)
def test_mla_tree_verify_seq_len_zero_gives_zero(dev):
    r, rope, K = 16, 16, 2
    lat, _, r2t, rows, sl = paged([0, 9], 1, r + rope, dev=dev)
    mask = torch.tril(torch.ones(2, K, K, dtype=torch.bool)).to(dev)
    q = torch.randn(2 * K, 2, r + rope).to(dev)
    ref = mla_tree_verify_attention(q, lat, r2t, rows, sl, mask, r, 0.2, impl="torch")
    with nan_filled_empty():
        out = mla_tree_verify_attention(q, lat, r2t, rows, sl, mask, r, 0.2, num_splits=2,
                                        impl="triton")
    close(out, ref, slice(0, K))
