"""Benchmark paged attention on the GPU: ours vs SDPA vs the bytes-moved floor, and cold capture.

    python -m bench.bench_attention              # everything (< 3 min on an H200)
    python -m bench.bench_attention --no-sweep --no-cold
    python -m bench.bench_attention --smoke      # CPU, tiny sizes, interpreted: a script check
    python -m bench.bench_attention --ab REV     # the decode kernel at git revision REV beside
                                                 # today's and SDPA, in a graph, same process
    python -m bench.bench_attention --grid 8:512 # decode launch policies (tile, stages, warps,
                                                 # splits) in a graph, beside the default and SDPA

32 q heads, 8 kv heads, head_dim 128, bf16, every request at full length.
- decode: bs {1, 8, 32, 128} x context {512, 4096, 32768}, random and contiguous slot layouts;
- tree verify (k = 8 drafts per request, a random tree) and draft-extend (steps + 1 = 6 new tokens
  per request, causal) at bs {1, 8, 32} x context {512, 4096}, against SDPA with the equivalent
  boolean mask;
- a split / tile / fold sweep on a few decode cases (each configuration as a CUDA-graph replay);
- cold capture: a fresh process captures the default 36-bucket ladder of a decode-only body
  (16 layers of store_kv + decode_attention at Llama-3.2-1B's attention shape, max context 1024),
  once with an empty Triton cache and once more with the cache it filled; seconds and the number
  of Triton compiles.
"ours" is timed as a CUDA-graph replay (how padgraph runs it) and eagerly; SDPA (the fastest of its
flash / cuDNN / efficient backends that runs the case and agrees, else math; enable_gqa) on a
contiguous [bs, kv_heads, ctx, dim] cache of the same data, likewise. The floor is bytes read +
written (K, V, req_to_token, q, o) over the device-to-device copy bandwidth measured in the same
run. Times: `triton.testing.do_bench` medians (L2 flushed before each call). `--in-graph N` adds,
for decode, the time a call takes inside a graph of N calls (each after an L2 flush; the graph of
the flushes alone subtracted): the kernel's time without one graph launch per call, as in a
model's step. Results are checked against the torch reference first. Writes attention.md /
attention.json to $OUT (or results/local/).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

if "--smoke" in sys.argv:  # before triton is imported: kernels run interpreted on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import einops  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench.common import command_line, git_commit, module_at, random_tree_masks  # noqa: E402
from padgraph.backends.triton.attention import (  # noqa: E402
    decode_attention, decode_attention_reference, extend_attention, extend_attention_reference,
    tree_verify_attention, tree_verify_attention_reference)
from padgraph.backends.triton.attention_decode import (  # noqa: E402
    SplitPolicy, choose_num_splits, plan_split, sm_count, split_kv_attention)
from padgraph.backends.triton.attention_meta import PagedMeta  # noqa: E402

from bench.attention_config import *  # noqa: E402,F401,F403 (the shapes and sweeps of this benchmark)

from bench.attention_report import fmt_rows, markdown  # noqa: E402,F401
from bench.cold_capture import cold_capture, cold_child  # noqa: E402,F401
from bench.gpu_timing import (bench_us, copy_bandwidth, graph_of, in_graph_us, rel_err, rotating,  # noqa: E402,F401
                              sync)


# ----------------------------------------------------------------------------- cases

class PagedCase:
    """One cache set: a paged cache (+ req_to_token) and the same data as a dense SDPA cache.

    kind: "decode" (1 query per request), "verify" (K_DRAFT drafts, tree mask) or "extend"
    (DRAFT_EXTEND new tokens, causal). Every request is at full length ctx.
    """

    def __init__(self, bs, ctx, layout, gen, device, kind="decode"):
        self.bs, self.ctx, self.kind, self.device = bs, ctx, kind, device
        self.impl = "auto" if device.type == "cuda" else "triton"  # --smoke: the interpreter
        self.n_q = dict(decode=1, verify=K_DRAFT, extend=DRAFT_EXTEND)[kind]
        dev = dict(device=device, dtype=DTYPE)
        # [bs, kv_heads, ctx, dim] as SDPA wants it
        self.k_dense = torch.randn(bs, N_KV_HEADS, ctx, HEAD_DIM, generator=gen, **dev)
        self.v_dense = torch.randn(bs, N_KV_HEADS, ctx, HEAD_DIM, generator=gen, **dev)
        n_tok = bs * ctx
        if layout == "random":
            slots = torch.randperm(n_tok, device=device, generator=gen) + 1
        else:
            slots = torch.arange(1, n_tok + 1, device=device)
        self.k_cache = torch.randn(n_tok + 1, N_KV_HEADS, HEAD_DIM, generator=gen, **dev)
        self.v_cache = torch.empty_like(self.k_cache)
        self.v_cache[0].normal_(generator=gen)
        self.k_cache[slots] = einops.rearrange(self.k_dense, "b h l d -> (b l) h d")
        self.v_cache[slots] = einops.rearrange(self.v_dense, "b h l d -> (b l) h d")
        self.req_to_token = torch.zeros(bs + 1, ctx, dtype=torch.int32, device=device)
        self.req_to_token[1:] = slots.view(bs, ctx).int()
        self.rows = torch.arange(1, bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=device)
        self.q = torch.randn(bs * self.n_q, N_Q_HEADS, HEAD_DIM, generator=gen, **dev)
        self.tree = random_tree_masks(bs, K_DRAFT, torch.Generator().manual_seed(bs)).to(device)
        self.qo_indptr = (torch.arange(bs + 1, device=device) * self.n_q).int()
        self.mask = self.dense_mask()  # [bs, 1, n_q, ctx] bool, or None (decode)

    def dense_mask(self):
        """SDPA's equivalent of the paged kernels' visibility rule."""
        if self.kind == "decode":
            return None
        pos = torch.arange(self.ctx, device=self.device)
        first = self.ctx - self.n_q  # position of new token / draft 0
        if self.kind == "extend":
            qpos = first + torch.arange(self.n_q, device=self.device)
            mask = (pos[None, :] <= qpos[:, None]).expand(self.bs, -1, -1)
        else:
            j = (pos - first).clamp(0, self.n_q - 1)
            mask = (pos < first)[None, None, :] | (self.tree[:, :, j] & (pos >= first))
        return mask[:, None].contiguous()

    def paged_args(self):
        return (self.q, self.k_cache, self.v_cache, self.req_to_token, self.rows, self.seq_lens)

    def ours(self, **knobs):
        args = self.paged_args()
        if self.kind == "extend":
            return lambda: extend_attention(*args, self.qo_indptr, impl=self.impl)
        if self.kind == "verify":
            return lambda: tree_verify_attention(*args, self.tree, impl=self.impl)
        if knobs:  # `SplitPolicy` fields: the decode launcher under that policy
            meta, policy = PagedMeta.decode(*args[3:]), SplitPolicy(**knobs)
            return lambda: split_kv_attention(*args[:3], meta, HEAD_DIM ** -0.5, policy)
        return lambda: decode_attention(*args, impl=self.impl)

    def reference(self, pick):
        """fp32 torch reference of requests `pick` (a list of request indices)."""
        rows = [r * self.n_q + i for r in pick for i in range(self.n_q)]
        args = (self.q[rows], self.k_cache, self.v_cache, self.req_to_token, self.rows[pick],
                self.seq_lens[pick])
        if self.kind == "extend":
            indptr = (torch.arange(len(pick) + 1, device=self.device) * self.n_q).int()
            return rows, extend_attention_reference(*args, indptr)
        if self.kind == "verify":
            return rows, tree_verify_attention_reference(*args, self.tree[pick])
        return rows, decode_attention_reference(*args)

    def sdpa(self, backend):
        q4 = einops.rearrange(self.q, "(b n) h d -> b h n d", b=self.bs)

        def run():
            with torch.nn.attention.sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q4, self.k_dense, self.v_dense,
                                                   attn_mask=self.mask, enable_gqa=True)
            return einops.rearrange(o, "b h n d -> (b n) h d")
        return run

    def bytes_moved(self) -> int:
        kv = 2 * self.bs * self.ctx * N_KV_HEADS * HEAD_DIM * 2
        index = self.bs * self.ctx * 4
        q_and_o = 2 * self.bs * self.n_q * N_Q_HEADS * HEAD_DIM * 2
        return kv + index + q_and_o


def check(case: PagedCase) -> tuple[dict, torch.Tensor]:
    """Ours vs the fp32 torch reference on the first and last request: (errors, our output)."""
    out = case.ours()()
    rows, ref = case.reference(sorted({0, case.bs - 1}))
    err = rel_err(out[rows], ref)
    return dict(vs_reference=err, ok=err < 1e-2), out


def sdpa_backends(case: PagedCase, ref) -> list:
    """The SDPA backends that run this case and agree with ours (each is then timed the same way
    as ours and the fastest kept: an eager pick was noisy, e.g. flash picked over cuDNN at
    bs 1 ctx 32768, 57 us against 49 as graph replays).

    The math backend is tried only when no fused one runs (it materializes the GQA repeat).
    """
    from torch.nn.attention import SDPBackend
    fused = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION)
    for backends in (fused, (SDPBackend.MATH,)):
        ok = []
        for backend in backends:
            fn = case.sdpa(backend)
            try:
                agrees = rel_err(fn(), ref) < 1e-2
                sync(case.device)
            except RuntimeError:  # no kernel for these inputs (or out of memory)
                continue
            if agrees:
                ok.append(backend)
        if ok:
            return ok
    return []


def time_sdpa(cases: list, backend) -> dict:
    """One SDPA backend over the rotating cases: graph replay (eager if not capturable)."""
    fns = [c.sdpa(backend) for c in cases]
    t = dict(sdpa_eager_us=bench_us(rotating(fns)))
    try:
        t["sdpa_us"] = bench_us(rotating([graph_of(f) for f in fns]))
    except RuntimeError:  # not capturable: compare eagerly
        t["sdpa_us"] = t["sdpa_eager_us"]
    return t


def best_sdpa_backend(case: PagedCase, ref):
    """The fastest agreeing SDPA backend on this one case (graph replays), or None."""
    timed = {b: time_sdpa([case], b)["sdpa_us"] for b in sdpa_backends(case, ref)}
    return min(timed, key=timed.get) if timed else None


class CaseSpec(NamedTuple):
    """What `time_case` measures: kind ("decode", "verify" or "extend") at bs requests of
    context ctx, the cache slots in layout order ("random" or "contiguous")."""
    bs: int
    ctx: int
    layout: str
    kind: str = "decode"


def time_case(spec: CaseSpec, copy_bw, l2_bytes, gen, device, in_graph=0) -> dict:
    bs, ctx, layout, kind = spec
    first = PagedCase(bs, ctx, layout, gen, device, kind)
    set_bytes = first.bytes_moved()
    n_sets = min(MAX_SETS, math.ceil(3 * l2_bytes / set_bytes)) if set_bytes < 3 * l2_bytes else 1
    cases = [first] + [PagedCase(bs, ctx, layout, gen, device, kind) for _ in range(n_sets - 1)]
    errs, out = check(first)
    timed = {b: time_sdpa(cases, b) for b in sdpa_backends(first, out)}
    backend = min(timed, key=lambda b: timed[b]["sdpa_us"]) if timed else None
    sdpa_fns = [c.sdpa(backend) for c in cases] if backend is not None else []
    row = dict(kind=kind, bs=bs, ctx=ctx, layout=layout, n_sets=n_sets,
               sdpa_backend=backend.name if backend is not None else None,
               sdpa_backends_us={b.name: t["sdpa_us"] for b, t in timed.items()},
               bytes=set_bytes, **errs)
    if kind == "extend":
        row.update(num_splits=choose_num_splits(bs, N_KV_HEADS, ctx, sm_count(first.q.device)),
                   fold=False)
    else:   # what split_kv_attention launches for the case
        plan = plan_split(bs, N_KV_HEADS, N_Q_HEADS // N_KV_HEADS, first.n_q, HEAD_DIM, HEAD_DIM,
                          ctx, sm_count(first.q.device))
        row.update(num_splits=plan.num_splits, fold=plan.fold)
    row["ours_eager_us"] = bench_us(rotating([c.ours() for c in cases]))
    row["ours_us"] = bench_us(rotating([graph_of(c.ours()) for c in cases]))
    if sdpa_fns:
        row.update(timed[backend])
    row["floor_us"] = set_bytes / copy_bw * 1e6
    if in_graph:
        flush_buf = torch.empty(max(1, l2_bytes // 4), dtype=torch.int32, device=device)
        flush = flush_buf.zero_
        row["in_graph_calls"] = in_graph
        row["ig_ours_us"] = in_graph_us([c.ours() for c in cases], in_graph, flush)
        if sdpa_fns:
            try:
                row["ig_sdpa_us"] = in_graph_us(sdpa_fns, in_graph, flush)
            except RuntimeError:  # not capturable
                pass
        del flush_buf
    row["frac_copy_bw"] = row["floor_us"] / row["ours_us"]
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["ours_us"] if sdpa_fns else None
    del cases, first, sdpa_fns, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def sweep_case(case: PagedCase, copy_bw, splits_list, tiles, time_fn=None, folds=(True, False),
               every_split: bool = False) -> dict:
    """Time the decode kernel of `case` over split counts, tiles and fold, each as a graph
    replay (eager times count the launches, which a captured step does not pay), or with
    `time_fn(fn) -> µs`; the policy's pick is marked. A split count past the context's tiles
    (empty splits) is skipped unless every_split."""
    bs, ctx = case.bs, case.ctx
    time_fn = time_fn or (lambda fn: bench_us(graph_of(fn), rep=30))
    ref = case.ours()()
    floor = case.bytes_moved() / copy_bw * 1e6
    plan = plan_split(bs, N_KV_HEADS, N_Q_HEADS // N_KV_HEADS, 1, HEAD_DIM, HEAD_DIM, ctx,
                      sm_count(case.q.device))
    policy, policy_fold = plan.num_splits, plan.fold
    results = []
    for (block_n, stages, warps), splits in itertools.product(tiles, splits_list):
        if splits > triton.cdiv(ctx, block_n) and not every_split:
            continue
        for fold in (folds if splits > 1 else (True,)):
            fn = case.ours(num_splits=splits, block_n=block_n, num_stages=stages,
                           num_warps=warps, fold=fold)
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001 - e.g. a tile past the shared memory
                print(f"sweep: skipping {block_n=} {stages=} {warps=}: {type(e).__name__}")
                break
            if rel_err(out, ref) > 1e-2:
                raise AssertionError(f"sweep config {block_n=} {stages=} {warps=} {splits=} "
                                     f"{fold=} disagrees with the default kernel at {bs=} {ctx=}")
            t = time_fn(fn)
            results.append(dict(block_n=block_n, stages=stages, warps=warps, splits=splits,
                                fold=fold, us=t, frac_copy_bw=floor / t))
            print(f"sweep bs={bs} ctx={ctx} {block_n}/{stages}/{warps} {splits=} {fold=}: "
                  f"{t:.2f} µs", flush=True)
    best = min(results, key=lambda r: r["us"])
    mine = [r for r in results if r["splits"] == policy and (r["block_n"], r["stages"],
            r["warps"]) == tiles[0] and r["fold"] == (policy_fold or policy == 1)]
    return dict(bs=bs, ctx=ctx, floor_us=floor, policy_splits=policy, policy_fold=policy_fold,
                best=best, policy=mine[0] if mine else None, all=results)


def decode_case(bs: int, ctx: int, gen, device):
    """A random-slot decode case for the in-graph comparisons: (case, its paged args, its
    metadata, the default kernel's output, the fastest SDPA backend that agrees or None)."""
    case = PagedCase(bs, ctx, "random", gen, device)
    args = case.paged_args()
    ref = case.ours()()
    return case, args, PagedMeta.decode(*args[3:]), ref, best_sdpa_backend(case, ref)


def ab_rows(source: str, cases, l2_bytes, gen, device, calls: int = 20, rounds: int = 3) -> list:
    """The decode kernel (`split_kv_attention`, its default policy) at git revision (or .py
    file) `source` beside today's and the fastest agreeing SDPA, one process: at each (bs, ctx)
    of `cases` (random slots), each in a graph of `calls` calls after an L2-sized write each
    (`in_graph_us`), in turn, `rounds` times; the median. Outputs are checked against SDPA's."""
    other = module_at(source, "backends/triton/attention_decode.py", "padgraph.backends.triton")
    flush_buf = torch.empty(max(1, l2_bytes // 4), dtype=torch.int32, device=device)
    rows = []
    for bs, ctx in cases:
        case, args, meta, ref, backend = decode_case(bs, ctx, gen, device)
        fns = {source: lambda: other.split_kv_attention(*args[:3], meta, HEAD_DIM ** -0.5),
               "today": lambda: split_kv_attention(*args[:3], meta, HEAD_DIM ** -0.5)}
        if backend is not None:
            fns["sdpa"] = case.sdpa(backend)
        for side, fn in fns.items():
            if rel_err(fn(), ref) >= 1e-2:
                raise AssertionError(f"{side} disagrees with the default kernel at {bs=} {ctx=}")
        times = {side: [] for side in fns}
        for _ in range(rounds):
            for side, fn in fns.items():
                times[side].append(in_graph_us([fn], calls, flush_buf.zero_))
        us = {side: sorted(t)[len(t) // 2] for side, t in times.items()}
        rows.append(dict(bs=bs, ctx=ctx, us=us,
                         sdpa_backend=backend.name if backend is not None else None))
        print(f"ab bs={bs} ctx={ctx}: " + "  ".join(f"{k} {v:.1f}" for k, v in us.items()),
              flush=True)
        del case
    return rows


def ab_markdown(meta: dict, source: str, rows: list) -> str:
    lines = [f"# Decode attention A/B: {source} against today's and SDPA, in a graph", "",
             f"`{json.dumps(meta)}`", "",
             "µs a call inside a CUDA graph of 20 calls, each after an L2-sized write (the writes' "
             "own graph subtracted); median of three rounds taken in turn; random slot layout.", "",
             f"| bs | ctx | {source} | today | SDPA | SDPA backend | today / SDPA as speed |",
             "|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        u = r["us"]
        sdpa, today = u.get("sdpa"), u["today"]
        cells = ("-", "-") if sdpa is None else (f"{sdpa:.1f}", f"{sdpa / today:.2f}x")
        lines.append(f"| {r['bs']} | {r['ctx']} | {u[source]:.1f} | {today:.1f} | {cells[0]} | "
                     f"{r['sdpa_backend']} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def grid_rows(cases, copy_bw, l2_bytes, gen, device, tiles, splits_list, calls: int = 20,
              rounds: int = 3) -> list:
    """`sweep_case` at each (bs, ctx) of `cases` (random slots), merge folded, every split count
    of `splits_list`, each point once in a graph of `calls` calls after an L2-sized write each
    (`in_graph_us`), beside the default policy and the fastest agreeing SDPA timed the same way
    `rounds` times (a round before the grid, the others after it; the median)."""
    flush_buf = torch.empty(max(1, l2_bytes // 4), dtype=torch.int32, device=device)

    def in_graph(fn):
        return in_graph_us([fn], calls, flush_buf.zero_)
    rows = []
    for bs, ctx in cases:
        case, _, _, ref, backend = decode_case(bs, ctx, gen, device)
        peers = {"default": case.ours()}
        if backend is not None:
            peers["sdpa"] = case.sdpa(backend)
        times = {side: [in_graph(fn)] for side, fn in peers.items()}
        sweep = sweep_case(case, copy_bw, splits_list, tiles, in_graph, folds=(True,),
                           every_split=True)
        for _ in range(rounds - 1):
            for side, fn in peers.items():
                times[side].append(in_graph(fn))
        us = {side: sorted(t)[len(t) // 2] for side, t in times.items()}
        rows.append(dict(bs=bs, ctx=ctx, us=us, best=sweep["best"], points=sweep["all"],
                         sdpa_backend=backend.name if backend is not None else None))
        print(f"grid bs={bs} ctx={ctx}: default {us['default']:.2f}  sdpa "
              f"{us.get('sdpa', float('nan')):.2f}  best {sweep['best']}", flush=True)
        del case, ref
    return rows


def grid_axes(tiles, splits, block_n=None, stages=None, warps=None, split_counts=None):
    """The grid's (BLOCK_N, stages, warps) tiles and split counts: each axis given as a comma
    list replaces that axis of `tiles` / `splits`; the others keep their values."""
    def axis(given, default):
        return tuple(int(v) for v in given.split(",")) if given else default
    ns = axis(block_n, tuple(dict.fromkeys(t[0] for t in tiles)))
    ss = axis(stages, tuple(dict.fromkeys(t[1] for t in tiles)))
    ws = axis(warps, tuple(dict.fromkeys(t[2] for t in tiles)))
    if (block_n, stages, warps) != (None, None, None):
        tiles = tuple(itertools.product(ns, ss, ws))
    return tiles, axis(split_counts, tuple(splits))


def grid_markdown(meta: dict, rows: list) -> str:
    lines = ["# Decode attention launch policies in a graph", "", f"`{json.dumps(meta)}`", "",
             "µs a call inside a CUDA graph of 20 calls, each after an L2-sized write (the "
             "writes' own graph subtracted); the default and SDPA: median of three rounds; a "
             "grid point: one; random slot layout; merge folded.", "",
             "| bs | ctx | default | best point | best (BLOCK_N/stages/warps, splits) | SDPA | "
             "SDPA backend | best / SDPA as speed |", "|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in rows:
        u, b = r["us"], r["best"]
        sdpa = u.get("sdpa")
        cells = ("-", "-") if sdpa is None else (f"{sdpa:.1f}", f"{sdpa / b['us']:.2f}x")
        lines.append(f"| {r['bs']} | {r['ctx']} | {u['default']:.1f} | {b['us']:.1f} | "
                     f"{b['block_n']}/{b['stages']}/{b['warps']}, {b['splits']} | {cells[0]} | "
                     f"{r['sdpa_backend']} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def section(name, fn, *args):
    """Run one benchmark section; a failure is reported and the others still run."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a benchmark reports what it could measure
        print(f"section {name} failed:\n{traceback.format_exc()}", flush=True)
        return []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("random", "contiguous", "both"), default="both",
                        help="slot order in the paged cache (random = fully fragmented)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the split/tile sweep")
    parser.add_argument("--sweep-cases", default="", metavar="BS:CTX,...",
                        help="sweep these (batch, context) cases instead of the default ones")
    parser.add_argument("--no-spec", action="store_true", help="skip verify / draft-extend")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-capture runs")
    parser.add_argument("--bs", type=int, nargs="*", default=BATCHES)
    parser.add_argument("--ctx", type=int, nargs="*", default=CONTEXTS)
    parser.add_argument("--in-graph", type=int, default=0, metavar="N",
                        help="decode: also time calls inside a graph of N calls (0: off)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (script check)")
    parser.add_argument("--ab", metavar="REV", default=None,
                        help="only: the decode kernel at git revision REV (or a .py file) beside "
                             "today's and SDPA, in a graph, at --ab-cases")
    parser.add_argument("--ab-cases", default="1:512,8:512,32:512,1:4096,8:4096,32:4096,128:512",
                        metavar="BS:CTX,...")
    parser.add_argument("--grid", metavar="BS:CTX,...", default=None,
                        help="only: decode launch policies (GRID_TILES x GRID_SPLITS) beside "
                             "the default policy and SDPA, in a graph, at these cases")
    parser.add_argument("--grid-block-n", default=None, metavar="N,...",
                        help="--grid: these tiles (BLOCK_N) instead of GRID_TILES' (16, 32, 64)")
    parser.add_argument("--grid-stages", default=None, metavar="S,...",
                        help="--grid: these num_stages instead of GRID_TILES' (1, 2, 3)")
    parser.add_argument("--grid-warps", default=None, metavar="W,...",
                        help="--grid: these num_warps instead of GRID_TILES' (1, 2, 4)")
    parser.add_argument("--grid-splits", default=None, metavar="K,...",
                        help="--grid: these split counts instead of GRID_SPLITS (2, 4, 8, 16)")
    parser.add_argument("--cold-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cold_child:
        return cold_child()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    batches, contexts = (SMOKE["batches"], SMOKE["contexts"]) if args.smoke else (args.bs,
                                                                                  args.ctx)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu smoke"
    l2_bytes = (getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
                if device.type == "cuda" else 1 << 20)
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bw = copy_bandwidth(device)
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu,
                n_sm=sm_count(device), torch=torch.__version__, triton=triton.__version__,
                command=command_line(), commit=git_commit(), copy_bw_GBps=copy_bw / 1e9)
    layouts = ("random", "contiguous") if args.layout == "both" else (args.layout,)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results/local")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.ab:
        cases = SMOKE["sweep"] if args.smoke else \
            [tuple(int(v) for v in c.split(":")) for c in args.ab_cases.split(",")]
        rows = ab_rows(args.ab, cases, l2_bytes, gen, device)
        report = ab_markdown(meta, args.ab, rows)
        print(report)
        (out_dir / "attention_ab.md").write_text(report)
        (out_dir / "attention_ab.json").write_text(json.dumps(dict(meta=meta, source=args.ab,
                                                                   rows=rows), indent=1))
        return None

    if args.grid:
        cases = SMOKE["sweep"] if args.smoke else \
            [tuple(int(v) for v in c.split(":")) for c in args.grid.split(",")]
        tiles, splits = (SMOKE["tiles"], SMOKE["splits"]) if args.smoke else (GRID_TILES,
                                                                              GRID_SPLITS)
        tiles, splits = grid_axes(tiles, splits, args.grid_block_n, args.grid_stages,
                                  args.grid_warps, args.grid_splits)
        rows = grid_rows(cases, copy_bw, l2_bytes, gen, device, tiles, splits)
        report = grid_markdown(meta, rows)
        print(report)
        (out_dir / "attention_grid.md").write_text(report)
        (out_dir / "attention_grid.json").write_text(json.dumps(dict(meta=meta, rows=rows),
                                                                indent=1))
        return None

    def decode_rows():
        rows = []
        for layout, bs, ctx in itertools.product(layouts, batches, contexts):
            rows.append(time_case(CaseSpec(bs, ctx, layout), copy_bw, l2_bytes, gen, device,
                                  in_graph=args.in_graph))
            r = rows[-1]
            print(f"decode {layout:10s} bs={bs:4d} ctx={ctx:6d} splits={r['num_splits']:3d} "
                  f"ours {r['ours_us']:8.1f} µs  sdpa {r.get('sdpa_us', float('nan')):8.1f} µs"
                  f"  floor {r['floor_us']:7.1f} µs  {r['frac_copy_bw']:.0%} of copy BW  "
                  f"ok={r['ok']}", flush=True)
        return rows

    def spec_rows():
        rows = []
        sb, sc = (SMOKE["spec_batches"], SMOKE["spec_contexts"]) if args.smoke else \
            (SPEC_BATCHES, SPEC_CONTEXTS)
        for kind, bs, ctx in itertools.product(("verify", "extend"), sb, sc):
            rows.append(time_case(CaseSpec(bs, ctx, "random", kind), copy_bw, l2_bytes, gen,
                                  device))
            r = rows[-1]
            print(f"{kind} bs={bs} ctx={ctx}: ours {r['ours_us']:.1f} µs sdpa "
                  f"{r.get('sdpa_us', float('nan')):.1f} µs ok={r['ok']}", flush=True)
        return rows

    def sweeps():
        out = []
        cases, splits, tiles = (SMOKE["sweep"], SMOKE["splits"], SMOKE["tiles"]) if args.smoke \
            else (SWEEP_CASES, SWEEP_SPLITS, SWEEP_TILES)
        if args.sweep_cases:
            cases = [tuple(int(v) for v in c.split(":")) for c in args.sweep_cases.split(",")]
        for bs, ctx in cases:
            out.append(sweep_case(PagedCase(bs, ctx, "random", gen, device), copy_bw, splits,
                                  tiles))
            print(f"sweep bs={bs} ctx={ctx}: best {out[-1]['best']}", flush=True)
        return out

    rows = section("decode", decode_rows)
    spec = [] if args.no_spec else section("verify/extend", spec_rows)
    sweep = [] if args.no_sweep else section("sweep", sweeps)
    cold = [] if args.no_cold or args.smoke else section("cold capture", cold_capture)
    report = markdown(meta, rows, spec, sweep, cold)
    print(report)
    name = "attention_smoke" if args.smoke else "attention"
    (out_dir / f"{name}.md").write_text(report)
    (out_dir / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, spec=spec,
                                                          sweeps=sweep, cold=cold), indent=1))
    print(f"wrote {out_dir / name}.md and .json")
    if not all(r["ok"] for r in rows + spec):
        sys.exit("some results disagree with the reference (rel err >= 1e-2): see the table")


if __name__ == "__main__":
    main()
