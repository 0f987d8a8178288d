"""The recurrent-state kernels (`ssm`, `conv_state`) as opaque custom ops under `torch.compile`.

Traced by dynamo, those kernels give way to their torch references (`kv.resolve_impl`), which
inductor then compiles into its own kernels: a decode step's gather, update and scatter fused as
it sees fit, a verify's tree unrolled node by node, a prefill's scan unrolled token by token
(one graph the size of the packed prompt). Through the functions here, a traced call instead
becomes one `padgraph::` op that runs the Triton kernels at replay, as the attention functions do
(`compile_ops`). Each op declares the pool it writes (`Tensor(a!)` in its schema): the
functionaliser wraps the call, and inductor's reinplacing pass turns it back into the in-place
call on the pool itself (no copy of the pool; `tests/test_recurrent_ops.py` checks both).

Eagerly, and while tracing with `opaque=False`, every function is exactly the kernel function it
names (`ssm.ssm_decode_update`, ...). The fake implementations allocate the outputs as the real
ops return them (contiguous, x's shape and dtype), so inductor sees the real strides.
"""
from __future__ import annotations

import torch

from . import conv_state as _conv
from . import ssm as _ssm

_SSM_ARGS = ("Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
             "bool dt_softplus, float dt_lo, float dt_hi")


def _act(activation: str):
    return activation or None


@torch.library.custom_op("padgraph::ssm_decode_update", mutates_args=("state",),
                         schema=f"(Tensor(a!) state, Tensor slot, {_SSM_ARGS}, str impl) -> Tensor")
def _ssm_decode_op(state, slot, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_lo, dt_hi, impl):
    return _ssm.ssm_decode_update(state, slot, x, dt, A, B, C, D, z, dt_bias, dt_softplus, (dt_lo, dt_hi),
                                  impl).contiguous()


@torch.library.custom_op("padgraph::ssm_tree_update", mutates_args=("tree",),
                         schema=f"(Tensor state, Tensor(a!) tree, Tensor slot, Tensor parents, {_SSM_ARGS}, "
                                "str impl) -> Tensor")
def _ssm_tree_op(state, tree, slot, parents, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_lo, dt_hi, impl):
    return _ssm.ssm_tree_update(state, tree, slot, parents, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                (dt_lo, dt_hi), impl).contiguous()


@torch.library.custom_op("padgraph::ssm_chunked_scan", mutates_args=("state",),
                         schema=f"(Tensor(a!) state, Tensor slot, Tensor cu_seqlens, Tensor has_initial_state, "
                                f"{_SSM_ARGS}, str method, str impl) -> Tensor")
def _ssm_scan_op(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_lo,
                 dt_hi, method, impl):
    return _ssm.ssm_chunked_scan(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D, z, dt_bias,
                                 dt_softplus, (dt_lo, dt_hi), method, impl).contiguous()


@torch.library.custom_op("padgraph::conv_state_update", mutates_args=("conv_state",),
                         schema="(Tensor(a!) conv_state, Tensor slot, Tensor x, Tensor weight, Tensor? bias, "
                                "str activation, str impl) -> Tensor")
def _conv_decode_op(conv_state, slot, x, weight, bias, activation, impl):
    return _conv.conv_state_update(conv_state, slot, x, weight, bias, _act(activation), impl).contiguous()


@torch.library.custom_op("padgraph::conv_tree_update", mutates_args=("tree",),
                         schema="(Tensor conv_state, Tensor(a!) tree, Tensor slot, Tensor parents, Tensor x, "
                                "Tensor weight, Tensor? bias, str activation, str impl) -> Tensor")
def _conv_tree_op(conv_state, tree, slot, parents, x, weight, bias, activation, impl):
    return _conv.conv_tree_update(conv_state, tree, slot, parents, x, weight, bias, _act(activation),
                                  impl).contiguous()


@torch.library.custom_op("padgraph::conv_state_prefill", mutates_args=("conv_state",),
                         schema="(Tensor(a!) conv_state, Tensor slot, Tensor cu_seqlens, Tensor has_initial_state, "
                                "Tensor x, Tensor weight, Tensor? bias, str activation, str impl) -> Tensor")
def _conv_prefill_op(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias, activation, impl):
    return _conv.conv_state_prefill(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias,
                                    _act(activation), impl).contiguous()


# the fakes: a contiguous output of x's shape and dtype, as each op returns
_ssm_decode_op.register_fake(lambda state, slot, x, *rest: x.new_empty(x.shape))
_ssm_tree_op.register_fake(lambda state, tree, slot, parents, x, *rest: x.new_empty(x.shape))
_ssm_scan_op.register_fake(lambda state, slot, cu, init, x, *rest: x.new_empty(x.shape))
_conv_decode_op.register_fake(lambda conv_state, slot, x, *rest: x.new_empty(x.shape))
_conv_tree_op.register_fake(lambda conv_state, tree, slot, parents, x, *rest: x.new_empty(x.shape))
_conv_prefill_op.register_fake(lambda conv_state, slot, cu, init, x, *rest: x.new_empty(x.shape))


def _traced(opaque: bool) -> bool:
    return opaque and torch.compiler.is_compiling()


def ssm_decode_update(state, slot, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                      dt_limit=_ssm.NO_LIMIT, impl: str = "auto", opaque: bool = True):
    """`ssm.ssm_decode_update`; while traced with `opaque`, its op (module doc)."""
    if _traced(opaque):
        return _ssm_decode_op(state, slot, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus),
                              float(dt_limit[0]), float(dt_limit[1]), impl)
    return _ssm.ssm_decode_update(state, slot, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, impl)


def ssm_tree_update(state, tree, slot, parents, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=_ssm.NO_LIMIT, impl: str = "auto", opaque: bool = True):
    """`ssm.ssm_tree_update`; while traced with `opaque`, its op (module doc)."""
    if _traced(opaque):
        return _ssm_tree_op(state, tree, slot, parents, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus),
                            float(dt_limit[0]), float(dt_limit[1]), impl)
    return _ssm.ssm_tree_update(state, tree, slot, parents, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                impl)


def ssm_chunked_scan(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                     dt_softplus=True, dt_limit=_ssm.NO_LIMIT, method: str = "sequential", impl: str = "auto",
                     opaque: bool = True):
    """`ssm.ssm_chunked_scan`; while traced with `opaque`, its op (module doc)."""
    if _traced(opaque):
        return _ssm_scan_op(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D, z, dt_bias,
                            bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]), method, impl)
    return _ssm.ssm_chunked_scan(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D, z, dt_bias,
                                 dt_softplus, dt_limit, method, impl)


def conv_state_update(conv_state, slot, x, weight, bias=None, activation=None, impl: str = "auto",
                      opaque: bool = True):
    """`conv_state.conv_state_update`; while traced with `opaque`, its op (module doc)."""
    if _traced(opaque):
        return _conv_decode_op(conv_state, slot, x, weight, bias, activation or "", impl)
    return _conv.conv_state_update(conv_state, slot, x, weight, bias, activation, impl)


def conv_tree_update(conv_state, tree, slot, parents, x, weight, bias=None, activation=None, impl: str = "auto",
                     opaque: bool = True):
    """`conv_state.conv_tree_update`; while traced with `opaque`, its op (module doc)."""
    if _traced(opaque):
        return _conv_tree_op(conv_state, tree, slot, parents, x, weight, bias, activation or "", impl)
    return _conv.conv_tree_update(conv_state, tree, slot, parents, x, weight, bias, activation, impl)


def conv_state_prefill(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias=None, activation=None,
                       impl: str = "auto", opaque: bool = True):
    """`conv_state.conv_state_prefill`; while traced with `opaque`, its op (module doc)."""
    if _traced(opaque):
        return _conv_prefill_op(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias,
                                activation or "", impl)
    return _conv.conv_state_prefill(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias, activation,
                                    impl)
