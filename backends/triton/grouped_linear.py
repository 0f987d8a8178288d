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
bf16, outside autocast and autograd, with every weight and bias a plain strided tensor of x's
dtype on x's device (weights with contiguous rows; a bias of any stride, an expanded one included)
and every offset within int32 (`kernel_takes`); anything else (more rows, the CPU, fp32, autocast,
inputs that need grad, another layout) runs F.linear per weight, so the result is F.linear's
wherever it is called. Under torch.compile it is the opaque custom op `padgraph::grouped_linear`
(a fake implementation gives the output shapes), and the kernel choice happens when it runs: a
CUDA graph captured at a bucket of 4 holds the kernel, one at 64 holds cuBLAS.

`group_linears` is a `pg.compile` graph pass (`torch_compile={"passes": [group_linears]}`): in
the FX graph dynamo traced, every set of `F.linear` calls on one input node, with weights [N, K]
of one K and biases [N] (all or none), becomes one `grouped_linear` call, inserted before the
first of them. It must never change a result, so it groups only what it can prove safe
(graph_writes.py): a set is split at every node between two of its linears that is not known to
write nothing (dynamo's graph is not functionalised: an in-place activation, a write through a view
of the input, a foreach op or a custom op with a mutable argument could change the input, a
weight or a bias in between), and where a weight is computed after the first linear. Only linears
that run with grad off (the op has no backward) and outside autocast (where F.linear computes in
autocast's dtype) are grouped, whether the mode is set inside the graph or around the compile.
"""
from __future__ import annotations

import bisect
import contextlib
import operator

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from padgraph.errors import ContractValueError

from .attention_decode import mma, upcast_dots
from .graph_writes import grad_off_no_autocast, pure
from .kv import resolve_impl

MAX_M = 16          # rows of x the kernel takes: one BLOCK_M tile
MAX_GROUP = 4       # weights one launch takes (q, k, v; gate, up)
_LINEARS = (torch._C._nn.linear, F.linear)


@triton.jit
def _tile(x_ptr, w_ptr, b_ptr, y_ptr, pid_n, M, N, K, stride_xm, stride_wn, stride_b, stride_ym,
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
        acc += tl.load(b_ptr + offs_n * stride_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_kernel(x_ptr, w0, w1, w2, w3, b0, b1, b2, b3, y0, y1, y2, y3, N0, N1, N2, N3,
                    sw0, sw1, sw2, sw3, sb0, sb1, sb2, sb3, sy0, sy1, sy2, sy3, M, K, stride_xm,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """Programs [0, t0) take weight 0's column blocks, [t0, t1) weight 1's, ...; an unused weight
    has N = 0 and no program."""
    pid = tl.program_id(0)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = t0 + tl.cdiv(N1, BLOCK_N)
    t2 = t1 + tl.cdiv(N2, BLOCK_N)
    if pid < t0:
        _tile(x_ptr, w0, b0, y0, pid, M, N0, K, stride_xm, sw0, sb0, sy0,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    elif pid < t1:
        _tile(x_ptr, w1, b1, y1, pid - t0, M, N1, K, stride_xm, sw1, sb1, sy1,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    elif pid < t2:
        _tile(x_ptr, w2, b2, y2, pid - t1, M, N2, K, stride_xm, sw2, sb2, sy2,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    else:
        _tile(x_ptr, w3, b3, y3, pid - t2, M, N3, K, stride_xm, sw3, sb3, sy3,
              HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)


_I32 = 2 ** 31      # the kernel's offsets are int32: every element it reads or writes lies below this


def _check(x: torch.Tensor, weights, biases) -> list:
    """The shapes `grouped_linear` takes (F.linear's own errors cover dtypes and devices); the
    biases as a list."""
    if not weights:
        raise ContractValueError("grouped_linear: weights must be one or more [N, K] tensors, got none")
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ContractValueError(f"grouped_linear: biases must be one per weight (or None), got "
                                 f"{len(weights)} weights and {len(biases)} biases")
    for i, (w, b) in enumerate(zip(weights, biases)):
        if x.dim() < 1 or w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ContractValueError(f"grouped_linear: weight {i} must be [N, K] for x [..., K] = "
                                     f"{tuple(x.shape)}, got {tuple(w.shape)}")
        if b is not None and tuple(b.shape) != (w.shape[0],):
            raise ContractValueError(f"grouped_linear: bias {i} must be [N] = ({w.shape[0]},) for weight "
                                     f"{tuple(w.shape)}, got {tuple(b.shape)}")
    return biases


def _extent(t: torch.Tensor) -> int:
    """One past the furthest element a strided tensor reads from its data pointer."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0


def _plain(t: torch.Tensor, x: torch.Tensor) -> bool:
    """A tensor the kernel reads through its data pointer and strides exactly as torch does."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and t.dtype == x.dtype and t.device == x.device and not t.is_conj() and not t.is_neg()
            and _extent(t) < _I32)


def kernel_takes(x: torch.Tensor, weights, biases) -> bool:
    """Whether one launch computes these linears (else F.linear runs per weight): 1..MAX_M rows of
    fp16 / bf16, every tensor plain (`_plain`: x's dtype and device, strided, no conj / neg bit,
    int32 offsets), each weight non-empty with contiguous rows, all or no biases (any stride)."""
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    tensors = [x, *weights, *(b for b in biases if b is not None)]
    return (0 < rows <= MAX_M and k > 0 and rows * k < _I32 and x.dtype in (torch.float16, torch.bfloat16)
            and all(_plain(t, x) for t in tensors) and all(w.shape[0] > 0 and w.stride(1) == 1 for w in weights)
            and len({b is None for b in biases}) == 1)


def grouped_linear(x: torch.Tensor, weights, biases=None, *, impl: str = "auto") -> list[torch.Tensor]:
    """[F.linear(x, w, b) for w, b in zip(weights, biases)]: x [..., K], each w [N_i, K], each b
    [N_i] -> each [..., N_i]. impl: "auto" (the kernel where it applies on CUDA, see module doc),
    "triton" (the kernel where it applies, any device: the CPU interpreter), "torch". Under
    autocast on x's device, or where the result would carry autograd (the kernel has no backward),
    F.linear runs: the dtype and grad_fn are F.linear's."""
    biases = _check(x, weights, biases)
    if (resolve_impl(impl, x, *weights) == "torch" or _autocast_on(x.device)
            or _needs_grad(x, weights, biases) or not kernel_takes(x, weights, biases)):
        return [F.linear(x, w, b) for w, b in zip(weights, biases)]
    out = []
    for i in range(0, len(weights), MAX_GROUP):
        out += _launch(x, weights[i:i + MAX_GROUP], biases[i:i + MAX_GROUP])
    return out


def _needs_grad(x, weights, biases) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *weights, *biases))


def _autocast_on(device: torch.device) -> bool:
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:                            # a device type autocast does not know (meta)
        return False


def _launch(x, weights, biases) -> list[torch.Tensor]:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)                                             # [M, K]
    if x2.stride(1) != 1 or _extent(x2) >= _I32:
        x2 = x2.contiguous()
    m = x2.shape[0]
    ys = [torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]   # [M, N_i]
    total = sum(w.shape[0] for w in weights)
    block_n = 64 if total >= 16384 else 32          # the H200's best one-split gemv tiles (results/gemv.md)
    block_k = 128 if block_n == 64 else 256
    pad = MAX_GROUP - len(weights)
    ws, bs, yy = [*weights, *[weights[0]] * pad], [*biases, *[biases[0]] * pad], [*ys, *[ys[0]] * pad]
    ns = [w.shape[0] for w in weights] + [0] * pad
    has_bias = biases[0] is not None
    bs = [b if has_bias else w for b, w in zip(bs, ws)]          # unread without a bias
    sbs = [b.stride(0) if has_bias else 0 for b in bs]          # a strided or expanded (0) bias
    grid = (sum(triton.cdiv(n, block_n) for n in ns),)
    _grouped_kernel[grid](x2, *ws, *bs, *yy, *ns, *(w.stride(0) for w in ws), *sbs, *(y.stride(0) for y in yy),
                          m, k, x2.stride(0), HAS_BIAS=has_bias, BLOCK_M=MAX_M, BLOCK_N=block_n,
                          BLOCK_K=block_k, UPCAST=upcast_dots(x.dtype), num_warps=4, num_stages=4)
    return [y.reshape(*lead, y.shape[1]) for y in ys]


@torch.library.custom_op("padgraph::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, weights: list[torch.Tensor],
                      biases: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """`grouped_linear` as an op a compiled graph calls (what `group_linears` inserts, only outside
    autocast): autocast plays no part, the outputs are contiguous in x's dtype, as `_fake` says."""
    with torch.autocast(x.device.type, enabled=False) if _autocast_on(x.device) else contextlib.nullcontext():
        return [y.contiguous() for y in grouped_linear(x, weights, biases)]


@grouped_linear_op.register_fake
def _fake(x, weights, biases):
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weights]


# ---- the graph pass -----------------------------------------------------------------------------
def _linear_args(node) -> tuple | None:
    """(input, weight, bias) of an F.linear call node, else None."""
    if node.op != "call_function" or node.target not in _LINEARS:
        return None
    names = ("input", "weight", "bias")
    if len(node.args) > 3 or set(node.kwargs) - set(names[len(node.args):]):
        return None
    args = list(node.args) + [node.kwargs.get(n) for n in names[len(node.args):]]
    return tuple(args[:3])


def _value(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _sibling_key(x, w, b) -> tuple | None:
    """(x, K, no bias) for a linear `grouped_linear` computes as F.linear does: node arguments with
    static shapes x [..., K], w [N, K], b [N] (F.linear also broadcasts a bias: not grouped), all
    of x's dtype and device (a mismatch would raise at the group's first linear, not at its own)."""
    nodes = (x, w) if b is None else (x, w, b)
    if not all(isinstance(a, torch.fx.Node) for a in nodes):
        return None
    values = [_value(a) for a in nodes]
    xv = values[0]
    if not all(isinstance(v, torch.Tensor) and (v.dtype, v.device) == (xv.dtype, xv.device) for v in values):
        return None
    k_x = xv.shape[-1] if xv.dim() else None
    w_shape = tuple(values[1].shape)
    b_shape = tuple(values[2].shape) if b is not None else ()
    if len(w_shape) != 2 or not all(isinstance(d, int) for d in (k_x, *w_shape, *b_shape)):
        return None                                 # symbolic sizes: not provably equal
    n, k = w_shape
    if k_x != k or (b is not None and b_shape != (n,)):
        return None
    return x, k, b is None


def group_linears(gm: torch.fx.GraphModule, example_inputs) -> int:
    """The graph pass (module doc): each group of sibling linears becomes one `grouped_linear`
    call. Returns the number of groups made (0: the graph is unchanged)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    clean = grad_off_no_autocast(nodes)
    walls = [order[n] for n in nodes if not pure(n)]               # may write any tensor: sorted
    siblings: dict = {}
    for node in nodes:
        args = _linear_args(node) if node in clean else None
        key = _sibling_key(*args) if args is not None else None
        if key is not None:
            siblings.setdefault(key, []).append((node, *args[1:]))
    made, moved = 0, {}                         # a replaced linear -> the getitem now giving its value
    for (x, _, _), group in siblings.items():
        for run in _runs(group, order, walls):
            for i in range(0, len(run), MAX_GROUP):
                part = [tuple(moved.get(a, a) for a in g) for g in run[i:i + MAX_GROUP]]
                if len(part) > 1:
                    moved.update(_replace(graph, moved.get(x, x), part))
                    made += 1
    if made:
        graph.lint()
        gm.recompile()
    return made


def _runs(group, order, walls) -> list[list]:
    """The group's linears split where grouping could change a result: a run computes at its first
    linear, so every weight and bias of the run must exist there, and no node between the run's
    first and last linear may write (`walls`: the input, a weight or a bias could change). A
    linear that cannot join the run before it starts a run of its own."""
    runs: list[list] = []
    for g in group:
        pos = order[g[0]]
        if runs:
            start = order[runs[-1][0][0]]
            ready = all(order[a] < start for a in g[1:] if a is not None)
            wall = bisect.bisect_right(walls, start)
            if ready and (wall == len(walls) or walls[wall] > pos):
                runs[-1].append(g)
                continue
        runs.append([g])
    return runs


def _replace(graph, x, part) -> dict:
    """One `grouped_linear` call before the part's first linear, a getitem per linear in its
    place. Returns {linear: its getitem} (a later part may name a linear as its input or weight)."""
    nodes, weights, biases = zip(*part)
    items = {}
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
            items[node] = item
    for node in nodes:
        graph.erase_node(node)
    return items
