"""The fused decode step (`backends/triton/fused_decode.py` layers, `fused_tail.py` norm +
lm_head + argmax) against the current decode step, Llama-1B shape, random weights, under CUDA
graphs: a greedy step, tokens in, next tokens and top-2 gaps out (the decode program's outputs).

    python -m bench.bench_fused_decode [--sizes 1,4,16] [--iters 50] [--check]
    python -m bench.bench_fused_decode --smoke --check   # CPU, tiny model, interpreted, untimed

Variants, each captured in its own CUDA graph per batch size:
  current    `LlamaModel.forward_decode` (cuBLAS GEMVs, the Triton KV store and attention),
             then the argmax and top-2 of its fp32 logits
  fused      the fused layers (one-row kernels at 1 row, tensor-core ones from 2 rows: the
             default policy) and the fused greedy tail; plain launches
  fused+...  options: +pdl (programmatic dependent launch, where the GPU and Triton have it),
             +logits (the sampling path's step: the tail writes fp32 logits, the argmax is
             torch's), +rows (the one-row kernels at every row count), +tc (the tensor-core ones
             at every row count, 1 included), +reduce (a reduce kernel sums the one-row down
             partials), and `FusedDecodePolicy` fields: +splitsN, +warpsN, +bnN, +halfN (one-row
             kernels), +tcbnN, +tchalfN, +tcffnN, +tckN, +tcprojkN, +tcstagesN, +tcwarpsN,
             +tailvN, +tcqkvsN, +tcosN, +tcdsN (tensor-core kernels and the tail;
             +nofold: their K splits summed by a second kernel), +apdl (the attention
             launches with PDL too, with +pdl)
The fused path takes bs <= the default policy's max_rows (64); at a larger bs its rows say so
and time nothing (a model hook falls back to the current path there).

Per variant and size: the step (median of single replays, and back-to-back replays), one layer
alone (back-to-back replays of a one-layer graph), each against its weight-streaming floor
(bytes read / device copy bandwidth), kernels per step (profiled replays), and the check against
the current path: hidden relative error, greedy tokens equal (a differing token is reported
with the current path's top-2 logit gap), the K/V written, and whether two replays give the
same bits. --check: exit 1 if a fused variant's token differs where that gap is over 0.05, or
two replays differ. Writes fused_decode.md and fused_decode.json to $OUT (results/local/
elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import copy_bandwidth, env_info, kernel_table, out_dir, time_us  # noqa: E402
from padgraph.backends.triton import fused_decode as fd  # noqa: E402
from padgraph.backends.triton import fused_tail  # noqa: E402
from padgraph.llm import Batch  # noqa: E402
from padgraph.llm.kv import FIRST, KVCache  # noqa: E402
from padgraph.llm.models.llama import LlamaConfig, LlamaModel, decode_batch  # noqa: E402

MAX_CTX = 1024          # the cache width; contexts are random in [256, MAX_CTX - 1)
SMOKE_CTX = 48


def make_batch(n: int, kv: KVCache, cfg, gen: torch.Generator, device) -> dict:
    """n requests with random context lengths in [256, kv.max_context - 1) (the runner
    benchmark's), each in a row of its own."""
    width = kv.max_context
    ctx = torch.randint(min(256, width - 2), width - 1, (n,), generator=gen)
    slots = FIRST + torch.arange(n)[:, None] * width + torch.arange(width)[None]
    kv.req_to_token[FIRST:FIRST + n] = slots.to(device, torch.int32)
    return {"input_ids": torch.randint(1, cfg.vocab_size, (n,), generator=gen).to(device),
            "positions": (ctx - 1).to(device),
            "seq_lens": ctx.to(device, torch.int32),
            "req_pool_indices": torch.arange(FIRST, FIRST + n, dtype=torch.int32).to(device),
            "out_cache_loc": slots[torch.arange(n), ctx - 1].to(device)}


def batch_of(kv, raw) -> Batch:
    return Batch(kv, kv.req_to_token, raw["req_pool_indices"], raw["seq_lens"], raw["out_cache_loc"])


OPTIONS = {"splits": "down_splits", "warps": "num_warps", "bn": "block_n", "half": "half_n",
           "tcbn": "tc_block_n", "tchalf": "tc_half_n", "tcffn": "tc_ffn_n", "tck": "tc_block_k",
           "tcprojk": "tc_proj_block_k", "tcstages": "tc_stages", "tcwarps": "tc_warps",
           "tailv": "tail_block_v", "tcqkvs": "tc_qkv_splits", "tcos": "tc_o_splits",
           "tcds": "tc_down_splits"}
FLAGS = {"pdl": {"pdl": True, "tc_pdl": True}, "reduce": {"fold_max_m": 0}, "rows": {"tc_min_rows": fd.MAX_M + 1},
         "tc": {"tc_min_rows": 1}, "logits": {}, "nofold": {"tc_fold": False},
         "apdl": {"attn_pdl": True}}
NEAR_TIE = 0.05         # a differing token with the current path's top-2 gap under it is a tie


def policy_of(variant: str) -> fd.FusedDecodePolicy:
    """"fused" plus options (the module docstring's list): a `FusedDecodePolicy`, PDL off
    unless "+pdl" (the projections and the tail) or "+apdl" (the attention)."""
    fields, opts = {}, variant.split("+")
    for opt in opts[1:]:
        name = opt.rstrip("0123456789")
        if opt in FLAGS:
            fields.update(FLAGS[opt])
        elif name in OPTIONS and opt[len(name):]:
            fields[OPTIONS[name]] = int(opt[len(name):])
        else:
            raise SystemExit(f"variant {variant!r}: option {opt!r} is not one of "
                             + ", ".join(f"+{f}" for f in FLAGS) + ", "
                             + ", ".join(f"+{o}N" for o in OPTIONS))
    if opts[0] != "fused":
        raise SystemExit(f"variant {variant!r}: 'current' or 'fused' with options")
    return fd.FusedDecodePolicy(**{"pdl": False, "attn_pdl": False, **fields})


def step_fn(model, kv, raw, variant: str, impl: str = "auto"):
    """The greedy step of `variant` on the static inputs raw: () -> {"ids" [n], "gap" [n],
    "hidden" [n, H], and "logits" [n, V] where the variant writes them}."""
    def current():
        logits, hidden = model.forward_decode(raw["input_ids"], raw["positions"], batch_of(kv, raw))
        ids, gap = fused_tail.greedy_reference(logits)
        return {"ids": ids, "gap": gap, "hidden": hidden, "logits": logits}
    if variant == "current":
        return current
    policy, logits = policy_of(variant), "logits" in variant.split("+")

    def fused():
        b = batch_of(kv, raw)
        out = fused_tail.decode_step(model, raw["input_ids"], raw["positions"], b.out_cache_loc,
                                     kv, decode_batch(b).attend, logits=logits, policy=policy,
                                     impl=impl)
        if logits:
            ids, gap = fused_tail.greedy_reference(out.logits)
            return {"ids": ids, "gap": gap, "hidden": out.hidden, "logits": out.logits}
        return {"ids": out.ids, "gap": out.gap, "hidden": out.hidden}
    return fused


def layer_fn(model, kv, raw, variant: str, impl: str = "auto"):
    """Layer 0 alone on a fixed input (the one-row fused layer with the partials of a previous
    layer, the tensor-core one with its input's sums of squares)."""
    n, cfg = raw["input_ids"].shape[0], model.cfg
    x = model.embed(raw["input_ids"])
    plan = decode_batch(batch_of(kv, raw))
    layer = model.layers[0]
    if variant == "current":
        return lambda: layer(x, raw["positions"], model.rope, plan, kv.k[0], kv.v[0])
    policy = policy_of(variant)
    w, rope = fd.layer_weights(model)[0], fd.RopeTables(model.rope.cos, model.rope.sin)
    if n >= policy.tc_min_rows:
        ssq = fd.ssq_partials_reference(x, policy.tc_block_n)
        return lambda: fd.decode_layer_tc(x, ssq, w, rope, raw["positions"], raw["out_cache_loc"],
                                          kv.k[0], kv.v[0], plan.attend, policy=policy, impl=impl)
    parts = torch.zeros(policy.down_splits, n, cfg.hidden_size, device=x.device)
    return lambda: fd.decode_layer(x, parts, w, rope, raw["positions"], raw["out_cache_loc"],
                                   kv.k[0], kv.v[0], plan.attend, policy=policy, impl=impl)


def graph_of(fn):
    """(replay, outputs): fn captured after a warm-up on a side stream (CPU: fn and one call)."""
    if not torch.cuda.is_available():
        return fn, fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph.replay, out


def kernels_per_step(replay, calls: int = 5) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            replay()
        torch.cuda.synchronize()
    return kernel_table(prof.events(), calls)["kernels"]


def layer_bytes(model, n_ctx_tokens: int) -> int:
    """Bytes one layer must read: its weights and the KV of the batch's context."""
    cfg, layer = model.cfg, model.layers[0]
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    return weights + n_ctx_tokens * 2 * cfg.n_kv_heads * cfg.head_dim * 2


def step_bytes(model, n: int, n_ctx_tokens: int) -> int:
    """Bytes a step must read: every layer, the final norm, the lm_head, n embedding rows."""
    emb = model.embed.weight
    rest = sum(p.numel() * p.element_size() for p in (model.norm.weight, model.lm_head.weight))
    rows = n * emb.stride(0) * emb.element_size()
    return model.cfg.n_layers * layer_bytes(model, n_ctx_tokens) + rest + rows


def written_kv(kv, loc) -> torch.Tensor:
    """[n_layers, 2, n, Hkv, D] the K/V at slots loc of every layer."""
    return torch.stack([torch.stack([k[loc], v[loc]]) for k, v in zip(kv.k, kv.v)]).float()


def compare(ref: dict, got: dict) -> dict:
    """The fused step's outputs against the current one's on the same inputs and cache."""
    differ = ref["ids"] != got["ids"]
    gaps = ref["gap"][differ]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()   # noqa: E731
    return {"hidden_rel_err": rel(got["hidden"].float(), ref["hidden"].float()),
            "kv_rel_err": rel(got["kv"], ref["kv"]),
            "gap_max_abs_err": (got["gap"] - ref["gap"]).abs().max().item(),
            "tokens_equal": int((~differ).sum()), "tokens": int(differ.numel()),
            "differing_token_top2_gaps": [round(g, 5) for g in gaps.tolist()]}


def run_step(model, kv, raw, variant: str, impl: str) -> tuple:
    """(replay, the step's outputs and "kv" written after one replay, bit_stable)."""
    replay, out = graph_of(step_fn(model, kv, raw, variant, impl))
    replay()
    first = {k: t.clone() for k, t in out.items()}
    first["kv"] = written_kv(kv, raw["out_cache_loc"])
    replay()
    stable = all(torch.equal(first[k], t) for k, t in out.items())
    return replay, first, stable


def failures(rows: list[dict]) -> list[str]:
    """What --check refuses: a fused token that differs where the current path's top-2 gap is
    over NEAR_TIE, or a step whose two replays differ."""
    bad = []
    for r in rows:
        if "note" in r:
            continue
        far = [g for g in r.get("differing_token_top2_gaps", []) if g > NEAR_TIE]
        if far:
            bad.append(f"bs {r['bs']} {r['variant']}: tokens differ at top-2 gaps {far}")
        if not r["bit_stable"]:
            bad.append(f"bs {r['bs']} {r['variant']}: two replays differ")
    return bad


def measure_size(model, kv, raw, variants, iters: int, bw: float, impl: str) -> list[dict]:
    """Every variant at one batch size; impl: the fused kernels' ("triton" runs them
    interpreted on the CPU)."""
    n = raw["input_ids"].shape[0]
    ctx_tokens = int(raw["seq_lens"].sum())
    floor_step = step_bytes(model, n, ctx_tokens) / bw * 1e6
    floor_layer = layer_bytes(model, ctx_tokens) / bw * 1e6
    rows, ref = [], None
    for variant in variants:
        row = {"bs": n, "variant": variant, "floor_us": floor_step, "layer_floor_us": floor_layer}
        if variant != "current" and not fd.takes(model, raw["input_ids"], kv):
            rows.append({**row, "note": f"bs {n} > {fd.MAX_M}: not taken (the current path runs)"})
            continue
        with torch.no_grad():
            replay, outs, stable = run_step(model, kv, raw, variant, impl)
            layer_replay, _ = graph_of(layer_fn(model, kv, raw, variant, impl))
        ref = outs if variant == "current" else ref
        step_us, chain_us = time_us(replay, iters), time_us(replay, max(iters // 5, 3), 10)
        layer_us = time_us(layer_replay, iters, 10)
        row.update(step_us=step_us, step_b2b_us=chain_us, x_floor=chain_us / floor_step,
                   layer_us=layer_us, layer_x_floor=layer_us / floor_layer,
                   kernels_per_step=kernels_per_step(replay), bit_stable=stable)
        if variant != "current":
            row.update(compare(ref, outs))
        rows.append(row)
        del replay, layer_replay
    return rows


def table_lines(rows: list[dict]) -> list[str]:
    head = ("| bs | variant | step µs | b2b µs | x floor | layer µs | layer x floor | kernels/step "
            "| tokens equal | hidden rel err | KV rel err | same bits |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['bs']} | {r['variant']} | {r['note']} |")
            continue
        match = f"{r['tokens_equal']}/{r['tokens']}" if "tokens" in r else "ref"
        err = lambda k: f"{r[k]:.1e}" if k in r else "-"   # noqa: E731
        lines.append(f"| {r['bs']} | {r['variant']} | {r['step_us']:.1f} | {r['step_b2b_us']:.1f} "
                     f"| {r['x_floor']:.2f} | {r['layer_us']:.1f} | {r['layer_x_floor']:.2f} "
                     f"| {r['kernels_per_step']:.0f} | {match} | {err('hidden_rel_err')} "
                     f"| {err('kv_rel_err')} | {r['bit_stable']} |")
    return lines


def setup(smoke: bool, device, sizes):
    cfg = (LlamaConfig.tiny(hidden_size=80, n_heads=3, n_kv_heads=1, head_dim=32, ffn_size=72)
           if smoke else LlamaConfig.llama_1b())
    width = SMOKE_CTX if smoke else MAX_CTX
    model = LlamaModel(cfg).to(device, torch.bfloat16).eval()
    kv = KVCache(cfg.n_layers, FIRST + max(sizes) * width, cfg.n_kv_heads, cfg.head_dim, width,
                 FIRST + max(sizes), torch.bfloat16, device)
    for t in kv.k + kv.v:
        t.normal_()                                     # never time on zeros
    return model, kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--variants", default="current,fused,fused+pdl,fused+pdl+logits,fused+pdl+rows")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny model; on CPU, interpreted, untimed")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 if a fused token differs beyond a near tie (top-2 gap > "
                         f"{NEAR_TIE}) or two replays differ")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = ["current"] + [v for v in args.variants.split(",") if v != "current"]
    for v in variants[1:]:
        policy_of(v)                                    # refuse an unknown option up front
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("the 1B-shaped benchmark needs a GPU; --smoke runs the tiny model on the CPU")
    torch.manual_seed(0)
    model, kv = setup(args.smoke, device, sizes)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    pdl = fd.pdl_supported(device)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; PDL {'available' if pdl else 'unavailable'}", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in sizes:
        rows += measure_size(model, kv, make_batch(n, kv, model.cfg, gen, device), variants,
                             args.iters, bw, "triton" if args.smoke else "auto")
        print("\n".join(table_lines([r for r in rows if r["bs"] == n])[2:]), flush=True)
    write(rows, bw, pdl, kv.max_context, args)
    if args.check:
        bad = failures(rows)
        print("\n".join(bad) if bad else "check: fused tokens equal the current path's "
              f"(near ties, top-2 gap <= {NEAR_TIE}, excepted); replays bit-stable")
        if bad:
            raise SystemExit(1)


def write(rows, bw: float, pdl: bool, width: int, args) -> None:
    info = {**env_info(), "copy_bandwidth_tb_s": bw / 1e12, "pdl_available": pdl,
            "max_ctx": width, "smoke": args.smoke}
    lines = ["# Fused greedy decode step against the current decode step", "",
             f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, copy bandwidth "
             f"{bw / 1e12:.2f} TB/s, PDL {'available' if pdl else 'unavailable'}; contexts "
             f"random in [{min(256, width - 2)}, {width - 1}). A step: tokens in, next tokens "
             "and top-2 gaps out. Step µs: one replay (launch included); b2b: back-to-back "
             "replays (x floor uses it); layer: layer 0 alone, back-to-back.", "",
             *table_lines(rows), "", f"`{info['command']}`"]
    out = out_dir()
    (out / "fused_decode.md").write_text("\n".join(lines) + "\n")
    (out / "fused_decode.json").write_text(json.dumps({"env": info, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
