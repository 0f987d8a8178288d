"""1-d index / length tensors passed as strided views (a column of a [bs, 2] metadata tensor):
the kernels index them with unit stride, so the launchers make them dense (a no-op for the dense
tensors the runners pass). Decode, extend, store_kv and pack_draft_extend (whose `hidden` may
also be column-strided) against their torch references on the same views."""
import torch

from padgraph.backends.triton import eagle
from padgraph.backends.triton.attention import (
    decode_attention, decode_attention_reference, extend_attention, extend_attention_reference)
from padgraph.backends.triton.store import store_kv, store_kv_reference


def paged(lens, n_kv, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_slots = sum(lens) + 1
    k = torch.randn(n_slots, n_kv, hd, generator=g)
    v = torch.randn(n_slots, n_kv, hd, generator=g)
    r2t = torch.zeros(len(lens) + 1, max(lens), dtype=torch.int32)
    perm = (torch.randperm(sum(lens), generator=g) + 1).tolist()
    for r, n in enumerate(lens):
        r2t[r + 1, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    rows = torch.arange(1, len(lens) + 1, dtype=torch.int32)
    return k, v, r2t, rows, torch.tensor(lens, dtype=torch.int32)


def strided(t):
    """The same values as t, as a stride-2 view (column 0 of a [n, 2] tensor)."""
    return torch.stack([t, torch.full_like(t, 1)], 1)[:, 0]


def test_decode_strided_seq_lens_and_rows():
    k, v, r2t, rows, sl = paged([30, 5, 70], 2, 16)
    q = torch.randn(3, 4, 16)
    ref = decode_attention_reference(q, k, v, r2t, rows, sl)
    assert torch.equal(decode_attention_reference(q, k, v, r2t, strided(rows), strided(sl)), ref)
    out = decode_attention(q, k, v, r2t, strided(rows), strided(sl), num_splits=2, impl="triton")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_extend_strided_qo_indptr():
    k, v, r2t, rows, sl = paged([20, 9], 1, 16)
    ind = torch.tensor([0, 4, 6], dtype=torch.int32)
    q = torch.randn(6, 2, 16)
    ref = extend_attention_reference(q, k, v, r2t, rows, sl, ind)
    out = extend_attention(q, k, v, r2t, rows, sl, strided(ind), impl="triton")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_store_kv_strided_loc_writes_the_right_slots():
    loc = torch.tensor([3, 5, 7], dtype=torch.int32)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    want_k, want_v = torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
    store_kv_reference(want_k, want_v, loc, k, v)
    got_k, got_v = torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
    store_kv(got_k, got_v, strided(loc), k, v, impl="triton")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_pack_draft_extend_hidden_with_column_stride():
    gen = torch.Generator().manual_seed(0)
    bs, n_path, k, H = 2, 3, 3, 8
    accept_len = torch.tensor([2, 3], dtype=torch.int32)
    accept_index = torch.randint(0, k, (bs, n_path), generator=gen)
    out_tokens = torch.randint(0, 100, (bs, n_path), generator=gen)
    hidden = torch.randn(H, bs * k, generator=gen).t()          # [bs*k, H], stride (1, bs*k)
    rt = torch.randperm(640, generator=gen).int().view(20, 32)
    rows, seq_lens = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([4, 9], dtype=torch.int32)
    args = (accept_len, accept_index, out_tokens, hidden, seq_lens, rt, rows, torch.tensor(2))
    ref = eagle.pack_draft_extend(*args, impl="torch")
    tri = eagle.pack_draft_extend(*args, impl="triton")
    for name, a, b in zip(("ids", "pos", "loc", "hidden", "qo_indptr", "seq_lens"), ref, tri):
        assert torch.equal(a, b), name
