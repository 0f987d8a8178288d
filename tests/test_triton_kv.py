"""KVCache, slot/row allocators, and store_kv (Triton, interpreted on CPU) against its reference."""
import pytest
import torch

from padgraph.backends.triton.kv import resolve_impl
from padgraph.llm.kv import KVCache, RowAllocator, SlotAllocator
from padgraph.backends.triton.store import store_kv, store_kv_reference


# ----------------------------------------------------------------------------- allocators

@pytest.mark.parametrize("cls", [SlotAllocator, RowAllocator])
def test_allocator_never_hands_out_the_sink(cls):
    a = cls(6)
    assert a.n_free == 4
    ids = a.alloc(4)
    assert sorted(ids) == [2, 3, 4, 5] and a.n_free == 0
    a.free(ids[:2])
    again = a.alloc(2)
    assert sorted(again) == sorted(ids[:2]) and 0 not in again


@pytest.mark.parametrize("cls", [SlotAllocator, RowAllocator])
def test_allocator_exhausted_raises_and_takes_nothing(cls):
    a = cls(5)
    a.alloc(2)
    with pytest.raises(RuntimeError, match="exhausted: asked for 2"):
        a.alloc(2)
    assert a.n_free == 1
    assert a.alloc(0) == []


def test_allocator_rejects_bad_frees():
    a = SlotAllocator(6)
    ids = a.alloc(3)
    with pytest.raises(ValueError, match="cannot free slot 0"):
        a.free([0])
    with pytest.raises(ValueError, match="cannot free slot 1"):
        a.free([1])                      # the canary
    with pytest.raises(ValueError, match="valid ids are 2 .. 5"):
        a.free([6])
    a.free(ids[:1])
    with pytest.raises(ValueError, match="freed twice"):
        a.free(ids[:1])
    with pytest.raises(ValueError, match="duplicate"):
        a.free([ids[1], ids[1]])
    assert a.n_free == 2  # the failed frees changed nothing
    with pytest.raises(ValueError, match="n >= 3"):
        RowAllocator(2)


def test_allocator_ids_are_distinct_under_churn():
    a = SlotAllocator(50)
    held = []
    gen = torch.Generator().manual_seed(0)
    for step in range(200):
        if held and torch.rand((), generator=gen) < 0.5:
            k = int(torch.randint(1, len(held) + 1, (), generator=gen))
            a.free(held[:k])
            held = held[k:]
        else:
            n = min(a.n_free, int(torch.randint(0, 6, (), generator=gen)))
            held += a.alloc(n)
        assert len(set(held)) == len(held) and 0 not in held and 1 not in held
        assert a.n_free + len(held) == 48


# ----------------------------------------------------------------------------- KVCache

def test_kvcache_shapes_and_fixed_storage():
    c = KVCache(n_layers=3, n_slots=10, n_kv_heads=2, head_dim=(96, 64), max_context=17,
                n_req_rows=4, dtype=torch.bfloat16, device="cpu")
    assert len(c.k) == len(c.v) == 3
    assert c.k[0].shape == (10, 2, 96) and c.v[2].shape == (10, 2, 64)
    assert c.k[1].dtype == torch.bfloat16
    assert c.req_to_token.shape == (4, 17) and c.req_to_token.dtype == torch.int32
    assert int(c.req_to_token.abs().sum()) == 0  # every position starts on the sink slot
    ptrs = [t.data_ptr() for t in c.k + c.v]
    k0, v0 = c.layer(0)
    store_kv(k0, v0, torch.tensor([3]), torch.ones(1, 2, 96, dtype=torch.bfloat16),
             torch.ones(1, 2, 64, dtype=torch.bfloat16))
    assert [t.data_ptr() for t in c.k + c.v] == ptrs
    assert c.nbytes() == 3 * 10 * 2 * (96 + 64) * 2 + 4 * 17 * 4
    with pytest.raises(ValueError, match="slot 0 and row 0 are sinks"):
        KVCache(1, 1, 1, 8, 4, 2, torch.float32, "cpu")


def test_resolve_impl():
    cpu = torch.zeros(1)
    assert resolve_impl("auto", cpu) == "torch"
    assert resolve_impl("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("cuda", cpu)


# ----------------------------------------------------------------------------- store_kv

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,v_head_dim,n_kv_heads", [(64, 64, 1), (96, 80, 3)])
def test_store_kv_matches_reference(dtype, head_dim, v_head_dim, n_kv_heads):
    gen = torch.Generator().manual_seed(1)
    n_slots, n_tok = 40, 7
    k_cache = torch.randn(n_slots, n_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(n_slots, n_kv_heads, v_head_dim, generator=gen).to(dtype)
    loc = torch.tensor([5, 0, 17, 39, 0, 2, 8], dtype=torch.int32)  # two padded lanes -> sink
    k = torch.randn(n_tok, n_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n_tok, n_kv_heads, v_head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_pad_last = k[4].clone()  # the two padded lanes race on slot 0; either may win
    k[1], v[1] = k[4], v[4]
    store_kv_reference(k_ref, v_ref, loc, k, v)
    store_kv(k_cache, v_cache, loc, k, v, impl="triton")
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)
    assert torch.equal(k_cache[0], k_pad_last)


def test_store_kv_strided_inputs_and_int64_loc():
    # k and v as views into one fused qkv-like buffer (non-contiguous token stride)
    gen = torch.Generator().manual_seed(2)
    n_tok, n_kv_heads, head_dim = 5, 2, 64
    fused = torch.randn(n_tok, 3 * n_kv_heads, head_dim, generator=gen)
    k, v = fused[:, n_kv_heads:2 * n_kv_heads], fused[:, 2 * n_kv_heads:]
    k_cache = torch.zeros(12, n_kv_heads, head_dim)
    v_cache = torch.zeros(12, n_kv_heads, head_dim)
    loc = torch.tensor([11, 3, 4, 9, 1], dtype=torch.int64)
    store_kv(k_cache, v_cache, loc, k, v, impl="triton")
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    assert k_cache[[0, 2, 5]].abs().sum() == 0


def test_store_kv_checks_shapes():
    k_cache = torch.zeros(8, 2, 64)
    with pytest.raises(ValueError, match="k/v must be"):
        store_kv(k_cache, k_cache, torch.tensor([1, 2]), torch.zeros(2, 2, 32),
                 torch.zeros(2, 2, 64))
    with pytest.raises(ValueError, match="loc must be"):
        store_kv(k_cache, k_cache, torch.tensor([1.0]), torch.zeros(1, 2, 64),
                 torch.zeros(1, 2, 64))


@pytest.mark.parametrize("shape", [(10, 5), (10, 2, 3, 5)])
@pytest.mark.parametrize("n_tok", [0, 3])
def test_store_kv_takes_any_cache_rank(shape, n_tok):
    """The kernel takes [slots, heads, dim] caches; other ranks (and no token) store as the
    reference does instead of failing to unpack their shapes."""
    k_cache, v_cache = torch.randn(*shape), torch.randn(*shape)
    caches = [k_cache.clone(), v_cache.clone(), k_cache, v_cache]
    loc = torch.tensor([4, 1, 7])[:n_tok]
    k, v = torch.randn(n_tok, *shape[1:]), torch.randn(n_tok, *shape[1:])
    store_kv(caches[0], caches[1], loc, k, v, impl="triton")
    store_kv_reference(caches[2], caches[3], loc, k, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
