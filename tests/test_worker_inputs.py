"""padgraph.llm.Engine against bad requests and failing calls, on the CPU (reference backend):
requests are checked before any is admitted (empty prompts, token ids outside the vocabulary,
max_new_tokens < 1 or not an int), an impossible tree is rejected when the SpecConfig is built,
and a call that fails after admission gives back every row and slot, so the next call runs as
on a fresh worker; a call that cannot get a row raises instead of waiting forever."""

import pytest
import torch


from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm import Engine, SpecConfig

import padgraph as pg
from padgraph.llm.kv import FIRST

torch.manual_seed(0)
TARGET = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
HEAD = EagleHead.copy_of_target(TARGET).eval()
V = TARGET.cfg.vocab_size


def _prompts(*lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in lens]


def _worker(spec=SpecConfig(3, 2, 5), **kw):
    kw = {"max_bs": 2, "max_context": 40, "buckets": pg.Buckets([1, 2]), **kw}
    return Engine(TARGET, HEAD, spec, **kw)


def _released(w):
    return (w.pool.slots.all_free and w.pool.rows.all_free
            and not w.worker.kv.req_to_token[FIRST:].any())


def _run(w, mode, prompts, news):
    with torch.no_grad():
        return (w.generate_spec if mode == "spec" else w.generate_greedy)(prompts, news)


BAD = [
    ("max_new 0", [[5, 6]], [0], ValueError, "max_new_tokens must be >= 1"),
    ("max_new negative", [list(range(1, 31))], [-20], ValueError, "max_new_tokens must be >= 1"),
    ("max_new float", [[5, 6]], [2.0], TypeError, "max_new_tokens must be an int"),
    ("max_new bool", [[5, 6]], [True], TypeError, "max_new_tokens must be an int"),
    ("empty prompt", [[5, 6], []], [3, 3], ValueError, "non-empty"),
    ("token = vocab", [[5, 6], [V, 1]], [3, 3], ValueError, rf"in \[0, {V}\); got {V}"),
    ("token < 0", [[5, -1]], [3], ValueError, "got -1"),
    ("float tokens", [[5.0, 6.0]], [3], TypeError, "must be integers"),
    ("2-d prompt", [[[5, 6]]], [3], ValueError, "1-d"),
]


@pytest.mark.parametrize("mode", ["spec", "greedy"])
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_fail_before_any_is_admitted(case, mode):
    _, prompts, news, exc, msg = case
    w = _worker()
    with pytest.raises(exc, match=msg):
        _run(w, mode, _prompts(3) + prompts, [4] + news)   # a good request first
    assert _released(w)


@pytest.mark.parametrize("cfg", [(3, 2, 1), (1, 1, 1), (1, 1, 3), (2, 2, 8), (3, 1, 8),
                                 (0, 2, 4), (2, 0, 4)])
def test_impossible_trees_are_rejected_when_configured(cfg):
    with pytest.raises(ValueError, match="must be"):
        SpecConfig(*cfg)


@pytest.mark.parametrize("cfg", [(2, 2, 7), (1, 3, 4), (3, 1, 4), (4, 1, 2)])
def test_trees_at_the_edge_of_the_range_run_exactly(cfg):
    """k = n_candidates + 1 (every candidate verified) and k = 2 are valid and exact."""
    spec = SpecConfig(*cfg)
    w = _worker(spec, max_context=48)
    prompts, news = _prompts(4, 7), [9, 5]
    greedy, _ = _run(w, "greedy", prompts, news)
    reqs, _ = _run(w, "spec", prompts, news)
    assert [r.output for r in reqs] == [r.output for r in greedy]
    assert _released(w)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ["spec", "greedy"])
def test_a_call_failing_after_admission_gives_everything_back(mode, overlap, monkeypatch):
    """The third round raises (as a failing kernel or an interrupt would), with requests
    queued for continuous admission: every row and slot comes back, and the next call on the
    same worker gives the tokens a fresh worker gives."""
    prompts, news = _prompts(3, 5, 4, 6, 2), [7, 3, 9, 4, 6]
    w = _worker(overlap=overlap)
    name = "spec_round" if mode == "spec" else "decode_step"
    real, calls = getattr(w.worker, name), []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("stop")
        return real(*a, **kw)
    monkeypatch.setattr(w.worker, name, failing)
    with pytest.raises(KeyboardInterrupt):
        _run(w, mode, prompts, news)
    assert _released(w)
    monkeypatch.setattr(w.worker, name, real)
    again, _ = _run(w, mode, prompts, news)
    fresh, _ = _run(_worker(overlap=overlap), mode, prompts, news)
    assert [r.output for r in again] == [r.output for r in fresh]
    assert _released(w)


def test_no_free_row_and_nothing_running_raises_instead_of_waiting():
    w = _worker()
    held = w.admit(_prompts(2, 2), [3, 3])          # both rows, admitted outside generate
    with pytest.raises(RuntimeError, match="must be released first"):
        _run(w, "greedy", _prompts(3), [3])
    for r in held:
        w.release(r)
    reqs, _ = _run(w, "greedy", _prompts(3), [3])
    assert len(reqs[0].output) == 3 and _released(w)
