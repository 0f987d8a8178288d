"""GPU tests of MLA over a latent cache at DeepSeek-V2-Lite sizes (16 heads, kv_lora_rank 512,
rope 64, nope 128, v 128): the absorbed bf16 kernels against the non-absorbed fp64 reference,
and decode (with `store_latent`) captured once in a `torch.cuda.CUDAGraph` at a padded bucket,
then replayed with new lengths / request rows written into the static buffers.

Run on a GPU: `pytest -m cuda tests/test_cuda_mla.py` (skipped without one).
"""
import pytest
import torch

from padgraph.backends.triton.attention_mla import (
    absorb_query, mla_decode_attention, mla_extend_attention, mla_reference, mla_sm_scale,
    mla_tree_verify_attention, project_output, store_latent)

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

    def __init__(self, n_slots, n_rows, max_context, seed=0):
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.latent = self.randn(n_slots, 1, KV_LORA_RANK + ROPE)
        # scaled so that up-projected K and V have unit variance
        self.W_UK = self.randn(N_HEADS, NOPE, KV_LORA_RANK, scale=KV_LORA_RANK ** -0.5)
        self.W_UV = self.randn(N_HEADS, KV_LORA_RANK, V_DIM, scale=KV_LORA_RANK ** -0.5)
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
        q_nope, q_rope = self.randn(n, N_HEADS, NOPE), self.randn(n, N_HEADS, ROPE)
        return q_nope, q_rope, absorb_query(q_nope, q_rope, self.W_UK)

    def reference(self, q_nope, q_rope, rows, seq_lens, **kw):
        """Non-absorbed MLA in fp64 on the same bf16 values."""
        return mla_reference(q_nope.double(), q_rope.double(), self.latent.double(),
                             self.W_UK.double(), self.W_UV.double(), self.req_to_token, rows,
                             seq_lens, SM_SCALE, **kw)

    def output(self, o_latent):
        return project_output(o_latent, self.W_UV)


def random_tree_masks(bs, k, gen):
    """Each draft token sees itself and the ancestors of a random parent (a random tree)."""
    masks = torch.zeros(bs, k, k, dtype=torch.bool)
    for r in range(bs):
        for i in range(k):
            masks[r, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (), generator=gen))
                masks[r, i] |= masks[r, parent]
    return masks.to(DEVICE)


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
    masks = random_tree_masks(len(lens), k, torch.Generator().manual_seed(k))
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
