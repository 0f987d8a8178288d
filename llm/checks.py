"""`pg.check` of a worker's runner programs: random valid raw calls of each, and the check itself.

`pg.check`'s default sampler draws small integers, which are not valid request rows, lengths or
slots; the runner programs index the paged cache with them, so each program needs calls a
scheduler could make. `sampler(worker, name)` draws those: distinct request rows, sequence
lengths that leave room for the round's tree, slots read from the rows' slot table, packed
`qo_indptr` for the extends, a tree mask with siblings for verify, and, for a program that
samples, each request's sampling parameters (greedy lanes and every filter among them, valid
values only: what `SamplingParams` admits). `check(worker)` runs
`pg.check` on every runner program the worker has over a copy of its slot table in which every
request row owns its own slots (the cache itself is restored by `pg.check` after every run).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

import padgraph as pg

from .kv import FIRST


def _requests(gen: torch.Generator, w):
    """bs in 1..max_bs distinct request rows (never the sink row 0 or the canary row 1)."""
    bs = int(torch.randint(1, w.max_bs + 1, (), generator=gen))
    rows = (torch.randperm(w.max_bs, generator=gen)[:bs] + FIRST).int()
    return bs, rows


def sampling_lanes(gen: torch.Generator, bs: int, vocab: int) -> dict:
    """Valid per-request sampling inputs [bs]: about a third greedy (temperature 0), the rest at
    temperatures in [0.2, 1.5], each filter (top-k in 1..vocab, top-p in [0.05, 1), min-p in
    [0, 0.5)) on for about half the lanes, seeds anywhere in [0, 2**62)."""
    def on(p):
        return torch.rand(bs, generator=gen) < p

    temperature = torch.where(on(1 / 3), 0.0, 0.2 + 1.3 * torch.rand(bs, generator=gen))
    top_k = torch.where(on(0.5), torch.randint(1, vocab + 1, (bs,), generator=gen), 0).int()
    top_p = torch.where(on(0.5), 0.05 + 0.95 * torch.rand(bs, generator=gen), 1.0)
    min_p = torch.where(on(0.5), 0.5 * torch.rand(bs, generator=gen), 0.0)
    seed = torch.randint(0, 2 ** 62, (bs,), generator=gen)
    return dict(temperature=temperature.float(), top_k=top_k, top_p=top_p.float(),
                min_p=min_p.float(), seed=seed)


def sampler(w, name: str) -> Callable[[torch.Generator], dict]:
    """Raw inputs of a random valid call of runner `name` of worker `w` (`_call`), with valid
    sampling parameters where the program takes them (`sampling_lanes`)."""
    call = _call(w, name)
    samples = "temperature" in w.programs[name].inputs if name in w.programs else False
    V = w.target.cfg.vocab_size

    def sample(gen: torch.Generator) -> dict:
        raw = call(gen)
        if samples:
            raw.update(sampling_lanes(gen, raw["seq_lens"].shape[0], V))
        return raw
    return sample


def _call(w, name: str) -> Callable[[torch.Generator], dict]:
    """Raw inputs of a random valid call of runner `name` of worker `w` (CPU tensors; the
    runner moves nothing, so `check` hands them to a reference runner on the state's device)."""
    rt, V, H = w.kv.req_to_token.cpu(), w.target.cfg.vocab_size, w.target.cfg.hidden_size
    k, S, topk = w.spec.num_draft_tokens, w.spec.steps, w.spec.topk
    top = w.max_context - w.spec.margin                 # the last sequence length a round fits after
    if top <= S + 2:
        raise pg.ContractValueError(f"padgraph.llm.checks: max_context {w.max_context} leaves no room for a "
                                    f"round of {w.spec.tree_positions} tree positions after {S + 2} tokens")

    def sample(gen: torch.Generator) -> dict:
        bs, rows = _requests(gen, w)
        L = torch.randint(S + 2, top + 1, (bs,), generator=gen).int()      # >= any accept length

        def ids(n):
            return torch.randint(0, V, (n,), generator=gen)

        def slots(pos):
            return rt[rows.long()[:, None], pos].long().reshape(-1)

        if name == "decode":
            return dict(input_ids=ids(bs), positions=(L - 1).long(), seq_lens=L,
                        req_pool_indices=rows, out_cache_loc=slots((L - 1).long()[:, None]))
        if name == "verify":
            mask = torch.tril(torch.ones(k, k, dtype=torch.bool)).repeat(bs, 1, 1)
            if k > 2:
                mask[:, 2, 1] = False                      # node 2 is a sibling of node 1
            pos = L.long()[:, None] + torch.arange(k)
            return dict(input_ids=ids(bs * k), positions=pos.reshape(-1), out_cache_loc=slots(pos),
                        seq_lens=L, req_pool_indices=rows, tree_mask=mask)
        if name == "draft":
            p = torch.rand(bs, topk, generator=gen).sort(1, descending=True).values
            pos = L.long()[:, None] + torch.arange(S * topk)
            return dict(topk_p=p, topk_index=torch.randint(0, V, (bs, topk), generator=gen),
                        hidden_states=torch.randn(bs, H, generator=gen), positions=L.long(),
                        seq_lens=L, req_pool_indices=rows, out_cache_loc=slots(pos), verified_id=ids(bs))
        if name in ("prefill", "draft_prefill"):           # whole prompts from position 0, packed
            qo = torch.cat([torch.zeros(1, dtype=torch.int32), L.cumsum(0).int()])
            pos = torch.cat([torch.arange(int(n)) for n in L])
            row_of = rows.long().repeat_interleave(L.long())
            x = dict(input_ids=ids(int(qo[-1])), positions=pos, out_cache_loc=rt[row_of, pos].long(),
                     seq_lens=L, req_pool_indices=rows, qo_indptr=qo)
            if name == "draft_prefill":                    # + the target's hidden per token, first tokens
                x.update(hidden_states=torch.randn(int(qo[-1]), H, generator=gen), verified_id=ids(bs))
            return x
        if name != "draft_extend":
            raise pg.ContractKeyError(f"padgraph.llm.checks: no sampler for a runner named {name!r}")
        acc = torch.randint(1, S + 2, (bs,), generator=gen).int()
        qo = torch.cat([torch.zeros(1, dtype=torch.int32), acc.cumsum(0).int()])
        pos = torch.cat([torch.arange(int(n) - int(a), int(n)) for n, a in zip(L, acc)])
        row_of = rows.long().repeat_interleave(acc.long())
        return dict(input_ids=ids(int(qo[-1])), positions=pos, out_cache_loc=rt[row_of, pos].long(),
                    hidden_states=torch.randn(int(qo[-1]), H, generator=gen), seq_lens=L,
                    req_pool_indices=rows, accept_lens=acc, qo_indptr=qo)
    return sample


def own_slots(w, seed: int = 0) -> None:
    """Give every request row of `w`'s slot table its own max_context slots (a random choice, no
    slot shared, the sink slot 0 and the canary slot 1 in none), as admissions would."""
    rt = w.kv.req_to_token
    n_rows, width = rt.shape[0] - FIRST, rt.shape[1]
    perm = torch.randperm(w.n_slots - FIRST, generator=torch.Generator().manual_seed(seed))[: n_rows * width]
    rt[FIRST:] = (perm.int().view(n_rows, width) + FIRST).to(rt.device)


def check(w, names: Iterable[str] | None = None, trials: int = 3, seed: int = 0,
          tolerance: tuple[float, float] | None = None) -> dict[str, pg.CheckResult]:
    """`pg.check` of each runner program of worker `w` (default: all it has) with `sampler`'s
    calls, over a copy of its slot table in which every row owns its slots; the worker's own slot
    table is put back after."""
    saved = w.kv.req_to_token.clone()
    try:
        own_slots(w, seed)
        results = {}
        for name in names if names is not None else list(w.programs):
            sample = sampler(w, name)
            device = w.kv.req_to_token.device

            def on_device(gen, sample=sample):
                return {n: t.to(device) for n, t in sample(gen).items()}

            with torch.no_grad():
                results[name] = pg.check(w.programs[name], w.bodies[name], state=w.state(name), sample=on_device,
                                         trials=trials, seed=seed, tolerance=tolerance)
        return results
    finally:
        w.kv.req_to_token.copy_(saved)
