"""The grouped linear kernel (interpreted on CPU) against F.linear in fp64, and the graph pass
that routes a compiled body's sibling linears through it: awkward sizes (M 1 / 3 / 16, N and K
not multiples of the tiles, a weight narrower than a tile), 1-5 weights (a fifth starts a second
launch), biases, bf16 / fp16, a strided x and a 3-D x, the fallbacks (more rows than the kernel
takes, mixed dtypes, fp32) and the checks."""
import pytest
import torch
import torch.nn.functional as F

import padgraph as pg
from padgraph.backends.triton.grouped_linear import MAX_M, group_linears, grouped_linear, kernel_takes


def _weights(ns, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, k, generator=g).to(dtype) for n in ns]
    bs = [torch.randn(n, generator=g).to(dtype) for n in ns] if bias else None
    return ws, bs


def _assert_linear(got, x, ws, bs):
    bs = bs or [None] * len(ws)
    assert len(got) == len(ws)
    for y, w, b in zip(got, ws, bs):
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert y.dtype == x.dtype and y.shape == want.shape
        tol = 2e-2 if x.dtype != torch.float32 else 1e-5
        torch.testing.assert_close(y.double(), want, rtol=tol, atol=tol * x.shape[-1] ** 0.5)


@pytest.mark.parametrize("m,ns,k", [(1, [40, 24, 24], 72), (3, [17], 300), (16, [64, 64], 48),
                                    (5, [33, 8, 70, 16], 40), (2, [16, 16, 16, 16, 40], 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_matches_each_linear(m, ns, k, dtype, bias):
    ws, bs = _weights(ns, k, dtype, bias, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    assert kernel_takes(x, ws, bs or [None] * len(ws))
    _assert_linear(grouped_linear(x, ws, bs, impl="triton"), x, ws, bs)


def test_a_3d_strided_x_keeps_its_leading_dims():
    ws, _ = _weights([40, 24], 64, torch.bfloat16, False)
    base = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = base[..., ::2]                                                     # [2, 3, 64], stride(-1) 2
    got = grouped_linear(x, ws, impl="triton")
    assert [tuple(y.shape) for y in got] == [(2, 3, 40), (2, 3, 24)]
    _assert_linear(got, x, ws, None)


@pytest.mark.parametrize("why", ["rows", "fp32", "mixed", "one_bias"])
def test_what_the_kernel_does_not_take_runs_f_linear(why):
    m = MAX_M + 1 if why == "rows" else 2
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    ws, bs = _weights([24, 16], 32, dtype, why == "one_bias")
    if why == "mixed":
        ws[1] = ws[1].half()
    if why == "one_bias":
        bs[1] = None
    x = torch.randn(m, 32).to(dtype)
    assert not kernel_takes(x, ws, bs or [None, None])
    if why == "mixed":                                     # F.linear's own error, as without the op
        with pytest.raises(RuntimeError, match="same dtype"):
            grouped_linear(x, ws, bs, impl="triton")
        return
    got = grouped_linear(x, ws, bs, impl="triton")
    for y, w, b in zip(got, ws, bs or [None, None]):
        torch.testing.assert_close(y, F.linear(x, w, b))


def test_checks():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="at least one"):
        grouped_linear(x, [])
    with pytest.raises(ValueError, match="weights \\[N, K\\]"):
        grouped_linear(x, [torch.randn(4, 9)])
    with pytest.raises(ValueError, match="2 weights and 1 biases"):
        grouped_linear(x, [torch.randn(4, 8)] * 2, [None])
    with pytest.raises(ValueError, match="a bias"):
        grouped_linear(x, [torch.randn(4, 8)], [torch.randn(5)])


# ---- the graph pass -----------------------------------------------------------------------------
class Block(torch.nn.Module):
    """q / k / v on one input (with biases), gate / up on another, one lone linear."""

    def __init__(self, d=32):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, n) for n in (d, d // 2, d // 2))
        self.gate, self.up = (torch.nn.Linear(d, 2 * d, bias=False) for _ in range(2))
        self.down = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, h):
        q, k, v = self.q(h), self.k(h), self.v(h)
        a = h + q * torch.cat([k, v], -1)
        return self.down(F.silu(self.gate(a)) * self.up(a))


def _program(block, d=32):
    bs = pg.Axis("bs")
    prog = pg.Program("blk", inputs={"h": pg.Input((bs, d), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((bs, d), torch.float32)}, buckets=pg.Buckets([1, 4]))
    return prog, lambda x: {"y": block(x.h)}


@pytest.mark.parametrize("regional", [False, True])
def test_the_pass_groups_sibling_linears_and_keeps_the_results(regional):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block()])
    seen = []

    def spy(gm, example_inputs):
        seen.append(group_linears(gm, example_inputs))
        seen.append(sum(n.target is torch.ops.padgraph.grouped_linear.default for n in gm.graph.nodes))

    def body(x):
        return {"y": blocks[1](blocks[0](x.h))}
    prog, _ = _program(blocks[0])
    spec = {"passes": [spy], **({"regions": list(blocks), "size_oblivious": True} if regional else {})}
    runner = pg.compile(prog, body, backend="reference", torch_compile=spec)
    h = torch.randn(3, 32)
    with torch.no_grad():
        got = runner(h=h)["y"]
        want = blocks[1](blocks[0](h))
    torch.testing.assert_close(got, want)
    per_graph = 2 if regional else 4                      # (q, k, v) and (gate, up) per block
    assert seen[:2] == [per_graph, per_graph]


def test_the_pass_leaves_a_graph_alone_under_grad():
    gm = torch.fx.symbolic_trace(Block())
    before = len(gm.graph.nodes)
    with torch.enable_grad():
        assert group_linears(gm, []) == 0
    assert len(gm.graph.nodes) == before


def test_passes_must_be_callables_and_one_may_be_given_alone():
    prog, body = _program(Block())
    with pytest.raises(pg.ContractValueError, match="passes"):
        pg.compile(prog, body, backend="reference", torch_compile={"passes": ["group_linears"]})
    seen = []
    runner = pg.compile(prog, body, backend="reference", torch_compile={"passes": lambda gm, ex: seen.append(gm)})
    with torch.no_grad():
        runner(h=torch.randn(2, 32))
    assert seen


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_grouped_linear_at_the_1b_shapes_and_in_a_cuda_graph(m, bias):
    """q / k / v and gate / up of the Llama-1B shape in bf16, eagerly and replayed from a CUDA
    graph on new data; 64 rows run cuBLAS per weight."""
    dev = torch.device("cuda")
    for ns, k in (([2048, 512, 512], 2048), ([8192, 8192], 2048)):
        ws, bs = _weights(ns, k, torch.bfloat16, bias, seed=m)
        ws, bs = [w.to(dev) for w in ws], (None if bs is None else [b.to(dev) for b in bs])
        x = torch.randn(m, 1, k, device=dev, dtype=torch.bfloat16)
        assert kernel_takes(x, ws, bs or [None] * len(ws)) == (m <= MAX_M)
        _assert_linear(grouped_linear(x, ws, bs), x, ws, bs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = grouped_linear(x, ws, bs)
        x.copy_(torch.randn_like(x))
        graph.replay()
        _assert_linear(out, x, ws, bs)


# ---- the pass keeps what the graph computes, whatever the graph -----------------------------------
D = 16


class Generated(torch.nn.Module):
    """A random straight-line program over [bs, D] values: linears (weights [N, D], N in 8 / 16
    / 24, with or without a bias, some scaled by an earlier value's first row, so computed after
    the linears before them), in-place writes to earlier values, and sums of two values. Only
    width-D values feed a linear; the output mixes every value, row by row (padded rows stay
    apart from real ones)."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        g = torch.Generator().manual_seed(len(ops))
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(op[3], D, generator=g) / 4)
                                        for op in ops if op[0] == "linear")
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(op[3], generator=g))
                                        for op in ops if op[0] == "linear")

    def forward(self, h):
        vals, k = [h.clone()], 0
        for op in self.ops:
            wide = [v for v in vals if v.shape[-1] == D]
            if op[0] == "linear":
                _, src, scale_by, n, bias = op
                w = self.w[k] if scale_by is None else self.w[k] * (1 + vals[scale_by % len(vals)][:1].mean())
                vals.append(F.linear(wide[src % len(wide)], w, self.b[k] if bias else None))
                k += 1
            elif op[0] == "write":
                vals[op[1] % len(vals)].mul_(0.5).add_(0.25)
            else:
                a, b = wide[op[1] % len(wide)], wide[op[2] % len(wide)]
                vals.append(a + b)
        return torch.stack([v.sum(-1) for v in vals], -1).sum(-1, keepdim=True) + vals[-1].mean(-1, keepdim=True) * h


def _ops():
    from hypothesis import strategies as st
    idx = st.integers(0, 7)
    linear = st.tuples(st.just("linear"), idx, st.one_of(st.none(), idx), st.sampled_from([8, 16, 24]),
                       st.booleans())
    write = st.tuples(st.just("write"), idx)
    add = st.tuples(st.just("add"), idx, idx)
    return st.lists(st.one_of(linear, linear, linear, write, add), min_size=2, max_size=10)


def _run_generated(ops, h):
    block = Generated(ops)
    prog, _ = _program(block, D)
    groups = []

    def spy(gm, example_inputs):
        groups.append(group_linears(gm, example_inputs))
    runner = pg.compile(prog, lambda x: {"y": block(x.h)}, backend="reference", torch_compile={"passes": [spy]})
    with torch.no_grad():
        got = runner(h=h)["y"]
        want = block(h)
    return got, want, sum(groups)


def test_generated_programs_give_the_eager_results():
    from hypothesis import HealthCheck, given, settings
    made = []

    @settings(max_examples=30, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(_ops())
    def check(ops):
        torch._dynamo.reset()
        got, want, groups = _run_generated(ops, torch.randn(3, D, generator=torch.Generator().manual_seed(7)))
        made.append(groups)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    check()
    assert sum(made) > 0, "no generated program was grouped: the test would not see a wrong grouping"


@pytest.mark.parametrize("ops", [
    [("linear", 0, None, 16, False), ("write", 0), ("linear", 0, None, 16, False)],     # x written between
    [("linear", 0, None, 16, False), ("linear", 0, 1, 16, False)],                      # weight from q's output
], ids=["write-between", "weight-after-first"])
def test_grouping_that_would_change_a_result_is_split(ops):
    """Each case gives a wrong result if its two linears are grouped."""
    torch._dynamo.reset()
    got, want, groups = _run_generated(ops, torch.randn(3, D))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert groups == 0
