"""Benchmark paged attention on the GPU: ours vs SDPA vs the bytes-moved floor, and cold capture.

    python -m bench.bench_attention.py              # everything (< 3 min on an H200)
    python -m bench.bench_attention.py --no-sweep --no-cold
    python -m bench.bench_attention.py --smoke      # CPU, tiny sizes, interpreted: a script check

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
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported: kernels run interpreted on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import einops  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench.common import random_tree_masks  # noqa: E402
from padgraph.backends.triton.attention import (  # noqa: E402
    decode_attention, decode_attention_reference, extend_attention, extend_attention_reference,
    tree_verify_attention, tree_verify_attention_reference)
from padgraph.backends.triton.attention_decode import (  # noqa: E402
    choose_fold, choose_num_splits, sm_count, split_kv_attention)

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 4096, 32768)
K_DRAFT, DRAFT_EXTEND = 8, 6  # tree verify tokens; EAGLE steps (5) + 1
SPEC_BATCHES, SPEC_CONTEXTS = (1, 8, 32), (512, 4096)
SWEEP_CASES = ((1, 512), (8, 512), (1, 4096), (8, 4096), (32, 4096), (128, 4096), (1, 32768),
               (8, 32768))
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)
SWEEP_TILES = ((64, 2, 4), (32, 2, 4), (64, 3, 4), (128, 2, 8))  # (BLOCK_N, stages, warps)
MAX_SETS = 8
SMOKE = dict(batches=(1, 3), contexts=(40, 100), spec_batches=(2,), spec_contexts=(50,),
             sweep=((2, 100),), splits=(1, 3), tiles=((64, 2, 4),))


# ----------------------------------------------------------------------------- timing

def bench_us(fn, rep=100) -> float:
    """Median time of fn in µs (do_bench warms up and flushes L2 before each call); on CPU
    (--smoke) a plain wall-clock median of a few calls."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e6
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def rotating(fns):
    """One callable that runs fns[0], fns[1], ... in turn (cache-set rotation)."""
    cycle = itertools.cycle(fns)
    return lambda: next(cycle)()


def graph_of(fn):
    """Capture fn in a CUDA graph after a warm-up on a side stream; returns graph.replay
    (on CPU: fn itself)."""
    if not torch.cuda.is_available():
        return fn
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


def in_graph_us(fns, calls, flush) -> float:
    """µs a call of fns (cycled) takes inside one CUDA graph of `calls` calls, each call after
    flush() (an L2-sized write), less the same graph of flushes alone (CPU: plain loops)."""
    def body(with_calls):
        def run():
            for i in range(calls):
                flush()
                if with_calls:
                    fns[i % len(fns)]()
        return run
    both = bench_us(graph_of(body(True)), rep=50)
    flushes = bench_us(graph_of(body(False)), rep=50)
    return max(both - flushes, 0.0) / calls


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    n = (1 << 29) if device.type == "cuda" else (1 << 20)
    x = torch.randn(n, dtype=DTYPE, device=device)  # 1 GiB on the GPU
    y = torch.empty_like(x)
    t_us = bench_us(lambda: y.copy_(x))
    nbytes = 2 * x.numel() * x.element_size()
    del x, y
    return nbytes / (t_us * 1e-6)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


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
        if knobs:
            return lambda: split_kv_attention(*args, None, 1, HEAD_DIM ** -0.5, **knobs)
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


def time_case(bs, ctx, layout, copy_bw, l2_bytes, gen, device, kind="decode",
              in_graph=0) -> dict:
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
               num_splits=choose_num_splits(bs, N_KV_HEADS, ctx, sm_count(first.q.device),
                                            first.n_q if kind != "extend" else 1),
               bytes=set_bytes, **errs)
    row["fold"] = kind != "extend" and choose_fold(row["num_splits"], first.n_q,
                                                   N_Q_HEADS // N_KV_HEADS, HEAD_DIM)
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


def sweep_case(bs, ctx, layout, copy_bw, gen, device, splits_list, tiles) -> dict:
    """Time the decode kernel over split counts, tiles and fold, each as a graph replay (eager
    times count the launches, which a captured step does not pay); the policy's pick is marked."""
    case = PagedCase(bs, ctx, layout, gen, device)
    ref = case.ours()()
    floor = case.bytes_moved() / copy_bw * 1e6
    policy = choose_num_splits(bs, N_KV_HEADS, ctx, sm_count(case.q.device))
    policy_fold = choose_fold(policy, 1, N_Q_HEADS // N_KV_HEADS, HEAD_DIM)
    results = []
    for (block_n, stages, warps), splits in itertools.product(tiles, splits_list):
        if splits > triton.cdiv(ctx, block_n):
            continue
        for fold in ((True, False) if splits > 1 else (True,)):
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
            t = bench_us(graph_of(fn), rep=30)
            results.append(dict(block_n=block_n, stages=stages, warps=warps, splits=splits,
                                fold=fold, us=t, frac_copy_bw=floor / t))
    best = min(results, key=lambda r: r["us"])
    mine = [r for r in results if r["splits"] == policy and (r["block_n"], r["stages"],
            r["warps"]) == tiles[0] and r["fold"] == (policy_fold or policy == 1)]
    del case
    return dict(bs=bs, ctx=ctx, floor_us=floor, policy_splits=policy, policy_fold=policy_fold,
                best=best, policy=mine[0] if mine else None, all=results)


# ----------------------------------------------------------------------------- cold capture

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
            proc = subprocess.run([sys.executable, __file__, "--cold-child"], env=env,
                                  capture_output=True, text=True, timeout=120)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise RuntimeError(f"cold-capture child failed ({label}):\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(dict(label=label, process_s=wall, **row))
            print(f"cold capture ({label}): {row}", flush=True)
    return results


# ----------------------------------------------------------------------------- report

def fmt_rows(rows, with_splits=True) -> list[str]:
    head = ("| kind | layout | bs | ctx | splits | ours µs | sdpa µs | floor µs | frac of copy BW "
            "| speedup | sdpa backend | rel err |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        sdpa = (f"{r['sdpa_us']:.1f} ({r['sdpa_eager_us']:.1f})" if r.get("sdpa_us")
                else "n/a")
        speed = f"{r['speedup_vs_sdpa']:.2f}x" if r["speedup_vs_sdpa"] else "n/a"
        splits = f"{r['num_splits']}{'' if r['fold'] or r['num_splits'] == 1 else '+m'}" \
            if r["kind"] != "extend" else "-"
        lines.append(f"| {r['kind']} | {r['layout']} | {r['bs']} | {r['ctx']} | {splits} "
                     f"| {r['ours_us']:.1f} ({r['ours_eager_us']:.1f}) | {sdpa} "
                     f"| {r['floor_us']:.1f} | {r['frac_copy_bw']:.0%} | {speed} "
                     f"| {r['sdpa_backend']} | {r['vs_reference']:.1e}"
                     f"{'' if r['ok'] else ' FAIL'} |")
    return lines


def markdown(meta, rows, spec_rows, sweeps, cold) -> str:
    lines = [f"# Paged attention benchmark ({meta['gpu']})", "",
             f"- date: {meta['date']}", f"- torch {meta['torch']}, triton {meta['triton']}",
             f"- command: `{meta['command']}`",
             f"- copy bandwidth (read + write): {meta['copy_bw_GBps']:.0f} GB/s",
             f"- {N_Q_HEADS} q heads, {N_KV_HEADS} kv heads, head_dim {HEAD_DIM}, bf16; ours/sdpa "
             "= CUDA-graph replay, eager in brackets; splits `S` = one launch (merge folded or "
             "S = 1), `S+m` = split pass + merge kernel", "", "## Decode", ""]
    lines += fmt_rows(rows)
    ig = [r for r in rows if "ig_ours_us" in r]
    if ig:
        lines += ["", f"Inside a graph of {ig[0]['in_graph_calls']} calls (an L2 flush before "
                  "each, the flushes' own time subtracted), µs a call:", "",
                  "| layout | bs | ctx | ours | sdpa | speedup | floor |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in ig:
            sd = r.get("ig_sdpa_us")
            sp = f"{sd / r['ig_ours_us']:.2f}x" if sd and r["ig_ours_us"] > 0 else "n/a"
            lines.append(f"| {r['layout']} | {r['bs']} | {r['ctx']} | {r['ig_ours_us']:.1f} | "
                         f"{f'{sd:.1f}' if sd else 'n/a'} | {sp} | {r['floor_us']:.1f} |")
    if spec_rows:
        lines += ["", f"## Tree verify (k = {K_DRAFT}) and draft-extend ({DRAFT_EXTEND} "
                  "tokens, causal) vs SDPA with the equivalent mask", ""]
        lines += fmt_rows(spec_rows)
    if sweeps:
        lines += ["", "## Decode split / tile / fold sweep (graph replays, µs; tile = BLOCK_N/stages/"
                  "warps)", "",
                  "| bs | ctx | policy splits | policy µs | best µs | best tile | best splits "
                  "| best fold | best frac |", "|---:|---:|---:|---:|---:|---|---:|---|---:|"]
        for s in sweeps:
            b, p = s["best"], s["policy"]
            pol = f"{p['us']:.1f}" if p else "n/a"
            lines.append(f"| {s['bs']} | {s['ctx']} | {s['policy_splits']} | {pol} "
                         f"| {b['us']:.1f} | {b['block_n']}/{b['stages']}/{b['warps']} "
                         f"| {b['splits']} | {b['fold']} | {b['frac_copy_bw']:.0%} |")
    if cold:
        lines += ["", "## Cold capture of the default ladder (decode-only body: "
                  f"{COLD_LAYERS} x (store_kv + decode_attention), 32/8/64 heads, max context "
                  f"{COLD_MAX_CTX})", "",
                  "| run | buckets | capture s (first) | capture s (again, same process) "
                  "| Triton compiles | cubins in cache | split counts | process s |",
                  "|---|---:|---:|---:|---|---:|---|---:|"]
        for c in cold:
            lines.append(f"| {c['label']} | {c['n_buckets']} | {c['first_s']:.2f} "
                         f"| {c['again_s']:.2f} | {c['compiles']} | {c['cubins_in_cache']} "
                         f"| {c['split_counts']} | {c['process_s']:.1f} |")
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
                command=" ".join([sys.executable] + sys.argv), copy_bw_GBps=copy_bw / 1e9)
    layouts = ("random", "contiguous") if args.layout == "both" else (args.layout,)

    def decode_rows():
        rows = []
        for layout, bs, ctx in itertools.product(layouts, batches, contexts):
            rows.append(time_case(bs, ctx, layout, copy_bw, l2_bytes, gen, device,
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
            rows.append(time_case(bs, ctx, "random", copy_bw, l2_bytes, gen, device, kind))
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
            out.append(sweep_case(bs, ctx, "random", copy_bw, gen, device, splits, tiles))
            print(f"sweep bs={bs} ctx={ctx}: best {out[-1]['best']}", flush=True)
        return out

    rows = section("decode", decode_rows)
    spec = [] if args.no_spec else section("verify/extend", spec_rows)
    sweep = [] if args.no_sweep else section("sweep", sweeps)
    cold = [] if args.no_cold or args.smoke else section("cold capture", cold_capture)
    report = markdown(meta, rows, spec, sweep, cold)
    print(report)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / "results/local")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "attention_smoke" if args.smoke else "attention"
    (out_dir / f"{name}.md").write_text(report)
    (out_dir / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, spec=spec,
                                                          sweeps=sweep, cold=cold), indent=1))
    print(f"wrote {out_dir / name}.md and .json")
    if not all(r["ok"] for r in rows + spec):
        sys.exit("some results disagree with the reference (rel err >= 1e-2): see the table")


if __name__ == "__main__":
    main()
