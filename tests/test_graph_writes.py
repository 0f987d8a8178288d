"""What the graph pass may assume about dynamo's nodes (backends/triton/graph_writes.py), in both
directions: every way a body writes a tensor in place is a write (in-place activations by keyword,
position and method, writes through views, setitem, out=, foreach, custom ops with a mutable
argument by packet and by overload, batch norm's running statistics, F.embedding's max_norm,
module calls, unknown functions), and the ops between a decoder layer's linears (views,
activations, casts, arithmetic, aten and non-mutating custom ops) are not. And which nodes run
with grad off and outside autocast, whether the mode is set in the graph or around the compile."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from padgraph.backends.triton.graph_writes import grad_off_no_autocast, pure


@torch.library.custom_op("pgtest_writes::scale_", mutates_args=("x",))
def _scale_(x: torch.Tensor) -> None:
    x.mul_(0.5)


@_scale_.register_fake
def _(x):
    return None


@torch.library.custom_op("pgtest_writes::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


_LIB = torch.library.Library("pgtest_writes", "FRAGMENT")
_LIB.define("bump(Tensor(a!) x) -> ()")


def _bump(x):
    x.add_(1)


_LIB.impl("bump", _bump, "CompositeExplicitAutograd")
torch.library.register_fake("pgtest_writes::bump", lambda x: None, lib=_LIB)


@torch._dynamo.allow_in_graph
def _opaque(x):
    """A function dynamo puts in the graph as one call: nothing says what it writes."""
    x.mul_(3)
    return x


def _graph(fn, *args, ctx=contextlib.nullcontext()):
    """The FX graph dynamo traces for fn(*args), with the grad-off / no-autocast node set the pass
    sees at compile time."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, grad_off_no_autocast(list(gm.graph.nodes))))
        return gm.forward
    torch._dynamo.reset()
    with torch.no_grad(), ctx:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(seen) == 1
    return seen[0]


@torch._dynamo.allow_in_graph
def relu(x):
    """Named like torch's relu, and writes: identity, not the name, makes a function torch's."""
    return x.relu_()


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op.startswith("call_")]


def _view_iadd(x):
    v = x[:, 1::2]
    v += 1
    return x


WRITES = {
    "relu-inplace-kw": lambda x: F.relu(x, inplace=True),
    "relu-inplace-pos": lambda x: F.relu(x, True),
    "hardtanh-inplace-pos": lambda x: F.hardtanh(x, -0.5, 0.5, True),
    "dropout-inplace-pos": lambda x: F.dropout(x, 0.5, True, True),
    "silu-inplace": lambda x: F.silu(x, inplace=True),
    "method-relu_": lambda x: x.relu_(),
    "torch-relu_": lambda x: torch.relu_(x),
    "view-iadd": _view_iadd,
    "view-add_": lambda x: x.view(-1)[::3].add_(1.0),
    "t-mul_": lambda x: x.t().mul_(0.5),
    "setitem": lambda x: x.__setitem__(0, 0.25),
    "out=": lambda x: torch.mul(x, 0.5, out=x),
    "copy_": lambda x: x.copy_(x.flip(0)),
    "foreach-add_": lambda x: torch._foreach_add_([x], 1.0),
    "foreach-mul_-list": lambda x: torch._foreach_mul_([x, x[:1]], [0.5, 2.0]),
    "custom-op-packet": lambda x: torch.ops.pgtest_writes.scale_(x),
    "custom-op-overload": lambda x: torch.ops.pgtest_writes.scale_.default(x),
    "defined-op-packet": lambda x: torch.ops.pgtest_writes.bump(x),
    "defined-op-overload": lambda x: torch.ops.pgtest_writes.bump.default(x),
    "aten-add_": lambda x: torch.ops.aten.add_.Tensor(x, x),
    "batch-norm-training": lambda x: F.batch_norm(x, x[0].clone(), x[1].abs() + 1, training=True),
    "embedding-max-norm": lambda x: F.embedding(torch.tensor([0, 1]), x, max_norm=0.5),
    "unknown-function": lambda x: _opaque(x),
    "user-function-named-relu": lambda x: relu(x),
}

PURE = {
    "linear": lambda x: F.linear(x, x),
    "view-transpose": lambda x: x.view(4, 2, 2).transpose(1, 2).reshape(4, 4),
    "silu-relu-gelu": lambda x: F.gelu(F.relu(F.silu(x))),
    "softmax-matmul": lambda x: torch.softmax(x, -1) @ x,
    "getitem-arith": lambda x: x[:, :2] * 2 + x[:, 2:] / 3 - 1,
    "cat-chunk": lambda x: torch.cat(x.chunk(2, -1)[::-1], -1),
    "casts": lambda x: x.to(torch.bfloat16).float().half().to(x.dtype).contiguous(),
    "sizes": lambda x: x.new_zeros(x.size(0), x.shape[1]),
    "norms": lambda x: F.layer_norm(x, (4,)) + F.rms_norm(x, (4,)),
    "aten-overload": lambda x: torch.ops.aten.add.Tensor(x, x),
    "pure-custom-op": lambda x: torch.ops.pgtest_writes.twice(x),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_every_in_place_write_is_a_write(name):
    gm, _ = _graph(WRITES[name], torch.randn(4, 4))
    assert not all(pure(n) for n in _calls(gm)), gm.graph


@pytest.mark.parametrize("name", sorted(PURE))
def test_the_ops_between_a_layers_linears_are_not_writes(name):
    gm, _ = _graph(PURE[name], torch.randn(4, 4))
    assert _calls(gm) and [n for n in _calls(gm) if not pure(n)] == [], gm.graph


def test_a_module_call_is_a_write():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    assert [pure(n) for n in _calls(gm)] == [False]


def _linears(gm, clean):
    return [n in clean for n in gm.graph.nodes if n.target is torch._C._nn.linear]


def _two_modes(x):
    a = F.linear(x, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = F.linear(x, x)
    with torch.enable_grad():
        c = F.linear(x, x)
        with torch.no_grad():
            d = F.linear(x, x)
    return a, b, c, d, F.linear(x, x)


def test_linears_under_autocast_or_grad_are_not_clean():
    gm, clean = _graph(_two_modes, torch.randn(4, 4))
    assert _linears(gm, clean) == [True, False, False, True, True]


def test_autocast_or_grad_around_the_compile_makes_every_node_unclean():
    plain = (lambda x: F.linear(x, x), torch.randn(4, 4))
    gm, clean = _graph(*plain, ctx=torch.autocast("cpu", dtype=torch.bfloat16))
    assert _linears(gm, clean) == [False]
    gm, clean = _graph(*plain, ctx=torch.enable_grad())
    assert _linears(gm, clean) == [False]
    gm, clean = _graph(*plain)
    assert _linears(gm, clean) == [True]
