"""The paged decode attention at the decode step's own shapes, its launch policy swept.

`bench_attention` times the kernel at 32 / 8 heads of dimension 128 and one context length a
case. The Llama-1B step (`bench_runner`) calls it at head dimension 64, with each request's
context drawn from 256 .. 1022 in a 1024-slot row: a request's K / V tile is half the bytes, and
the program of the longest request runs the longest serial chain of tiles. This sweep times the
kernel there: `--sizes` requests, `--layers` caches (one a layer, as the step reads them: the
call before has not left its K / V in L2), each call on the next layer's cache, captured in one
CUDA graph; µs a call = median replay / layers. Every point of the grid (`SplitPolicy`: splits,
tile tokens, the double-buffered loop, warps, stages) is checked against the default policy's
output (bf16 rounding: the splits change only the fp32 summation order; a point past TOL stops
the run, after the JSON is written) and timed in the same process.

    python -m bench.sweep_decode_attention [--sizes 1,16,32,64] [--head-dim 64]
    python -m bench.sweep_decode_attention --head-dim 128 --sizes 8 --ctx 512 --splits 1,2,4,8
                                  # bench_attention's decode case (32 / 8 heads, d 128) instead
    python -m bench.sweep_decode_attention --head-dim 128 --sizes 8 --ctx 512 --tree 8
                                  # tree verify: 8 drafts a request under a random tree mask
    python -m bench.sweep_decode_attention --smoke      # CPU, interpreted, tiny: the script runs

Writes sweep_decode_attention_d<head dim>[_tree<K>][_ctx<ctx>].json under $OUT (or
results/local). The floor column: the K / V bytes a call reads (each request's own length) over
the copy bandwidth.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import (copy_bandwidth, env_info, out_dir, random_tree_masks,  # noqa: E402
                          time_us)
from bench.gpu_timing import graph_of  # noqa: E402
from padgraph.backends.triton import attention_decode as ad  # noqa: E402
from padgraph.backends.triton.attention_meta import PagedMeta  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402


KNOBS = ("num_splits", "block_n", "prefetch", "num_warps", "num_stages")
TOL = 2e-2     # max abs difference from the default's output: bf16 rounding, not a wrong kernel


def cases(bs: int, layers: int, args, device, gen):
    """(q, k_cache, v_cache) a layer and the batch's PagedMeta, laid out as bench_runner's."""
    ctx = torch.full((bs,), args.ctx) if args.ctx else \
        torch.randint(args.min_ctx, args.max_ctx - 1, (bs,), generator=gen)
    slots = torch.stack([1 + r * args.max_ctx + torch.arange(args.max_ctx) for r in range(bs)])
    if args.layout == "random":      # each request's slots scattered over the cache
        perm = 1 + torch.randperm(bs * args.max_ctx, generator=gen)
        slots = perm[slots - 1]
    req_to_token = torch.zeros(bs + 1, args.max_ctx, dtype=torch.int32)
    req_to_token[1:] = slots.to(torch.int32)
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=device)
    if args.tree:     # the last `tree` positions of each request are its drafts
        masks = random_tree_masks(bs, args.tree, gen).to(device)
        meta = PagedMeta.tree(req_to_token.to(device), rows, ctx.to(device, torch.int32), masks)
    else:
        meta = PagedMeta.decode(req_to_token.to(device), rows, ctx.to(device, torch.int32))
    n_slots, hq, hk, d = bs * args.max_ctx + 1, args.q_heads, args.kv_heads, args.head_dim
    dt = torch.bfloat16
    per_layer = []
    for _ in range(layers):
        q = torch.randn(bs * max(1, args.tree), hq, d, generator=gen).to(device, dt)
        k = torch.randn(n_slots, hk, d, generator=gen).to(device, dt)
        v = torch.randn(n_slots, hk, d, generator=gen).to(device, dt)
        per_layer.append((q, k, v))
    kv_bytes = int(ctx.sum()) * hk * d * 2 * 2
    return per_layer, meta, kv_bytes, ctx


def grid(args) -> list[dict]:
    pts = [{}]       # the default policy first
    prefetch = (False,) if args.tree else (False, True)    # the double-buffered loop: decode's
    for s, bn, pf, w, st in itertools.product(args.splits, args.block_n, prefetch, args.warps,
                                              args.stages):
        pts.append(dict(num_splits=s, block_n=bn, prefetch=pf, num_warps=w, num_stages=st))
    return pts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16,32,64")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--min-ctx", type=int, default=256)
    ap.add_argument("--max-ctx", type=int, default=1024, help="the cache row's width (slots)")
    ap.add_argument("--ctx", type=int, default=0,
                    help="every request at this context (the row this wide), as bench_attention's "
                         "cases; 0: drawn from --min-ctx .. --max-ctx - 2")
    ap.add_argument("--layout", choices=("contiguous", "random"), default="contiguous")
    ap.add_argument("--tree", type=int, default=0, metavar="K",
                    help="tree verify: K drafts a request under a random tree mask (0: decode)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="2", help="num_stages (the kernel's default: 2)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.splits = [int(s) for s in args.splits.split(",")]
    args.block_n = [int(s) for s in args.block_n.split(",")]
    args.warps = [int(s) for s in args.warps.split(",")]
    args.stages = [int(s) for s in args.stages.split(",")]
    if args.ctx:
        args.max_ctx = args.ctx
    if args.smoke:
        args.sizes, args.max_ctx, args.min_ctx, args.layers, args.ctx = "2", 128, 16, 2, 0
        args.splits, args.block_n, args.warps, args.stages = [1, 2], [32], [4], [2]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    sm_scale = args.head_dim ** -0.5
    rows = []
    for bs in (int(s) for s in args.sizes.split(",")):
        per_layer, meta, kv_bytes, ctx = cases(bs, args.layers, args, device, gen)
        d, group = args.head_dim, args.q_heads // args.kv_heads
        num_q = max(1, args.tree)
        plan = ad.plan_split(bs, args.kv_heads, group, num_q, d, d, args.max_ctx,
                             ad.sm_count(device))        # what split_kv_attention launches
        default = dict(num_splits=plan.num_splits, block_n=plan.blocks["BLOCK_N"],
                       prefetch=plan.prefetch, num_warps=plan.num_warps,
                       num_stages=plan.num_stages)
        ref = None
        for pt in grid(args):
            policy = ad.SplitPolicy(**pt)

            def body(policy=policy):
                return [ad.split_kv_attention(q, k, v, meta, sm_scale, policy)
                        for q, k, v in per_layer]
            try:
                outs = body()
            except OutOfResources as e:   # a point past the SM's shared memory: recorded
                if not pt:
                    raise
                row = dict(bs=bs, **pt, us=None, error=f"{type(e).__name__}: {str(e)[:120]}")
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            if ref is None:
                ref = outs
            err = max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, ref))
            us = time_us(graph_of(body), args.iters) / args.layers
            row = dict(bs=bs, **(pt or {"policy": "default", **default}), us=round(us, 2),
                       floor_us=round(kv_bytes / bw * 1e6, 2) if bw == bw else None,
                       max_abs_diff=round(err, 5), agrees=err <= TOL)
            rows.append(row)
            print(json.dumps(row), flush=True)
        timed = [r for r in rows if r["bs"] == bs and r.get("us") is not None]
        if timed and device.type == "cuda":
            best = min(timed, key=lambda r: r["us"])
            knobs = {k: best[k] for k in KNOBS if k in best}
            print(f"bs {bs} (ctx {int(ctx.min())}..{int(ctx.max())}, median "
                  f"{int(statistics.median(ctx.tolist()))}): default {timed[0]['us']} us, best "
                  f"{best['us']} us at {knobs}", flush=True)
        del per_layer
    tree = f"_tree{args.tree}" if args.tree else ""
    ctx_tag = f"_ctx{args.ctx}" if args.ctx else ""     # runs at several contexts share $OUT
    out = out_dir() / f"sweep_decode_attention_d{args.head_dim}{tree}{ctx_tag}.json"
    out.write_text(json.dumps({"env": env_info(), "args": {k: v for k, v in vars(args).items()},
                               "copy_bandwidth_gbs": round(bw / 1e9, 1) if bw == bw else None,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    wrong = [r for r in rows if r.get("agrees") is False]
    if wrong:
        raise SystemExit(f"{len(wrong)} grid points differ from the default's output by more "
                         f"than {TOL}: {wrong[:3]}")


if __name__ == "__main__":
    main()
