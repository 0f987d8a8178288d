"""Benchmark paged decode attention on the GPU: ours vs SDPA vs the bytes-moved floor.

    python examples/bench_attention.py              # full run (< 3 min on an H200)
    python examples/bench_attention.py --no-sweep   # skip the split-count / tile sweep

Decode attention, 32 q heads, 8 kv heads, head_dim 128, bf16, every request at full length, for
bs in {1, 8, 32, 128} x context in {512, 4096, 32768}. "ours" is timed as a CUDA-graph replay
(how padgraph runs it) and eagerly; SDPA (best of its flash / cuDNN / efficient / math backends,
enable_gqa) on a contiguous [bs, kv_heads, ctx, dim] cache of the same data, likewise. The floor is
bytes read + written (K, V, req_to_token, q, o) over the device-to-device copy bandwidth
measured in the same run. Times: `triton.testing.do_bench` medians (it flushes L2 before each
call); small cases also rotate several cache sets so L2 never holds the data. Results are checked
against the torch reference and SDPA before timing. Writes attention.md / attention.json to
$OUT (or results/local/).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
from pathlib import Path

import einops
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from padgraph.backends.triton.attention import decode_attention, decode_attention_reference
from padgraph.backends.triton.attention_decode import choose_num_splits, sm_count, \
    split_kv_attention

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 4096, 32768)
SWEEP_CASES = ((1, 32768), (8, 4096), (8, 32768), (32, 4096), (128, 4096))
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_TILES = ((64, 2, 4), (32, 2, 4), (64, 3, 4), (64, 2, 8))  # (BLOCK_N, stages, warps)
MAX_SETS = 64


def bench_us(fn, rep=100) -> float:
    """Median time of fn in µs (do_bench warms up and flushes L2 before each call)."""
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def rotating(fns):
    """One callable that runs fns[0], fns[1], ... in turn (cache-set rotation)."""
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def graph_of(fn):
    """Capture fn in a CUDA graph after a warm-up on a side stream; returns graph.replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    x = torch.randn(1 << 29, dtype=DTYPE, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    t_us = bench_us(lambda: y.copy_(x))
    nbytes = 2 * x.numel() * x.element_size()
    del x, y
    return nbytes / (t_us * 1e-6)


class DecodeCase:
    """One cache set: a paged cache (+ req_to_token) and the same data as a dense SDPA cache."""

    def __init__(self, bs, ctx, layout, gen):
        self.bs, self.ctx = bs, ctx
        dev = dict(device="cuda", dtype=DTYPE)
        # [bs, kv_heads, ctx, dim] as SDPA wants it
        self.k_dense = torch.randn(bs, N_KV_HEADS, ctx, HEAD_DIM, generator=gen, **dev)
        self.v_dense = torch.randn(bs, N_KV_HEADS, ctx, HEAD_DIM, generator=gen, **dev)
        n_tok = bs * ctx
        if layout == "random":
            slots = torch.randperm(n_tok, device="cuda", generator=gen) + 1
        else:
            slots = torch.arange(1, n_tok + 1, device="cuda")
        self.k_cache = torch.randn(n_tok + 1, N_KV_HEADS, HEAD_DIM, generator=gen, **dev)
        self.v_cache = torch.empty_like(self.k_cache)
        self.v_cache[0].normal_(generator=gen)
        self.k_cache[slots] = einops.rearrange(self.k_dense, "b h l d -> (b l) h d")
        self.v_cache[slots] = einops.rearrange(self.v_dense, "b h l d -> (b l) h d")
        self.req_to_token = torch.zeros(bs + 1, ctx, dtype=torch.int32, device="cuda")
        self.req_to_token[1:] = slots.view(bs, ctx).int()
        self.rows = torch.arange(1, bs + 1, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(bs, N_Q_HEADS, HEAD_DIM, generator=gen, **dev)

    def ours(self, **knobs):
        args = (self.q, self.k_cache, self.v_cache, self.req_to_token, self.rows, self.seq_lens)
        if knobs:
            return lambda: split_kv_attention(*args, None, 1, HEAD_DIM ** -0.5, **knobs)
        return lambda: decode_attention(*args)

    def sdpa(self, backend):
        q4 = self.q.unsqueeze(2)  # [bs, q_heads, 1, dim]

        def run():
            with torch.nn.attention.sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, self.k_dense, self.v_dense,
                                                      enable_gqa=True).squeeze(2)
        return run

    def bytes_moved(self) -> int:
        kv = 2 * self.bs * self.ctx * N_KV_HEADS * HEAD_DIM * 2
        index = self.bs * self.ctx * 4
        q_and_o = 2 * self.bs * N_Q_HEADS * HEAD_DIM * 2
        return kv + index + q_and_o


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(case: DecodeCase) -> tuple[dict, torch.Tensor]:
    """Ours vs the fp32 torch reference on the first and last request: (errors, our output)."""
    out = case.ours()()
    pick = torch.tensor(sorted({0, case.bs - 1}), device="cuda")
    ref = decode_attention_reference(case.q[pick], case.k_cache, case.v_cache,
                                     case.req_to_token, case.rows[pick], case.seq_lens[pick])
    err = rel_err(out[pick], ref)
    return dict(vs_reference=err, ok=err < 1e-2), out


def best_sdpa_backend(case: DecodeCase, ref):
    """The fastest SDPA backend that runs this case and agrees with ours, or None.

    The math backend is tried only when no fused one runs (it materializes the GQA repeat).
    """
    from torch.nn.attention import SDPBackend
    fused = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION)
    timed = []
    for backends in (fused, (SDPBackend.MATH,)):
        for backend in backends:
            fn = case.sdpa(backend)
            try:
                ok = rel_err(fn(), ref) < 1e-2
                torch.cuda.synchronize()
            except RuntimeError:  # no kernel for these inputs (or out of memory)
                continue
            if ok:
                timed.append((bench_us(fn, rep=50), backend))
        if timed:
            break
    return min(timed, key=lambda t: t[0])[1] if timed else None


def time_case(bs, ctx, layout, copy_bw, l2_bytes, gen) -> dict:
    first = DecodeCase(bs, ctx, layout, gen)
    set_bytes = first.bytes_moved()
    n_sets = min(MAX_SETS, math.ceil(3 * l2_bytes / set_bytes)) if set_bytes < 3 * l2_bytes else 1
    cases = [first] + [DecodeCase(bs, ctx, layout, gen) for _ in range(n_sets - 1)]
    errs, out = check(first)
    backend = best_sdpa_backend(first, out)
    sdpa_fns = [c.sdpa(backend) for c in cases] if backend is not None else []
    row = dict(bs=bs, ctx=ctx, layout=layout, n_sets=n_sets,
               sdpa_backend=backend.name if backend is not None else None,
               num_splits=choose_num_splits(bs, N_KV_HEADS, ctx, sm_count(first.q.device)),
               bytes=set_bytes, **errs)
    row["ours_eager_us"] = bench_us(rotating([c.ours() for c in cases]))
    row["ours_us"] = bench_us(rotating([graph_of(c.ours()) for c in cases]))
    if sdpa_fns:
        row["sdpa_eager_us"] = bench_us(rotating(sdpa_fns))
        try:
            row["sdpa_us"] = bench_us(rotating([graph_of(f) for f in sdpa_fns]))
        except RuntimeError:  # not capturable: compare eagerly
            row["sdpa_us"] = row["sdpa_eager_us"]
    row["floor_us"] = set_bytes / copy_bw * 1e6
    row["frac_copy_bw"] = row["floor_us"] / row["ours_us"]
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["ours_us"] if sdpa_fns else None
    del cases, first, sdpa_fns, out
    torch.cuda.empty_cache()
    return row


def sweep_case(bs, ctx, layout, copy_bw, gen) -> dict:
    """Time the split kernel over split counts and tiles; the policy's pick is marked."""
    case = DecodeCase(bs, ctx, layout, gen)
    ref = case.ours()()
    floor = case.bytes_moved() / copy_bw * 1e6
    policy = choose_num_splits(bs, N_KV_HEADS, ctx, sm_count(case.q.device))
    results = []
    for (block_n, stages, warps), splits in itertools.product(SWEEP_TILES, SWEEP_SPLITS):
        if splits > triton.cdiv(ctx, block_n):
            continue
        fn = case.ours(num_splits=splits, block_n=block_n, num_stages=stages, num_warps=warps)
        if rel_err(fn(), ref) > 1e-2:
            raise AssertionError(f"sweep config {block_n=} {stages=} {warps=} {splits=} "
                                 f"disagrees with the default kernel at {bs=} {ctx=}")
        t = bench_us(fn, rep=50)
        results.append(dict(block_n=block_n, stages=stages, warps=warps, splits=splits,
                            us=t, frac_copy_bw=floor / t))
    best = min(results, key=lambda r: r["us"])
    mine = [r for r in results if r["splits"] == policy and (r["block_n"], r["stages"],
                                                             r["warps"]) == SWEEP_TILES[0]]
    del case
    torch.cuda.empty_cache()
    return dict(bs=bs, ctx=ctx, floor_us=floor, policy_splits=policy, best=best,
                policy=mine[0] if mine else None, all=results)


def markdown(meta, rows, sweeps) -> str:
    lines = [f"# Paged decode attention benchmark ({meta['gpu']})", "",
             f"- date: {meta['date']}", f"- torch {meta['torch']}, triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             f"- copy bandwidth (read + write): {meta['copy_bw_GBps']:.0f} GB/s",
             f"- {N_Q_HEADS} q heads, {N_KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16, "
             f"slot layout {meta['layout']}; ours/sdpa = CUDA-graph replay, eager in brackets", "",
             "| bs | ctx | splits | ours µs | sdpa µs | floor µs | frac of copy BW | speedup "
             "| sdpa backend | rel err |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        sdpa = (f"{r['sdpa_us']:.1f} ({r['sdpa_eager_us']:.1f})" if r.get("sdpa_us")
                else "n/a")
        speed = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] else "n/a"
        lines.append(f"| {r['bs']} | {r['ctx']} | {r['num_splits']} | {r['ours_us']:.1f} "
                     f"({r['ours_eager_us']:.1f}) | {sdpa} | {r['floor_us']:.1f} "
                     f"| {r['frac_copy_bw']:.0%} | {speed} | {r['sdpa_backend']} "
                     f"| {r['vs_reference']:.1e}{'' if r['ok'] else ' FAIL'} |")
    if sweeps:
        lines += ["", "## Split / tile sweep (eager, µs; tile = BLOCK_N/stages/warps)", "",
                  "| bs | ctx | policy splits | policy µs | best µs | best tile | best splits "
                  "| best frac |", "|---:|---:|---:|---:|---:|---|---:|---:|"]
        for s in sweeps:
            b, p = s["best"], s["policy"]
            lines.append(f"| {s['bs']} | {s['ctx']} | {s['policy_splits']} | "
                         f"{p['us']:.1f} | {b['us']:.1f} | {b['block_n']}/{b['stages']}/"
                         f"{b['warps']} | {b['splits']} | {b['frac_copy_bw']:.0%} |"
                         if p else f"| {s['bs']} | {s['ctx']} | {s['policy_splits']} | n/a "
                         f"| {b['us']:.1f} | - | {b['splits']} | {b['frac_copy_bw']:.0%} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("random", "contiguous"), default="random",
                        help="slot order in the paged cache (random = fully fragmented)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the split/tile sweep")
    parser.add_argument("--bs", type=int, nargs="*", default=BATCHES)
    parser.add_argument("--ctx", type=int, nargs="*", default=CONTEXTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=props.name,
                n_sm=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, command=" ".join([sys.executable] + sys.argv),
                copy_bw_GBps=copy_bw / 1e9, layout=args.layout)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    rows = []
    for bs, ctx in itertools.product(args.bs, args.ctx):
        rows.append(time_case(bs, ctx, args.layout, copy_bw, l2_bytes, gen))
        r = rows[-1]
        print(f"bs={bs:4d} ctx={ctx:6d} splits={r['num_splits']:3d} ours {r['ours_us']:8.1f} µs"
              f"  sdpa {r.get('sdpa_us', float('nan')):8.1f} µs  floor {r['floor_us']:7.1f} µs"
              f"  {r['frac_copy_bw']:.0%} of copy BW  ok={r['ok']}", flush=True)
    sweeps = []
    if not args.no_sweep:
        for bs, ctx in SWEEP_CASES:
            sweeps.append(sweep_case(bs, ctx, args.layout, copy_bw, gen))
            print(f"sweep bs={bs} ctx={ctx}: best {sweeps[-1]['best']}", flush=True)
    report = markdown(meta, rows, sweeps)
    print(report)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results/local")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention.md").write_text(report)
    (out_dir / "attention.json").write_text(json.dumps(dict(meta=meta, rows=rows,
                                                            sweeps=sweeps), indent=1))
    print(f"wrote {out_dir / 'attention.md'} and attention.json")
    if not all(r["ok"] for r in rows):
        sys.exit("some results disagree with the reference (rel err >= 1e-2): see the table")


if __name__ == "__main__":
    main()
