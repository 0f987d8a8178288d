"""Inductor graph passes for bodies padgraph compiles: `unfuse_addmm`.

A decoder layer's residual adds, `x + o_proj(h)` and `x + down(h)`, reach inductor as
`add(mm(h, W^T), x)`, and its post-grad patterns rewrite each into one extern call
`addmm(x, h, W^T, out=buf)`. ATen's `addmm` with an `out` other than its first argument first
copies that argument into `out` (on a GPU a device-to-device copy: in a captured graph the
`memcpy32_post` node before each GEMM, results/bench_runner.md), then runs the GEMM with beta 1:
two copy kernels a layer at decode sizes, and one rounding (fp32 accumulator plus x) where the
eager layer rounds twice (the GEMM's output, then the sum).

`unfuse_addmm` is an inductor `post_grad_custom_post_pass` that turns every such `addmm(x, a, b)`
(beta and alpha 1, x of the output's full shape and dtype: a residual, not a broadcast bias,
which cuBLAS adds in its epilogue without a copy) back into `add(x, mm(a, b))`. The GEMM writes a
buffer of its own, and the add is a pointwise node inductor fuses into its neighbours (the next
RMSNorm's kernel reads x anyway), so the copy kernels go and the stored sum is rounded as the
eager layer rounds it. A norm fused after the add reads the fp32 sum, before its rounding to the
layer's dtype, unless inductor's `emulate_precision_casts` option is set (with it, a bf16 norm's
output is the eager layer's bits on the CPU; not measured on a GPU). Without that option the
step as a whole is neither the eager step's bits nor the fused `addmm`'s: on an H100
(`bench_runner` at 64 rows) 2 of 64 greedy tokens differed from the compiled step's without the
pass, for a step 1-2 % faster (results/bench_runner.md). Use it through `pg.compile`'s inductor
options:

    pg.compile(program, body, backend="cuda",
               torch_compile={"fullgraph": True,
                              "options": {"post_grad_custom_post_pass": unfuse_addmm}})

Set there, it takes the place of any other post-grad custom pass; to run another one too,
call both from one `CustomGraphPass`. Off by default: `bench_runner`'s
`padgraph+compile+unfused` variant is the same-process A/B against `padgraph+compile`.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten


def _is_one(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1


def _unfusable(node: torch.fx.Node):
    """(x, a, b) of an `addmm(x, a, b)` node that adds a full-shaped x with beta = alpha = 1,
    else None."""
    if node.op != "call_function" or node.target is not aten.addmm.default:
        return None
    if len(node.args) != 3 or set(node.kwargs) - {"beta", "alpha"}:
        return None
    if not all(_is_one(node.kwargs.get(k, 1)) for k in ("beta", "alpha")):
        return None
    x, a, b = node.args
    if not all(isinstance(n, torch.fx.Node) for n in (x, a, b)):
        return None
    xv, out = x.meta.get("val"), node.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(out, torch.Tensor)):
        return None
    if xv.shape != out.shape or xv.dtype != out.dtype or not out.dtype.is_floating_point:
        return None
    return x, a, b


class UnfuseAddmm(CustomGraphPass):
    """The post-grad pass (module docstring): `addmm(x, a, b)` → `add(x, mm(a, b))` for a
    full-shaped x; `rewritten` counts the nodes it changed over its life (a test's probe)."""

    def __init__(self):
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._guards import detect_fake_mode
        for node in list(graph.nodes):
            found = _unfusable(node)
            if found is None:
                continue
            x, a, b = found
            mode = detect_fake_mode([a.meta.get("val"), b.meta.get("val"), x.meta.get("val")])
            if mode is None:    # no fake values to give the new nodes: leave it fused
                continue
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (a, b))
                add = graph.call_function(aten.add.Tensor, (x, mm))
            with mode:
                mm.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
                add.meta["val"] = aten.add.Tensor(x.meta["val"], mm.meta["val"])
            for m in (mm, add):
                if "stack_trace" in node.meta:
                    m.meta["stack_trace"] = node.meta["stack_trace"]
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            self.rewritten += 1

    def uuid(self) -> bytes:
        # inductor's FX graph cache keys on this: the pass's source
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


unfuse_addmm = UnfuseAddmm()

__all__ = ["UnfuseAddmm", "unfuse_addmm"]
