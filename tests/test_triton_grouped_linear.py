"""The grouped linear kernel (interpreted on CPU) against F.linear in fp64, and the graph pass
that routes a compiled body's sibling linears through it: awkward sizes (M 1 / 3 / 16, N and K
not multiples of the tiles, a weight narrower than a tile), 1-5 weights (a fifth starts a second
launch), biases of any stride (strided, expanded, offset), weights whose rows are a slice of a
wider matrix, bf16 / fp16, a strided x and a 3-D x, the fallbacks (more rows than the kernel takes,
mixed dtypes, fp32, a neg-bit view, an empty weight, autocast) and the checks. Then the graph pass
(`group_linears`): generated bodies full of in-place writes, autocast and grad regions keep every
value bit for bit, hazard-free ones get every sibling set grouped."""
import contextlib

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


@pytest.mark.parametrize("layout", ["strided", "expanded", "offset"])
def test_a_bias_of_any_stride_and_sliced_weight_rows_are_read_as_torch_reads_them(layout):
    """A bias [::2], a bias expanded from one element (stride 0) and biases at offsets into one
    buffer; weights [N, K] that are the first K columns of [N, 2K] (row stride 2K)."""
    ns, k = [40, 24], 48
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(n, 2 * k, generator=g).bfloat16()[:, :k] for n in ns]
    if layout == "strided":
        bs = [torch.randn(2 * n, generator=g).bfloat16()[::2] for n in ns]
    elif layout == "expanded":
        bs = [torch.randn(1, generator=g).bfloat16().expand(n) for n in ns]
    else:
        base = torch.randn(80, generator=g).bfloat16()
        bs = [base[3:43], base[50:74]]
    x = torch.randn(3, k, generator=g).bfloat16()
    assert kernel_takes(x, ws, bs)
    _assert_linear(grouped_linear(x, ws, bs, impl="triton"), x, ws, bs)


@pytest.mark.parametrize("why", ["rows", "fp32", "mixed", "one_bias", "neg_bit", "empty_weight"])
def test_what_the_kernel_does_not_take_runs_f_linear(why):
    m = MAX_M + 1 if why == "rows" else 2
    dtype = torch.float32 if why == "fp32" else torch.bfloat16
    ws, bs = _weights([24, 16], 32, dtype, why == "one_bias")
    if why == "mixed":
        ws[1] = ws[1].half()
    if why == "one_bias":
        bs[1] = None
    if why == "neg_bit":                                   # memory holds -w: the kernel would read w negated
        ws[0] = torch._neg_view(ws[0].neg())
    if why == "empty_weight":
        ws[1] = ws[1][:0]
    x = torch.randn(m, 32).to(dtype)
    assert not kernel_takes(x, ws, bs or [None, None])
    if why == "mixed":                                     # F.linear's own error, as without the op
        with pytest.raises(RuntimeError, match="same dtype"):
            grouped_linear(x, ws, bs, impl="triton")
        return
    got = grouped_linear(x, ws, bs, impl="triton")
    for y, w, b in zip(got, ws, bs or [None, None]):
        assert torch.equal(y, F.linear(x, w, b))


def test_under_autocast_the_function_computes_as_f_linear_and_the_op_without_it():
    """fp16 tensors under bf16 autocast: F.linear computes in bf16, and so does `grouped_linear`;
    the op the pass inserts (only outside autocast) keeps x's dtype whatever the mode, as its
    fake implementation says."""
    ws, bs = _weights([24, 16], 32, torch.float16, True)
    x = torch.randn(2, 32).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_linear(x, ws, bs, impl="triton")
        want = [F.linear(x, w, b) for w, b in zip(ws, bs)]
        op = torch.ops.padgraph.grouped_linear(x, ws, bs)
    assert all(y.dtype == torch.bfloat16 and torch.equal(y, r) for y, r in zip(got, want))
    assert all(y.dtype == torch.float16 and torch.equal(y, F.linear(x, w, b)) for y, w, b in zip(op, ws, bs))


def test_inputs_that_need_grad_get_f_linear_and_its_backward():
    ws, bs = _weights([24, 16], 32, torch.bfloat16, True)
    ws = [w.requires_grad_() for w in ws]
    x = torch.randn(2, 32).bfloat16()
    assert kernel_takes(x, ws, bs)
    got = grouped_linear(x, ws, bs, impl="triton")
    assert all(y.grad_fn is not None and torch.equal(y, F.linear(x, w, b)) for y, w, b in zip(got, ws, bs))
    sum(y.float().sum() for y in got).backward()
    assert all(w.grad is not None for w in ws)


def test_checks():
    x = torch.randn(2, 8)
    with pytest.raises(pg.ContractValueError, match="one or more"):
        grouped_linear(x, [])
    with pytest.raises(pg.ContractValueError, match="weight 0 must be \\[N, K\\]"):
        grouped_linear(x, [torch.randn(4, 9)])
    with pytest.raises(pg.ContractValueError, match="2 weights and 1 biases"):
        grouped_linear(x, [torch.randn(4, 8)] * 2, [None])
    with pytest.raises(pg.ContractValueError, match="bias 1 must be \\[N\\] = \\(4,\\)"):
        grouped_linear(x, [torch.randn(4, 8)] * 2, [torch.randn(4), torch.randn(1)])


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


@torch.library.custom_op("pgtest_gl::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor) -> None:
    x.mul_(0.5)


@_scale_.register_fake
def _(x):
    return None


_LIB = torch.library.Library("pgtest_gl", "FRAGMENT")
_LIB.define("bump(Tensor(a!) x) -> ()")


def _bump(x):
    x.add_(1)


_LIB.impl("bump", _bump, "CompositeExplicitAutograd")
torch.library.register_fake("pgtest_gl::bump", lambda x: None, lib=_LIB)


def _view_iadd(v, other):
    half = v[:, 1::2]
    half += 0.5


# Every way the generated bodies write a tensor in place: v [rows, n], o any tensor; each keeps rows
# apart (a padded row never reaches a real one).
WRITERS = {
    "mul_-add_": lambda v, o: v.mul_(0.5).add_(0.25),
    "relu_": lambda v, o: v.relu_(),
    "relu-inplace": lambda v, o: F.relu(v, inplace=True),
    "hardtanh-positional-inplace": lambda v, o: F.hardtanh(v, -0.5, 0.5, True),
    "view-iadd": _view_iadd,
    "view-add_": lambda v, o: v.view(-1)[::3].add_(1.0),
    "t-mul_": lambda v, o: v.t().mul_(0.5),
    "setitem": lambda v, o: v.__setitem__(0, 0.25),
    "out=": lambda v, o: torch.mul(v, 0.5, out=v),
    "copy_": lambda v, o: v.copy_(v.flip(-1)),
    "foreach": lambda v, o: torch._foreach_add_([v] if o is v else [v, o], 0.5),   # (inductor adds a repeat once)
    "custom-op": lambda v, o: torch.ops.pgtest_gl.scale_(v),
    "defined-op": lambda v, o: torch.ops.pgtest_gl.bump.default(v),
}
# Ops that write nothing, as found between a decoder layer's linears: v [rows, n] -> [rows, n].
PURES = {
    "silu": lambda v: F.silu(v),
    "view-t": lambda v: v.view(v.shape[0], -1, 2).transpose(1, 2).reshape(v.shape),
    "softmax": lambda v: torch.softmax(v, -1),
    "cast": lambda v: v.to(torch.bfloat16).float(),
}
LAYOUTS = ("plain", "strided-weight", "strided-bias", "expanded-bias")


class Generated(torch.nn.Module):
    """A random straight-line program over [bs, n] values, vals[0] = h. Ops:
    ("linear", src, scale_by, n, bias, layout): F.linear of a width-D value, its weight [n, D]
        scaled by an earlier value's first row when scale_by is set (so computed after the linears
        before it), the weight or bias a strided or expanded view where layout says;
    ("write", i, how, j): an in-place write to value i (WRITERS[how], j another value);
    ("wwrite", k, how): the same to linear k's weight;
    ("add", i, j) and ("pure", i, how): a new value (PURES[how]);
    ("autocast", src, n, bias): two linears of src under CPU bf16 autocast (outputs cast back);
    ("grad", src, n): two linears of src with grad enabled.
    Deterministic in `ops`: two instances hold equal parameters."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops
        g = torch.Generator().manual_seed(len(ops))
        shapes = []                                           # (n, bias, layout) per weight, in forward's order
        for op in ops:
            if op[0] == "linear":
                shapes.append(op[3:6])
            elif op[0] in ("autocast", "grad"):
                shapes += [(op[2], op[0] == "autocast" and op[3], "plain")] * 2
        rows = {"strided-bias": 2, "expanded-bias": 0}        # bias rows per output (0: one row)
        self.w = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(n, D * (2 if lay == "strided-weight" else 1), generator=g) / 4)
            for n, _, lay in shapes)
        self.b = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(max(rows.get(lay, 1) * n, 1), generator=g))
                                        for n, _, lay in shapes)

    def _weight(self, k, layout, bias):
        """Linear k's weight and bias, as views where `layout` says (a view is computed where it
        is used, so such a linear starts a group)."""
        w = self.w[k][:, ::2] if layout == "strided-weight" else self.w[k]
        if not bias:
            return w, None
        if layout == "strided-bias":
            return w, self.b[k][::2]
        return w, self.b[k].expand(w.shape[0]) if layout == "expanded-bias" else self.b[k]

    def forward(self, h):
        vals, k = [h], 0
        for op in self.ops:
            wide = [v for v in vals if v.shape[-1] == D]
            kind = op[0]
            if kind == "linear":
                _, src, scale_by, n, bias, layout = op
                w, b = self._weight(k, layout, bias)
                if scale_by is not None:
                    w = w * (1 + vals[scale_by % len(vals)][:1].mean())
                vals.append(F.linear(wide[src % len(wide)], w, b))
                k += 1
            elif kind == "write":
                WRITERS[op[2]](vals[op[1] % len(vals)], vals[op[3] % len(vals)])
            elif kind == "wwrite" and len(self.w):
                WRITERS[op[2]](self.w[op[1] % len(self.w)], vals[0])
            elif kind == "add":
                vals.append(wide[op[1] % len(wide)] + wide[op[2] % len(wide)])
            elif kind == "pure":
                vals.append(PURES[op[2]](vals[op[1] % len(vals)]))
            elif kind in ("autocast", "grad"):
                vals += self._pair(kind, wide[op[1] % len(wide)], k, op[0] == "autocast" and op[3])
                k += 2
        return vals

    def _pair(self, kind, x, k, bias):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if kind == "autocast" else torch.enable_grad()
        with ctx:
            ys = [F.linear(x, *self._weight(k + i, "plain", bias)) for i in range(2)]
        return [y.float() for y in ys] if kind == "autocast" else ys


def _ops(kinds=("linear", "write", "wwrite", "add", "pure", "autocast", "grad"), pures=tuple(PURES)):
    """Programs for `Generated`: mostly linears of the first few values (so siblings are common),
    mostly plain weights (a view computed in the body starts a group of its own)."""
    from hypothesis import strategies as st
    idx, src = st.integers(0, 7), st.integers(0, 2)
    width = st.sampled_from([8, 16, 24])
    make = {
        "linear": st.tuples(st.just("linear"), src, st.one_of(st.none(), st.none(), idx), width, st.booleans(),
                            st.sampled_from(["plain"] * 3 + list(LAYOUTS))),
        "write": st.tuples(st.just("write"), idx, st.sampled_from(sorted(WRITERS)), idx),
        "wwrite": st.tuples(st.just("wwrite"), idx, st.sampled_from(sorted(WRITERS))),
        "add": st.tuples(st.just("add"), idx, idx),
        "pure": st.tuples(st.just("pure"), idx, st.sampled_from(sorted(pures))),
        "autocast": st.tuples(st.just("autocast"), src, width, st.booleans()),
        "grad": st.tuples(st.just("grad"), src, width),
    }
    weighted = ["linear"] * 2 * (len(kinds) - 1) + [k for k in kinds if k != "linear"]      # half linears
    return st.lists(st.sampled_from(weighted).flatmap(make.__getitem__), min_size=2, max_size=12)


def _grads(outs, params):
    """Gradients of the outputs that carry autograd, or the error backward raises."""
    live = [o for o in outs if o.requires_grad]
    if not live:
        return None
    try:
        return torch.autograd.grad(sum(o.sum() for o in live), list(params), allow_unused=True)
    except RuntimeError as e:
        return type(e).__name__


def _eager_fx(ops, h):
    """(the compiled outputs and module, eager's, groups made): dynamo's graph after the pass,
    run as FX (no inductor), so any difference is the pass's and every value must be bit-equal."""
    torch._dynamo.reset()
    made = []

    def backend(gm, example_inputs):
        made.append(group_linears(gm, example_inputs))
        return gm.forward
    compiled, eager = Generated(ops), Generated(ops)
    with torch.no_grad():
        got = torch.compile(compiled, backend=backend, fullgraph=True)(h.clone())
        want = eager(h.clone())
    return (got, compiled), (want, eager), sum(made)


def _assert_same(got, want):
    (outs, mod), (ref, ref_mod) = got, want
    for i, (y, r) in enumerate(zip(outs, ref, strict=True)):
        assert (y.dtype, y.shape, y.requires_grad) == (r.dtype, r.shape, r.requires_grad), i
        assert torch.equal(y, r), f"value {i} differs from eager"
    for p, q in zip(mod.parameters(), ref_mod.parameters(), strict=True):
        assert torch.equal(p, q), "a parameter differs from eager"
    g, r = _grads(outs, mod.parameters()), _grads(ref, ref_mod.parameters())
    assert type(g) is type(r) and (not isinstance(g, tuple) or all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(g, r))), (g, r)


def test_generated_graphs_keep_every_value_bit_for_bit():
    """Hypothesis draws bodies mixing the pass's hazards (every WRITERS form on values and
    weights, autocast and grad regions, weights computed late, strided / expanded weights and
    biases) with ops that are no hazard; the graph after the pass gives eager's values, dtypes,
    parameters and gradients exactly, and groups something in many bodies."""
    from hypothesis import HealthCheck, given, settings
    made = []

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(_ops())
    def check(ops):
        got, want, groups = _eager_fx(ops, torch.randn(3, D, generator=torch.Generator().manual_seed(7)))
        made.append(groups)
        _assert_same(got, want)
    check()
    assert sum(g > 0 for g in made) >= 10, made


def test_generated_pure_graphs_group_every_sibling_set():
    """The other direction: bodies with no hazard (linears of ready weights, sums and PURES ops
    between them) get every set of sibling linears grouped: per (input, bias or not), one launch
    per MAX_GROUP linears, a lone remainder left as it is."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    from padgraph.backends.triton.grouped_linear import MAX_GROUP

    idx, src = st.integers(0, 7), st.integers(0, 2)
    linear = st.tuples(st.just("linear"), src, st.none(), st.sampled_from([8, 16]), st.booleans(), st.just("plain"))
    other = st.one_of(st.tuples(st.just("add"), idx, idx),
                      st.tuples(st.just("pure"), idx, st.sampled_from(sorted(PURES))))
    kinds = st.sampled_from(["linear", "linear", "other"])
    made = []

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(kinds.flatmap({"linear": linear, "other": other}.get), min_size=2, max_size=12))
    def check(ops):
        got, want, groups = _eager_fx(ops, torch.randn(3, D))
        _assert_same(got, want)
        assert groups == _expected_groups(ops, MAX_GROUP), ops
        made.append(groups)
    check()
    assert sum(g > 1 for g in made) >= 3, made


def _expected_groups(ops, max_group) -> int:
    """Groups the pass must make in a hazard-free body: linears keyed by (input value, bias)."""
    widths, sets = [D], {}
    for op in ops:
        wide = [i for i, w in enumerate(widths) if w == D]
        if op[0] == "linear":
            key = (wide[op[1] % len(wide)], op[4])
            sets[key] = sets.get(key, 0) + 1
            widths.append(op[3])
        elif op[0] == "add":
            widths.append(D)
        else:
            widths.append(widths[op[1] % len(widths)])
    return sum(c // max_group + (c % max_group >= 2) for c in sets.values())


@pytest.mark.parametrize("hazard", [
    [("write", 0, "relu-inplace", 0)], [("write", 0, "hardtanh-positional-inplace", 0)],
    [("write", 0, "view-iadd", 0)], [("write", 0, "foreach", 1)], [("write", 0, "custom-op", 0)],
    [("write", 0, "defined-op", 0)], [("wwrite", 1, "foreach")], [("wwrite", 1, "view-iadd")],
], ids=["relu-inplace", "positional-inplace", "view-iadd", "foreach", "custom-op", "defined-op",
        "foreach-on-weight", "view-iadd-on-weight"])
def test_a_write_between_two_linears_splits_them(hazard):
    """Shrunk reproductions: each gives a wrong result if its two linears are grouped."""
    ops = [("linear", 0, None, 16, False, "plain"), *hazard, ("linear", 0, None, 16, False, "plain")]
    got, want, groups = _eager_fx(ops, torch.randn(3, D))
    _assert_same(got, want)
    assert groups == 0


@pytest.mark.parametrize("ops", [
    [("autocast", 0, 16, True)], [("grad", 0, 16)],
    [("linear", 0, None, 16, False, "plain"), ("linear", 0, 1, 16, False, "plain")],
], ids=["autocast", "grad", "weight-after-first"])
def test_linears_grouping_would_change_are_left_alone(ops):
    got, want, groups = _eager_fx(ops, torch.randn(3, D))
    _assert_same(got, want)
    assert groups == 0


def test_a_group_may_read_another_groups_output():
    """q and k of h grouped, then two linears of q: the second group reads the first's output."""
    ops = [("linear", 0, None, D, False, "plain")] * 2 + [("linear", 1, None, 8, True, "plain")] * 2
    got, want, groups = _eager_fx(ops, torch.randn(3, D))
    _assert_same(got, want)
    assert groups == 2


def test_linears_with_a_broadcast_bias_are_left_alone():
    """F.linear broadcasts a bias of one element; `grouped_linear` takes [N] only."""
    ws = [torch.randn(n, D) for n in (8, 16)]
    bs = [torch.randn(1), torch.randn(1)]
    made = []

    def body(x):
        return [F.linear(x, w, b) for w, b in zip(ws, bs)]
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(body, backend=lambda gm, ex: made.append(group_linears(gm, ex)) or gm.forward,
                            fullgraph=True)(torch.ones(3, D))
    assert made == [0] and all(torch.equal(y, r) for y, r in zip(got, body(torch.ones(3, D))))


def test_autocast_around_the_compile_leaves_the_graph_alone():
    """Autocast entered outside the compiled function: no node of the graph says so, the mode at
    compile time does (dynamo recompiles when it changes)."""
    ops = [("linear", 0, None, 16, True, "plain"), ("linear", 0, None, 16, True, "plain")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want, groups = _eager_fx(ops, torch.randn(3, D))
    assert got[0][1].dtype == torch.bfloat16
    _assert_same(got, want)
    assert groups == 0
    assert _eager_fx(ops, torch.randn(3, D))[2] == 1


def _mixed(vals, h):
    """One [bs, D] output mixing every value row by row (padded rows stay apart from real ones)."""
    return torch.stack([v.sum(-1) for v in vals], -1).sum(-1, keepdim=True) + vals[-1].mean(-1, keepdim=True) * h


def _run_compiled(ops, h):
    """Through pg.compile and inductor, as a user runs the pass."""
    torch._dynamo.reset()
    block = Generated(ops)
    prog, _ = _program(block, D)
    groups = []

    def spy(gm, example_inputs):
        groups.append(group_linears(gm, example_inputs))
    runner = pg.compile(prog, lambda x: {"y": _mixed(block(x.h.clone()), x.h)}, backend="reference",
                        torch_compile={"passes": [spy]})
    with torch.no_grad():
        got = runner(h=h)["y"]
        want = _mixed(Generated(ops)(h.clone()), h)
    return got, want, sum(groups)


def test_generated_programs_give_the_eager_results_through_inductor():
    """The same bodies (no weight writes, autocast or grad regions; no bf16 round trip, which
    inductor elides with or without the pass) through pg.compile and inductor."""
    from hypothesis import HealthCheck, given, settings
    made = []

    @settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(_ops(kinds=("linear", "write", "add", "pure"), pures=("silu", "view-t", "softmax")))
    def check(ops):
        got, want, groups = _run_compiled(ops, torch.randn(3, D, generator=torch.Generator().manual_seed(7)))
        made.append(groups)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    check()
    assert sum(made) > 0, "no generated program was grouped: the test would not see a wrong grouping"


def _inductor_with_pass(fn, made):
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        made.append(group_linears(gm, example_inputs))
        return compile_fx(gm, example_inputs)
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)],
                         ids=["bf16-under-fp16", "fp32-under-bf16"])
def test_cuda_kernel_with_strided_and_expanded_biases_and_under_autocast(m, dtype, autocast):
    """The kernel path on the GPU: weights whose rows are a slice of a wider matrix, a strided, an
    expanded and a plain bias; eagerly, and through the pass and inductor, with and without
    autocast around the call (F.linear computes in autocast's dtype: the function runs it, the
    pass leaves the graph alone)."""
    dev, k = torch.device("cuda"), 256
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, k, device=dev, generator=g).to(dtype)
    ws = [torch.randn(n, 2 * k, device=dev, generator=g).to(dtype)[:, :k] for n in (96, 40, 40)]
    bs = [torch.randn(2 * 96, device=dev, generator=g).to(dtype)[::2],
          torch.randn(1, device=dev, generator=g).to(dtype).expand(40),
          torch.randn(40, device=dev, generator=g).to(dtype)]
    assert kernel_takes(x, ws, bs) == (dtype == torch.bfloat16)
    _assert_linear(grouped_linear(x, ws, bs), x, ws, bs)

    def body(x):
        return [F.linear(x, w, b) for w, b in zip(ws, bs)]
    for ctx, groups in ((torch.autocast("cuda", dtype=autocast), 0), (contextlib.nullcontext(), 1)):
        made = []
        with torch.no_grad(), ctx:
            eager, want = grouped_linear(x, ws, bs), body(x)
            got = _inductor_with_pass(body, made)(x)
        assert made == [groups]
        for y, e, r in zip(got, eager, want):
            assert y.dtype == e.dtype == r.dtype == (autocast if groups == 0 else dtype)
            assert groups or torch.equal(e, r)               # under autocast: F.linear itself
            torch.testing.assert_close(y.float(), r.float(), rtol=2e-2, atol=2e-2 * k ** 0.5)
            torch.testing.assert_close(e.float(), r.float(), rtol=2e-2, atol=2e-2 * k ** 0.5)
