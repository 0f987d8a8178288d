"""Benchmark: padgraph's CUDA runner against its peers on a Llama-3.2-1B-shaped decode step.

All variants run side by side in one process on the same body, weights and KV cache:
  eager            the body called at the raw batch size, no graphs
  handwritten      an SGLang-style runner: per-buffer copy_/fill_, bisect, one graph per bucket
  compile-ro       torch.compile(mode="reduce-overhead") at the raw sizes (its own cudagraphs), set
                   up as its users do: the KV pools and the request map are marked static addresses
                   (what HF's StaticCache and gpt-fast's buffers do), so the graphs may mutate them
                   in place; every "skipping cudagraphs" reason torch logs is printed and recorded
  padgraph         pg.compile(backend="cuda") with the eager body
  padgraph+canary  the same runner with the cache bound as state whose last slot and request row are
                   canary rows (pg.State(canary=...)): every replay checks them in-graph (its cost)
  padgraph+compile pg.compile(backend="cuda", torch_compile={"regions": model.layers}): the decoder
                   layer compiled once for every layer and the whole ladder, inductor's kernels
                   captured in padgraph's graphs (--pg-compile whole: the whole body compiled)
  padgraph+compile+pdl  the same, inductor's kernels launched with programmatic dependent launch
                   (torch_compile options {"triton.enable_pdl": True}; skipped, saying so, where
                   torch's inductor lacks the option)
  padgraph+compile+unfused  padgraph+compile with backends.cuda.passes.unfuse_addmm as inductor's
                   post-grad pass: the residual adds out of the GEMMs (no copy of the residual
                   into each GEMM's output; the stored sum rounded as eager rounds it)
  padgraph+compile+sample  padgraph+compile with the sampler in place of the argmax: Llama 3's
                   own generation settings (temperature 0.6, top-p 0.9) on the logits times
                   --sample-factor (a random model's logits are nearly flat; the factor sharpens
                   them, and the run prints their mean entropy at that temperature). The factor
                   goes into the temperature lanes (0.6 / factor on the logits is the same
                   distribution), so the step runs no kernel a trained model's would not; what
                   sampling adds to the step is its time over padgraph+compile's. Its check:
                   every token lies in the eager model's nucleus (the share that does)
  padgraph+fused   the same weights through the fused per-layer kernels and fused tail
                   (`LlamaModel(fused=FusedDecodePolicy(pdl=False))`, steps of at most its max_rows;
                   larger steps run the model's own path), captured by padgraph; +pdl: with PDL
  padgraph+fused+greedy  the engine's greedy body on the fused kernels at their default policy
                   (`FusedDecodePolicy()`: PDL for the one-row kernels and the tail, what
                   `examples/eagle.py --fused` sets): the argmax in the lm_head kernel, no
                   logits written, where the other fused variants write the logits and take
                   the Step's temperature-scaled torch argmax of them (`GreedyStep`)
  padgraph+fused+split  padgraph+fused+pdl with the tensor-core layer's o and down projections in
                   K splits (`--fused-splits O,D`: FusedDecodePolicy.tc_o_splits / tc_down_splits)
  padgraph+fused+greedy+policy  padgraph+fused+greedy at the default policy with the fields of
                   `--fused-policy field=value,...` changed (a candidate default, against the
                   default in the same process)
  padgraph+fused+greedy+compile  padgraph+fused+greedy+policy with the model's layers compiled as
                   padgraph+compile's: steps past the policy's max_rows run inductor's code, as in
                   padgraph.llm's engine on a GPU with the fused kernels (`examples/eagle.py
                   --fused`); `--fused-policy max_rows=32` gives 33-64 rows to inductor
  <padgraph variant>+attn64  that variant captured with the decode attention's single-buffered
                   tile of heads wider than 64 (64 tokens: `attention_decode.decode_block_n` with
                   NARROW_HEAD_DIM 0), the tile the 1B's d 64 took before its 128: what the
                   tile changes in the step, in the same process
Per raw batch size: step time (CUDA events, median), host time per call (median), each greedy
variant's next tokens against the eager model's (computed at every size whatever --variants
lists; a differing row is a near tie where the eager top-2 gap is within 4 bf16 ulps of the top
logit, and the gap in ulps of any other is reported), and the floor: (weight bytes a step reads + KV
bytes read) / measured device-to-device copy bandwidth. A step reads every weight but the
embedding table, of which it reads one row per request (`step_weight_bytes`; results pages whose
floor counted the whole table, 0.53 GB of the 1B model's 3.00, say so: ~125 us more
floor at bs 1). For the ladder: capture seconds and pool bytes.
Writes bench_runner.{md,json,png} under $OUT (or results/local).

    python -m bench.bench_runner [--variants a,b] [--sizes 1,3,8] [--tiny]
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import copy
import json
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


import padgraph as pg  # noqa: E402
from bench.common import (CudagraphSkips, copy_bandwidth, env_info, gpu_span_us,  # noqa: E402
                          kernel_classes, kernel_lines, kernel_table, out_dir, plot_step_times,
                          split_ties, tie_margin, time_us)
from padgraph.llm.models.llama import LlamaConfig, LlamaModel  # noqa: E402
from padgraph.llm import Batch
from padgraph.llm.kv import KVCache  # noqa: E402
from padgraph.llm.sampling import PURPOSE_DECODE, sample, sampling_weights

SIZES = [1, 3, 8, 27, 64, 200]
MAX_BS, MAX_CTX = 256, 1024


def decode_program(hidden_dtype=torch.bfloat16) -> pg.Program:
    """8 inputs: the five of every decode step plus temperature, stop token and a done mask."""
    bs = pg.Axis("bs")
    return pg.Program(
        "llama_decode",
        inputs={
            "input_ids": pg.Input((bs,), torch.int64, pad=0),
            "positions": pg.Input((bs,), torch.int64, pad=0),
            "seq_lens": pg.Input((bs,), torch.int32, pad=1),
            "req_pool_indices": pg.Input((bs,), torch.int32, pad=0),
            "out_cache_loc": pg.Input((bs,), torch.int64, pad=0),
            "temperature": pg.Input((bs,), torch.float32, pad=1.0),
            "stop_token": pg.Input((bs,), torch.int64, pad=0),
            "done": pg.Input((bs,), torch.bool, pad=True),
        },
        outputs={"next_token": pg.Output((bs,), torch.int64), "finished": pg.Output((bs,), torch.bool)},
        buckets=pg.Buckets.default(MAX_BS),
    )


class Step:
    """The decode body: model forward, temperature-scaled greedy pick, stop handling."""

    def __init__(self, model: LlamaModel, kv: KVCache):
        self.model, self.kv = model, kv

    def __call__(self, input_ids, positions, seq_lens, req_pool_indices, out_cache_loc,
                 temperature, stop_token, done):
        batch = Batch(self.kv, self.kv.req_to_token, req_pool_indices, seq_lens, out_cache_loc)
        logits, _ = self.model.forward_decode(input_ids, positions, batch)
        nxt = torch.where(done, stop_token, self.pick(logits, temperature, positions))
        return nxt, done | (nxt == stop_token)

    def pick(self, logits, temperature, positions):
        """The next tokens [bs] from the logits: the temperature-scaled argmax."""
        return (logits / temperature[:, None]).argmax(-1)

    def body(self, x):
        nxt, fin = self(x.input_ids, x.positions, x.seq_lens, x.req_pool_indices, x.out_cache_loc,
                        x.temperature, x.stop_token, x.done)
        return {"next_token": nxt, "finished": fin}


class GreedyStep(Step):
    """The engine's greedy decode body (`padgraph.llm.bodies.decode_body`): the next tokens from
    the model's `forward_decode_greedy`, which with the fused kernels takes the argmax in the
    lm_head kernel and writes no [bs, V] logits. The temperature input is unused: argmax(l / T)
    is argmax(l) for T > 0 except where the division's rounding makes two logits equal, which
    the next-token check against the eager Step reports."""

    def __call__(self, input_ids, positions, seq_lens, req_pool_indices, out_cache_loc,
                 temperature, stop_token, done):
        batch = Batch(self.kv, self.kv.req_to_token, req_pool_indices, seq_lens, out_cache_loc)
        ids, _, _ = self.model.forward_decode_greedy(input_ids, positions, batch)
        nxt = torch.where(done, stop_token, ids)
        return nxt, done | (nxt == stop_token)


class SampledStep(Step):
    """The decode body with the sampler in place of the argmax: every row at `SAMPLING`'s
    settings on logits * factor, seeded per row, drawn at its position. The factor is in the
    temperature lanes (temperature / factor on the logits: the same distribution), not a
    multiply of the logits: a trained model's step would run no such kernel."""

    SAMPLING = dict(temperature=0.6, top_p=0.9)      # Llama 3's generation_config

    def __init__(self, model: LlamaModel, kv: KVCache, factor: float):
        super().__init__(model, kv)
        dev = kv.req_to_token.device
        self.temperature = self.SAMPLING["temperature"] / factor
        self.lanes = (torch.full((MAX_BS,), self.temperature, device=dev),
                      torch.zeros(MAX_BS, dtype=torch.int32, device=dev),
                      torch.full((MAX_BS,), self.SAMPLING["top_p"], device=dev),
                      torch.zeros(MAX_BS, device=dev), torch.arange(MAX_BS, device=dev) + 1)

    def pick(self, logits, temperature, positions):
        """The sampler at `SAMPLING`'s lanes (the program's temperature input is unused)."""
        n = logits.shape[0]
        return sample(logits, *(t[:n] for t in self.lanes), positions,
                      PURPOSE_DECODE)

    def nucleus(self, raw: dict) -> tuple[torch.Tensor, float]:
        """(kept [n, V] bool: the tokens the eager model's sampling distribution can draw, the
        mean entropy in nats of its tempered distribution before filtering)."""
        n = raw["input_ids"].shape[0]
        batch = Batch(self.kv, self.kv.req_to_token, raw["req_pool_indices"], raw["seq_lens"],
                      raw["out_cache_loc"])
        logits, _ = self.model.forward_decode(raw["input_ids"], raw["positions"], batch)
        x = logits.float()
        w, _ = sampling_weights(x, *(t[:n] for t in self.lanes[:4]))
        logp = torch.log_softmax(x / self.temperature, -1)
        return w > 0, float(-(logp.exp() * logp).sum(-1).mean())


class HandwrittenRunner:
    """What engines write by hand: a static buffer per input, copy_ + fill_ per buffer, bisect."""

    PADS = {"input_ids": 0, "positions": 0, "seq_lens": 1, "req_pool_indices": 0,
            "out_cache_loc": 0, "temperature": 1.0, "stop_token": 0, "done": True}

    def __init__(self, step: Step, program: pg.Program, device):
        self.step, self.buckets = step, list(program.buckets)
        self.bufs = {n: torch.zeros(MAX_BS, dtype=s.dtype, device=device) for n, s in program.inputs.items()}
        for n, v in self.PADS.items():
            self.bufs[n].fill_(v)
        self.graphs, self.outs = {}, {}
        self.pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            args = {n: t[:b] for n, t in self.bufs.items()}
            for _ in range(2):
                step(**args)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outs[b] = step(**args)
            self.graphs[b] = g
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def __call__(self, **raw):
        n = raw["input_ids"].shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        for name, t in raw.items():
            self.bufs[name][:n].copy_(t)
            if b != n:
                self.bufs[name][n:b].fill_(self.PADS[name])
        self.graphs[b].replay()
        nxt, fin = self.outs[b]
        return nxt[:n], fin[:n]


def make_batch(n: int, kv: KVCache, cfg, gen: torch.Generator, device) -> dict:
    """n requests with random context lengths; their KV rows and slots are laid out in kv."""
    ctx = torch.randint(256, MAX_CTX - 1, (n,), generator=gen)
    rows = torch.arange(1, n + 1)
    slots = torch.stack([1 + r * MAX_CTX + torch.arange(MAX_CTX) for r in range(n)])   # [n, MAX_CTX]
    kv.req_to_token[1:n + 1] = slots.to(device, torch.int32)
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (n,), generator=gen).to(device),
        "positions": (ctx - 1).to(device),
        "seq_lens": ctx.to(device, torch.int32),
        "req_pool_indices": rows.to(device, torch.int32),
        "out_cache_loc": slots[torch.arange(n), ctx - 1].to(device),
        "temperature": torch.full((n,), 0.7).to(device),
        "stop_token": torch.full((n,), 2, dtype=torch.int64).to(device),
        "done": torch.zeros(n, dtype=torch.bool).to(device),
    }


def time_calls(fn, raw: dict, iters: int) -> tuple[float, float]:
    """(median step µs by CUDA events, median host µs per call), after warm-up."""
    for _ in range(3):
        fn(**raw)
    torch.cuda.synchronize()
    steps, hosts = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        start.record()
        t0 = time.perf_counter()
        fn(**raw)
        hosts.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        steps.append(start.elapsed_time(end) * 1e3)
    return statistics.median(steps), statistics.median(hosts)


def next_tokens(out):
    return out["next_token"] if isinstance(out, dict) else out[0]


def canary_program(program: pg.Program, kv: KVCache) -> tuple[pg.Program, dict]:
    """`program` with the cache bound as state, its last slot and request row canary rows (no call
    of the benchmark uses them), and the state to bind."""
    state = {"kv": pg.State(sink=0, canary=kv.n_slots - 1), "req_to_token": pg.State(sink=0, canary=kv.n_req_rows - 1)}
    prog = pg.Program(program.name, inputs=program.inputs, outputs=program.outputs, state=state,
                      buckets=program.buckets)
    return prog, {"kv": kv.k + kv.v, "req_to_token": kv.req_to_token}


def parse_policy(text: str) -> dict:
    """`--fused-policy` "field=value,..." -> FusedDecodePolicy fields (ints; true / false)."""
    from padgraph.backends.triton.fused_decode import FusedDecodePolicy
    known = FusedDecodePolicy.__dataclass_fields__
    fields = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in known or not value:
            raise SystemExit(f"--fused-policy {item!r}: expected field=value, field one of "
                             + ", ".join(known))
        fields[name] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    return fields


ATTN64 = "+attn64"


@contextlib.contextmanager
def wide_head_attention_tiles():
    """The decode attention launches taken inside: the tiles of heads wider than 64, whatever
    the head dim (what `attention_decode.decode_block_n` gave d 64 before its narrow tiles)."""
    from padgraph.backends.triton import attention_decode
    narrow = attention_decode.NARROW_HEAD_DIM
    attention_decode.NARROW_HEAD_DIM = 0
    try:
        yield
    finally:
        attention_decode.NARROW_HEAD_DIM = narrow


def build_variants(names, step, program, device, pg_compile=True, sample_factor=20.0,
                   fused_splits=(2, 4), fused_policy=None):
    variants, setup = {}, {}
    for name in names:
        if name.endswith(ATTN64):       # graphs captured with the old tiles: baked into them
            base = name[:-len(ATTN64)]
            if not base.startswith("padgraph"):
                raise SystemExit(f"{name}: {ATTN64} takes a padgraph variant (captured graphs)")
            with wide_head_attention_tiles():
                v, s = build_variants([base], step, program, device, pg_compile, sample_factor,
                                      fused_splits, fused_policy)
            if base in v:
                variants[name] = v[base]
                setup[name] = {**s.get(base, {}), "attention_tiles": "heads wider than 64's"}
    if "eager" in names:
        variants["eager"] = lambda **r: step(**r)
    if "handwritten" in names:
        hw = HandwrittenRunner(step, program, device)
        variants["handwritten"] = hw
        setup["handwritten"] = {"capture_seconds": hw.capture_seconds}
    if "padgraph" in names:
        t0 = time.perf_counter()
        r = pg.compile(program, step.body, backend="cuda", progress=False)
        setup["padgraph"] = {"capture_seconds": time.perf_counter() - t0, "pool_bytes": r.pool_bytes()}
        variants["padgraph"] = r
    if "padgraph+canary" in names:
        prog, state = canary_program(program, step.kv)
        r = pg.compile(prog, step.body, backend="cuda", progress=False, state=state, restore_state=False)
        setup["padgraph+canary"] = {"canary_rows": len(r._canary)}
        variants["padgraph+canary"] = r
    for every in (1000, 1):          # shadow verification: the unsampled path, and every call sampled
        name = f"padgraph+shadow{every}"
        if name in names:
            variants[name] = pg.compile(program, step.body, backend="cuda", progress=False,
                                        shadow=pg.Shadow(every=every, first=1))
            setup[name] = {"shadow_every": every}
    if "padgraph+compile" in names:
        t0 = time.perf_counter()
        r = pg.compile(program, step.body, backend="cuda", progress=False, torch_compile=pg_compile)
        setup["padgraph+compile"] = {"warmup_seconds": time.perf_counter() - t0, "pool_bytes": r.pool_bytes(),
                                     "compiles": r.stats.compiles, "recompiles": r.stats.recompiles,
                                     "compile_seconds": r.stats.compile_seconds}
        variants["padgraph+compile"] = r
    if "padgraph+compile+sample" in names:
        sstep = SampledStep(step.model, step.kv, sample_factor)
        t0 = time.perf_counter()
        r = pg.compile(program, sstep.body, backend="cuda", progress=False, torch_compile=pg_compile)
        setup["padgraph+compile+sample"] = {"warmup_seconds": time.perf_counter() - t0,
                                            "sampling": SampledStep.SAMPLING,
                                            "logit_factor": sample_factor}
        r.nucleus = sstep.nucleus
        variants["padgraph+compile+sample"] = r
    def compiled_with(name, patches):
        """padgraph+compile's step with inductor config `patches` added: the variant `name`."""
        opts = dict(pg_compile) if isinstance(pg_compile, dict) else {}
        opts["options"] = {**opts.get("options", {}), **patches}
        t0 = time.perf_counter()
        r = pg.compile(program, step.body, backend="cuda", progress=False, torch_compile=opts)
        setup[name] = {"warmup_seconds": time.perf_counter() - t0, "pool_bytes": r.pool_bytes(),
                       "compiles": r.stats.compiles}
        variants[name] = r
    if "padgraph+compile+pdl" in names:
        # inductor's own kernels launched with programmatic dependent launch (torch's
        # triton.enable_pdl: each kernel waits on the previous one's writes inside the graph)
        if not hasattr(torch._inductor.config.triton, "enable_pdl"):
            print("padgraph+compile+pdl: skipped: this torch's inductor has no triton.enable_pdl")
        else:
            compiled_with("padgraph+compile+pdl", {"triton.enable_pdl": True})
    if "padgraph+compile+unfused" in names:
        # the residual adds out of inductor's addmm calls, and ATen's copy of the residual into
        # each GEMM's output with them (backends/cuda/passes.py); inductor's FX graph cache off,
        # so the count is this run's rewrites, not 0 after a cache hit
        from padgraph.backends.cuda.passes import UnfuseAddmm
        unfuse = UnfuseAddmm()
        compiled_with("padgraph+compile+unfused",
                      {"post_grad_custom_post_pass": unfuse, "fx_graph_cache": False})
        setup["padgraph+compile+unfused"]["addmm_rewritten"] = unfuse.rewritten
    from padgraph.backends.triton.fused_decode import FusedDecodePolicy
    o_splits, down_splits = fused_splits
    candidate = FusedDecodePolicy(**(fused_policy or {}))
    for name, policy, body, compiled in (
            ("padgraph+fused", FusedDecodePolicy(pdl=False), Step, False),
            ("padgraph+fused+pdl", FusedDecodePolicy(pdl=True), Step, False),
            ("padgraph+fused+split", FusedDecodePolicy(
                pdl=True, tc_o_splits=o_splits, tc_down_splits=down_splits), Step, False),
            ("padgraph+fused+greedy", FusedDecodePolicy(), GreedyStep, False),
            ("padgraph+fused+greedy+policy", candidate, GreedyStep, False),
            ("padgraph+fused+greedy+compile", candidate, GreedyStep, True)):
        if name in names:
            # the same weights through the fused per-layer kernels and fused tail (bs <= their
            # max_rows; larger steps run the model's own path, its layers compiled as
            # padgraph+compile's where `compiled`), captured by the same runner
            fused = copy.copy(step.model)
            fused.fused = policy
            fstep = body(fused, step.kv)
            t0 = time.perf_counter()
            r = pg.compile(program, fstep.body, backend="cuda", progress=False,
                           torch_compile=pg_compile if compiled else None)
            setup[name] = {"capture_seconds": time.perf_counter() - t0, "pool_bytes": r.pool_bytes(),
                           "max_rows": fused.fused.max_rows, "pdl": policy.pdl,
                           "body": body.__name__}
            if policy is candidate:
                setup[name]["policy"] = dict(fused_policy or {})
            if compiled:
                setup[name].update(compiles=r.stats.compiles,
                                   compile_seconds=r.stats.compile_seconds)
            variants[name] = r
    if "compile-ro" in names:
        variants["compile-ro"] = torch.compile(step, mode="reduce-overhead")
        setup["compile-ro"] = {"warmup_seconds": 0.0, "cudagraph_skips": 0, "skip_reasons": []}
    return variants, setup


def build_step(tiny: bool, device) -> tuple:
    """(cfg, model, kv, step): the bf16 Llama-1B-shaped model (tiny: `LlamaConfig.tiny`), seed 0,
    and its cache filled with random values (never time on zeros): slot 0 / row 0 sinks, then the
    requests' slots and rows, then one spare (padgraph+canary's)."""
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny() if tiny else LlamaConfig.llama_1b()
    model = LlamaModel(cfg).to(device, torch.bfloat16).eval()
    kv = KVCache(cfg.n_layers, MAX_BS * MAX_CTX + 2, cfg.n_kv_heads, cfg.head_dim, MAX_CTX, MAX_BS + 2,
                 torch.bfloat16, device)
    for t in kv.k + kv.v:
        t.normal_()
    return cfg, model, kv, Step(model, kv)


def static_addresses(kv: KVCache) -> None:
    """Tell dynamo the cache tensors never move, as HF's StaticCache does for its layers.

    reduce-overhead's cudagraphs copy every non-static input into the graph's own buffer before a
    replay and refuse graphs that mutate one ("skipping cudagraphs due to mutated inputs"); a KV
    pool written in place each step must therefore be a static address (or a module buffer).
    """
    for t in kv.k + kv.v + [kv.req_to_token]:
        torch._dynamo.mark_static_address(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="eager,handwritten,padgraph,padgraph+compile,compile-ro")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--pg-compile", default="regions", choices=["regions", "whole"],
                    help="padgraph+compile: compile the decoder layer (regions) or the whole body")
    ap.add_argument("--profile", default=None, metavar="VARIANT",
                    help="after the timed runs, --iters more calls of VARIANT at each size under "
                         "torch.profiler: its kernels per step, written to bench_runner_profile.json")
    ap.add_argument("--sample-factor", type=float, default=20.0,
                    help="padgraph+compile+sample: the factor on the logits before sampling")
    ap.add_argument("--fused-splits", default="2,4", metavar="O,D",
                    help="padgraph+fused+split: K splits of the o and the down projection")
    ap.add_argument("--fused-policy", default="", metavar="FIELD=V,..",
                    help="padgraph+fused+greedy+policy: FusedDecodePolicy fields changed from the "
                         "default, e.g. tc_qkv_splits=2,half_n=4")
    ap.add_argument("--size-oblivious", action="store_true",
                    help="padgraph+compile: size-oblivious tracing, so bucket 1 shares the graph")
    args = ap.parse_args()
    names, sizes = args.variants.split(","), [int(s) for s in args.sizes.split(",")]
    if args.profile is not None and args.profile not in names:
        ap.error(f"--profile {args.profile!r} must be one of --variants {names}")
    device = torch.device("cuda")
    cfg, model, kv, step = build_step(args.tiny, device)
    static_addresses(kv)                                # as torch.compile users set a cache up
    program = decode_program()
    bw = copy_bandwidth(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())   # all, stored
    step_bytes = lambda n: step_weight_bytes(model, n)   # noqa: E731  (what a step of n reads)
    gen = torch.Generator().manual_seed(0)
    batches = {n: make_batch(n, kv, cfg, gen, device) for n in sizes}
    with torch.inference_mode():
        pg_compile = {"regions": model.layers, "fullgraph": True} if args.pg_compile == "regions" \
            else {"fullgraph": True}
        if args.size_oblivious:
            pg_compile["size_oblivious"] = True
        variants, setup = build_variants(names, step, program, device, pg_compile,
                                         args.sample_factor,
                                         tuple(int(x) for x in args.fused_splits.split(",")),
                                         parse_policy(args.fused_policy))
        rows = run_all(variants, setup, batches, sizes, args.iters, StepFloor(cfg, step_bytes, bw),
                       lambda rows, done: report(rows, setup, names, done, bw, weight_bytes, cfg, args),
                       lambda raw: eager_reference(step, raw))
        if "padgraph+canary" in variants:
            variants["padgraph+canary"].canary_check()      # raises if any replay wrote a canary row
            print("padgraph+canary: no canary row written")
        if args.profile and args.profile not in variants:
            print(f"--profile {args.profile}: skipped: the variant did not run (see above)")
        elif args.profile:
            profile_steps(variants[args.profile], args.profile, batches, sizes, args.iters, rows)


def profile_steps(fn, name: str, batches, sizes, iters: int, rows) -> None:
    """`iters` calls of one variant per size under torch.profiler: kernels and kernel-µs per step
    beside its measured step time and floor (where the time over the floor goes)."""
    from torch.profiler import ProfilerActivity, profile
    out = {"variant": name, "sizes": {}}
    for n in sizes:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn(**batches[n])
            torch.cuda.synchronize()
        events = prof.events()
        table = kernel_table(events, iters, top=24)
        row = next(r for r in rows if r["bs"] == n and r["variant"] == name)
        table.update(step_us=row["step_us"], b2b_us=row["b2b_us"], floor_us=row["floor_us"],
                     gpu_span_us=gpu_span_us(events, iters), classes=kernel_classes(events, iters))
        out["sizes"][n] = table
        print("\n".join(kernel_lines(table, f"{name} bs={n}", f"step (step {row['step_us']:.0f} "
                                                             f"µs, floor {row['floor_us']:.0f} µs)")))
        print(f"  GPU span {table['gpu_span_us']:.0f} µs a step (first kernel start to last kernel end, "
              f"over {iters} steps); kernels by class:")
        for c in table["classes"]:
            print(f"  {c['class']:<12} {c['kernels']:6.1f} kernels {c['us']:8.1f} µs")
    (out_dir() / "bench_runner_profile.json").write_text(json.dumps(out, indent=1))


def step_weight_bytes(model, n: int) -> int:
    """Weight bytes one decode step of n requests must read: every parameter but the embedding
    table, of which it reads n rows (a table shared with the lm_head is read whole)."""
    table = model.embed.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if table is model.lm_head.weight:
        return total
    return total - table.numel() * table.element_size() + n * table.stride(0) * table.element_size()


@dataclass(frozen=True)
class StepFloor:
    """A decode step's floor: the weight bytes it reads + the KV bytes it reads, over the copy
    bandwidth bw (bytes/s). weight_bytes(n): the weight bytes a step of n requests reads."""
    cfg: LlamaConfig
    weight_bytes: Callable[[int], int]
    bw: float

    def us(self, n: int, raw: dict) -> float:
        """The floor in µs of a step of the n requests of batch raw."""
        cfg = self.cfg
        kv_bytes = int(raw["seq_lens"].sum()) * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
        return (self.weight_bytes(n) + kv_bytes) / self.bw * 1e6


def eager_reference(step: Step, raw: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager model's next tokens for batch `raw` (the Step's pick on `forward_decode`'s
    logits, done rows their stop token), each row's top-2 gap of the logits it picked from, and
    the gap under which a row is a near tie (`tie_margin`: 4 ulps of the top logit in the
    model's dtype, the lm_head's output before its fp32 upcast)."""
    batch = Batch(step.kv, step.kv.req_to_token, raw["req_pool_indices"], raw["seq_lens"],
                  raw["out_cache_loc"])
    logits, _ = step.model.forward_decode(raw["input_ids"], raw["positions"], batch)
    toks = torch.where(raw["done"], raw["stop_token"],
                       step.pick(logits, raw["temperature"], raw["positions"]))
    gap, tol = tie_margin(logits / raw["temperature"][:, None], step.model.embed.weight.dtype)
    return toks, gap, tol


def judge_tokens(got, ref, gap, tol) -> dict:
    """A variant's greedy tokens against the eager model's: the share equal, the differing rows
    at a near tie of the eager logits (gap <= tol), and the gap in ulps of each other one."""
    differ = got != ref
    near, far = split_ties(differ, gap, tol)
    return {"token_match_vs_eager": float((~differ).float().mean()), "near_ties": near,
            "far_gaps_ulps": far}


def run_all(variants, setup, batches, sizes, iters, floor: StepFloor, after_size, reference):
    """Every variant at every size, its tokens judged against `reference(raw)` (the eager
    model's: `eager_reference`); the results are written after each size (a timeout keeps
    them)."""
    rows = []
    for i, n in enumerate(sizes):
        raw = batches[n]
        ref, gap, tol = (t.clone() for t in reference(raw))
        floor_us = floor.us(n, raw)
        for name, fn in variants.items():
            if name == "compile-ro":
                got = warm_compile_ro(fn, raw, setup["compile-ro"], n)
            else:
                got = next_tokens(fn(**raw))
            if hasattr(fn, "nucleus"):          # a sampled variant: its tokens in the nucleus
                kept, entropy = fn.nucleus(raw)
                judged = {"token_match_vs_eager":
                          float(kept[torch.arange(n, device=got.device), got].float().mean())}
                setup[name].setdefault("entropy_nats", {})[n] = entropy
            else:
                judged = judge_tokens(got, ref, gap, tol)
            step_us, host_us = time_calls(fn, raw, iters)
            b2b_us = time_us(lambda: fn(**raw), 5, back_to_back=iters)   # median of 5 chains of iters calls
            rows.append({"bs": n, "variant": name, "step_us": step_us, "b2b_us": b2b_us, "host_us": host_us,
                         "floor_us": floor_us, **judged})
            print(f"bs={n:>3} {name:<17} step {step_us:9.1f} µs  b2b {b2b_us:9.1f} µs  host {host_us:8.1f} µs  "
                  f"floor {floor_us:8.1f} µs  {token_words(judged)}", flush=True)
        after_size(rows, sizes[:i + 1])
    return rows


def token_summary(rows) -> str:
    """The greedy variants' tokens against the eager model's, one line for the report."""
    differ = [f"{r['variant']} bs {r['bs']} {token_words(r)}" for r in rows
              if "near_ties" in r and r["token_match_vs_eager"] < 1]
    if not differ:
        return "Greedy tokens equal the eager model's in every row of every greedy variant."
    return ("Greedy tokens against the eager model's (a near tie: the eager top-2 gap within 4 "
            "ulps of the top logit in the model's dtype): " + "; ".join(differ) + ".")


def token_words(row: dict) -> str:
    """A row's tokens against the eager model's, in words."""
    words = f"match {row['token_match_vs_eager']:.3f}"
    if row.get("near_ties") or row.get("far_gaps_ulps"):
        words += (f" ({row['near_ties']} differing rows at a near tie; top-2 gaps of the others: "
                  f"{row['far_gaps_ulps']} ulps)")
    return words


def warm_compile_ro(fn, raw: dict, setup: dict, n: int) -> torch.Tensor:
    """First three calls at this size (compile, warm-up, cudagraph record): timed, skips recorded."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with CudagraphSkips() as skips:
        for _ in range(3):
            got = next_tokens(fn(**raw)).clone()
        torch.cuda.synchronize()
    setup["warmup_seconds"] += time.perf_counter() - t0
    setup["cudagraph_skips"] += skips.count
    setup["skip_reasons"] += [r for r in skips.reasons if r not in setup["skip_reasons"]]
    print(f"bs={n:>3} compile-ro: {skips.summary()}", flush=True)
    return got


def report(rows, setup, names, sizes, bw, weight_bytes, cfg, args):
    out = out_dir()
    info = env_info()
    data = {"env": info, "copy_bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes,
            "floor": "weight bytes a step reads (all but the embedding table, one row of it per "
                     "request) + KV bytes read, over the copy bandwidth",
            "config": cfg.__dict__, "setup": setup, "rows": rows}
    (out / "bench_runner.json").write_text(json.dumps(data, indent=1, default=str))
    by = {(r["bs"], r["variant"]): r for r in rows}
    ratio_col = "padgraph" in names and "handwritten" in names     # the runner against a hand-written one
    lines = [f"# bench_runner — {info['date']}, {info['gpu']}, torch {info['torch']}, triton {info['triton']}",
             f"command: `{info['command']}`; copy bandwidth {bw / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB "
             "stored; floor: the weight bytes a step reads (all but the embedding table, one row "
             "of it per request) + KV bytes read, over the copy bandwidth", "",
             "step time µs per call (median, CUDA events around one call) / back to back (µs a call, "
             f"{args.iters} calls queued between two events, median of 5) / host µs per call (median)", "",
             "| bs | floor | " + " | ".join(names) + (" | padgraph/handwritten |" if ratio_col else " |"),
             "|---|---|" + "---|" * (len(names) + ratio_col)]
    for n in sizes:
        cells = [f"{by[(n, v)]['step_us']:.0f} / {by[(n, v)]['b2b_us']:.0f} / {by[(n, v)]['host_us']:.0f}"
                 if (n, v) in by else "-" for v in names]
        if ratio_col:
            cells.append(f"{by[(n, 'padgraph')]['step_us'] / by[(n, 'handwritten')]['step_us']:.3f}"
                         if (n, "padgraph") in by and (n, "handwritten") in by else "-")
        floor_us = next(r["floor_us"] for r in rows if r["bs"] == n)     # a size's floor, whichever variant ran
        lines.append(f"| {n} | {floor_us:.0f} | " + " | ".join(cells) + " |")
    lines += ["", token_summary(rows)]
    lines += warmup_lines(setup, sizes)
    lines += sampling_lines(by, setup, sizes)
    lines += ["", "setup (capture / warm-up seconds, pool bytes):", "", "```", json.dumps(setup, indent=1), "```"]
    (out / "bench_runner.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_step_times(rows, names, out / "bench_runner.png", "Llama-3.2-1B-shaped decode step", "step time (ms)",
                    floor_key="floor_us")


def sampling_lines(by: dict, setup: dict, sizes) -> list[str]:
    """What the sampler adds to the compiled step (padgraph+compile+sample over padgraph+compile,
    back to back), with the sampled tokens' nucleus check and the logits' entropy."""
    name = "padgraph+compile+sample"
    if name not in setup or "padgraph+compile" not in setup:
        return []
    st = setup[name]
    t, f = st['sampling']['temperature'], st['logit_factor']
    out = ["", f"sampling ({name}: temperature {t}, top-p {st['sampling']['top_p']} on the "
               f"logits times {f}, run as temperature {t} / {f} = {t / f:.4g} on the logits) "
               "against the argmax (padgraph+compile), back to back:", ""]
    for n in sizes:
        g, smp = by.get((n, "padgraph+compile")), by.get((n, name))
        if g and smp:
            out.append(f"- bs {n}: {smp['b2b_us']:.0f} against {g['b2b_us']:.0f} µs, "
                       f"{100 * (smp['b2b_us'] / g['b2b_us'] - 1):+.1f} %; tokens in the eager "
                       f"model's nucleus {smp['token_match_vs_eager']:.3f}; entropy at the "
                       f"temperature {st.get('entropy_nats', {}).get(n, float('nan')):.2f} nats")
    return out


def warmup_lines(setup: dict, sizes) -> list[str]:
    """padgraph+compile's warm-up for its whole ladder against compile-ro's for the measured sizes."""
    if "padgraph+compile" not in setup or "compile-ro" not in setup:
        return []
    pgc, ro = setup["padgraph+compile"], setup["compile-ro"]
    skips = (f"compile-ro skipped cudagraphs {ro['cudagraph_skips']} time(s): {ro['skip_reasons']}"
             if ro["cudagraph_skips"] else "compile-ro captured its cudagraphs (no skip logged)")
    return ["", f"warm-up: padgraph+compile {pgc['warmup_seconds']:.1f} s for the whole ladder "
            f"({pgc['compiles']} graphs compiled, {pgc['recompiles']} recompiles, "
            f"{pgc['compile_seconds']:.1f} s in the calls that compiled; the rest is warm-up "
            f"runs and capture) vs compile-ro "
            f"{ro['warmup_seconds']:.1f} s for sizes {list(sizes)}: ratio "
            f"{pgc['warmup_seconds'] / max(ro['warmup_seconds'], 1e-9):.2f}", "", skips]




if __name__ == "__main__":
    main()
