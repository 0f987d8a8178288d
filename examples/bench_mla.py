"""Benchmark absorbed MLA decode over a latent cache: achieved bandwidth vs a measured copy.

    python examples/bench_mla.py               # DeepSeek-V2-Lite: 16 heads, r 512, rope 64
    python examples/bench_mla.py --heads 128   # DeepSeek-V3-like head count

bs in {1, 8, 32} x context in {1024, 8192}, bf16, every request at full length, slots shuffled.
Timed as a CUDA-graph replay with `triton.testing.do_bench` (median; L2 flushed before each call).
Bytes = latent rows + req_to_token + q_latent + o_latent; "fraction" = (bytes / time) over the
device-to-device copy bandwidth measured in the same run. Checked against the torch path first.
Writes mla.md to $OUT (or results/local/).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.common import copy_bandwidth, env_info, out_dir  # noqa: E402
from bench_attention import bench_us, graph_of  # noqa: E402
from padgraph.backends.triton.attention_decode import choose_num_splits, sm_count  # noqa: E402
from padgraph.backends.triton.attention_mla import (head_groups, mla_decode_attention,  # noqa: E402
                                                    mla_sm_scale)

KV_LORA_RANK, ROPE, NOPE = 512, 64, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192)


def make_case(bs, ctx, n_heads, gen):
    """(q_latent, latent_cache, req_to_token, rows, seq_lens) with shuffled slots, sink slot 0."""
    dev = dict(device="cuda", dtype=DTYPE)
    latent = torch.randn(bs * ctx + 1, 1, KV_LORA_RANK + ROPE, generator=gen, **dev)
    slots = torch.randperm(bs * ctx, device="cuda", generator=gen) + 1
    req_to_token = torch.zeros(bs + 1, ctx, dtype=torch.int32, device="cuda")
    req_to_token[1:] = slots.view(bs, ctx).int()
    rows = torch.arange(1, bs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    q_latent = torch.randn(bs, n_heads, KV_LORA_RANK + ROPE, generator=gen, **dev)
    return q_latent, latent, req_to_token, rows, seq_lens


def time_case(bs, ctx, n_heads, copy_bw, gen) -> dict:
    args = make_case(bs, ctx, n_heads, gen)
    run = lambda: mla_decode_attention(*args, KV_LORA_RANK, mla_sm_scale(NOPE, ROPE))  # noqa
    ref = mla_decode_attention(*args, KV_LORA_RANK, mla_sm_scale(NOPE, ROPE), impl="torch")
    out = run()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, f"bs={bs} ctx={ctx}: relative error {err:.2e} vs the torch path"
    t_us = bench_us(graph_of(run))
    n_bytes = (bs * ctx * ((KV_LORA_RANK + ROPE) * 2 + 4)
               + bs * n_heads * (2 * KV_LORA_RANK + ROPE) * 2)
    groups = head_groups(n_heads, 1)
    splits = choose_num_splits(bs, groups, ctx, sm_count(args[0].device))
    return dict(bs=bs, ctx=ctx, splits=splits, groups=groups, us=t_us, err=err,
                gbs=n_bytes / (t_us * 1e-6) / 1e9, fraction=n_bytes / (t_us * 1e-6) / copy_bw)


def markdown(meta, heads, copy_bw, rows) -> str:
    lines = [f"# MLA decode ({heads} heads, kv_lora_rank {KV_LORA_RANK}, rope {ROPE}, bf16)", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [f"- copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read + write)", "",
              "| bs | ctx | splits | head groups | µs (graph) | GB/s | fraction of copy "
              "| rel err |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['bs']} | {r['ctx']} | {r['splits']} | {r['groups']} | {r['us']:.1f} | "
              f"{r['gbs']:.0f} | {r['fraction']:.2f} | {r['err']:.1e} |" for r in rows]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    heads = parser.parse_args().heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth("cuda")
    rows = []
    for bs in BATCHES:
        for ctx in CONTEXTS:
            rows.append(time_case(bs, ctx, heads, copy_bw, gen))
            print(rows[-1], flush=True)
    text = markdown(env_info(), heads, copy_bw, rows)
    path = out_dir() / ("mla.md" if heads == 16 else f"mla_h{heads}.md")
    path.write_text(text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
