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
SENTINEL = -1.0        # every cache slot starts here, so a write to any slot shows

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


def cache_report(cache: torch.Tensor, written: dict[int, int]) -> str:
    """What the calls left in the cache, checked: each slot a real token was given holds that
    token's id, every other non-sink slot still holds SENTINEL, and sink slot 0 holds the
    input_ids pad (0), written by the padded lanes. Exits with the slots that break it."""
    cache = cache.cpu()
    wrong = [s for s, tok in written.items() if cache[s].item() != tok]
    stray = [s for s in range(1, N_SLOTS) if s not in written and cache[s].item() != SENTINEL]
    if wrong or stray or cache[0].item() != 0.0:
        raise SystemExit(f"padded lanes wrote outside the sink: slots {stray} changed, slots {wrong} "
                         f"lost their token's id, sink slot 0 holds {cache[0].item()}")
    return (f"cache, every slot {SENTINEL} before the calls: the {len(written)} slots real tokens were "
            f"given hold their ids,\n  the other {N_SLOTS - 1 - len(written)} slots still hold {SENTINEL}, "
            f"and sink slot 0 holds {cache[0].item()} (the input_ids pad): padded lanes wrote only there")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="reference", choices=["reference", "cuda"])
    args = ap.parse_args()
    if args.backend == "cuda" and not torch.cuda.is_available():
        ap.error("--backend cuda needs a CUDA GPU (torch.cuda.is_available() is False); the "
                 "reference backend runs anywhere")
    device = "cuda" if args.backend == "cuda" else "cpu"
    print(program, "\n")
    cache = torch.full((N_SLOTS,), SENTINEL, device=device)
    seen, written = [], {}                                  # written: slot -> the last id stored there
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
        written.update(zip(raw["out_cache_loc"].tolist(), raw["input_ids"].tolist()))
        raw = {k: v.to(device) for k, v in raw.items()}
        out = runner(**raw)
        bucket, padded_lens = seen[-1]
        print(f"call: {n_req} requests, {n_tok} tokens -> bucket {bucket}; "
              f"the body saw seq_lens={padded_lens} (pad 1)")
        print(f"      outputs sliced to raw: new_tokens={out.new_tokens.tolist()} "
              f"scores={[round(s, 3) for s in out.scores.tolist()]}")
    print("\n" + cache_report(cache, written))
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

    print(pg.check(program, body, state={"cache": torch.full((N_SLOTS,), SENTINEL)}, sample=sample, trials=8))


if __name__ == "__main__":
    main()
