"""Tensor-parallel decode against one GPU: step ms at bs 1 and 64, capture seconds of the decode
ladder per rank (cuda only).

    python bench/bench_tp.py --world 2
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import Tensor

import padgraph as pg
from padgraph.llm.bodies import decode_body
from padgraph.llm.tp import Shard
from padgraph.llm.tp_run import GPU, Setup, full_model, in_group, put, rank_shard, spawn


BENCH_BS = (1, 64)
BENCH_CTX = 512          # tokens already in each request's cache when a step is timed


def bench_setup(setup: Setup) -> Setup:
    return Setup(**{**setup.__dict__, "max_bs": max(BENCH_BS), "max_context": BENCH_CTX + 1,
                    "buckets": tuple(pg.Buckets.default(max(BENCH_BS)))})


def bench_inputs(shard: Shard, bs: int) -> dict[str, Tensor]:
    """A decode batch of bs requests at position BENCH_CTX (rows 1..bs own disjoint slots)."""
    rt, n = shard.kv.req_to_token, BENCH_CTX + 1
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=rt.device)
    rt[1:bs + 1, :n] = (1 + torch.arange(bs * n, device=rt.device)).view(bs, n).int()
    return {"input_ids": torch.randint(1, shard.target.cfg.vocab_size, (bs,), device=rt.device),
            "positions": torch.full((bs,), BENCH_CTX, device=rt.device),
            "seq_lens": torch.full((bs,), n, dtype=torch.int32, device=rt.device),
            "req_pool_indices": rows, "out_cache_loc": rt[1:bs + 1, BENCH_CTX].long()}


def time_step(shard: Shard, bs: int, cpu_group=None, iters: int = 200) -> float:
    """Mean ms per decode call at bs (graph replays back to back: the GPU's time per step)."""
    raw = bench_inputs(shard, bs)
    for _ in range(10):
        shard.decode(**raw)
    torch.cuda.synchronize()
    if cpu_group is not None:
        dist.barrier(group=cpu_group)       # ranks start together: no wait charged to a step
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        shard.decode(**raw)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def measure(shard: Shard, cpu_group=None) -> dict:
    """Capture seconds of the ladder and ms per step at each BENCH_BS."""
    capture = sum(c["seconds"] for c in shard.decode.stats.capture.values())
    with torch.no_grad():
        steps = {bs: time_step(shard, bs, cpu_group) for bs in BENCH_BS}
    return {"capture_s": capture, "step_ms": steps}


def bench_rank(rank: int, setup: Setup, port: int, out_dir: str):
    put(out_dir, rank, in_group(rank, setup, port, lambda tp, group: measure(
        rank_shard(rank, setup, tp, group), group)))


def bench(setup: Setup) -> None:
    """TP=world against one GPU (the plain model, the decode body): step ms at
    bs=1 and 64, capture seconds of the decode ladder per rank."""
    setup = bench_setup(setup)
    ranks = spawn(bench_rank, setup)
    target = full_model(setup, "cuda")
    one = measure(Shard(target, setup, decode_body(target), progress=False))
    print(f"1B-shaped decode, {len(setup.buckets)} buckets up to {max(BENCH_BS)}, context "
          f"{BENCH_CTX}, bf16; TP={setup.world} (NCCL in the graphs, head={setup.head}) vs 1 GPU")
    for bs in BENCH_BS:
        tp_ms = max(r["step_ms"][str(bs)] for r in ranks.values())
        print(f"bs={bs}: step ms 1 GPU {one['step_ms'][bs]:.3f}, TP={setup.world} {tp_ms:.3f} "
              f"({tp_ms / one['step_ms'][bs]:.2f}x)")
    caps = [round(ranks[r]["capture_s"], 2) for r in sorted(ranks)]
    print(f"capture s: 1 GPU {one['capture_s']:.2f}, per rank {caps} "
          f"({max(caps) / one['capture_s']:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--head", choices=("top2", "gather"), default="top2")
    args = ap.parse_args()
    bench(Setup(**{**GPU.__dict__, "world": args.world, "head": args.head}))


if __name__ == "__main__":
    main()
