"""GPU tests of MLA over a latent cache at DeepSeek-V2-Lite sizes (16 heads, kv_lora_rank 512,
rope 64, nope 128, v 128): the absorbed bf16 kernels against the non-absorbed fp64 reference,
and decode (with `store_latent`) captured once in a `torch.cuda.CUDAGraph` at a padded bucket,
then replayed with new lengths / request rows written into the static buffers.

Run on a GPU: `pytest -m cuda tests/test_cuda_mla.py` (skipped without one).
"""
import pytest
import torch

from attention_cases import random_tree_masks
from padgraph.backends.triton.attention_mla import (
    absorb_query, mla_decode_attention, mla_extend_attention, mla_reference, mla_sm_scale,
    mla_tree_verify_attention, project_output, store_latent)
from padgraph.backends.triton.attention_meta import PagedMeta
from padgraph.backends.triton.attention_mla_decode import (MlaPolicy, _mla_kernel,
                                                           mla_paged_attention)
from padgraph.backends.triton.attention_split import _COUNTERS

pytestmark = pytest.mark.cuda

N_HEADS, KV_LORA_RANK, ROPE, NOPE, V_DIM = 16, 512, 64, 128, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
PAD = None  # a padded lane in a list of lengths: seq_len 1, row 0
SM_SCALE = mla_sm_scale(NOPE, ROPE)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class Latent:
    """A bf16 latent cache with shuffled slots and MLA weights; rows 1.. hold requests."""

    def __init__(self, n_slots, n_rows, max_context, seed=0, n_heads=N_HEADS):
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.n_heads = n_heads
        self.latent = self.randn(n_slots, 1, KV_LORA_RANK + ROPE)
        # scaled so that up-projected K and V have unit variance
        self.W_UK = self.randn(n_heads, NOPE, KV_LORA_RANK, scale=KV_LORA_RANK ** -0.5)
        self.W_UV = self.randn(n_heads, KV_LORA_RANK, V_DIM, scale=KV_LORA_RANK ** -0.5)
        self.req_to_token = torch.zeros(n_rows, max_context, dtype=torch.int32, device=DEVICE)
        self.perm = torch.randperm(n_slots - 1, device=DEVICE, generator=self.gen) + 1
        self.next_row, self.next_slot = 1, 0

    def randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=self.gen) * scale).to(DTYPE)

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
        as_i32 = dict(dtype=torch.int32, device=DEVICE)
        return torch.tensor(rows, **as_i32), torch.tensor(seq_lens, **as_i32)

    def queries(self, n):
        """(q_nope [n, H, nope], q_rope [n, H, rope], q_latent [n, H, r + rope]) in bf16."""
        q_nope, q_rope = self.randn(n, self.n_heads, NOPE), self.randn(n, self.n_heads, ROPE)
        return q_nope, q_rope, absorb_query(q_nope, q_rope, self.W_UK)

    def reference(self, q_nope, q_rope, rows, seq_lens, **kw):
        """Non-absorbed MLA in fp64 on the same bf16 values."""
        return mla_reference(q_nope.double(), q_rope.double(), self.latent.double(),
                             self.W_UK.double(), self.W_UV.double(), self.req_to_token, rows,
                             seq_lens, SM_SCALE, **kw)

    def output(self, o_latent):
        return project_output(o_latent, self.W_UV)


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_mla_decode_bf16_vs_fp64(num_splits):
    lens = [4096, 1, PAD, 777, 8191, 17, PAD, 2048]
    cache = Latent(n_slots=16384, n_rows=16, max_context=8192)
    rows, seq_lens = cache.requests(lens)
    q_nope, q_rope, q_latent = cache.queries(len(lens))
    o_latent = mla_decode_attention(q_latent, cache.latent, cache.req_to_token, rows, seq_lens,
                                    KV_LORA_RANK, SM_SCALE, num_splits=num_splits)
    assert o_latent.dtype == DTYPE and o_latent.shape == (len(lens), N_HEADS, KV_LORA_RANK)
    assert torch.isfinite(o_latent).all()
    ref = cache.reference(q_nope, q_rope, rows, seq_lens)
    assert rel_err(cache.output(o_latent), ref) < 1e-2


@pytest.mark.parametrize("n_heads", [16, 128])  # 128 (V3-like): 8 row blocks per request
@pytest.mark.parametrize("fold", [True, False])
def test_mla_decode_merge_folded_or_separate_vs_fp64(n_heads, fold):
    lens = [8191, 1, PAD, 777, 2048]
    cache = Latent(n_slots=16384, n_rows=8, max_context=8192, n_heads=n_heads)
    rows, seq_lens = cache.requests(lens)
    q_nope, q_rope, q_latent = cache.queries(len(lens))
    ref = cache.reference(q_nope, q_rope, rows, seq_lens)
    for _ in range(3):  # the counters must come back zeroed after every launch
        meta = PagedMeta.decode(cache.req_to_token, rows, seq_lens)
        o_latent = mla_paged_attention(q_latent, cache.latent, meta, KV_LORA_RANK, SM_SCALE,
                                       MlaPolicy(num_splits=6, fold=fold))
        assert torch.isfinite(o_latent).all()
        assert rel_err(cache.output(o_latent), ref) < 1e-2
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


def n_compiled(kernel) -> int:
    return sum(len({id(k) for k in caches[0].values()}) for caches in
               kernel.device_caches.values())


def test_mla_every_split_count_runs_one_compiled_kernel():
    cache = Latent(n_slots=16384, n_rows=40, max_context=8192)
    rows, seq_lens = cache.requests([5000, 1, 64] + [PAD] * 29)
    q_nope, q_rope, q_latent = cache.queries(32)
    ref = cache.reference(q_nope, q_rope, rows, seq_lens)
    run = lambda bs, splits=None: mla_decode_attention(  # noqa: E731
        q_latent[:bs], cache.latent, cache.req_to_token, rows[:bs], seq_lens[:bs],
        KV_LORA_RANK, SM_SCALE, num_splits=splits)
    run(1)
    before = n_compiled(_mla_kernel)
    for bs, splits in [(2, None), (4, None), (8, None), (32, None), (4, 1), (4, 3), (4, 64)]:
        assert rel_err(cache.output(run(bs, splits)), ref[:bs]) < 1e-2, f"{bs=} {splits=}"
    assert n_compiled(_mla_kernel) == before


def test_mla_extend_bf16_vs_fp64():
    # (seq_len, new tokens): a chunk after a prefix, a full short prefill, 1-token, pad, 0-token
    reqs = [(2048, 256), (300, 300), (1, 1), (PAD, 0), (513, 0), (700, 64)]
    cache = Latent(n_slots=8192, n_rows=8, max_context=4096)
    rows, seq_lens = cache.requests([n for n, _ in reqs])
    qo_indptr = torch.tensor([0] + [m for _, m in reqs], device=DEVICE).cumsum(0).int()
    n_pad_tokens = 29
    q_nope, q_rope, q_latent = cache.queries(int(qo_indptr[-1]) + n_pad_tokens)
    o_latent = mla_extend_attention(q_latent, cache.latent, cache.req_to_token, rows, seq_lens,
                                    qo_indptr, KV_LORA_RANK, SM_SCALE)
    assert o_latent[-n_pad_tokens:].abs().sum() == 0
    ref = cache.reference(q_nope, q_rope, rows, seq_lens, qo_indptr=qo_indptr)
    n_real = int(qo_indptr[-1])
    assert rel_err(cache.output(o_latent)[:n_real], ref[:n_real]) < 1e-2


@pytest.mark.parametrize("k", [4, 8])  # 8 drafts x 16 heads: 4 head groups of 32 rows
def test_mla_tree_verify_bf16_vs_fp64(k):
    lens = [3000 + k, PAD, 5 + k, k, 1500 + k]
    cache = Latent(n_slots=8192, n_rows=8, max_context=4096)
    rows, seq_lens = cache.requests(lens)
    masks = random_tree_masks(len(lens), k, torch.Generator().manual_seed(k)).to(DEVICE)
    masks[1] = True  # padded lane: mask of ones
    q_nope, q_rope, q_latent = cache.queries(len(lens) * k)
    o_latent = mla_tree_verify_attention(q_latent, cache.latent, cache.req_to_token, rows,
                                         seq_lens, masks, KV_LORA_RANK, SM_SCALE)
    assert torch.isfinite(o_latent).all()
    ref = cache.reference(q_nope, q_rope, rows, seq_lens, tree_mask=masks)
    assert rel_err(cache.output(o_latent), ref) < 1e-2


# ----------------------------------------------------------------------------- CUDA graphs

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


def test_mla_decode_in_cuda_graph_with_store():
    bucket = 16
    cache = Latent(n_slots=32768, n_rows=32, max_context=8192)
    rows_buf = torch.zeros(bucket, dtype=torch.int32, device=DEVICE)
    lens_buf = torch.ones(bucket, dtype=torch.int32, device=DEVICE)
    loc_buf = torch.zeros(bucket, dtype=torch.int32, device=DEVICE)
    q_buf = torch.zeros(bucket, N_HEADS, KV_LORA_RANK + ROPE, dtype=DTYPE, device=DEVICE)
    c_kv_new = torch.zeros(bucket, KV_LORA_RANK, dtype=DTYPE, device=DEVICE)
    k_rope_new = torch.zeros(bucket, ROPE, dtype=DTYPE, device=DEVICE)

    def step():  # a model step: store the new token's latent row, then attend
        store_latent(cache.latent, loc_buf, c_kv_new, k_rope_new)
        return mla_decode_attention(q_buf, cache.latent, cache.req_to_token, rows_buf, lens_buf,
                                    KV_LORA_RANK, SM_SCALE)

    def set_batch(lens):
        rows, seq_lens = cache.requests(lens)
        n = len(lens)
        rows_buf.zero_()
        lens_buf.fill_(1)  # tail lanes become pads: seq_len 1, row 0, loc 0
        rows_buf[:n], lens_buf[:n] = rows, seq_lens
        last = cache.req_to_token[rows.long(), (seq_lens - 1).long()]  # the new token's slot
        loc_buf.zero_()
        loc_buf[:n] = last
        q_nope, q_rope, q_latent = cache.queries(bucket)
        q_buf.copy_(q_latent)
        c_kv_new.copy_(cache.randn(bucket, KV_LORA_RANK))
        k_rope_new.copy_(cache.randn(bucket, ROPE))
        return rows, seq_lens, last, q_nope[:n], q_rope[:n]

    set_batch([100, 5])
    graph, out = capture(step)
    for lens in ([8000, 1, 300, 4096, 33], [7, 6000, 1, 1, 2, 3, 900, 8191, 64, 65, 1000]):
        rows, seq_lens, last, q_nope, q_rope = set_batch(lens)
        n = len(lens)
        graph.replay()
        assert torch.equal(cache.latent[last.long(), 0, :KV_LORA_RANK], c_kv_new[:n])
        assert torch.equal(cache.latent[last.long(), 0, KV_LORA_RANK:], k_rope_new[:n])
        eager = step()
        assert torch.equal(out[:n], eager[:n])
        ref = cache.reference(q_nope, q_rope, rows, seq_lens)
        assert rel_err(cache.output(out[:n]), ref) < 1e-2


def test_mla_tree_verify_and_extend_in_cuda_graphs():
    bucket, k, n_tok = 8, 8, 64
    cache = Latent(n_slots=16384, n_rows=24, max_context=4096)
    rows_buf = torch.zeros(bucket, dtype=torch.int32, device=DEVICE)
    lens_buf = torch.ones(bucket, dtype=torch.int32, device=DEVICE)
    mask_buf = torch.ones(bucket, k, k, dtype=torch.bool, device=DEVICE)
    indptr_buf = torch.zeros(bucket + 1, dtype=torch.int32, device=DEVICE)
    qv_buf = torch.zeros(bucket * k, N_HEADS, KV_LORA_RANK + ROPE, dtype=DTYPE, device=DEVICE)
    qe_buf = torch.zeros(n_tok, N_HEADS, KV_LORA_RANK + ROPE, dtype=DTYPE, device=DEVICE)

    def step():
        verify = mla_tree_verify_attention(qv_buf, cache.latent, cache.req_to_token, rows_buf,
                                           lens_buf, mask_buf, KV_LORA_RANK, SM_SCALE)
        extend = mla_extend_attention(qe_buf, cache.latent, cache.req_to_token, rows_buf,
                                      lens_buf, indptr_buf, KV_LORA_RANK, SM_SCALE)
        return verify, extend

    graph, (out_v, out_e) = capture(step)
    gen = torch.Generator().manual_seed(0)
    for lens in ([4000 + k, 3 + k, k], [k, 100 + k, 2500 + k, 1 + k, 3000 + k, 64 + k]):
        rows, seq_lens = cache.requests(lens)
        n = len(lens)
        rows_buf.zero_()
        lens_buf.fill_(1)
        rows_buf[:n], lens_buf[:n] = rows, seq_lens
        mask_buf.fill_(True)
        mask_buf[:n] = random_tree_masks(n, k, gen).to(mask_buf.device)
        counts = torch.tensor([min(k, 5) for _ in lens] + [0] * (bucket - n))  # draft-extend
        indptr_buf.zero_()
        indptr_buf[1:] = counts.cumsum(0).int().to(DEVICE)
        qv_nope, qv_rope, qv = cache.queries(bucket * k)
        qe_nope, qe_rope, qe = cache.queries(n_tok)
        qv_buf.copy_(qv)
        qe_buf.copy_(qe)
        graph.replay()
        eager_v, eager_e = step()
        assert torch.equal(out_v, eager_v) and torch.equal(out_e, eager_e)
        ref_v = cache.reference(qv_nope[:n * k], qv_rope[:n * k], rows, seq_lens,
                                tree_mask=mask_buf[:n])
        assert rel_err(cache.output(out_v[:n * k]), ref_v) < 1e-2
        n_real = int(counts.sum())
        ref_e = cache.reference(qe_nope, qe_rope, rows, seq_lens,
                                qo_indptr=indptr_buf[:n + 1])
        assert rel_err(cache.output(out_e[:n_real]), ref_e[:n_real]) < 1e-2
        assert out_e[n_real:].abs().sum() == 0


# ----------------------------------------------------------------------------- kernel forms

@pytest.mark.parametrize("mode", ["decode", "tree", "causal"])
@pytest.mark.parametrize("form", [dict(keys_major=False, slots_ahead=0),
                                  dict(keys_major=False, slots_ahead=1),
                                  dict(keys_major=True, slots_ahead=1),
                                  dict(keys_major=True, slots_ahead=0),
                                  dict(keys_major=False, split_c=True)])
def test_mla_kernel_forms_vs_fp64(mode, form):
    # the row-major and the keys-major (Hopper warp-group MMA) kernel, each with its slot
    # indices one tile ahead and in the loop, and the row-major one with c_kv in two column
    # halves: awkward lengths, pads, several splits with
    # the merge folded and separate, and the counters zeroed after every launch
    k = 8
    lens = [4097, 1, PAD, 777, 63, 2048]
    cache = Latent(n_slots=16384, n_rows=8, max_context=8192)
    rows, seq_lens = cache.requests(lens)
    n_q = {"decode": 1, "tree": k, "causal": 5}[mode]
    paged = (cache.req_to_token, rows, seq_lens)
    meta, ref_kw = PagedMeta.decode(*paged), {}
    if mode == "tree":
        masks = random_tree_masks(len(lens), k, torch.Generator().manual_seed(3)).to(DEVICE)
        meta, ref_kw = PagedMeta.tree(*paged, masks), dict(tree_mask=masks)
    n_tok = len(lens) * n_q
    if mode == "causal":  # 5 new tokens a request (1 for the length-1 and padded lanes)
        new = [1 if n in (1, PAD) else n_q for n in lens]
        qo = torch.tensor([0] + new, device=DEVICE).cumsum(0).int()
        meta, ref_kw, n_tok = PagedMeta.causal(*paged, qo), dict(qo_indptr=qo), sum(new)
    q_nope, q_rope, q_latent = cache.queries(n_tok)
    ref = cache.reference(q_nope, q_rope, rows, seq_lens, **ref_kw)
    for splits, fold in ((None, None), (5, True), (5, False)):
        if mode == "causal" and fold is False:
            continue  # a causal extend merges folded only
        o_latent = mla_paged_attention(q_latent, cache.latent, meta, KV_LORA_RANK, SM_SCALE,
                                       MlaPolicy(num_splits=splits, fold=fold, **form))
        assert torch.isfinite(o_latent).all()
        err = rel_err(cache.output(o_latent), ref)
        assert err < 1e-2, f"{splits=} {fold=}: {err=}"
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())
