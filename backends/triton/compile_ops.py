"""The attention, draft top-k and routed MoE kernels as opaque torch custom ops under
`torch.compile`.

Dynamo can trace a user Triton kernel, but the split-KV kernels bump per-device ticket
counters (`attention_split.tickets`) that live outside any graph: traced, the counters become a
mutated graph input, and `torch.compile(mode="reduce-overhead")` refuses its CUDA graphs
("skipping cudagraphs due to mutated inputs"). Engines register their attention as custom ops
for that reason; so does padgraph: under compilation each public attention function calls its
`padgraph::` op (a fake implementation gives inductor the output's shape and dtype, the real
one launches the kernels), and eagerly it calls the function itself, with no dispatcher cost.
The routed MoE experts (`moe_routed.routed_experts`) are an op for another reason: traced, the
kernels would give way to their torch reference (`kv.resolve_impl`), whose gather copies every
picked expert slice, so a compiled decoder layer would lose the point of routing.

The ops mutate none of their arguments (the counters are the kernels' own, left zeroed), so a
graph around them can be captured and replayed by torch's cudagraphs or by padgraph's.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

_PAGED = ("Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
          "Tensor req_pool_indices, Tensor seq_lens")
_LATENT = "Tensor q_latent, Tensor latent_cache, Tensor req_to_token, Tensor req_pool_indices, " \
          "Tensor seq_lens"

_F32, _I64 = torch.float32, torch.int64


def _topk_outputs(n, k):
    """(values [n, k] fp32, indices [n, k] int64, lse [n] fp32): the draft top-k ops' outputs."""
    return [((n, k), _F32), ((n, k), _I64), ((n,), _F32)]


# name -> (schema, outputs from the bound arguments: one shape (a Tensor of the first argument's
# dtype), or a list of (shape, dtype) for several)
SCHEMAS: dict[str, tuple[str, Callable]] = {
    "decode_attention": (
        f"({_PAGED}, float? sm_scale=None, int? num_splits=None, str impl=\"auto\", "
        f"bool pdl=False) -> Tensor",
        lambda a: (a["q"].shape[0], a["q"].shape[1], a["v_cache"].shape[2])),
    "tree_verify_attention": (
        f"({_PAGED}, Tensor tree_mask, float? sm_scale=None, int? num_splits=None, "
        f"str impl=\"auto\", bool pdl=False) -> Tensor",
        lambda a: (a["q"].shape[0], a["q"].shape[1], a["v_cache"].shape[2])),
    "extend_attention": (
        f"({_PAGED}, Tensor qo_indptr, float? sm_scale=None, str impl=\"auto\", "
        f"int? num_splits=None) -> Tensor",
        lambda a: (a["q"].shape[0], a["q"].shape[1], a["v_cache"].shape[2])),
    "mla_decode_attention": (
        f"({_LATENT}, int kv_lora_rank, float sm_scale, int? num_splits=None, "
        f"str impl=\"auto\") -> Tensor",
        lambda a: (a["q_latent"].shape[0], a["q_latent"].shape[1], a["kv_lora_rank"])),
    "mla_tree_verify_attention": (
        f"({_LATENT}, Tensor tree_mask, int kv_lora_rank, float sm_scale, int? num_splits=None, "
        f"str impl=\"auto\") -> Tensor",
        lambda a: (a["q_latent"].shape[0], a["q_latent"].shape[1], a["kv_lora_rank"])),
    "mla_extend_attention": (
        f"({_LATENT}, Tensor qo_indptr, int kv_lora_rank, float sm_scale, "
        f"str impl=\"auto\") -> Tensor",
        lambda a: (a["q_latent"].shape[0], a["q_latent"].shape[1], a["kv_lora_rank"])),
    "routed_experts": (
        "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, "
        "str impl=\"auto\") -> Tensor",
        lambda a: tuple(a["x"].shape)),
    "topk_logsumexp": (
        "(Tensor logits, int k, Tensor scale, str impl=\"auto\") -> (Tensor, Tensor, Tensor)",
        lambda a: _topk_outputs(a["logits"].shape[0], a["k"])),
    "fp8_lm_head_topk": (
        "(Tensor x8, Tensor sx, Tensor w8, Tensor sw, int k, Tensor scale, str impl=\"auto\") "
        "-> (Tensor, Tensor, Tensor)",
        lambda a: _topk_outputs(a["x8"].shape[0], a["k"])),
}


def opaque_under_compile(fn: Callable | None = None, *, reference: Callable | None = None):
    """`fn` eagerly; its `padgraph::<name>` custom op while dynamo traces (see module doc).

    reference: the op's differentiable torch reference, taking fn's arguments but `impl`. The
    kernels have no backward, so where autograd records (grad mode on and a tensor argument
    requiring grad) the reference runs instead, eager or traced."""
    if fn is None:
        return functools.partial(opaque_under_compile, reference=reference)
    name = fn.__name__
    schema, outputs = SCHEMAS[name]
    sig = inspect.signature(fn)
    op = torch.library.custom_op(f"padgraph::{name}", fn, mutates_args=(), schema=schema)

    @op.register_fake
    def _fake(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        first = next(iter(bound.arguments.values()))
        out = outputs(bound.arguments)
        if isinstance(out, list):
            return tuple(first.new_empty(shape, dtype=dtype) for shape, dtype in out)
        return first.new_empty(out)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if reference is not None and torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in (*args, *kwargs.values())):
            bound = sig.bind(*args, **kwargs)
            bound.arguments.pop("impl", None)
            return reference(*bound.args, **bound.kwargs)
        if torch.compiler.is_compiling():
            return op(*args, **kwargs)
        return fn(*args, **kwargs)

    call.op = op
    return call
