"""Benchmark the sampler (`padgraph.llm.sampling.sample`, its Triton kernels) against greedy.

    python -m bench.bench_sampling            # GPU: Llama-3 vocabulary, bs 1 / 16 / 64
    python -m bench.bench_sampling --smoke    # CPU, tiny sizes, interpreter: checks the script

Each case draws one token a row from bf16 logits [bs, 128256], timed as CUDA-graph replays
(`triton.testing.do_bench` medians): torch's argmax (what greedy decode runs), `sample` with
temperature 0 (greedy through the sampler), temperature only, top-p and top-k + top-p on sharp
logits (a narrow nucleus: settled on the chunk candidates) and top-p on flat logits (a nucleus
of thousands of tokens: the one-program-a-row fallback). Every case is first checked against the
torch reference, token for token. Writes sampling.md / sampling.json to $OUT.
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
from bench.gpu_timing import bench_us, graph_of  # noqa: E402
from padgraph.llm.sampling import PURPOSE_DECODE, sample  # noqa: E402

CASES = {   # name: (logit scale, temperature, top_k, top_p)
    "sample greedy": (4.0, 0.0, 0, 1.0),
    "temperature 0.7": (4.0, 0.7, 0, 1.0),
    "top-p 0.9 (sharp)": (8.0, 0.7, 0, 0.9),
    "top-k 50 + top-p 0.95 (sharp)": (8.0, 1.0, 50, 0.95),
    "top-p 0.9 (flat)": (1.0, 1.0, 0, 0.9),
}


def lanes(bs, temperature, top_k, top_p, device):
    return (torch.full((bs,), temperature, device=device),
            torch.full((bs,), top_k, dtype=torch.int32, device=device),
            torch.full((bs,), top_p, device=device), torch.zeros(bs, device=device),
            torch.arange(bs, device=device) + 7, torch.full((bs,), 100, device=device))


def run_case(logits, scale, temperature, top_k, top_p) -> float:
    x = (logits * scale).to(torch.bfloat16)
    args = lanes(x.shape[0], temperature, top_k, top_p, x.device)
    got = sample(x, *args, PURPOSE_DECODE)
    want = sample(x, *args, PURPOSE_DECODE, impl="torch")
    assert torch.equal(got, want), "the kernels and the torch reference disagree"
    return bench_us(graph_of(lambda: sample(x, *args, PURPOSE_DECODE)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (script check)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    V, sizes = (5000, (2,)) if args.smoke else (128256, (1, 16, 64))
    rows = []
    for bs in sizes:
        logits = torch.randn(bs, V, generator=torch.Generator().manual_seed(bs)).to(device)
        x = (logits * 4).to(torch.bfloat16)
        row = {"bs": bs, "argmax": bench_us(graph_of(lambda: x.argmax(-1)))}
        for name, case in CASES.items():
            row[name] = run_case(logits, *case)
        rows.append(row)
        print(row, flush=True)
    names = ["argmax", *CASES]
    md = ["# Sampling: µs a call, [bs, V] bf16 logits, V = %d" % V, "",
          f"`{json.dumps(env_info())}`", "",
          "| bs | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    md += ["| %d | " % r["bs"] + " | ".join(f"{r[n]:.1f}" for n in names) + " |" for r in rows]
    out = out_dir()
    (out / "sampling.md").write_text("\n".join(md) + "\n")
    (out / "sampling.json").write_text(json.dumps({"env": env_info(), "rows": rows}, indent=1))
    print("\n".join(md))


if __name__ == "__main__":
    main()
