"""Helpers of the recurrent kernels' tests (SSM, conv window, delta rule): packed sequences, and the
CUDA-graph check (capture a call, feed it new data, replay)."""
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


def packed(lengths, n_pad_seq, n_pad_tok, device="cpu"):
    """cu_seqlens of sequences `lengths` then n_pad_seq empty padded ones (edge-padded), and the
    token count with n_pad_tok padded tokens past the last sequence."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] + [sum(lengths)] * n_pad_seq, dtype=torch.int32)
    return cu.to(device), sum(lengths) + n_pad_tok
