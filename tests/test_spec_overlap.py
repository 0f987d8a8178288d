"""Overlap scheduling in padgraph.llm's Engine: round N+1 is queued before round N is read back,
finished requests are retired one round late. On the CPU (reference backend, tiny models) the
overlapped loop must give exactly the plain loop's tokens (and greedy's top-2 gaps), count only
real request-rounds, release every row after the last round that used it, and keep the extra
round inside each request's reservation. On a GPU: the overlapped rounds never synchronise
except in the one readback wait per round."""
import warnings

import pytest
import torch


from padgraph.llm import timing
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm import Engine, RequestPool, SpecConfig, Worker
from test_eagle_e2e import assert_released

import padgraph as pg

# (prompt, max_new): 1 (done at prefill), 2, values that end mid-round; the batch shrinks
LENS = [(5, 1), (9, 7), (3, 13), (7, 2), (4, 22), (6, 5), (8, 10)]
SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=5)


def _prompts(vocab, lens=LENS, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n, _ in lens]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    return {"random": (target, EagleHead(target).eval()),                 # accepts ~1 per round
            "oracle": (target, EagleHead.copy_of_target(target).eval())}  # accepts ~steps + 1


def _worker(target, head, overlap, spec=SPEC, max_context=64, **kw):
    return Engine(target, head, spec, max_bs=8, max_context=max_context, overlap=overlap,
                  buckets=pg.Buckets([1, 2, 4, 8]), **kw)


def _run(w, mode, prompts, news):
    gen = w.generate_spec if mode == "spec" else w.generate_greedy
    with torch.no_grad():
        return gen(prompts, news)


def _in_loop(reqs, eos_id=None):
    """Requests that ran at least one round (not finished by their prefill token)."""
    return sum(1 for r in reqs if r.max_new_tokens > 1 and r.output[0] != eos_id)


def assert_same_run(on, off, eos_id=None):
    (r_on, s_on), (r_off, s_off) = on, off
    assert [r.output for r in r_on] == [r.output for r in r_off]
    # greedy's top-2 gaps (the bf16 near-tie oracle): one per token, the same up to float
    # rounding (a stale lane can put a step in a larger bucket: other matmul shapes)
    assert [len(r.gaps) for r in r_on] == [len(r.gaps) for r in r_off]
    for a, b in zip(r_on, r_off):
        torch.testing.assert_close(torch.tensor(a.gaps), torch.tensor(b.gaps), rtol=0, atol=1e-4)
    assert (s_on.tokens, s_on.accepted, s_on.request_rounds) == \
        (s_off.tokens, s_off.accepted, s_off.request_rounds)
    assert s_on.overlap and not s_off.overlap
    assert s_off.discarded == 0
    n = _in_loop(r_on, eos_id)
    # at most one wasted lane-round per request: none for one whose last round was sure to
    # finish it (one token left), which is kept out of the next round
    assert 0 <= s_on.discarded <= n
    assert s_on.rounds - s_off.rounds in (0, 1)      # at most one trailing round
    assert sum(len(r.output) for r in r_on) == s_on.tokens


@pytest.mark.parametrize("head_kind", ["random", "oracle"])
def test_overlap_equals_plain_loop(models, head_kind):
    target, head = models[head_kind]
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    w_on, w_off = _worker(target, head, True), _worker(target, head, False)
    for mode in ("spec", "greedy"):
        on, off = _run(w_on, mode, prompts, news), _run(w_off, mode, prompts, news)
        assert_same_run(on, off)
        if mode == "greedy":    # no EOS: every finish is foreseen, nothing runs for nothing
            assert (on[1].discarded, on[1].rounds) == (0, off[1].rounds), on[1]
        for r in on[0]:
            assert len(r.output) == r.max_new_tokens, (mode, r.rid)
            if mode == "greedy":
                assert len(r.gaps) == len(r.output)
        if mode == "spec" and head_kind == "oracle":
            st = on[1]                                  # long paths: some requests end
            assert st.accept_len > 2.5 and st.accepted > st.tokens - len(LENS)   # mid-round
            assert st.discarded > 0     # unforeseen finishes: the retire-late path ran
    spec_on, greedy_on = _run(w_on, "spec", prompts, news), _run(w_on, "greedy", prompts, news)
    assert [r.output for r in spec_on[0]] == [r.output for r in greedy_on[0]]
    assert_released(w_on)
    assert_released(w_off)


def test_tail_sync_runs_no_round_discarded_whole(models):
    """One request at a time (bs 1): without tail sync, the round queued while the last one runs
    is discarded whole whenever that last round's finish was not foreseen (budget > 1 left, as
    with long accepts); with tail sync (the default) the loop reads the round back first once
    the request may finish in it, so the run has the plain loop's rounds and discards nothing,
    with the same tokens. Several requests: rounds and discards never exceed tail sync's off."""
    target, head = models["oracle"]
    prompts = _prompts(target.cfg.vocab_size)
    news = [m for _, m in LENS]
    w_sync, w_late = _worker(target, head, True), _worker(target, head, True, tail_sync=False)
    w_off = _worker(target, head, False)
    late_discards = 0
    for p, n in zip(prompts, news):
        sync, late, off = (_run(w, "spec", [p], [n]) for w in (w_sync, w_late, w_off))
        assert [r.output for r in sync[0]] == [r.output for r in off[0]] == \
            [r.output for r in late[0]]
        assert (sync[1].rounds, sync[1].discarded) == (off[1].rounds, 0), (n, sync[1])
        assert sync[1].overlap
        late_discards += late[1].discarded
    assert late_discards > 0            # the case tail sync exists for did occur
    sync, late = (_run(w, "spec", prompts, news) for w in (w_sync, w_late))
    assert_same_run(sync, _run(w_off, "spec", prompts, news))
    assert sync[1].rounds <= late[1].rounds and sync[1].discarded <= late[1].discarded
    assert [r.output for r in sync[0]] == [r.output for r in late[0]]
    for w in (w_sync, w_late, w_off):
        assert_released(w)


def test_overlap_with_eos(models):
    target, head = models["oracle"]
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    plain, _ = _run(_worker(target, head, False), "greedy", prompts, news)
    eos = plain[4].output[6]                          # mid-way through the longest request
    w_on, w_off = (_worker(target, head, o, eos_id=eos) for o in (True, False))
    for mode in ("spec", "greedy"):
        on, off = _run(w_on, mode, prompts, news), _run(w_off, mode, prompts, news)
        assert_same_run(on, off, eos_id=eos)
        assert any(r.output[-1] == eos and len(r.output) < r.max_new_tokens for r in on[0])
    assert_released(w_on)


def test_every_request_done_at_prefill(models):
    target, head = models["random"]
    lens = [(5, 1), (3, 1)]
    w = _worker(target, head, True)
    for mode in ("spec", "greedy"):
        reqs, stats = _run(w, mode, _prompts(target.cfg.vocab_size, lens), [1, 1])
        assert [len(r.output) for r in reqs] == [1, 1]
        assert (stats.rounds, stats.discarded, stats.request_rounds) == (0, 0, 0)
    assert_released(w)


class _Recorder:
    """A runner stand-in that records each call's raw inputs and delegates."""

    def __init__(self, runner, log):
        self.runner, self.log = runner, log

    def __call__(self, **raw):
        self.log.append({k: v.clone() for k, v in raw.items()})
        return self.runner(**raw)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def test_late_retirement_stays_in_bounds_and_releases_after_readback(models, monkeypatch):
    """The tightest max_context that still overlaps: every KV slot the rounds write (verify's
    tree, the draft's nodes), the extra round past a request's end included, is one the request
    reserved (req_to_token 0 would mean past its reservation); a row is released only once every
    round that used it has been read back, and no later round uses it."""
    target, head = models["oracle"]
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    tight = SPEC.reservation(max(len(p) + n for p, n in zip(prompts, news)), overlap=True)
    w = _worker(target, head, True, max_context=tight)
    calls = {"draft": [], "verify": []}
    for name, log in calls.items():
        w.worker._runners[name] = _Recorder(w.worker.runner(name), log)
    launched, reads, released = [], [0], []
    orig_round, orig_wait, orig_release = Worker.spec_round, timing.Readback.wait, \
        RequestPool.release

    def spec_round(self, st, clock):
        launched.append(set(st.rows.tolist()))
        return orig_round(self, st, clock)

    def wait(self):
        reads[0] += 1
        return orig_wait(self)

    def release(self, req):
        released.append((req.row, reads[0], len(launched)))
        return orig_release(self, req)

    monkeypatch.setattr(Worker, "spec_round", spec_round)
    monkeypatch.setattr(timing.Readback, "wait", wait)
    monkeypatch.setattr(RequestPool, "release", release)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                # it fits: overlap stays on
        on = _run(w, "spec", prompts, news)
    assert on[1].overlap
    for name, log in calls.items():
        assert log and all((c["out_cache_loc"] != 0).all() for c in log), name
    for row, n_read, n_launched in released:
        used = [i for i, rows in enumerate(launched) if row in rows]
        if used:                                      # not finished at prefill
            assert used[-1] < n_read, (row, used, n_read)         # read back before release
            assert used[-1] < n_launched
        assert all(row not in rows for rows in launched[n_launched:])   # never used again
    assert len(released) == len(LENS)
    monkeypatch.undo()
    assert_same_run(on, _run(_worker(target, head, False), "spec", prompts, news))
    assert_released(w)


def test_overlap_off_where_the_extra_round_does_not_fit(models):
    target, head = models["oracle"]
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    fits = SPEC.reservation(max(len(p) + n for p, n in zip(prompts, news)))   # no room for it
    w = _worker(target, head, True, max_context=fits)
    with pytest.warns(UserWarning, match="overlap off for this run"):
        on = _run(w, "spec", prompts, news)
    assert not on[1].overlap and on[1].discarded == 0
    ref = _run(_worker(target, head, False), "spec", prompts, news)
    assert [r.output for r in on[0]] == [r.output for r in ref[0]]
    g = _run(w, "greedy", prompts, news)              # greedy's extra step always fits
    assert g[1].overlap and [r.output for r in g[0]] == [r.output for r in on[0]]
    assert_released(w)


def sync_checked_loop(monkeypatch) -> list:
    """Run Engine._loop under sync debug mode "error", a Readback's wait exempt; the list
    that gets one entry per wait."""
    waits = []
    orig_wait, orig_loop = timing.Readback.wait, Engine._loop

    def exempt_wait(self):
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            waits.append(1)
            return orig_wait(self)
        finally:
            torch.cuda.set_sync_debug_mode(prev)

    def checked_loop(self, *args, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return orig_loop(self, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(timing.Readback, "wait", exempt_wait)
    monkeypatch.setattr(Engine, "_loop", checked_loop)
    return waits


@pytest.mark.cuda
def test_cuda_overlapped_rounds_never_sync(monkeypatch):
    """cuda backend, tiny sizes: the whole overlapped loop (queue, readback start, retire, row
    drops, release) runs under sync debug mode "error"; only readback waits may synchronise:
    one per round launched, plus the batch's one admission, whose first tokens are read at once
    (no round is in flight to overlap). Spec rounds, then greedy steps; tokens equal the
    warm-up run's."""
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).cuda().to(torch.bfloat16).eval()
    head = EagleHead.copy_of_target(target).cuda().to(torch.bfloat16).eval()
    w = Engine(target, head, SpecConfig(3, 2, 5), backend="cuda", max_bs=4, max_context=64,
               buckets=pg.Buckets([1, 2, 4]))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, target.cfg.vocab_size, (n,), generator=g).tolist()
               for n in (5, 9, 3, 7)]
    news = [8, 4, 12, 1]
    with torch.no_grad():                             # compile, capture, JIT, pinned blocks
        warm = {m: _run(w, m, prompts, news) for m in ("spec", "greedy")}
    waits = sync_checked_loop(monkeypatch)
    for mode in ("spec", "greedy"):
        n0 = len(waits)
        reqs, stats = _run(w, mode, prompts, news)
        assert stats.overlap and stats.rounds >= 3 and stats.prefills == 1, (mode, stats)
        assert len(waits) - n0 == stats.rounds + 1    # one wait per round launched + admission
        assert stats.discarded <= 3                   # at most one per request that ran rounds
        assert [r.output for r in reqs] == [r.output for r in warm[mode][0]], mode
    assert w.pool.slots.all_free and w.pool.rows.all_free


@pytest.mark.cuda
def test_cuda_continuous_admission_never_syncs(monkeypatch):
    """cuda backend, tiny sizes, more requests than rows: admissions happen inside the overlapped
    loop, with a round in flight. Packing the prompts, writing the rows' slots, the prefill and
    appending to the batch queue work without a host synchronisation (sync debug mode "error");
    only readback waits may synchronise: one per round launched, plus one per admission whose
    first tokens are read after the next round is queued. Tokens equal the warm-up run's."""
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).cuda().to(torch.bfloat16).eval()
    head = EagleHead.copy_of_target(target).cuda().to(torch.bfloat16).eval()
    w = Engine(target, head, SpecConfig(3, 2, 5), backend="cuda", max_bs=2, max_context=64,
               buckets=pg.Buckets([1, 2]))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, target.cfg.vocab_size, (n,), generator=g).tolist()
               for n in (5, 9, 3, 7, 4, 6)]
    news = [8, 4, 12, 1, 2, 6]
    with torch.no_grad():                             # compile, capture, JIT, pinned blocks
        warm = {m: _run(w, m, prompts, news) for m in ("spec", "greedy")}
    waits = sync_checked_loop(monkeypatch)
    for mode in ("spec", "greedy"):
        n0 = len(waits)
        reqs, stats = _run(w, mode, prompts, news)
        assert stats.overlap and stats.prefills >= 3, (mode, stats)
        assert stats.rounds < len(waits) - n0 <= stats.rounds + stats.prefills
        assert [r.output for r in reqs] == [r.output for r in warm[mode][0]], mode
    assert w.pool.slots.all_free and w.pool.rows.all_free


def test_compiled_layers_give_the_eager_tokens(models):
    """Engine(torch_compile=True): every runner's decoder layers compiled regionally (the GPU
    default) serve the same tokens as the eager oracle, spec and greedy."""
    target, head = models["oracle"]
    prompts, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    eager = _worker(target, head, True)
    compiled = _worker(target, head, True, torch_compile=True)
    assert "torch_compile" in compiled.worker.options("draft") and "torch_compile" not in eager.worker.options("draft")
    for mode in ("spec", "greedy"):
        (ra, _), (rb, _) = _run(compiled, mode, prompts, news), _run(eager, mode, prompts, news)
        assert [r.output for r in ra] == [r.output for r in rb], mode
    for name, runner in compiled.worker._runners.items():
        assert runner.stats.compiles >= 1, name


def test_whole_draft_bodies_compile_fullgraph_and_give_the_eager_tokens(models):
    """Engine(draft_compile="whole"): the draft and draft-extend bodies (tree expansion, the
    head's steps, top-k, tree build) compile as one fullgraph each for the ladder; tokens equal
    the eager oracle's. The head's top-k is the opaque `padgraph::topk_logsumexp` op in that
    graph. Short run: the CPU compile of the unrolled draft is the cost here."""
    target, head = models["oracle"]
    spec = SpecConfig(steps=2, topk=2, num_draft_tokens=3)
    lens = LENS[:4]
    prompts, news = _prompts(target.cfg.vocab_size, lens), [n for _, n in lens]
    eager = _worker(target, head, True, spec=spec)
    whole = _worker(target, head, True, spec=spec, torch_compile=True, draft_compile="whole")
    assert "regions" not in whole.worker.options("draft")["torch_compile"]
    assert "regions" in whole.worker.options("verify")["torch_compile"]
    (ra, _), (rb, _) = _run(whole, "spec", prompts, news), _run(eager, "spec", prompts, news)
    assert [r.output for r in ra] == [r.output for r in rb]
    for name in ("draft", "draft_extend"):
        assert whole.worker._runners[name].stats.compiles >= 1, name
    with pytest.raises(ValueError, match="draft_compile"):
        _worker(target, head, True, draft_compile="all")


@pytest.mark.parametrize("mode", ["fp8", "fp8-fused"])
def test_fp8_draft_lm_head_in_whole_compiled_draft_bodies(mode, no_compile_caches):
    """The fp8 draft lm_head (`_scaled_mm` of the row-quantized hidden, or the fused
    `padgraph::fp8_lm_head_topk` op) inside the whole-compiled draft and draft-extend bodies:
    the tokens of the eager oracle with the same head, and greedy's. A head of its own: the fp8
    copy is the head's state."""
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    head = EagleHead.copy_of_target(target).eval()
    head.set_draft_lm_head(mode)
    spec = SpecConfig(steps=2, topk=2, num_draft_tokens=3)
    lens = LENS[:3]
    prompts, news = _prompts(target.cfg.vocab_size, lens), [n for _, n in lens]
    eager = _worker(target, head, True, spec=spec)
    whole = _worker(target, head, True, spec=spec, torch_compile=True, draft_compile="whole")
    (ra, sa), (rb, _) = _run(whole, "spec", prompts, news), _run(eager, "spec", prompts, news)
    greedy, _ = _run(eager, "greedy", prompts, news)
    assert [r.output for r in ra] == [r.output for r in rb] == [r.output for r in greedy]
    assert sa.accept_len > 1.5                 # an oracle head still accepts through fp8 logits
    assert whole.worker._runners["draft"].stats.compiles >= 1
