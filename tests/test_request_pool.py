"""The request pool (`Engine.pool`, padgraph.llm.admission.RequestPool): `admit` gives each request
its own req_to_token row and the slots of its whole reservation (`SpecConfig.reservation`, the
overlap margin as far as max_context allows), all or none; `release` gives them back and zeroes
the row. `Engine.admit` / `Engine.release` and every generate call go through it."""
from __future__ import annotations

import pytest
import torch

import padgraph as pg
from padgraph.llm import Engine, RequestPool, SamplingParams, SpecConfig
from padgraph.llm.kv import FIRST
from padgraph.llm.models.llama import LlamaConfig, LlamaModel

SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=5)
torch.manual_seed(0)
TARGET = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()


def _engine(**kw) -> Engine:
    return Engine(TARGET, None, SPEC, **{"max_bs": 3, "max_context": 32, **kw})


def _empty(pool: RequestPool) -> bool:
    return (pool.slots.all_free and pool.rows.all_free
            and not pool.worker.kv.req_to_token[FIRST:].any())


@pytest.mark.parametrize("overlap", [True, False])
def test_admit_reserves_the_spec_reservation_and_release_gives_it_back(overlap):
    e = _engine(overlap=overlap)
    prompts, news = [[5, 6, 7], [9] * 12, [3, 4]], [4, 10, 1]
    reqs = e.pool.admit(prompts, news, rids=[7, 8, 9])
    assert [r.rid for r in reqs] == [7, 8, 9] and e.pool.n_free == 0
    assert len({r.row for r in reqs}) == 3 and all(r.row >= FIRST for r in reqs)
    rt = e.worker.kv.req_to_token
    for r, p, n in zip(reqs, prompts, news):
        need = min(SPEC.reservation(len(p) + n, overlap=overlap), e.max_context)
        assert len(r.slots) == need, (overlap, r.rid)
        assert rt[r.row, :need].tolist() == r.slots and not rt[r.row, need:].any()
    assert len({s for r in reqs for s in r.slots}) == sum(len(r.slots) for r in reqs)
    capped = reqs[1]                  # 12 + 10 + margin fits 32, the overlap margin does not whole
    assert len(capped.slots) == (e.max_context if overlap else 22 + SPEC.margin)
    for r in reqs:
        e.pool.release(r)
        assert r.slots == [] and r.row == 0
    assert _empty(e.pool)


def test_admit_is_all_or_nothing():
    e = _engine()
    with pytest.raises(ValueError, match="4 requests but 3 free rows"):
        e.pool.admit([[1, 2]] * 4, [2] * 4)
    with pytest.raises(ValueError, match="request 1: prompt 30"):      # past max_context
        e.pool.admit([[1, 2], [3] * 30], [2, 2])
    with pytest.raises(ValueError, match="non-empty"):
        e.pool.admit([[1, 2], []], [2, 2])
    assert _empty(e.pool)
    held = e.pool.admit([[1, 2], [3, 4]], [2, 2])
    with pytest.raises(ValueError, match="2 requests but 1 free rows"):
        e.pool.admit([[5, 6], [7, 8]], [2, 2])
    assert e.pool.n_free == 1
    for r in held:
        e.pool.release(r)
    assert _empty(e.pool)


def test_admit_draws_seeds_and_refuses_sampling_where_the_worker_does_not_sample():
    e = _engine(seed=5)
    a, b = e.pool.admit([[1, 2], [3, 4]], [2, 2], rids=[0, 1],
                        params=[None, SamplingParams(temperature=0.5, seed=11)])
    c, = _engine(seed=5).pool.admit([[1, 2]], [2], rids=[0])
    assert a.params.greedy and b.seed == 11 and a.seed == c.seed != _engine(seed=6).pool.admit([[1]], [1])[0].seed
    greedy_only = _engine(sampling=False)
    with pytest.raises(pg.ContractValueError, match=r"requests \[0\] sample"):
        greedy_only.pool.admit([[1, 2]], [2], params=[SamplingParams(temperature=0.5)])
    assert _empty(greedy_only.pool)


def test_engine_admission_and_generate_calls_go_through_the_pool(monkeypatch):
    e = _engine()
    calls = []
    for name in ("admit", "release"):
        real = getattr(RequestPool, name)
        monkeypatch.setattr(RequestPool, name, lambda self, *a, real=real, name=name, **kw:
                            calls.append(name) or real(self, *a, **kw))
    held = e.admit([[1, 2]], [3])
    assert calls == ["admit"] and e.pool.n_free == 2
    e.release(held[0])
    assert calls == ["admit", "release"] and _empty(e.pool)
    calls.clear()
    with torch.no_grad():
        reqs, _ = e.generate_greedy([[1, 2], [3], [4, 5], [6, 7, 8]], [3, 2, 4, 1])  # 4 requests, 3 rows
    assert calls.count("release") == 4 and calls.count("admit") >= 2
    assert [len(r.output) for r in reqs] == [3, 2, 4, 1] and _empty(e.pool)
