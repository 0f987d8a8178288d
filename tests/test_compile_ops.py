"""The attention functions are opaque `padgraph::` custom ops under torch.compile.

Traced, the split-KV kernels' ticket counters would be a mutated graph input (reduce-overhead
then skips its cudagraphs); as custom ops they are one node whose fake implementation gives
inductor the output's shape. Every public attention function is checked here on the CPU: it
compiles with fullgraph=True, its graph holds the op, and the result equals the eager call.
"""
import torch

from padgraph.backends.triton import attention, attention_mla

GEN = torch.Generator().manual_seed(0)
BS, CTX, HQ, HKV, D = 3, 16, 4, 2, 16
RANK, ROPE = 32, 8


def paged():
    rt = (torch.arange(BS * CTX, dtype=torch.int32).reshape(BS, CTX) + 1)
    rows = torch.arange(BS, dtype=torch.int32)
    lens = torch.tensor([3, 9, 16], dtype=torch.int32)
    return rt, rows, lens


def compiled(fn):
    """(torch.compile(fn, fullgraph=True), the set of call targets in its graphs)."""
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    return torch.compile(fn, backend=backend, fullgraph=True), seen


def check(fn, *args):
    torch._dynamo.reset()
    cfn, seen = compiled(fn)
    torch.testing.assert_close(cfn(*args), fn(*args), atol=1e-6, rtol=1e-6)
    ops = {s for s in seen if s.startswith("padgraph.")}
    assert ops, f"no padgraph op in the graph: {sorted(seen)}"
    return ops


def test_gqa_ops_are_opaque_under_compile():
    rt, rows, lens = paged()
    k, v = torch.randn(BS * CTX + 1, HKV, D, generator=GEN), torch.randn(BS * CTX + 1, HKV, D, generator=GEN)
    q = torch.randn(BS, HQ, D, generator=GEN)
    assert check(lambda q: attention.decode_attention(q, k, v, rt, rows, lens) * 2, q) \
        == {"padgraph.decode_attention.default"}
    qo = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    q6 = torch.randn(6, HQ, D, generator=GEN)
    assert check(lambda q: attention.extend_attention(q, k, v, rt, rows, lens, qo, sm_scale=0.3), q6) \
        == {"padgraph.extend_attention.default"}
    mask = torch.tril(torch.ones(BS, 2, 2, dtype=torch.bool))
    q2 = torch.randn(BS * 2, HQ, D, generator=GEN)
    assert check(lambda q: attention.tree_verify_attention(q, k, v, rt, rows, lens, mask), q2) \
        == {"padgraph.tree_verify_attention.default"}


def test_mla_ops_are_opaque_under_compile():
    rt, rows, lens = paged()
    latent = torch.randn(BS * CTX + 1, 1, RANK + ROPE, generator=GEN)
    q = torch.randn(BS, HQ, RANK + ROPE, generator=GEN)
    out = check(lambda q: attention_mla.mla_decode_attention(q, latent, rt, rows, lens, RANK, 0.2), q)
    assert out == {"padgraph.mla_decode_attention.default"}
    mask = torch.tril(torch.ones(BS, 2, 2, dtype=torch.bool))
    q2 = torch.randn(BS * 2, HQ, RANK + ROPE, generator=GEN)
    assert check(lambda q: attention_mla.mla_tree_verify_attention(q, latent, rt, rows, lens, mask, RANK,
                                                                   0.2), q2) \
        == {"padgraph.mla_tree_verify_attention.default"}
    qo = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    q6 = torch.randn(6, HQ, RANK + ROPE, generator=GEN)
    assert check(lambda q: attention_mla.mla_extend_attention(q, latent, rt, rows, lens, qo, RANK, 0.2), q6) \
        == {"padgraph.mla_extend_attention.default"}


def test_eager_calls_skip_the_dispatcher():
    """Eagerly the public function is the kernel wrapper itself (no custom-op dispatch cost)."""
    from padgraph.backends.triton import attention_decode
    assert attention.decode_attention.__wrapped__ is attention_decode.decode_attention
    assert attention.decode_attention.op is not None


def test_stores_compile_to_index_copy_even_when_the_kernel_is_asked_for():
    """Under compile, store_kv / store_latent are the reference's index_copy_ (inductor lowers it
    to its own scatter), never a traced user Triton kernel: impl="triton" is asked for here and
    the graph still holds no triton_kernel_wrapper node; both stores write what eager writes."""
    from padgraph.backends.triton.store import store_kv

    n_slots, n_tok = 12, 4
    loc = torch.tensor([5, 0, 0, 9])                          # two padded lanes on the sink slot 0
    k, v = torch.randn(n_tok, HKV, D, generator=GEN), torch.randn(n_tok, HKV, D + 8, generator=GEN)
    c_kv, k_rope = torch.randn(n_tok, RANK, generator=GEN), torch.randn(n_tok, ROPE, generator=GEN)
    real = [0, 3]                                             # the lanes whose slot no other lane writes

    def stores(kc, vc, lat):
        store_kv(kc, vc, loc, k, v, impl="triton")
        attention_mla.store_latent(lat, loc, c_kv, k_rope, impl="triton")
        return kc, vc, lat

    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm

    torch._dynamo.reset()
    cfn = torch.compile(stores, backend=backend, fullgraph=True)
    kc, vc, lat = cfn(torch.zeros(n_slots, HKV, D), torch.zeros(n_slots, HKV, D + 8),
                      torch.zeros(n_slots, 1, RANK + ROPE))
    assert not [s for s in seen if "triton_kernel_wrapper" in s], sorted(seen)
    assert any("index_copy" in s for s in seen), sorted(seen)
    idx = loc[real]
    torch.testing.assert_close(kc[idx], k[real])
    torch.testing.assert_close(vc[idx], v[real])
    torch.testing.assert_close(lat[idx, 0], torch.cat([c_kv, k_rope], -1)[real])
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[loc] = False
    assert not kc[untouched].any() and not lat[untouched].any()


def test_eagle_ops_compile_to_their_references_even_when_the_kernel_is_asked_for():
    """build_tree, verify_greedy and pack_draft_extend under compile (fullgraph, inductor) are
    their torch references, never traced user kernels, and give eager's results."""
    from test_eagle_ops import random_candidates, random_tree_case
    from padgraph.backends.triton import eagle

    bs, topk, steps, k, n_path, hid = 4, 3, 3, 6, 4, 5
    s, t, par = random_candidates(bs, topk, steps, GEN)
    tokens, mask, predict, _ = random_tree_case(bs, k, steps, GEN)
    rt = torch.randperm(6 * 24, generator=GEN).int().view(6, 24) + 1
    rows = torch.arange(1, bs + 1, dtype=torch.int32)
    lens = torch.randint(0, 16, (bs,), generator=GEN).int()
    acc_len = torch.randint(1, n_path + 1, (bs,), generator=GEN).int()
    acc_idx = torch.randint(0, k, (bs, n_path), generator=GEN)
    out_tok = torch.randint(0, 100, (bs, n_path), generator=GEN)
    hidden = torch.randn(bs * k, hid, generator=GEN)

    def ops(rt):
        tree = eagle.build_tree(s, t, par, k, topk, steps, impl="triton")
        verified = eagle.verify_greedy(tokens, mask, predict, rt, rows, lens, steps, impl="triton")
        packed = eagle.pack_draft_extend(acc_len, acc_idx, out_tok, hidden, lens, rt, rows,
                                         torch.tensor(bs - 1), impl="triton")
        return (*tree, *verified, *packed, rt)

    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(ops, backend=backend, fullgraph=True)(rt.clone())
    with torch.no_grad():
        want = [eagle.build_tree(s, t, par, k, topk, steps, impl="torch"),
                eagle.verify_greedy(tokens, mask, predict, rt_ref := rt.clone(), rows, lens, steps, impl="torch"),
                eagle.pack_draft_extend(acc_len, acc_idx, out_tok, hidden, lens, rt_ref, rows,
                                        torch.tensor(bs - 1), impl="torch")]
    want = [x for group in want for x in group] + [rt_ref]
    assert not [x for x in seen if "triton_kernel_wrapper" in x], sorted(seen)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
