"""`padgraph.backends.triton.graph_if`: launches a captured CUDA graph runs only where a flag on the
device is set (conditional IF nodes through torch's capture), and nothing of it outside a
capture."""
from __future__ import annotations

import pytest
import torch

from padgraph.backends.triton import graph_if


def test_no_conditional_outside_a_cuda_capture(monkeypatch):
    assert graph_if.capturing("cpu") is None
    if torch.cuda.is_available():
        assert graph_if.capturing("cuda") is None              # not capturing
    monkeypatch.setenv("PADGRAPH_GRAPH_IF", "0")
    assert not graph_if.enabled()


def test_a_flag_is_one_byte_on_the_device():
    with pytest.raises(ValueError, match="one byte"):
        with graph_if.only_if(object(), torch.zeros(1, dtype=torch.int32)):
            pass
    with pytest.raises(ValueError, match="one byte"):
        with graph_if.only_if(object(), torch.zeros(2, dtype=torch.int8)):
            pass
    with pytest.raises(ValueError, match="one byte"):
        with graph_if.only_if(object(), torch.zeros(1, dtype=torch.int8)):   # on the CPU
            pass


@pytest.mark.cuda
def test_nested_bodies_run_where_their_flags_are_set_at_each_replay():
    """Two nested bodies captured once; every replay runs the launches whose flags (written by
    a kernel of the same replay, before the node) are set, and skips the rest with the body."""
    if not graph_if.enabled():
        pytest.skip("this torch has no conditional nodes")
    x = torch.zeros(3, device="cuda")
    src = torch.zeros(2, dtype=torch.int8, device="cuda")
    flags = torch.zeros(2, dtype=torch.int8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert graph_if.capturing("cuda") is not None
        flags.copy_(src)                          # the kernel before writes the flags
        x[0] += 1
        with graph_if.only_if(graph_if.capturing("cuda"), flags[0]):
            x[1] += 1
            with graph_if.only_if(graph_if.capturing("cuda"), flags[1]):
                x[2] += 1
    want = torch.zeros(3)
    for a, b in ((0, 0), (1, 0), (1, 1), (0, 1), (1, 1)):
        src.copy_(torch.tensor([a, b], dtype=torch.int8))
        graph.replay()
        want += torch.tensor([1.0, a, a * b])
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), want), (a, b, x)
