"""Continuous admission in padgraph.llm's Engine: more requests than max_bs. The rest wait and
take rows as running requests finish; each admission is prefilled and appended to the running
batch. On the CPU (reference backend) every request must get exactly the tokens it gets when
served alone, with overlap on or off, for EAGLE and greedy; no row is handed out while a round
in flight uses it, and every row and slot comes back."""

import pytest
import torch


from padgraph.llm import admission, timing
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm import Engine, RequestPool, SpecConfig, Worker
from test_eagle_e2e import assert_released

import padgraph as pg

SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=5)
# 11 requests for 4 rows: done at prefill (1), sure to finish in their first round (2), long ones
LENS = [(5, 1), (9, 7), (3, 13), (7, 2), (4, 22), (6, 5), (8, 10), (2, 1), (5, 2), (3, 9),
        (6, 4)]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    return {"random": (target, EagleHead(target).eval()),
            "oracle": (target, EagleHead.copy_of_target(target).eval())}


def _prompts(vocab, lens=LENS, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n, _ in lens]


def _worker(target, head, overlap=True, max_bs=4, **kw):
    return Engine(target, head, SPEC, max_bs=max_bs, max_context=64, overlap=overlap,
                  buckets=pg.Buckets([b for b in (1, 2, 4, 8) if b <= max_bs]), **kw)


def _run(w, mode, prompts, news):
    with torch.no_grad():
        return (w.generate_spec if mode == "spec" else w.generate_greedy)(prompts, news)


@pytest.fixture(scope="module")
def alone(models):
    """Each request's greedy tokens, served alone."""
    target, head = models["random"]
    w = _worker(target, head, max_bs=1)
    prompts, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    return [_run(w, "greedy", [p], [n])[0][0].output for p, n in zip(prompts, news)]


def track_in_flight(monkeypatch, step_name: str) -> list:
    """Patch Worker.<step_name> (spec_round / decode_step) and Readback.wait so the returned
    list holds the readbacks of rounds queued and not yet read back, each with `.rows`, the
    req_to_token rows its round uses."""
    in_flight: list = []
    orig_step, orig_wait = getattr(Worker, step_name), timing.Readback.wait

    def step(self, st, clock):
        nxt, rb = orig_step(self, st, clock)
        rb.rows = set(st.rows.tolist())
        in_flight.append(rb)
        return nxt, rb

    def wait(self):
        out = orig_wait(self)
        in_flight[:] = [rb for rb in in_flight if rb is not self]
        return out

    monkeypatch.setattr(Worker, step_name, step)
    monkeypatch.setattr(timing.Readback, "wait", wait)
    return in_flight


@pytest.mark.parametrize("overlap,tail_sync", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("head_kind", ["random", "oracle"])
def test_more_requests_than_rows_give_each_its_own_tokens(models, alone, overlap, tail_sync,
                                                          head_kind):
    """tail_sync (with overlap): when every running request may finish in the round in flight,
    the loop reads it back before admitting and queuing the next; tokens must not change."""
    target, head = models[head_kind]
    prompts, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    w = _worker(target, head, overlap, tail_sync=tail_sync)
    for mode in ("spec", "greedy"):
        reqs, st = _run(w, mode, prompts, news)
        assert [r.rid for r in reqs] == list(range(len(LENS)))
        assert [r.output for r in reqs] == alone, (mode, overlap, head_kind)
        assert [len(r.output) for r in reqs] == news
        assert st.prefills > 1 and st.overlap == overlap
        assert st.tokens == sum(news)
        if mode == "greedy":
            assert all(len(r.gaps) == len(r.output) for r in reqs)
        assert_released(w)


@pytest.mark.parametrize("tail_sync", [True, False])
def test_admitted_rows_are_never_in_flight(models, monkeypatch, tail_sync):
    """Every admission takes rows that no queued-but-unread round uses: with overlap, a row
    freed by a request that finished in round N is handed out only once round N+1 (which still
    held it) has been read back."""
    target, head = models["oracle"]
    prompts, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    w = _worker(target, head, True, tail_sync=tail_sync)
    in_flight = track_in_flight(monkeypatch, "spec_round")
    checked = []
    orig_admit = RequestPool.admit

    def admit(self, prompts, news, rids=None, params=None):
        reqs = orig_admit(self, prompts, news, rids, params)
        busy = set().union(*(rb.rows for rb in in_flight)) if in_flight else set()
        assert not busy & {r.row for r in reqs}, (busy, [r.row for r in reqs])
        checked.append(len(busy))
        return reqs

    monkeypatch.setattr(RequestPool, "admit", admit)
    reqs, st = _run(w, "spec", prompts, news)
    assert st.prefills > 2 and all(r.done for r in reqs)
    assert sum(1 for b in checked if b) >= 2      # admissions while a round was in flight
    assert_released(w)


def test_admission_checks_every_request_first(models):
    """A request that cannot fit max_context fails the call before any request is admitted."""
    target, head = models["random"]
    w = _worker(target, head)
    prompts = _prompts(target.cfg.vocab_size)
    news = [n for _, n in LENS[:-1]] + [64]
    with pytest.raises(ValueError, match="request 10"):
        _run(w, "spec", prompts, news)
    assert_released(w)


@pytest.mark.parametrize("mode", ["spec", "greedy"])
def test_admissions_read_first_tokens_late_and_eos_there_releases_after_the_round(
        models, alone, mode, monkeypatch):
    """With overlap, a later admission's first tokens are read after the next round is queued
    (no wait for the round in flight). A request whose first token is EOS is then in that round:
    its lane is discarded, and its row comes back only once that round has been read back.
    Every request still gets its own tokens (cut at EOS), and every row comes back."""
    target, head = models["oracle"]
    prompts, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    late_ones = [i for i in range(4, len(LENS)) if news[i] > 2]      # admitted later, budget > 2
    eos = alone[late_ones[0]][0]               # its first token: EOS ends it at admission
    want = [out[:out.index(eos) + 1] if eos in out else out for out in alone]
    assert any(w_[0] == eos for i, w_ in enumerate(want) if i >= 4)
    w = _worker(target, head, True, eos_id=eos)
    in_flight = track_in_flight(monkeypatch, "spec_round" if mode == "spec" else "decode_step")
    deferred: list = []
    released_while_busy = []
    orig_release, orig_read = RequestPool.release, admission.Refill.read_first

    def release(self, req):
        busy = set().union(*(rb.rows for rb in in_flight)) if in_flight else set()
        if req.row in busy:
            released_while_busy.append(req.rid)
        return orig_release(self, req)

    def read_first(self):
        assert in_flight, "first tokens read with no round queued after the admission"
        done = orig_read(self)
        deferred.extend(r.rid for r in done)
        return done

    monkeypatch.setattr(RequestPool, "release", release)
    monkeypatch.setattr(admission.Refill, "read_first", read_first)
    reqs, st = _run(w, mode, prompts, news)
    assert [r.output for r in reqs] == want
    assert late_ones[0] in deferred            # finished by its deferred first token
    assert not released_while_busy, released_while_busy
    assert st.discarded >= 1                   # its lane in the round queued meanwhile
    assert_released(w)


def test_a_request_past_the_models_rotary_table_is_refused():
    """max_context past the target's max_position: a request whose positions would index past
    the rotary table is refused at admission (it failed mid-run on the CPU: an IndexError)."""
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1, max_position=32)).eval()
    engine = Engine(target, None, SPEC, max_bs=2, max_context=64)
    with pytest.raises(ValueError, match="max_position 32"):
        engine.generate_greedy([[5] * 30], [10])
    reqs, _ = engine.generate_greedy([[5] * 20], [4])        # within the table: served
    assert len(reqs[0].output) == 4
