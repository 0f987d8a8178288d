"""Benchmark the draft distribution's top-k: padgraph's kernel vs torch, alone and behind the lm_head.

    python -m bench.bench_topk            # H200: Llama-3 vocabulary, a few row counts
    python -m bench.bench_topk --smoke    # CPU, tiny sizes, interpreter: checks the script

A draft step turns the head's hidden [n, H] into the k best tokens and their probabilities under
a temperature t: top-k of the logits and logsumexp(t * logits). n = draft rows (requests x topk),
V = 128256, H = 2048, k = 4, bf16 weights.
- "top-k stage" on given logits (bf16 as the fp8 path writes them, and fp32 as `target.logits`
  returns them): torch (`topk` + `logsumexp`, what the head ran before) against
  `topk_logsumexp`, with a sweep of its chunk width and warps;
- "draft step": lm_head GEMM + top-k stage, for torch's bf16 GEMM + torch top-k, the bf16 GEMM +
  the kernel, the fp8 lm_head (`fp8_logits`) + the kernel, and the fused fp8 lm_head + top-k
  kernel (`fp8_lm_head_topk`, a few tile shapes).
Timed as CUDA-graph replays, `triton.testing.do_bench` medians (L2 flushed before each call).
The floor is the bytes each stage must read (logits for the top-k stage, lm_head weight for a
step) over the device-to-device copy bandwidth of the same run (read + write, as
bench_attention counts it). Every variant is checked
against torch first (values equal; indices hold them). Writes topk.md / topk.json to $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: kernels run interpreted on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


from bench.common import env_info, out_dir  # noqa: E402
from bench.bench_attention import bench_us, copy_bandwidth, graph_of  # noqa: E402
from padgraph.llm.models.draft_head import fp8_logits, fp8_rows  # noqa: E402
from padgraph.backends.triton import topk as topk_mod  # noqa: E402
from padgraph.backends.triton.lm_head_topk import (  # noqa: E402
    fp8_lm_head_topk_torch, fp8_lm_head_topk_triton)
from padgraph.backends.triton.topk import topk_logsumexp_torch, topk_logsumexp_triton  # noqa: E402

FULL = dict(V=128256, H=2048, rows=(16, 64, 256), k=4,
            sweep=((4096, 4), (4096, 8), (2048, 4), (2048, 2), (1024, 1), (1024, 2), (512, 1)),
            fused=((128, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4), (256, 128, 8, 3)))
SMOKE = dict(V=5000, H=64, rows=(4,), k=4, sweep=((4096, 4), (1024, 1)),
             fused=((128, 64, 4, 3),))    # fused: (block_v, block_h, num_warps, num_stages)


def check(got, logits, k, t) -> None:
    v, i, lse = got
    want_v, _, want_lse = topk_logsumexp_torch(logits, k, t)
    assert torch.equal(v, want_v), "top-k values differ from torch"
    assert torch.equal(logits.float().gather(1, i), v), "indices do not hold the values"
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (script check)")
    args = ap.parse_args()
    cfg = SMOKE if args.smoke else FULL
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    V, H, k = cfg["V"], cfg["H"], cfg["k"]
    gen = torch.Generator(device=device).manual_seed(0)
    bw = copy_bandwidth(device)
    w = (0.02 * torch.randn(V, H, generator=gen, device=device)).to(dtype)
    w8, w_scale = fp8_rows(w)
    w_scale = w_scale.t().contiguous()                      # [1, V], as the head keeps it
    t = torch.tensor(6.0, device=device)
    rows, sweep_rows, step_rows = [], [], []
    for n in cfg["rows"]:
        h = torch.randn(n, H, generator=gen, device=device).to(dtype)
        for ldtype in (torch.bfloat16, torch.float32):
            logits = (h @ w.t()).to(ldtype)
            name = str(ldtype).split(".")[-1]
            nbytes = logits.numel() * logits.element_size()
            torch_us = bench_us(graph_of(lambda: topk_logsumexp_torch(logits, k, t)))
            best = None
            default_cfg = (topk_mod.BLOCK, topk_mod.NUM_WARPS)
            for block, warps in dict.fromkeys((default_cfg, *cfg["sweep"])):
                fn = lambda: topk_logsumexp_triton(logits, k, t, block=block, num_warps=warps)  # noqa: E731
                check(fn(), logits, k, t)
                us = bench_us(graph_of(fn))
                sweep_rows.append({"n": n, "logits": name, "block": block,
                                   "num_warps": warps, "us": us})
                if best is None or us < best[0]:
                    best = (us, block, warps)
            default = next(r["us"] for r in sweep_rows if r["n"] == n and r["logits"] == name
                           and (r["block"], r["num_warps"]) == (topk_mod.BLOCK, topk_mod.NUM_WARPS))
            rows.append({"n": n, "logits": name, "torch_us": torch_us,
                         "kernel_us": default, "best_us": best[0], "best_block": best[1],
                         "best_num_warps": best[2], "floor_us": nbytes / bw * 1e6,
                         "speedup_default": torch_us / default, "speedup_best": torch_us / best[0]})
            print(rows[-1], flush=True)
        # one draft step: lm_head + top-k stage (checked, then timed)
        variants = {
            "bf16 GEMM + torch": lambda: topk_logsumexp_torch((h @ w.t()).float(), k, t),
            "bf16 GEMM + kernel": lambda: topk_logsumexp_triton((h @ w.t()).float(), k, t),
            "fp8 GEMM + kernel": lambda: topk_logsumexp_triton(fp8_logits(h, w8, w_scale), k, t),
        }
        x8, sx = fp8_rows(h)
        fused_ref = fp8_lm_head_topk_torch(x8, sx, w8, w_scale, k, t)
        for bv, bh, warps, stages in cfg["fused"]:
            def fused(bv=bv, bh=bh, warps=warps, stages=stages):
                return fp8_lm_head_topk_triton(x8, sx, w8, w_scale, k, t, block_v=bv, block_h=bh,
                                               num_warps=warps, num_stages=stages)
            v, _, lse = fused()            # fp32 logits in another summation order: close
            torch.testing.assert_close(v, fused_ref[0], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(lse, fused_ref[2], rtol=1e-3, atol=1e-3)
            variants[f"fp8 fused ({bv}, {bh}, {warps}, {stages})"] = fused
        # the default tile with Triton's sm90 fp8 accumulation (no promotion): what it costs
        fast = lambda: fp8_lm_head_topk_triton(x8, sx, w8, w_scale, k, t, precise=False)  # noqa: E731
        fast_err = (fast()[0] - fused_ref[0]).abs().max().item()
        prec_err = (fp8_lm_head_topk_triton(x8, sx, w8, w_scale, k, t)[0]
                    - fused_ref[0]).abs().max().item()
        variants["fp8 fused, unpromoted accumulation"] = fast
        step = {"n": n, "floor_bf16_us": w.numel() * w.element_size() / bw * 1e6,
                "floor_fp8_us": w8.numel() / bw * 1e6,
                "fused_max_err": prec_err, "fused_unpromoted_max_err": fast_err}
        for name, fn in variants.items():
            if not name.startswith("fp8 fused"):    # fused: checked against its reference above
                fp8 = name.startswith("fp8")
                check(fn(), fp8_logits(h, w8, w_scale) if fp8 else (h @ w.t()).float(), k, t)
            step[name] = bench_us(graph_of(fn))
        step_rows.append(step)
        print(step, flush=True)
    write(rows, sweep_rows, step_rows, bw, cfg, device)


def write(rows, sweep_rows, step_rows, bw, cfg, device) -> None:
    meta = {**env_info(), "copy_bandwidth_GBps": bw / 1e9, "V": cfg["V"], "H": cfg["H"],
            "k": cfg["k"], "device": device.type}
    out = out_dir()
    (out / "topk.json").write_text(json.dumps(
        {"meta": meta, "stage": rows, "sweep": sweep_rows, "step": step_rows}, indent=1))
    md = [f"# Draft top-k ({meta['gpu']})", "",
          f"- date {meta['date']}, torch {meta['torch']}, triton {meta['triton']}",
          f"- command: `{meta['command']}`",
          f"- V {cfg['V']}, H {cfg['H']}, k {cfg['k']}; copy bandwidth {bw / 1e9:.0f} GB/s "
          "(read + write); a floor is the bytes a stage must read over it",
          *(["- CPU smoke run: the kernels run in Triton's interpreter, so these times mean "
             "nothing"] if device.type == "cpu" else []), "",
          "## Top-k stage on given logits (torch topk + logsumexp vs topk_logsumexp)", "",
          "| n | logits | torch µs | kernel µs (default) | best µs (block, warps) | floor µs | "
          "speedup (default / best) |", "|---:|---|---:|---:|---|---:|---|"]
    for r in rows:
        md.append(f"| {r['n']} | {r['logits']} | {r['torch_us']:.1f} | {r['kernel_us']:.1f} | "
                  f"{r['best_us']:.1f} ({r['best_block']}, {r['best_num_warps']}) | "
                  f"{r['floor_us']:.1f} | {r['speedup_default']:.2f}x / {r['speedup_best']:.2f}x |")
    errs = ("fused_max_err", "fused_unpromoted_max_err")
    names = [k for k in step_rows[0] if k not in ("n", "floor_bf16_us", "floor_fp8_us", *errs)]
    md += ["", "## One draft step: lm_head GEMM + top-k stage (µs; fp8 fused: block_v, block_h, "
           "warps, stages)", "",
           "| n | " + " | ".join(names) + " | bf16 weight floor | fp8 weight floor | "
           "fused max abs err (promoted / not) |",
           "|---:|" + "---:|" * (len(names) + 2) + "---|"]
    for s in step_rows:
        md.append(f"| {s['n']} | " + " | ".join(f"{s[k]:.1f}" for k in names) +
                  f" | {s['floor_bf16_us']:.1f} | {s['floor_fp8_us']:.1f} | "
                  f"{s['fused_max_err']:.1e} / {s['fused_unpromoted_max_err']:.1e} |")
    (out / "topk.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"wrote {out / 'topk.md'} and .json")


if __name__ == "__main__":
    main()
