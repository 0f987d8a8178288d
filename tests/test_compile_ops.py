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
