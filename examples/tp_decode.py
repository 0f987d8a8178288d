"""Greedy decode of a Llama-like target, tensor-parallel over N ranks, checked against one process.

    python examples/tp_decode.py --world 2                          # CPU: gloo, reference, tiny
    python examples/tp_decode.py --world 2 --backend cuda           # 2 GPUs: NCCL, CUDA graphs
    python examples/tp_decode.py --world 2 --eagle                  # EAGLE rounds, TP verify

Every rank holds a shard of the target (`padgraph.llm.models.llama_tp`: heads, MLP and vocab
split, KV cache sharded by KV heads) and compiles the same declared decode program as one process
does (`padgraph.llm.programs`); its body's all-reduces run eagerly under gloo on the reference
backend and are captured into each bucket's graph under NCCL on the cuda backend. Rank 0 drives:
it broadcasts each raw scheduled batch, so every rank picks the same bucket with no device-side
agreement (`padgraph.llm.tp`). `--check-ranks` checks that premise on every call. Step and
capture times against one GPU: `python bench/bench_tp.py`.

The last line is `greedy_match=N/N`: the TP run's tokens against the single-process run's; on the
CPU (fp32) exactly, on GPUs (bf16) up to a first divergence at a top-2 near-tie.
"""
from __future__ import annotations

import argparse

import padgraph.distributed as pgd
from padgraph.llm import Request
from padgraph.llm.models.llama_tp import shard_config
from padgraph.llm.oracle import TIE_TOL, compare, oracle_line
from padgraph.llm.tp_run import (CPU, EAGLE_SPEC, GPU, Setup, eagle_rank, requests, run_single,
                                 run_tp, spawn)


def parse_setup(argv=None) -> tuple[Setup, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", choices=("reference", "cuda"), default="reference")
    ap.add_argument("--head", choices=("top2", "gather"), default="top2",
                    help="top2: distributed top-2 ([bs, 4] gathered); gather: full logits")
    ap.add_argument("--check-ranks", action="store_true",
                    help=f"check bucket agreement before every call (also {pgd.ENV}=1)")
    ap.add_argument("--eagle", action="store_true",
                    help="EAGLE rounds (draft, TP verify, draft-extend) instead of greedy steps")
    args = ap.parse_args(argv)
    base = GPU if args.backend == "cuda" else CPU
    setup = Setup(**{**base.__dict__, "world": args.world, "head": args.head,
                     "check_ranks": args.check_ranks})
    shard_config(setup.config(), setup.world)      # a size that does not split fails here
    return setup, args


def main(argv=None):
    setup, args = parse_setup(argv)
    prompts, news = requests(setup)
    what = f"EAGLE {EAGLE_SPEC} (untrained head)" if args.eagle else f"greedy, head={setup.head}"
    print(f"{setup.size} Llama-like target, TP={setup.world} over "
          f"{'NCCL' if setup.backend == 'cuda' else 'gloo'}, backend {setup.backend!r}, "
          f"{len(prompts)} requests (the batch shrinks), {what}")
    if args.eagle:
        res = spawn(eagle_rank, setup, prompts, news)[0]
        tp = res["outputs"]
        print(f"EAGLE: {res['rounds']} rounds, accept length {res['accept_len']:.2f}")
    else:
        tp = run_tp(setup, prompts, news)[0]["outputs"]
    single = run_single(setup, prompts, news)
    tp_reqs = [Request(r.rid, r.prompt, r.max_new_tokens, output=o, gaps=g)
               for r, (o, g) in zip(single, tp)]
    tol = TIE_TOL if setup.backend == "cuda" else 0.0          # fp32 on the CPU: exact
    match, ties, real = compare(single, tp_reqs, tie_tol=tol)
    print(f"tokens: TP {sum(len(r.output) for r in tp_reqs)}, one process "
          f"{sum(len(r.output) for r in single)}; tie tolerance {tol}")
    print(oracle_line(match, ties, real))


if __name__ == "__main__":
    main()
