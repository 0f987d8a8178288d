"""Where a cold capture's time goes: in this fresh process, the first call of each Triton kernel a
decode step runs (store_kv, decode attention: split pass + folded merge), timed one by one with
the GPU synchronized, then the same calls again. Run it with an empty TRITON_CACHE_DIR to
measure compilation, with the cache of a run before to measure loading:

    TRITON_CACHE_DIR=$(mktemp -d) python -m bench.triton_compile_times   # twice

Prints one JSON line: seconds per first call and per second call. --profile N: also the N
functions of most cumulative time over the first calls (cProfile), to see what the first
call of a kernel spends its time on (compiler passes, ptxas, building the launcher, loading)."""
import cProfile
import json
import pstats
import sys
import time

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    from padgraph.backends.triton.attention_decode import decode_attention
    from padgraph.backends.triton.store import store_kv
    dev = torch.device("cuda")
    slots, kvh, hd, heads, ctx = 4096, 8, 64, 32, 1024
    k = torch.randn(slots, kvh, hd, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    rt = torch.arange(ctx, dtype=torch.int32, device=dev).repeat(257, 1)
    out = {"cuda_init_s": timed(lambda: torch.ones(1, device=dev) @ torch.ones(1, 1, device=dev))}
    top = int(sys.argv[sys.argv.index("--profile") + 1]) if "--profile" in sys.argv else 0
    prof = cProfile.Profile() if top else None
    for rnd in ("first", "again"):
        if prof is not None:
            (prof.enable if rnd == "first" else prof.disable)()
        for bs in (1, 64):
            q = torch.randn(bs, heads, hd, dtype=torch.bfloat16, device=dev)
            new = torch.randn(bs, kvh, hd, dtype=torch.bfloat16, device=dev)
            loc = torch.arange(bs, dtype=torch.int64, device=dev)
            rows = torch.arange(bs, dtype=torch.int32, device=dev)
            lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
            out[f"{rnd}_store_kv_bs{bs}_s"] = timed(lambda: store_kv(k, v, loc, new, new))
            out[f"{rnd}_decode_bs{bs}_s"] = timed(
                lambda: decode_attention(q, k, v, rt, rows, lens))
    print(json.dumps(out))
    if prof is not None:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(top)


if __name__ == "__main__":
    main()
