"""Launches a captured CUDA graph runs only where a flag on the device says so: CUDA graph
conditional (IF) nodes, through torch's own capture.

A kernel sequence whose length depends on the data (the sampler's select passes: 12 launches
in the worst case, one for most rows) can be captured once and, at each replay, skip what no
row needs:

    graph = graph_if.capturing(x.device)          # None: run everything, as eagerly
    with contextlib.ExitStack() as stack:
        for s in range(passes):
            if graph is not None and s in checkpoints:
                stack.enter_context(graph_if.only_if(graph, flags[s - 1]))
            launch(s)

`only_if` captures what is launched inside it into the body of an IF node whose condition is a
one-byte flag on the device (nonzero: run the body), read when the replay reaches the node;
the kernel before it writes the flag. Bodies nest: a checkpoint inside a body is skipped with
it. Each node costs the replay one one-thread kernel (torch's, which copies the flag into the
node's condition) plus the node; a skipped body costs nothing more.

Where it applies: a stream capture of a `torch.cuda.CUDAGraph` (padgraph's runners, torch's
cudagraph trees), torch built with CUDA >= 12.4 and a driver that has conditional nodes, and
`PADGRAPH_GRAPH_IF` not "0" (which turns every conditional off, for A/B runs). Elsewhere
(eager calls, the CPU, another capture API) `capturing` returns None and the caller launches
everything: the results are the same, a skipped body being one whose launches would have found
nothing to do.
"""
from __future__ import annotations

import contextlib
import os

import torch


def _torch_has_if_nodes() -> bool:
    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is None or torch.version.hip is not None or torch.version.cuda is None:
        return False
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    return ((major, minor) >= (12, 4) and hasattr(graph, "get_currently_capturing_graph")
            and hasattr(graph, "begin_capture_to_if_node")
            and hasattr(graph, "end_capture_to_conditional_node"))


def enabled() -> bool:
    """Whether conditional bodies may be captured in this process (torch and the environment)."""
    return os.environ.get("PADGRAPH_GRAPH_IF", "1") != "0" and _torch_has_if_nodes()


def capturing(device: torch.device | str):
    """The `torch.cuda.CUDAGraph` the current stream of `device` is capturing into, where a
    conditional body can be captured there now; else None."""
    device = torch.device(device)
    if device.type != "cuda" or not enabled():
        return None
    if not torch.cuda.is_current_stream_capturing():
        return None
    try:
        return torch.cuda.CUDAGraph.get_currently_capturing_graph()
    except RuntimeError:        # a capture torch's CUDAGraph did not begin
        return None


@contextlib.contextmanager
def only_if(graph, flag: torch.Tensor):
    """Capture the launches inside into an IF node of `graph` that runs them at a replay only
    where `flag` (one byte on the device: bool, int8 or uint8) is nonzero then."""
    if flag.numel() != 1 or flag.element_size() != 1 or not flag.is_cuda:
        raise ValueError(f"a conditional's flag is one byte on a CUDA device; got "
                         f"{tuple(flag.shape)} {flag.dtype} on {flag.device}")
    graph.begin_capture_to_if_node(flag.reshape(()).view(torch.bool))
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()
