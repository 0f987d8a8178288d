"""The fused decode path's tensor-core kernels one by one at the Llama-1B layer shape (bf16):
norm + qkv + RoPE + KV store (whole K and in K splits), norm + gate/up + SiLU-mul, and the o
and down projections with their residual add (whole K and in K splits, summed by each tile's
last split or by a second kernel), against cuBLAS `F.linear` of the same weights.

Each kernel alone: `--calls` calls captured in one CUDA graph, back to back, each call on the
next of `--copies` copies of the layer's weights (4: 486 MB, so no call finds its weights in
the 50-60 MB L2 from the call before), µs a call = median replay time / calls over 15 replays. `--before COMMIT` loads
that commit's `fused_decode.py` beside the current one (`git show`, same process) and times its
default kernels too, checking that qkv and gate/up give the same bits. `--grid` sweeps the qkv
and gate/up launch fields at the first row count (a point that needs more shared memory than the SM
has is recorded as skipped). Writes sweep_fused_tc.json under $OUT (or
results/local).

    python -m bench.sweep_fused_tc [--rows 16,4] [--before 33e6ef9] [--grid]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from bench.common import env_info, out_dir, time_us
from bench.gpu_timing import graph_of
from padgraph.backends.triton import fused_decode as fd
from padgraph.backends.triton.fused_decode import FusedDecodePolicy, LayerWeights, RopeTables

H, FFN, HQ, HKV, D = 2048, 8192, 32, 8, 64      # the 1B layer
POSITIONS, SLOTS = 4096, 4096


_CALL = [0]     # which weight copy the next captured call binds (`current`)


def graph_us(fn, calls: int, reps: int = 15) -> float:
    """µs a call of fn: `calls` calls in one CUDA graph, the median of `reps` replays; each
    call made after advancing _CALL, so fn binds the next weight copy."""
    fn()                                    # compile outside the capture

    def body():
        out = []
        for _ in range(calls):
            _CALL[0] += 1
            out.append(fn())
        return out
    replay = graph_of(body)
    return time_us(replay, reps) / calls


def load_before(commit: str):
    """`backends/triton/fused_decode.py` of `commit` as a module of the same package."""
    root = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "show", f"{commit}:backends/triton/fused_decode.py"], cwd=root,
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "fused_decode_before.py"
    path.write_text(src)
    name = "padgraph.backends.triton.fused_decode_before"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "padgraph.backends.triton"
    sys.modules[name] = module
    spec.loader.exec_module(module)     # triton.jit reads the source from `path`
    return module


def layer(device):
    def rnd(*shape):
        return (torch.randn(*shape, device=device) * 0.02).to(torch.bfloat16)
    wqkv, wgu = rnd((HQ + 2 * HKV) * D, H), rnd(2 * FFN, H)
    ones = torch.ones(H, device=device, dtype=torch.bfloat16)
    w = LayerWeights(input_norm=ones, wq=wqkv[:HQ * D], wk=wqkv[HQ * D:(HQ + HKV) * D],
                     wv=wqkv[(HQ + HKV) * D:], wo=rnd(H, HQ * D), post_norm=ones,
                     w_gate=wgu[:FFN], w_up=wgu[FFN:], w_down=rnd(H, FFN), eps=1e-5)
    angle = (torch.arange(POSITIONS, device=device)[:, None]
             * torch.rand(D // 2, device=device)[None])
    return w, wqkv, wgu, RopeTables(angle.cos(), angle.sin())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,4")
    ap.add_argument("--before", default=None, metavar="COMMIT")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--copies", type=int, default=4)
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copies = [layer(device) for _ in range(args.copies)]
    w, wqkv, wgu, rope = copies[0]

    def cur():          # the weight copy of the call being made
        return copies[_CALL[0] % len(copies)]
    kc = torch.zeros(SLOTS, HKV, D, device=device, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    mb = {"qkv": wqkv.numel() * 2 / 1e6, "gate_up": wgu.numel() * 2 / 1e6,
          "o": w.wo.numel() * 2 / 1e6, "down": w.w_down.numel() * 2 / 1e6}
    before = load_before(args.before) if args.before else None
    base = FusedDecodePolicy(pdl=False)
    rows = []

    def rec(m, kernel, variant, fn, **cfg):
        try:
            us = graph_us(fn, args.calls)
        except OutOfResources as e:     # a grid point past the SM's shared memory: recorded, not timed
            if variant != "grid":
                raise
            row = dict(rows=m, kernel=kernel, variant=variant, cfg=cfg, us=None,
                       skipped=str(e).split(".")[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
            return
        row = dict(rows=m, kernel=kernel, variant=variant, cfg=cfg, us=round(us, 2),
                   tb_s=round(mb[kernel] / us, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)

    for i, m in enumerate(int(r) for r in args.rows.split(",")):
        x = (torch.randn(m, H, device=device) * 0.02).to(torch.bfloat16)
        ssq = x.float().pow(2).sum(-1)[None].contiguous()
        pos = torch.randint(0, POSITIONS, (m,), device=device)
        loc = torch.arange(1, m + 1, device=device)
        o = (torch.randn(m, HQ * D, device=device) * 0.02).to(torch.bfloat16)
        act = (torch.randn(m, FFN, device=device) * 0.02).to(torch.bfloat16)
        for kernel, a, wt in (("qkv", x, lambda: cur()[1]), ("gate_up", x, lambda: cur()[2]),
                              ("o", o, lambda: cur()[0].wo), ("down", act, lambda: cur()[0].w_down)):
            rec(m, kernel, "cublas", lambda a=a, wt=wt: F.linear(a, wt()))
        mods = [("now", fd, base)] + ([("before", before, before.FusedDecodePolicy(pdl=False))]
                                      if before else [])
        for variant, mod, pol in mods:
            rec(m, "qkv", variant, lambda mod=mod, pol=pol: mod.norm_qkv_rope_store_tc(
                x, ssq, cur()[0], rope, pos, loc, kc, vc, policy=pol))
            rec(m, "gate_up", variant,
                lambda mod=mod, pol=pol: mod.norm_gate_up_silu_tc(x, ssq, cur()[0], policy=pol))
        if before:
            same = {k: torch.equal(f(fd, base), f(before, before.FusedDecodePolicy(pdl=False)))
                    for k, f in (("qkv", lambda mod, pol: mod.norm_qkv_rope_store_tc(
                                     x, ssq, w, rope, pos, loc, kc, vc, policy=pol)),
                                 ("gate_up", lambda mod, pol: mod.norm_gate_up_silu_tc(
                                     x, ssq, w, policy=pol)))}
            print(f"rows {m}: the same bits as {args.before}: {same}", flush=True)
            rows.append(dict(rows=m, same_bits_as_before=same))
        for splits in (2, 4):
            p = dataclasses.replace(base, tc_qkv_splits=splits)
            rec(m, "qkv", "now", lambda p=p: fd.norm_qkv_rope_store_tc(
                x, ssq, cur()[0], rope, pos, loc, kc, vc, policy=p), splits=splits)
        for kernel, a, wt in (("o", o, lambda: cur()[0].wo), ("down", act, lambda: cur()[0].w_down)):
            for splits, fold in ((1, True), (2, True), (4, True), (2, False), (4, False)):
                p = dataclasses.replace(base, tc_fold=fold)
                rec(m, kernel, "now", lambda a=a, wt=wt, s=splits, p=p: fd.proj_residual_tc(
                    a, wt(), x, splits=s, policy=p), splits=splits, fold=fold)
        if not (args.grid and i == 0):
            continue
        warps = "tc_warps" if fd.row_block(m) <= 32 else "tc_wide_warps"   # the field m runs
        for half, bk, st, wp in itertools.product((8, 16, 32), (64, 128, 256), (3, 6), (4, 8)):
            cfg = {"tc_half_n": half, "tc_block_k": bk, "tc_stages": st, warps: wp}
            p = dataclasses.replace(base, **cfg)
            rec(m, "qkv", "grid", lambda p=p: fd.norm_qkv_rope_store_tc(
                x, ssq, cur()[0], rope, pos, loc, kc, vc, policy=p), **cfg)
        for fn_, bk, st in itertools.product((16, 32, 64), (64, 128, 256), (3, 6)):
            p = dataclasses.replace(base, tc_ffn_n=fn_, tc_block_k=bk, tc_ffn_stages=st)
            rec(m, "gate_up", "grid", lambda p=p: fd.norm_gate_up_silu_tc(x, ssq, cur()[0], policy=p),
                tc_ffn_n=fn_, tc_block_k=bk, tc_ffn_stages=st)
    out = out_dir() / "sweep_fused_tc.json"
    out.write_text(json.dumps({"env": env_info(), "calls": args.calls, "copies": args.copies,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
