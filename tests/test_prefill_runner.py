"""The prefill program (`Engine(prefill="runner")`): the target's extend over whole prompts as a
runner, bucketed by packed prompt tokens. On the CPU (reference backend, the oracle) it must give
exactly the eager prefill's tokens and greedy's top-2 gaps, for a Llama and a DeepSeek (MLA + MoE)
target, eager and with the decoder layers compiled; on a GPU, the cuda backend's graphs give the
eager prefill's tokens."""

import pytest
import torch


from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.models.mtp_head import MTPHead
from padgraph.llm import Engine, SpecConfig
from test_eagle_e2e import assert_released

import padgraph as pg

LENS = [(5, 1), (9, 7), (3, 13), (7, 2), (4, 12), (6, 5), (1, 6)]   # (prompt, max_new)
SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=5)


def _prompts(vocab, lens=LENS, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n, _ in lens]


def _models(kind):
    torch.manual_seed(0)
    if kind == "llama":
        target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()   # copy_of_target: 1 layer
        return target, EagleHead.copy_of_target(target).eval()
    target = DeepSeekModel(DeepSeekConfig.tiny(n_layers=2, n_dense_layers=1), seed=1).eval()
    return target, MTPHead(target).eval()


def _worker(target, head, prefill, **kw):
    return Engine(target, head, SPEC, max_bs=8, max_context=48, prefill=prefill,
                  buckets=pg.Buckets([1, 2, 4, 8]), **kw)


def _run(w, mode, prompts, news):
    with torch.no_grad():
        return (w.generate_spec if mode == "spec" else w.generate_greedy)(prompts, news)


def _same(a, b):
    (ra, sa), (rb, sb) = a, b
    assert [r.output for r in ra] == [r.output for r in rb]
    for x, y in zip(ra, rb):
        torch.testing.assert_close(torch.tensor(x.gaps), torch.tensor(y.gaps), rtol=0, atol=1e-4)
    assert (sa.tokens, sa.accepted, sa.request_rounds) == (sb.tokens, sb.accepted, sb.request_rounds)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_prefill_runner_equals_eager_prefill(kind):
    target, head = _models(kind)
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    eager, runner = _worker(target, head, "eager"), _worker(target, head, "runner")
    for mode in ("spec", "greedy"):
        _same(_run(runner, mode, prompts, news), _run(eager, mode, prompts, news))
    st = runner.worker.runner("prefill").stats
    n_tok = sum(n for n, _ in LENS)                   # 35 packed tokens: bucket 48
    assert dict(st.calls) == {48: 2} and st.padded_lanes[48] > 0 and st.eager_fallbacks == 0
    assert "prefill" not in eager.worker._runners and n_tok == 35
    # a smaller batch lands in a smaller bucket of the same runner
    _same(_run(runner, "greedy", prompts[:2], news[:2]), _run(eager, "greedy", prompts[:2], news[:2]))
    assert st.calls[16] == 1
    assert_released(runner)


def test_batch_past_the_prefill_ladder_runs_the_overflow_policy():
    """prefill_tokens caps the ladder; a batch past it runs eagerly through the runner (its
    overflow policy), with the same tokens."""
    target, head = _models("llama")
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    small = _worker(target, head, "runner", prefill_tokens=24)
    assert list(small.worker.programs["prefill"].buckets) == [16, 24]
    _same(_run(small, "greedy", prompts, news), _run(_worker(target, head, "eager"), "greedy",
                                                     prompts, news))
    assert small.worker.runner("prefill").stats.eager_fallbacks == 1


def test_compiled_prefill_runner_gives_the_eager_tokens():
    """With the decoder layers compiled (the GPU default), the prefill runner's layers compile
    for the token ladder and serve the eager prefill's tokens (greedy: the spec runners'
    compiles are covered in test_spec_overlap.py)."""
    target, head = _models("llama")
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    compiled = _worker(target, head, "runner", torch_compile=True)
    assert "regions" in compiled.worker.options("prefill")["torch_compile"]
    eager = _worker(target, head, "eager")
    for p, n in ((prompts, news), (prompts[:2], news[:2])):      # buckets 48, then 16
        (ra, _), (rb, _) = _run(compiled, "greedy", p, n), _run(eager, "greedy", p, n)
        assert [r.output for r in ra] == [r.output for r in rb]
    st = compiled.worker.runner("prefill").stats
    assert st.compiles >= 1 and st.calls[48] == st.calls[16] == 1


def test_prefill_mode_is_checked():
    target, head = _models("llama")
    with pytest.raises(ValueError, match="prefill must be 'eager' or 'runner'"):
        _worker(target, head, "graphs")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_cuda_prefill_runner_gives_the_eager_prefill_tokens(kind):
    """cuda backend, tiny bf16 models: the prefill graphs (one per bucket of packed tokens) give
    the eager prefill's tokens for spec and greedy, in two buckets."""
    target, head = _models(kind)
    target, head = target.cuda().to(torch.bfloat16), head.cuda().to(torch.bfloat16)
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    kw = dict(backend="cuda")
    runner, eager = _worker(target, head, "runner", **kw), _worker(target, head, "eager", **kw)
    for mode in ("spec", "greedy"):
        for p, n in ((prompts, news), (prompts[:2], news[:2])):
            (ra, _), (rb, _) = _run(runner, mode, p, n), _run(eager, mode, p, n)
            assert [r.output for r in ra] == [r.output for r in rb], (kind, mode, len(p))
    st = runner.worker.runner("prefill").stats
    assert st.calls[48] == 2 and st.calls[16] == 2 and st.eager_fallbacks == 0


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_draft_prefill_runner_equals_eager_draft_prefill(kind):
    """Engine(draft_prefill="runner"): the head's prefill as the draft-prefill program on the
    prefill ladder gives the eager draft prefill's first draft state (top-k, hidden, draft
    slots) for every request of a padded bucket, and the same tokens and accept counts, with
    the target's prefill eager or a runner, and through continuous admission (more requests
    than rows: several admissions, each its own bucket)."""
    target, head = _models(kind)
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    eager = _worker(target, head, "runner")
    for prefill in ("runner", "eager"):
        runner = _worker(target, head, prefill, draft_prefill="runner")
        _same(_run(runner, "spec", prompts, news), _run(eager, "spec", prompts, news))
        st = runner.worker.runner("draft_prefill").stats
        assert dict(st.calls) == {48: 1} and st.padded_lanes[48] > 0 and st.eager_fallbacks == 0
        assert "draft_prefill" not in eager.worker._runners
        assert_released(runner)
    # the first draft state itself, request by request
    reqs = runner.admit(prompts[:3], news[:3])
    with torch.no_grad():
        logits, hidden, b = runner.worker.prefill(reqs)
        first = logits.argmax(-1)
        got = runner.worker.draft_prefill(first, hidden, b)
        runner.worker.draft_prefill_mode = "eager"
        want = runner.worker.draft_prefill(first, hidden, b)
        runner.worker.draft_prefill_mode = "runner"
    for f in ("topk_p", "topk_index", "hidden", "draft_loc"):
        torch.testing.assert_close(getattr(got, f), getattr(want, f), rtol=1e-5, atol=1e-5)
    for r in reqs:
        runner.release(r)
    # continuous admission: 7 requests through 3 rows
    small = Engine(target, head, SPEC, max_bs=3, max_context=48, prefill="runner",
                   draft_prefill="runner", buckets=pg.Buckets([1, 2, 3]))
    ref = Engine(target, head, SPEC, max_bs=3, max_context=48, prefill="runner",
                 buckets=pg.Buckets([1, 2, 3]))
    _same(_run(small, "spec", prompts, news), _run(ref, "spec", prompts, news))
    assert sum(small.worker.runner("draft_prefill").stats.calls.values()) >= 3
    with pytest.raises(ValueError, match="draft_prefill must be"):
        _worker(target, head, "runner", draft_prefill="graphs")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_cuda_draft_prefill_runner_gives_the_eager_tokens(kind):
    """cuda backend, tiny bf16 models, the head's layer compiled as on a GPU by default: the
    draft-prefill graphs give the eager draft prefill's tokens, in two buckets."""
    target, head = _models(kind)
    target, head = target.cuda().to(torch.bfloat16), head.cuda().to(torch.bfloat16)
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    kw = dict(backend="cuda")
    runner = _worker(target, head, "runner", draft_prefill="runner", **kw)
    eager = _worker(target, head, "runner", **kw)
    for p, n in ((prompts, news), (prompts[:2], news[:2])):
        (ra, _), (rb, _) = _run(runner, "spec", p, n), _run(eager, "spec", p, n)
        assert [r.output for r in ra] == [r.output for r in rb], (kind, len(p))
    st = runner.worker.runner("draft_prefill").stats
    assert st.calls[48] == 1 and st.calls[16] == 1 and st.eager_fallbacks == 0


def test_compiled_draft_prefill_runner_gives_the_eager_tokens():
    """With the head's layer compiled regionally (the GPU default for the draft runners), the
    draft-prefill runner compiles for the token ladder and serves the eager draft prefill's
    tokens."""
    target, head = _models("llama")
    prompts, news = _prompts(target.cfg.vocab_size), [m for _, m in LENS]
    compiled = _worker(target, head, "runner", torch_compile=True, draft_prefill="runner")
    opts = compiled.worker.options("draft_prefill")["torch_compile"]
    assert opts["regions"] == [head.layer]
    eager = _worker(target, head, "runner")
    (ra, _), (rb, _) = _run(compiled, "spec", prompts, news), _run(eager, "spec", prompts, news)
    assert [r.output for r in ra] == [r.output for r in rb]
    assert compiled.worker.runner("draft_prefill").stats.compiles >= 1


def test_shifted_prompts_against_a_loop():
    """The head's prefill tokens: each prompt shifted by one, its first generated token last;
    padded tokens and padded requests (qo_indptr repeating its last value) change nothing real."""
    from padgraph.llm.bodies import shifted_prompts
    prompts = [[5, 6, 7], [9], [1, 2]]
    first = torch.tensor([50, 90, 10, 0, 0])                   # two padded requests
    ids = torch.tensor(sum(prompts, []) + [0, 0, 0])           # three padded tokens
    qo = torch.tensor([0, 3, 4, 6, 6, 6], dtype=torch.int32)
    want = sum(([*p[1:], int(f)] for p, f in zip(prompts, first)), [])
    got = shifted_prompts(ids, qo, first)
    assert got[:6].tolist() == want == [6, 7, 50, 90, 2, 10]
    assert got[6:].tolist() == [0, 0, ids[0].item()]           # pads: the next (padded) token
