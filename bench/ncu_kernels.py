"""Run one attention case a few times inside an NVTX range named "prof", for Nsight Compute.

    python -m bench.ncu_kernels mla 8 8192            # our MLA decode, bs 8, context 8192
    python -m bench.ncu_kernels mla 8 8192 --knobs block_n=64,num_warps=8,num_splits=16
    python -m bench.ncu_kernels mla-sdpa 8 8192       # the SDPA absorbed-MLA peer
    python -m bench.ncu_kernels decode 8 4096         # paged GQA decode (bench_attention's case)
    python -m bench.ncu_kernels decode-sdpa 8 4096    # SDPA (cuDNN / flash) on the dense copy

Under ncu: `ncu --nvtx --nvtx-include "prof/" --launch-skip 2 --launch-count 2 ... python
-m bench.ncu_kernels ...`. The case's inputs are
those of bench/bench_mla.py / bench_attention.py (random data, shuffled slots); the output is
checked against the torch path before the profiled calls.
"""
from __future__ import annotations

import argparse
import sys

import torch


from bench.bench_attention import PagedCase, best_sdpa_backend, rel_err  # noqa: E402
from bench.bench_mla import LatentCase, LatentSpec, best_sdpa  # noqa: E402


def knob_dict(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        out[key] = {"True": True, "False": False}.get(value, None)
        if out[key] is None:
            out[key] = int(value)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("mla", "mla-sdpa", "decode", "decode-sdpa"))
    parser.add_argument("bs", type=int)
    parser.add_argument("ctx", type=int)
    parser.add_argument("--knobs", default="", help="fields of the launch policy (MlaPolicy / "
                                                   "SplitPolicy), e.g. num_splits=16")
    parser.add_argument("--calls", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    knobs = knob_dict(args.knobs)
    if args.what.startswith("mla"):
        case = LatentCase(LatentSpec(args.bs, args.ctx, 16), gen, device)
        ref = case.ours(impl="torch")()
        if args.what == "mla":
            fn = case.ours(**knobs)
        else:
            fn, name = best_sdpa(case, ref)
            print("sdpa backend:", name)
    else:
        case = PagedCase(args.bs, args.ctx, "random", gen, device)
        rows, ref = case.reference([0, args.bs - 1])
        if args.what == "decode":
            fn = case.ours(**knobs)
        else:
            backend = best_sdpa_backend(case, case.ours()())
            print("sdpa backend:", backend)
            fn = case.sdpa(backend)
    out = fn()
    if args.what.startswith("decode"):
        out = out[rows]
    err = rel_err(out, ref)
    print(f"{args.what} bs={args.bs} ctx={args.ctx} knobs={knobs} rel_err={err:.1e}")
    if err > 1e-2:
        sys.exit("disagrees with the torch path")
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    for _ in range(args.calls):
        fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
