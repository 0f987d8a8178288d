"""Which implementation an op runs: the Triton kernel or its torch reference.

The paged KV cache these kernels read (SGLang's layout) and its allocators live in
`padgraph.llm.kv`.
"""
from __future__ import annotations

import torch

IMPLS = ("auto", "triton", "torch")


def resolve_impl(impl: str, *tensors: torch.Tensor) -> str:
    """`"auto"` means Triton when the tensors are on CUDA, else the torch reference.

    While torch.compile traces, every op that reaches here is its torch reference, whatever
    `impl` asks (inductor compiles it into its own fused kernels): a user Triton kernel traced by
    dynamo is functionalised and decomposed by inductor, which failed on the H200 for the store
    kernel writing two views of one buffer. The attention functions never get here while
    tracing: they are opaque custom ops (compile_ops.py), whose kernels run at replay."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if torch.compiler.is_compiling():
        return "torch"
    if impl != "auto":
        return impl
    return "triton" if all(t.is_cuda for t in tensors) else "torch"
