"""Cold capture of a ladder in a fresh process (bench_attention --cold): seconds, Triton kernels compiled."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.attention_config import DTYPE
from padgraph.backends.triton.attention import decode_attention
from padgraph.backends.triton.attention_decode import choose_num_splits, sm_count

COLD_LAYERS, COLD_MAX_BS, COLD_MAX_CTX = 16, 256, 1024
COLD_HEADS, COLD_KV_HEADS, COLD_HEAD_DIM = 32, 8, 64  # Llama-3.2-1B's attention


def triton_kernels():
    """The padgraph Triton kernels a decode step runs (name -> JITFunction)."""
    from padgraph.backends.triton import attention_decode, attention_split, store
    return dict(split_kv=attention_decode._split_kv_kernel, merge=attention_split._merge_kernel,
                store_kv=store._store_kv_kernel)


def n_compiled(kernel) -> int:
    """Distinct compiled variants of a Triton kernel, over devices (-1: unknown Triton layout)."""
    try:
        return sum(len({id(k) for k in caches[0].values()}) for caches in
                   kernel.device_caches.values())
    except (AttributeError, IndexError, TypeError):
        return -1


def capture_ladder(sizes, layers, req_to_token, pool) -> float:
    """Capture one graph per bucket (largest first, one memory pool): seconds."""
    from padgraph.backends.triton.store import store_kv
    device = req_to_token.device
    t0 = time.perf_counter()
    graphs = []
    for bs in sorted(sizes, reverse=True):
        q = torch.randn(bs, COLD_HEADS, COLD_HEAD_DIM, dtype=DTYPE, device=device)
        kv_new = torch.randn(bs, COLD_KV_HEADS, COLD_HEAD_DIM, dtype=DTYPE, device=device)
        loc = torch.zeros(bs, dtype=torch.int64, device=device)
        rows = torch.zeros(bs, dtype=torch.int32, device=device)
        lens = torch.ones(bs, dtype=torch.int32, device=device)  # padded lanes

        def body():
            o = q
            for k_cache, v_cache in layers:
                store_kv(k_cache, v_cache, loc, kv_new, kv_new)
                o = decode_attention(q, k_cache, v_cache, req_to_token, rows, lens)
            return o

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body()
        graphs.append(graph)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def cold_child() -> None:
    """In a fresh process: capture the ladder twice; print one JSON line."""
    import padgraph as pg
    t_import = time.perf_counter()
    device = torch.device("cuda")
    sizes = list(pg.Buckets.default(COLD_MAX_BS))
    n_slots = 4096
    layers = [(torch.zeros(n_slots, COLD_KV_HEADS, COLD_HEAD_DIM, dtype=DTYPE, device=device),
               torch.zeros(n_slots, COLD_KV_HEADS, COLD_HEAD_DIM, dtype=DTYPE, device=device))
              for _ in range(COLD_LAYERS)]
    req_to_token = torch.zeros(COLD_MAX_BS + 1, COLD_MAX_CTX, dtype=torch.int32, device=device)
    torch.cuda.synchronize()
    first = capture_ladder(sizes, layers, req_to_token, torch.cuda.graph_pool_handle())
    compiles = {name: n_compiled(k) for name, k in triton_kernels().items()}
    again = capture_ladder(sizes, layers, req_to_token, torch.cuda.graph_pool_handle())
    splits = sorted({choose_num_splits(bs, COLD_KV_HEADS, COLD_MAX_CTX, sm_count(device))
                     for bs in sizes})
    cache_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    print(json.dumps(dict(n_buckets=len(sizes), layers=COLD_LAYERS, first_s=first,
                          again_s=again, compiles=compiles, split_counts=splits,
                          cubins_in_cache=len(list(cache_dir.rglob("*.cubin"))),
                          setup_s=time.perf_counter() - t_import)))


def cold_capture() -> list[dict]:
    """Run cold_child twice in fresh processes sharing a new, empty Triton cache directory."""
    results = []
    with tempfile.TemporaryDirectory(prefix="triton-cold-") as cache_dir:
        root = str(Path(__file__).resolve().parents[1])          # `bench` importable there
        env = dict(os.environ, TRITON_CACHE_DIR=cache_dir,
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        for label in ("empty Triton cache", "Triton cache of the run before"):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, str(Path(__file__).with_name("bench_attention.py")), "--cold-child"], env=env,
                                  capture_output=True, text=True, timeout=120)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"cold-capture child failed ({label}):\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(dict(label=label, process_s=wall, **row))
            print(f"cold capture ({label}): {row}", flush=True)
    return results
