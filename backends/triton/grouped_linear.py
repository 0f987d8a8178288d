"""Linear layers that read one input, as one kernel launch: `grouped_linear`, and the graph pass
that routes a compiled body's sibling linears through it (`group_linears`).

An unmodified Hugging Face layer computes q, k and v (and gate and up) as separate `nn.Linear`
calls on the same hidden state. At decode batch sizes each is a matrix-vector product that reads
its weight once, and the small ones are bound by a kernel's ramp and tail, not by bandwidth: on
the H200 (`bench_hf --profile`, Llama-1B shape, bs 1) cuBLAS takes 5.7 us for the 8 MB q
projection and 5.4 us each for the 2 MB k and v, 16.5 us for what one 12 MB qkv launch reads in
6-7 us (`results/gemv.md`). Engines fuse the weights (one [q; k; v] matrix); padgraph serves the
model as it is, so it fuses the launch instead: one Triton kernel whose programs each take
BLOCK_N output columns of one of the weights (up to MAX_GROUP of them, each its own pointer,
shape and bias) over all M rows, as `gemv` does for one weight. No weight is copied or moved.

`grouped_linear(x, weights, biases)` equals `[F.linear(x, w, b) ...]` (fp32 accumulation; the
last bits may differ from cuBLAS's). The kernel runs for M <= MAX_M rows of x on CUDA in fp16 /
bf16 with row-contiguous weights of x's dtype; anything else (more rows, the CPU, fp32) runs
F.linear per weight, so the op is correct wherever it is called. Under torch.compile it is the
opaque custom op `padgraph::grouped_linear` (a fake implementation gives the output shapes), and
the kernel choice happens when it runs: a CUDA graph captured at a bucket of 4 holds the kernel,
one at 64 holds cuBLAS.

`group_linears` is a `pg.compile` graph pass (`torch_compile={"passes": [group_linears]}`): in
the FX graph dynamo traced, every set of `F.linear` calls on one input node, with weights of one
input width and all or none with a bias, becomes one `grouped_linear` call, inserted before the
first of them. A set is split where that would change a result: a weight computed after the first
linear, or an in-place write between two of them (dynamo's graph is not functionalised: the input
or a weight could change in between). It does nothing while grad mode is on (the op has no
backward).
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .attention_decode import mma, upcast_dots
from .kv import resolve_impl

MAX_M = 16          # rows of x the kernel takes: one BLOCK_M tile
MAX_GROUP = 4       # weights one launch takes (q, k, v; gate, up)
_LINEARS = (torch._C._nn.linear, F.linear)


@triton.jit
def _tile(x_ptr, w_ptr, b_ptr, y_ptr, pid_n, M, N, K, stride_xm, stride_wn, stride_ym,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """y[:, pid_n's BLOCK_N columns] = x @ w[those rows].T (+ b), fp32 accumulation."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += mma(x, tl.trans(w), UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_kernel(x_ptr, w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, N0, N1, N2, N3,
                    sw0, sw1, sw2, sw3, sy0, sy1, sy2, sy3, M, K, stride_xm,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """Programs [0, t0) take weight 0's column blocks, [t0, t1) weight 1's, ...; an unused weight
    has N = 0 and no program."""
    pid = tl.program_id(0)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = t0 + tl.cdiv(N1, BLOCK_N)
    t2 = t1 + tl.cdiv(N2, BLOCK_N)
    if pid < t0:
        _tile(x_ptr, w0, b0, y0, pid, M, N0, K, stride_xm, sw0, sy0,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    elif pid < t1:
        _tile(x_ptr, w1, b1, y1, pid - t0, M, N1, K, stride_xm, sw1, sy1,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    elif pid < t2:
        _tile(x_ptr, w2, b2, y2, pid - t1, M, N2, K, stride_xm, sw2, sy2,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    else:
        _tile(x_ptr, w3, b3, y3, pid - t2, M, N3, K, stride_xm, sw3, sy3,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)


def _check(x: torch.Tensor, weights, biases) -> list:
    if not weights:
        raise ValueError("grouped_linear takes at least one weight")
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"grouped_linear: {len(weights)} weights and {len(biases)} biases")
    for w, b in zip(weights, biases):
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"grouped_linear takes x [..., K] and weights [N, K]; got x "
                             f"{tuple(x.shape)} and a weight {tuple(w.shape)}")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"grouped_linear: a bias {tuple(b.shape)} for a weight {tuple(w.shape)}")
    return biases


def kernel_takes(x: torch.Tensor, weights, biases) -> bool:
    """Whether one launch computes these linears (else F.linear runs per weight)."""
    rows = x.numel() // max(x.shape[-1], 1)
    tensors = [x, *weights, *(b for b in biases if b is not None)]
    return (0 < rows <= MAX_M and x.shape[-1] > 0 and x.dtype in (torch.float16, torch.bfloat16)
            and all(t.dtype == x.dtype for t in tensors) and all(w.stride(1) == 1 for w in weights)
            and len({b is None for b in biases}) == 1)


def grouped_linear(x: torch.Tensor, weights, biases=None, *, impl: str = "auto") -> list[torch.Tensor]:
    """[F.linear(x, w, b) for w, b in zip(weights, biases)]: x [..., K], each w [N_i, K] -> each
    [..., N_i] in x's dtype. impl: "auto" (the kernel where it applies on CUDA, see module doc),
    "triton" (the kernel where it applies, any device: the CPU interpreter), "torch"."""
    biases = _check(x, weights, biases)
    if resolve_impl(impl, x, *weights) == "torch" or not kernel_takes(x, weights, biases):
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    out = []
    for i in range(0, len(weights), MAX_GROUP):
        out += _launch(x, weights[i:i + MAX_GROUP], biases[i:i + MAX_GROUP])
    return out


def _launch(x, weights, biases) -> list[torch.Tensor]:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    m = x2.shape[0]
    ys = [torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
    total = sum(w.shape[0] for w in weights)
    block_n = 64 if total >= 16384 else 32          # the H200's best one-split gemv tiles (results/gemv.md)
    block_k = 128 if block_n == 64 else 256
    pad = MAX_GROUP - len(weights)
    ws, bs, yy = [*weights, *[weights[0]] * pad], [*biases, *[biases[0]] * pad], [*ys, *[ys[0]] * pad]
    ns = [w.shape[0] for w in weights] + [0] * pad
    has_bias = biases[0] is not None
    bs = [b if has_bias else w for b, w in zip(bs, ws)]          # unread without a bias
    grid = (sum(triton.cdiv(n, block_n) for n in ns),)
    _grouped_kernel[grid](x2, *ws, *bs, *yy, *ns, *(w.stride(0) for w in ws), *(y.stride(0) for y in yy),
                          m, k, x2.stride(0), HAS_BIAS=has_bias, BLOCK_M=MAX_M, BLOCK_N=block_n,
                          BLOCK_K=block_k, UPCAST=upcast_dots(x.dtype), num_warps=4, num_stages=4)
    return [y.reshape(*lead, y.shape[1]) for y in ys]


@torch.library.custom_op("padgraph::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, weights: list[torch.Tensor],
                      biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`grouped_linear` as an op a compiled graph calls (what `group_linears` inserts)."""
    return grouped_linear(x, weights, biases)


@grouped_linear_op.register_fake
def _fake(x, weights, biases):
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]


# ---- the graph pass -----------------------------------------------------------------------------
def _linear_args(node) -> tuple | None:
    """(input, weight, bias) of an F.linear call node, else None."""
    if node.op != "call_function" or node.target not in _LINEARS:
        return None
    names = ("input", "weight", "bias")
    args = list(node.args) + [node.kwargs.get(n) for n in names[len(node.args):]]
    return tuple(args[:3])


def _value(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def group_linears(gm: torch.fx.GraphModule, example_inputs) -> int:
    """The graph pass (module doc): each group of sibling linears becomes one `grouped_linear`
    call. Returns the number of groups made (0: the graph is unchanged)."""
    if torch.is_grad_enabled():
        return 0
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes = [order[n] for n in graph.nodes if _may_write(n)]     # where a tensor may change in place
    siblings: dict = {}
    for node in graph.nodes:
        args = _linear_args(node)
        if args is not None and isinstance(args[1], torch.fx.Node):
            x, w, b = args
            wv = _value(w)
            if wv is None or wv.dim() != 2:
                continue
            siblings.setdefault((x, wv.shape[1], b is None), []).append((node, w, b))
    made = 0
    for (x, _, _), group in siblings.items():
        for run in _runs(group, order, writes):
            for i in range(0, len(run), MAX_GROUP):
                part = run[i:i + MAX_GROUP]
                if len(part) > 1:
                    _replace(graph, x, part)
                    made += 1
    if made:
        graph.lint()
        gm.recompile()
    return made


def _may_write(node) -> bool:
    """Whether a node may change a tensor in place (dynamo's graph is not functionalised): an
    in-place method or op, an `out=` / `inplace=True` call, item assignment, a module call."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("__")
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.setitem or "out" in node.kwargs or node.kwargs.get("inplace") is True:
        return True
    schema = getattr(t, "_schema", None)
    if schema is not None:
        return schema.is_mutable
    name = getattr(t, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _runs(group, order, writes) -> list[list]:
    """The group's linears split where grouping would change a result: each run computes at its
    first linear, so every weight and bias of the run must exist there, and nothing between the
    run's first and last linear may write a tensor in place (the input or a weight could change
    between them). A linear whose weight comes later starts a run of its own."""
    runs: list[list] = []
    for g in group:
        pos = order[g[0]]
        run = runs[-1] if runs else None
        if run is not None:
            start = order[run[0][0]]
            ready = all(order.get(a, -1) < start for a in g[1:] if a is not None)
            if ready and not any(start < w < pos for w in writes):
                run.append(g)
                continue
        runs.append([g])
    return runs


def _replace(graph, x, part) -> None:
    nodes, weights, biases = zip(*part)
    with graph.inserting_before(nodes[0]):
        call = graph.call_function(torch.ops.padgraph.grouped_linear.default, (x, list(weights), list(biases)))
        values = [_value(a) for a in (x, *weights, *(b for b in biases if b is not None))]
        fake = getattr(values[0], "fake_mode", None)           # the mode dynamo traced x in
        if fake is not None and all(v is not None for v in values):
            with fake:
                call.meta["example_value"] = _fake(_value(x), [_value(w) for w in weights], [])
        for i, node in enumerate(nodes):
            item = graph.call_function(operator.getitem, (call, i))
            if "example_value" in call.meta:
                item.meta["example_value"] = call.meta["example_value"][i]
            node.replace_all_uses_with(item)
    for node in nodes:
        graph.erase_node(node)
