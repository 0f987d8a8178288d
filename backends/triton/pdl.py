"""Programmatic dependent launch (PDL) for Triton kernels inside padgraph programs: the one place
that decides whether a kernel launches with it, and the device-side calls a kernel makes.

A kernel launched with PDL may start while the kernel before it on the stream is still running;
captured into a CUDA graph, the launch becomes a programmatic edge and every replay overlaps the
same way. The kernel must call `wait()` before it reads anything the kernel before wrote and
before it writes anything that kernel may still read; `launch_dependents()` lets the kernel after
start early. The usual shape (padgraph's own fused decode kernels):

    @triton.jit
    def kernel(X, W, Y, ..., PDL: tl.constexpr):
        w = tl.load(W + ...)              # weights: no earlier kernel in the graph writes them
        pdl.wait_for_previous(PDL)        # wait, then release the kernel after; before any loop
        for m in range(M):                # reads of X (the kernel before's output), the store
            ...

    on = pdl.supported(x.device)
    kernel[grid](x, w, y, ..., PDL=on, **pdl.launch_options(x.device, on))

The helpers are no-ops where this Triton lacks them or under TRITON_INTERPRET=1, so such a kernel
compiles (and runs on the CPU interpreter) everywhere. docs/pdl.md states what a kernel must do
to stay correct, and what PDL needs of the GPU, Triton and the driver.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

try:  # the grid-dependency instructions (griddepcontrol): Triton >= 3.4 on CUDA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: `wait` and `launch_dependents` do nothing
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        """Never emitted (`_EMIT` is false without the instructions)."""
        pass

    gdc_launch_dependents = gdc_wait


def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - a Triton without its NVIDIA backend
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


# both halves: the launch option and the device-side instructions
_TRITON_HAS_PDL = _HAS_GDC and _triton_launches_pdl()
# whether `wait` and `launch_dependents` emit the instructions: not where Triton lacks them, nor
# under the interpreter, which has no grid dependencies (read at import, as triton.jit does)
_EMIT: tl.constexpr = tl.constexpr(_TRITON_HAS_PDL and os.environ.get("TRITON_INTERPRET") != "1")


def supported(device: torch.device | str) -> bool:
    """Whether a kernel on `device` can launch with PDL: a CUDA device of compute capability 9.0
    or later (Hopper and newer), a Triton with the `launch_pdl` option and `gdc_wait`, kernels
    compiled (not TRITON_INTERPRET=1), and `PADGRAPH_PDL` not "0" in the environment (which turns
    PDL off for every padgraph kernel and every kernel launched through this module)."""
    device = torch.device(device)
    if not _TRITON_HAS_PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("PADGRAPH_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device | str, enabled: bool = True) -> dict:
    """The launch keywords of a kernel call on `device`: `{"launch_pdl": True}` where `enabled`
    and `supported(device)`, else `{}` (a plain launch). Pass the same decision to the kernel's
    PDL constexpr, so a kernel waits exactly when it launches with PDL."""
    return {"launch_pdl": True} if enabled and supported(device) else {}


@triton.jit
def wait():
    """Block until the kernel before has finished and its writes are visible (Triton's
    `gdc_wait`; nothing where this Triton lacks it or under the interpreter). Call it before any
    loop whose loads Triton may pipeline (a pipelined load can be hoisted above a wait inside the
    loop), and before the first read of an earlier kernel's output or write of a buffer it reads."""
    if _EMIT:
        gdc_wait()


@triton.jit
def launch_dependents():
    """Let the kernel after start (its programs up to their own wait) once every program of this
    kernel has called this or exited (Triton's `gdc_launch_dependents`; nothing where this Triton
    lacks it or under the interpreter). A hint: without it, that kernel starts when this one
    ends."""
    if _EMIT:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Where PDL is on: `wait()`, then `launch_dependents()`. Everything above it reads only what
    no earlier kernel in the graph writes (weights, the past KV); everything below may read what
    the kernel before wrote. Releasing the kernel after only once this one has waited keeps the
    overlap to one kernel: what runs beside a program before its wait is the kernel just before."""
    if PDL:
        wait()
        launch_dependents()
