"""Quickstart: a small decode-like static program on two padded axes, with a bound KV-like state.

Runs on the reference backend (CPU is fine) — or on CUDA graphs with `--backend cuda` on a GPU —
and prints what padgraph did: the declaration, the bucket each call landed in, the padded view
the body saw, the sliced outputs, the sink writes of padded lanes, and a `pg.check` report.
"""
from __future__ import annotations

import argparse

import torch

import padgraph as pg

N_SLOTS, HIDDEN = 32, 8

bs = pg.Axis("bs")                                  # requests: the bucketed axis
tok = pg.Axis("tokens", capacity=bs * 2)            # up to 2 new tokens per request

program = pg.Program(
    "quickstart_decode",
    inputs={
        "input_ids": pg.Input((tok,), torch.int64, pad=0),
        "out_cache_loc": pg.Input((tok,), torch.int64, pad=0),    # padded lanes write sink slot 0
        "seq_lens": pg.Input((bs,), torch.int32, pad=1),
        "qo_indptr": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
        "hidden": pg.Input((bs, HIDDEN), torch.float32, pad=0.0),
    },
    outputs={"scores": pg.Output((bs,), torch.float32), "new_tokens": pg.Output((bs,), torch.int32)},
    state={"cache": pg.State(sink=0)},
    buckets=pg.Buckets([1, 2, 4, 8]),
)


def body(x):
    x.cache[x.out_cache_loc] = x.input_ids.float()            # [tokens] -> cache slots
    new_tokens = x.qo_indptr[1:] - x.qo_indptr[:-1]           # [bs]; Edge pad makes padded lanes 0
    scores = x.hidden.sum(-1) / x.seq_lens.float()            # [bs]; seq_lens pad 1: no div by 0
    return {"scores": scores, "new_tokens": new_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="reference", choices=["reference", "cuda"])
    args = ap.parse_args()
    if args.backend == "cuda" and not torch.cuda.is_available():
        ap.error("--backend cuda needs a CUDA GPU (torch.cuda.is_available() is False); the "
                 "reference backend runs anywhere")
    device = "cuda" if args.backend == "cuda" else "cpu"
    print(program, "\n")
    cache = torch.zeros(N_SLOTS, device=device)
    seen = []
    runner = pg.compile(program, body, backend=args.backend, state={"cache": cache},
                        prepare=lambda x: seen.append((x.bucket, x.seq_lens.tolist())))
    gen = torch.Generator().manual_seed(0)
    for n_req in (1, 3, 6):
        per_req = torch.randint(1, 3, (n_req,), generator=gen)
        n_tok = int(per_req.sum())
        raw = {
            "input_ids": torch.randint(1, 100, (n_tok,), generator=gen),
            "out_cache_loc": torch.randperm(N_SLOTS - 1, generator=gen)[:n_tok] + 1,
            "seq_lens": torch.randint(1, 50, (n_req,), generator=gen).int(),
            "qo_indptr": torch.cat([torch.zeros(1, dtype=torch.long), per_req.cumsum(0)]).int(),
            "hidden": torch.randn(n_req, HIDDEN, generator=gen),
        }
        raw = {k: v.to(device) for k, v in raw.items()}
        out = runner(**raw)
        bucket, padded_lens = seen[-1]
        print(f"call: {n_req} requests, {n_tok} tokens -> bucket {bucket}; "
              f"the body saw seq_lens={padded_lens} (pad 1)")
        print(f"      outputs sliced to raw: new_tokens={out.new_tokens.tolist()} "
              f"scores={[round(s, 3) for s in out.scores.tolist()]}")
    print(f"\nsink slot 0 of the cache holds {cache[0].item()} (padded lanes' writes land only there)")
    print(runner.stats.table())

    def sample(g):
        n_req = int(torch.randint(1, 9, (), generator=g))
        per_req = torch.randint(0, 3, (n_req,), generator=g)
        n_tok = int(per_req.sum())
        return {"input_ids": torch.randint(1, 100, (n_tok,), generator=g),
                "out_cache_loc": torch.randperm(N_SLOTS - 1, generator=g)[:n_tok] + 1,
                "seq_lens": torch.randint(1, 50, (n_req,), generator=g).int(),
                "qo_indptr": torch.cat([torch.zeros(1, dtype=torch.long), per_req.cumsum(0)]).int(),
                "hidden": torch.randn(n_req, HIDDEN, generator=g)}

    print(pg.check(program, body, state={"cache": torch.zeros(N_SLOTS)}, sample=sample, trials=8))


if __name__ == "__main__":
    main()
