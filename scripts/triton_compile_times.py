"""Where a cold capture's time goes: in this fresh process, the first call of each Triton kernel a
decode step runs (store_kv, decode attention: split pass + folded merge), timed one by one with
the GPU synchronized, then the same calls again. Run it with an empty TRITON_CACHE_DIR to
measure compilation, with the cache of a run before to measure loading:

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/triton_compile_times.py   # twice

Prints one JSON line: seconds per first call and per second call."""
import json
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
    for rnd in ("first", "again"):
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


if __name__ == "__main__":
    main()
