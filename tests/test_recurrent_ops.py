"""The recurrent-state kernels as opaque custom ops under torch.compile (`recurrent_ops`): a traced
call becomes one `padgraph::` op (not inductor's code for the torch reference), the pool it
writes is updated in place with no copy of the pool (inductor's reinplacing), and the results are
those of the eager functions; with `opaque=False` the trace is the reference's, as before."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.fx_passes.reinplace import ReinplaceCounters

from padgraph.backends.triton import conv_state as conv_mod
from padgraph.backends.triton import recurrent_ops as ro
from padgraph.backends.triton import ssm as ssm_mod

N_SLOTS, H, P, N, D_CONV, K_CONV = 7, 2, 4, 8, 12, 4


def _inputs(seed, n, k=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    rows = n * (k or 1)
    return {"x": r(rows, H, P), "dt": r(rows, H) - 1.0, "A": -torch.rand(H, generator=g), "B": r(rows, 1, N),
            "C": r(rows, 1, N), "D": r(H), "z": r(rows, H, P), "dt_bias": r(H) * 0.5}


def _calls():
    """name -> (fn(opaque) running one op on fresh pools, the pools it writes)."""
    slot = torch.tensor([3, 5, 0])
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1], [-1, -1, -1]])
    cu, init = torch.tensor([0, 2, 5, 5], dtype=torch.int32), torch.tensor([True, False, False])
    g = torch.Generator().manual_seed(9)
    w, bias = torch.randn(D_CONV, K_CONV, generator=g), torch.randn(D_CONV, generator=g)
    state = torch.randn(N_SLOTS, H, P, N, generator=g)
    tree = torch.randn(N_SLOTS * 3, H, P, N, generator=g)
    conv = torch.randn(N_SLOTS, D_CONV, K_CONV - 1, generator=g)
    ctree = torch.randn(N_SLOTS * 3, D_CONV, K_CONV - 1, generator=g)
    xc = torch.randn(9, D_CONV, generator=g)
    one, tri, five = _inputs(1, 3), _inputs(2, 3, 3), _inputs(3, 5)
    return {
        "ssm_decode_update": (lambda s, op: op.ssm_decode_update(s["state"], slot, **one, **s["kw"]), {"state": state}),
        # the per-node pools as the hybrid model passes them: a flattened view of [n_slots, k, ...]
        "ssm_tree_update": (lambda s, op: op.ssm_tree_update(state, s["tree"].flatten(0, 1), slot, parents, **tri,
                                                             **s["kw"]), {"tree": tree.view(N_SLOTS, 3, H, P, N)}),
        "ssm_chunked_scan": (lambda s, op: op.ssm_chunked_scan(s["state"], slot, cu, init, **five, **s["kw"]),
                             {"state": state}),
        "conv_state_update": (lambda s, op: op.conv_state_update(s["conv"], slot, xc[:3], w, bias, "silu", **s["kw"]),
                              {"conv": conv}),
        "conv_tree_update": (lambda s, op: op.conv_tree_update(conv, s["ctree"].flatten(0, 1), slot, parents, xc, w,
                                                               bias, "silu", **s["kw"]),
                             {"ctree": ctree.view(N_SLOTS, 3, D_CONV, K_CONV - 1)}),
        "conv_state_prefill": (lambda s, op: op.conv_state_prefill(s["conv"], slot, cu, init, xc[:5], w, bias, "silu",
                                                                   **s["kw"]), {"conv": conv}),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_a_traced_call_is_one_op_that_updates_the_pool_in_place(name):
    call, pools = _calls()[name]
    kernels = ssm_mod if name.startswith("ssm") else conv_mod
    want_pools = {k: v.clone() for k, v in pools.items()}
    want = call({**want_pools, "kw": {}}, kernels)                       # the eager function
    got_pools = {k: v.clone() for k, v in pools.items()}
    ptrs = {k: v.data_ptr() for k, v in got_pools.items()}
    counter = CompileCounterWithBackend("inductor")
    ReinplaceCounters.clear()
    fn = torch.compile(lambda: call({**got_pools, "kw": {"opaque": True}}, ro), backend=counter, fullgraph=True)
    got = fn()
    graph = str(counter.graphs[0].graph)
    assert f"padgraph.{name}" in graph, graph                            # opaque: the op, not its reference
    assert torch.equal(got, want)
    for k in pools:
        assert got_pools[k].data_ptr() == ptrs[k]
        assert torch.equal(got_pools[k], want_pools[k]), f"{name}: pool {k}"
    assert ReinplaceCounters.get_total_missed_bytes() == 0, "a copy of the pool remained"


def test_without_opaque_the_trace_is_the_reference():
    call, pools = _calls()["ssm_decode_update"]
    counter = CompileCounterWithBackend("eager")
    torch.compile(lambda: call({**{k: v.clone() for k, v in pools.items()}, "kw": {"opaque": False}}, ro),
                  backend=counter, fullgraph=True)()
    assert "padgraph" not in str(counter.graphs[0].graph)
