"""GPU tests of the paged attention kernels: realistic sizes in bf16 against an fp64 reference,
and each kernel captured once in a `torch.cuda.CUDAGraph` at a padded bucket, then replayed
with new lengths / request rows written into the static buffers.

Run on a GPU: `pytest -m cuda tests/test_cuda_attention.py` (skipped without one).
"""
import pytest
import torch

from attention_cases import random_tree_masks
from padgraph.backends.triton.attention import (
    decode_attention, decode_attention_reference, extend_attention, extend_attention_reference,
    tree_verify_attention, tree_verify_attention_reference)
from padgraph.backends.triton.attention_decode import (SplitPolicy, _split_kv_kernel,
                                                       split_kv_attention)
from padgraph.backends.triton.attention_meta import PagedMeta
from padgraph.backends.triton.attention_split import _COUNTERS, _merge_kernel
from padgraph.backends.triton.store import store_kv, store_kv_reference

pytestmark = pytest.mark.cuda

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
PAD = None  # a padded lane in a list of lengths: seq_len 1, row 0


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class Paged:
    """A bf16 paged cache on the GPU with shuffled slots; rows 1.. hold requests, row 0 the sink."""

    def __init__(self, n_slots, n_rows, max_context, seed=0):
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.k = torch.randn(n_slots, N_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE,
                             generator=self.gen)
        self.v = torch.randn(n_slots, N_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE,
                             generator=self.gen)
        self.req_to_token = torch.zeros(n_rows, max_context, dtype=torch.int32, device="cuda")
        self.perm = torch.randperm(n_slots - 1, device="cuda", generator=self.gen) + 1
        self.next_row, self.next_slot = 1, 0

    def requests(self, lens):
        """Fill fresh rows for `lens` (PAD -> row 0, length 1): (rows, seq_lens) int32."""
        rows, seq_lens = [], []
        for n in lens:
            if n is PAD:
                rows.append(0)
                seq_lens.append(1)
                continue
            slots = self.perm[self.next_slot:self.next_slot + n]
            assert slots.numel() == n, "test cache too small"
            self.req_to_token[self.next_row, :n] = slots.int()
            rows.append(self.next_row)
            seq_lens.append(n)
            self.next_row += 1
            self.next_slot += n
        as_i32 = dict(dtype=torch.int32, device="cuda")
        return torch.tensor(rows, **as_i32), torch.tensor(seq_lens, **as_i32)

    def q(self, n):
        return torch.randn(n, N_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE,
                           generator=self.gen)

    def f64(self):
        return self.k.double(), self.v.double()


def capture(fn):
    """Warm fn up on a side stream (compiles the kernels), then capture it: (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_bf16_vs_fp64(num_splits):
    lens = [4096, 1, PAD, 777, 8191, 17, PAD, 2048]
    cache = Paged(n_slots=16384, n_rows=16, max_context=8192)
    rows, seq_lens = cache.requests(lens)
    q = cache.q(len(lens))
    out = decode_attention(q, cache.k, cache.v, cache.req_to_token, rows, seq_lens,
                           num_splits=num_splits)
    ref = decode_attention_reference(q.double(), *cache.f64(), cache.req_to_token, rows,
                                     seq_lens)
    assert out.dtype == DTYPE and torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("fold", [True, False])
def test_decode_merge_folded_or_separate_vs_fp64(fold):
    # 40 splits: the last split of each (request, kv head) merges, or the merge kernel does
    lens = [8191, 1, PAD, 777, 4096, 300]
    cache = Paged(n_slots=16384, n_rows=16, max_context=8192)
    rows, seq_lens = cache.requests(lens)
    q = cache.q(len(lens))
    ref = decode_attention_reference(q.double(), *cache.f64(), cache.req_to_token, rows,
                                     seq_lens)
    for _ in range(3):  # the counters must come back zeroed after every launch
        meta = PagedMeta.decode(cache.req_to_token, rows, seq_lens)
        out = split_kv_attention(q, cache.k, cache.v, meta, HEAD_DIM ** -0.5,
                                 SplitPolicy(num_splits=40, fold=fold))
        assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def n_compiled(kernel) -> int:
    """Distinct compiled variants of a Triton kernel, over devices."""
    return sum(len({id(k) for k in caches[0].values()}) for caches in
               kernel.device_caches.values())


def test_every_split_count_runs_one_compiled_kernel():
    # the split count, the fold flag and the partials' strides are runtime values: a ladder of
    # buckets (split counts 1 .. 128, folded and not) compiles the split kernel once for each
    # loop (bs 1's double-buffered one, `choose_prefetch`, and the one of larger batches)
    cache = Paged(n_slots=16384, n_rows=40, max_context=8192)
    rows, seq_lens = cache.requests([5000, 1, 64] + [PAD] * 29)
    q = cache.q(32)
    runs = [(bs, None) for bs in (1, 2, 4, 8, 16, 32)] + [(4, 1), (4, 3), (4, 128), (1, 128),
                                                          (1, 1)]
    for bs, splits in runs[:2]:
        decode_attention(q[:bs], cache.k, cache.v, cache.req_to_token, rows[:bs], seq_lens[:bs])
    before = n_compiled(_split_kv_kernel), n_compiled(_merge_kernel)
    for bs, splits in runs:
        out = decode_attention(q[:bs], cache.k, cache.v, cache.req_to_token, rows[:bs],
                               seq_lens[:bs], num_splits=splits)
        ref = decode_attention_reference(q[:bs].double(), *cache.f64(), cache.req_to_token,
                                         rows[:bs], seq_lens[:bs])
        assert rel_err(out, ref) < 1e-2, f"{bs=} {splits=}"
    after = n_compiled(_split_kv_kernel), n_compiled(_merge_kernel)
    assert after[0] == before[0], f"split kernel compiled {after[0] - before[0]} more variants"
    assert after[1] <= before[1] + 1, "the merge kernel compiles at most once"


def test_extend_bf16_vs_fp64():
    # (seq_len, new tokens): a full prefill, a chunk after a prefix, a 1-token, a pad, a 0-token
    reqs = [(2048, 2048), (4096, 300), (1, 1), (PAD, 0), (513, 0), (700, 64)]
    cache = Paged(n_slots=8192, n_rows=8, max_context=4096)
    rows, seq_lens = cache.requests([n for n, _ in reqs])
    qo_indptr = torch.tensor([0] + [m for _, m in reqs], device="cuda").cumsum(0).int()
    n_pad_tokens = 29
    q = cache.q(int(qo_indptr[-1]) + n_pad_tokens)
    out = extend_attention(q, cache.k, cache.v, cache.req_to_token, rows, seq_lens, qo_indptr)
    ref = extend_attention_reference(q.double(), *cache.f64(), cache.req_to_token, rows,
                                     seq_lens, qo_indptr)
    assert rel_err(out, ref) < 1e-2
    assert out[-n_pad_tokens:].abs().sum() == 0


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_draft_extend_bf16_vs_fp64(num_splits):
    # EAGLE's draft-extend: a few accepted tokens per request (<= steps + 1), long prefixes; the
    # policy splits the context (merge folded in the same launch)
    reqs = [(4000, 6), (PAD, 0), (17, 3), (2500, 1), (6, 6), (3000, 4)]
    cache = Paged(n_slots=16384, n_rows=8, max_context=4096)
    rows, seq_lens = cache.requests([n for n, _ in reqs])
    qo_indptr = torch.tensor([0] + [m for _, m in reqs], device="cuda").cumsum(0).int()
    n_pad_tokens = 6 * len(reqs) - int(qo_indptr[-1])
    q = cache.q(6 * len(reqs))
    ref = extend_attention_reference(q.double(), *cache.f64(), cache.req_to_token, rows,
                                     seq_lens, qo_indptr)
    for _ in range(2):
        out = extend_attention(q, cache.k, cache.v, cache.req_to_token, rows, seq_lens,
                               qo_indptr, num_splits=num_splits)
        n_real = int(qo_indptr[-1])
        assert rel_err(out[:n_real], ref[:n_real]) < 1e-2
        assert out[n_real:].abs().sum() == 0 and n_pad_tokens > 0
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


@pytest.mark.parametrize("k", [4, 8])
def test_tree_verify_bf16_vs_fp64(k):
    lens = [3000 + k, PAD, 5 + k, k, 1500 + k]
    cache = Paged(n_slots=8192, n_rows=8, max_context=4096)
    rows, seq_lens = cache.requests(lens)
    masks = random_tree_masks(len(lens), k, torch.Generator().manual_seed(k)).to("cuda")
    masks[1] = True  # padded lane: mask of ones
    q = cache.q(len(lens) * k)
    out = tree_verify_attention(q, cache.k, cache.v, cache.req_to_token, rows, seq_lens, masks)
    ref = tree_verify_attention_reference(q.double(), *cache.f64(), cache.req_to_token, rows,
                                          seq_lens, masks)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2


def test_store_kv_cuda():
    cache = Paged(n_slots=4096, n_rows=2, max_context=16)
    loc = (torch.randperm(4095, device="cuda")[:300] + 1).int()
    loc[-5:] = 0  # padded lanes write the sink
    k, v = cache.q(300)[:, :N_KV_HEADS], cache.q(300)[:, :N_KV_HEADS]  # strided views
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    k[-5:], v[-5:] = k[-1].clone(), v[-1].clone()
    store_kv_reference(k_ref, v_ref, loc, k, v)
    store_kv(cache.k, cache.v, loc, k, v)
    assert torch.equal(cache.k, k_ref) and torch.equal(cache.v, v_ref)


# ----------------------------------------------------------------------------- CUDA graphs

def set_lanes(rows_buf, lens_buf, rows, seq_lens):
    """Write a real batch into a bucket's static buffers; the tail lanes become pads."""
    n = rows.numel()
    rows_buf.zero_()
    lens_buf.fill_(1)
    rows_buf[:n] = rows
    lens_buf[:n] = seq_lens


def test_decode_in_cuda_graph_with_store():
    bucket = 16
    cache = Paged(n_slots=32768, n_rows=32, max_context=8192)
    rows_buf = torch.zeros(bucket, dtype=torch.int32, device="cuda")
    lens_buf = torch.ones(bucket, dtype=torch.int32, device="cuda")
    loc_buf = torch.zeros(bucket, dtype=torch.int32, device="cuda")
    q_buf, k_new, v_new = cache.q(bucket), cache.q(bucket), cache.q(bucket)

    def step():  # a model step: store the new token's KV, then attend
        store_kv(cache.k, cache.v, loc_buf, k_new[:, :N_KV_HEADS], v_new[:, :N_KV_HEADS])
        return decode_attention(q_buf, cache.k, cache.v, cache.req_to_token, rows_buf,
                                lens_buf)

    set_lanes(rows_buf, lens_buf, *cache.requests([100, 5]))
    graph, out = capture(step)
    for lens in ([8000, 1, 300, 4096, 33], [7, 6000, 1, 1, 2, 3, 900, 8191, 64, 65, 1000]):
        rows, seq_lens = cache.requests(lens)
        set_lanes(rows_buf, lens_buf, rows, seq_lens)
        last = cache.req_to_token[rows.long(), (seq_lens - 1).long()]  # the new token's slot
        loc_buf.zero_()
        loc_buf[:len(lens)] = last
        q_buf.copy_(cache.q(bucket))
        k_new.copy_(cache.q(bucket))
        v_new.copy_(cache.q(bucket))
        graph.replay()
        n = len(lens)
        first = out[:n].clone()   # raw lanes: padded lanes read the sink, which they all write
        for _ in range(3):  # replays find the folded merge's counters zeroed again
            graph.replay()
            assert torch.equal(out[:n], first)
        eager = step()
        assert torch.equal(out[:n], eager[:n])
        ref = decode_attention_reference(q_buf[:n].double(), *cache.f64(), cache.req_to_token,
                                         rows, seq_lens)
        assert rel_err(out[:n], ref) < 1e-2
        assert torch.equal(cache.k[last.long()], k_new[:n, :N_KV_HEADS])


def test_extend_in_cuda_graph():
    bucket_bs, bucket_tok = 4, 512
    cache = Paged(n_slots=16384, n_rows=16, max_context=4096)
    rows_buf = torch.zeros(bucket_bs, dtype=torch.int32, device="cuda")
    lens_buf = torch.ones(bucket_bs, dtype=torch.int32, device="cuda")
    indptr_buf = torch.zeros(bucket_bs + 1, dtype=torch.int32, device="cuda")
    q_buf = cache.q(bucket_tok)

    def step():
        return extend_attention(q_buf, cache.k, cache.v, cache.req_to_token, rows_buf, lens_buf,
                                indptr_buf)

    def set_batch(reqs):
        rows, seq_lens = cache.requests([n for n, _ in reqs])
        set_lanes(rows_buf, lens_buf, rows, seq_lens)
        counts = torch.tensor([m for _, m in reqs] + [0] * (bucket_bs - len(reqs)))
        indptr_buf.zero_()
        indptr_buf[1:] = counts.cumsum(0).int().cuda()  # pad lanes: 0 new tokens
        q_buf.copy_(cache.q(bucket_tok))
        return rows, seq_lens

    set_batch([(64, 64)])
    graph, out = capture(step)
    for reqs in ([(3000, 200), (17, 17)], [(1, 1), (4000, 100), (300, 250), (129, 0)]):
        rows, seq_lens = set_batch(reqs)
        graph.replay()
        eager = step()
        assert torch.equal(out, eager)
        n_real = sum(m for _, m in reqs)
        assert out[n_real:].abs().sum() == 0
        ref = extend_attention_reference(q_buf.double(), *cache.f64(), cache.req_to_token,
                                         rows, seq_lens, indptr_buf[:len(reqs) + 1])
        assert rel_err(out[:n_real], ref[:n_real]) < 1e-2


def test_tree_verify_in_cuda_graph():
    bucket, k = 8, 4
    cache = Paged(n_slots=16384, n_rows=24, max_context=4096)
    rows_buf = torch.zeros(bucket, dtype=torch.int32, device="cuda")
    lens_buf = torch.ones(bucket, dtype=torch.int32, device="cuda")
    mask_buf = torch.ones(bucket, k, k, dtype=torch.bool, device="cuda")
    q_buf = cache.q(bucket * k)

    def step():
        return tree_verify_attention(q_buf, cache.k, cache.v, cache.req_to_token, rows_buf,
                                     lens_buf, mask_buf)

    set_lanes(rows_buf, lens_buf, *cache.requests([10 + k]))
    graph, out = capture(step)
    gen = torch.Generator().manual_seed(0)
    for lens in ([4000 + k, 3 + k, k], [k, 100 + k, 2500 + k, 1 + k, 3000 + k, 64 + k]):
        rows, seq_lens = cache.requests(lens)
        set_lanes(rows_buf, lens_buf, rows, seq_lens)
        n = len(lens)
        mask_buf.fill_(True)
        mask_buf[:n] = random_tree_masks(n, k, gen).to(mask_buf.device)
        q_buf.copy_(cache.q(bucket * k))
        graph.replay()
        eager = step()
        assert torch.equal(out, eager)
        ref = tree_verify_attention_reference(q_buf[:n * k].double(), *cache.f64(),
                                              cache.req_to_token, rows, seq_lens, mask_buf[:n])
        assert rel_err(out[:n * k], ref) < 1e-2
