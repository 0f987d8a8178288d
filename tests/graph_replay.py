"""Kernel tests' CUDA-graph check: capture a call, feed it new data, replay."""
import torch


def replay_with_new_data(fn, inputs: dict, fresh: dict):
    """Capture fn(**inputs) in a CUDA graph, copy `fresh` into the inputs, replay: the outputs."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(**{k: v.clone() for k, v in inputs.items()})     # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**inputs)
    for k, v in fresh.items():
        inputs[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    return out
