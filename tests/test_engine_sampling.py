"""Sampling in padgraph.llm's engine, under the padding contract (CPU, reference backend, tiny
models; `cuda` variants replay captured graphs).

A request's tokens depend only on its prompt, its `SamplingParams` and its seed: the same alone or
beside others, in any row, in any bucket, with overlap on or off, on a rerun, graph or eager.
Greedy (temperature 0, the default) keeps the tokens of the greedy-only programs
(`sampling=False`). Speculative sampling (EAGLE tree, MTP chain) with the "draws" rule emits
exactly what plain sampling draws at the same positions with the same keys; with either rule the
joint distribution of the first tokens is the target's (chi-square against the exact joint,
where a rule that accepts any child the target could emit fails). Sampling parameters are padded
per-request inputs: padded lanes read their declared pads, parameters seen at capture never
reach a live call, `pg.check` and the shadow see sampled programs and flag a body that draws
from torch's global generator.
"""
import copy
import dataclasses

import pytest
import torch

import padgraph as pg
from padgraph.backends.triton import eagle as ops
from padgraph.llm import Engine, SpecConfig, checks
from padgraph.llm import bodies as llm_bodies
from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.models.mtp_head import MTPHead
from padgraph.llm.sampling import SamplingParams as SP
from padgraph.llm.sampling import sampling_probs
from padgraph.llm.kv import FIRST
from sampling_stats import P_MIN, chi_square

SPEC = SpecConfig(steps=3, topk=2, num_draft_tokens=5)
LENS = [(5, 7), (9, 4), (3, 8), (7, 2)]                   # (prompt, max_new)
# the tiny random target's logits are nearly flat (std 0.16): low temperatures are where its
# filters and a draft's acceptance matter
MIX = [SP(temperature=1.0, seed=11), SP(), SP(temperature=0.05, top_k=8, top_p=0.9, seed=12),
       SP(temperature=0.04, min_p=0.2, seed=13)]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    return {"random": (target, EagleHead(target).eval()),
            "oracle": (target, EagleHead.copy_of_target(target).eval())}


def _prompts(vocab, lens=LENS, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n, _ in lens]


def _engine(target, head, spec=SPEC, buckets=(1, 2, 4, 8), **kw):
    return Engine(target, head, spec, max_bs=8, max_context=64, buckets=pg.Buckets(list(buckets)),
                  **kw)


def _serve(w, mode, prompts, news, sampling):
    gen = w.generate_spec if mode == "spec" else w.generate_greedy
    with torch.no_grad():
        reqs, _ = gen(prompts, news, sampling=sampling)
    return [r.output for r in reqs]


def _on(dev, pair):
    """(target, head) on `dev`: copies for the GPU (the module fixture stays on the CPU), copied
    together so the head keeps sharing the target's embedding and lm_head."""
    return pair if dev == "cpu" else tuple(m.to(dev) for m in copy.deepcopy(pair))


def _released(w):
    return (w.pool.slots.all_free and w.pool.rows.all_free
            and not w.worker.kv.req_to_token[FIRST:].any())


# ---------------------------------------------------------------- greedy stays greedy

@pytest.mark.parametrize("mode", ["spec", "greedy"])
def test_greedy_params_keep_todays_tokens(models, mode):
    """No `sampling`, `SamplingParams()` and temperature 0 with every filter set: the same
    tokens (temperature 0 is the argmax, whatever the filters)."""
    target, head = models["random"]
    w = _engine(target, head)
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    today = _serve(w, mode, ps, news, None)
    assert _serve(w, mode, ps, news, SP()) == today
    filtered = SP(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3, seed=7)
    assert _serve(w, mode, ps, news, [filtered] * len(ps)) == today
    assert [len(o) for o in today] == news and _released(w)


# ---------------------------------------------------------------- reproducible by construction

@pytest.mark.parametrize("mode,rule", [("spec", "draws"), ("spec", "rejection"),
                                       ("greedy", "draws")])
def test_a_requests_tokens_depend_only_on_prompt_params_and_seed(models, mode, rule):
    """The same tokens per request: batch in order, reversed (other rows and lanes), each alone,
    one bucket of 8 (other padding), overlap off, and a rerun. The sampled requests do sample
    (their tokens differ from greedy's somewhere)."""
    target, head = models["oracle"]
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    w = _engine(target, head, spec_sampling=rule)
    base = _serve(w, mode, ps, news, MIX)
    assert _serve(w, mode, ps, news, MIX) == base                                   # rerun
    rev = _serve(w, mode, ps[::-1], news[::-1], MIX[::-1])[::-1]
    alone = [_serve(w, mode, [p], [n], [s])[0] for p, n, s in zip(ps, news, MIX)]
    one_bucket = _serve(_engine(target, head, buckets=(8,), spec_sampling=rule), mode, ps,
                        news, MIX)
    no_overlap = _serve(_engine(target, head, overlap=False, spec_sampling=rule), mode, ps,
                        news, MIX)
    for name, other in [("reversed", rev), ("alone", alone), ("bucket 8", one_bucket),
                        ("overlap off", no_overlap)]:
        assert other == base, name
    greedy = _serve(w, mode, ps, news, None)
    assert base[1] == greedy[1]                                 # the greedy request among them
    assert any(b != g for b, g in zip(base, greedy)), "the sampled requests drew greedy tokens"
    assert _released(w)


def test_seedless_requests_draw_from_the_engine_seed(models):
    """Requests without a seed: a rerun reproduces; another engine seed draws other tokens;
    requests with equal prompts and parameters draw different tokens (each its own stream)."""
    target, head = models["random"]
    ps, news = _prompts(target.cfg.vocab_size), [12] * len(LENS)
    ps[1] = list(ps[0])                                        # same prompt as request 0
    hot = SP(temperature=1.5)
    a, b = (_engine(target, head, seed=s, spec_sampling="draws") for s in (3, 4))
    first = _serve(a, "spec", ps, news, hot)
    assert _serve(a, "spec", ps, news, hot) == first
    assert _serve(a, "greedy", ps, news, hot) == first         # spec emits what decode draws
    assert _serve(b, "spec", ps, news, hot) != first
    assert first[0] != first[1]


@pytest.mark.parametrize("head_kind", ["random", "oracle"])
def test_speculative_sampling_emits_what_plain_sampling_draws(models, head_kind):
    """EAGLE's tree verify draws each node's token with decode's keys and walks the draws: for
    any draft (random: almost all rejected; oracle: long accepted paths) the emitted tokens are
    plain sampling's, token for token."""
    target, head = models[head_kind]
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    w = _engine(target, head, spec_sampling="draws")
    assert _serve(w, "spec", ps, news, MIX) == _serve(w, "greedy", ps, news, MIX)
    cool = [SP(temperature=0.02, seed=s) for s in range(len(ps))]    # a sharp distribution
    with torch.no_grad():
        spec, stats = w.generate_spec(ps, news, sampling=cool)
    assert [r.output for r in spec] == _serve(w, "greedy", ps, news, cool)
    if head_kind == "oracle":
        assert stats.accept_len > 2             # sampled lanes accept drafts


@pytest.mark.parametrize("spec", [SpecConfig(3, 1, 4), SpecConfig(3, 2, 5)], ids=["chain", "tree"])
def test_mtp_speculative_sampling_emits_what_plain_sampling_draws(spec):
    """The DeepSeek target (MLA + MoE) with its MTP head, a chain (top-1 draft) and a tree:
    "draws" emits plain sampling's tokens; "rejection" keeps the greedy request's greedy tokens
    and every budget."""
    torch.manual_seed(0)
    target = DeepSeekModel(DeepSeekConfig.tiny()).eval()
    head = MTPHead(target).eval()
    w = _engine(target, head, spec=spec, spec_sampling="draws")
    ps, news = _prompts(target.cfg.vocab_size)[:3], [n for _, n in LENS[:3]]
    params = [SP(temperature=1.0, seed=1), SP(temperature=0.8, top_k=20, seed=2), SP()]
    plain = _serve(w, "greedy", ps, news, params)
    assert _serve(w, "spec", ps, news, params) == plain
    rejection = _serve(_engine(target, head, spec=spec, spec_sampling="rejection"), "spec", ps,
                       news, params)
    assert rejection[2] == plain[2] and [len(o) for o in rejection] == news
    assert _released(w)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["spec", "greedy"])
def test_cuda_graphs_serve_the_eager_sampled_tokens(models, mode):
    """Captured graphs (layers eager, so the kernels are the same) against the reference
    backend's eager runs on the same GPU, and alone against in a batch, on the graphs."""
    target, head = _on("cuda", models["oracle"])
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    graphs = _engine(target, head, backend="cuda", torch_compile=False)
    eager = _engine(target, head, backend="reference")
    base = _serve(graphs, mode, ps, news, MIX)
    assert base == _serve(eager, mode, ps, news, MIX)
    assert [_serve(graphs, mode, [p], [n], [s])[0] for p, n, s in zip(ps, news, MIX)] == base
    assert _serve(_engine(target, head, backend="cuda", torch_compile=False, overlap=False),
                  mode, ps, news, MIX) == base


@pytest.mark.cuda
def test_cuda_graphs_serve_the_eager_tokens_of_the_rejection_rule(models):
    """spec_sampling="rejection" in captured graphs (verify's probabilities from the Triton
    sampler's thresholds, the tree walk and the residual draw inside the graph) against the
    reference backend's eager runs on the same GPU, and with overlap off. The random head's
    drafts are mostly rejected, so residual draws decide most tokens."""
    target, head = _on("cuda", models["random"])
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    kw = dict(spec_sampling="rejection")
    graphs = _engine(target, head, backend="cuda", torch_compile=False, **kw)
    base = _serve(graphs, "spec", ps, news, MIX)
    assert base == _serve(_engine(target, head, backend="reference", **kw), "spec", ps, news, MIX)
    assert _serve(_engine(target, head, backend="cuda", torch_compile=False, overlap=False, **kw),
                  "spec", ps, news, MIX) == base
    assert [len(o) for o in base] == news and _released(graphs)


# ---------------------------------------------------------------- stops, budgets, bad input

@pytest.mark.parametrize("mode", ["spec", "greedy"])
def test_stop_tokens_finish_a_request_and_are_emitted(models, mode):
    target, head = models["random"]
    w = _engine(target, head)
    ps = _prompts(target.cfg.vocab_size)[:2]
    free = _serve(w, mode, ps, None, [SP(temperature=1.0, seed=5, max_new_tokens=12)] * 2)
    assert [len(o) for o in free] == [12, 12]                 # the params' budget
    stop = free[0][4]
    params = [SP(temperature=1.0, seed=5, max_new_tokens=12, stop_token_ids=(stop,))] * 2
    got = _serve(w, mode, ps, None, params)
    for f, g in zip(free, got):
        cut = f.index(stop) + 1 if stop in f else len(f)
        assert g == f[:cut]
    assert got[0][-1] == stop and _released(w)
    # an explicit max_new_tokens is the call's budget, over the params'
    assert _serve(w, mode, ps, [3, 5], params[0]) == [got[0][:3], got[1][:5]]


def test_a_greedy_only_engine_keeps_todays_programs_and_refuses_sampling(models):
    """sampling=False: decode and verify declare no sampling inputs, serve the sampling
    engine's greedy tokens, and a request with temperature > 0 is refused before admission."""
    target, head = models["random"]
    greedy_only, sampling = _engine(target, head, sampling=False), _engine(target, head)
    assert "temperature" not in greedy_only.worker.programs["verify"].inputs
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    for mode in ("spec", "greedy"):
        assert _serve(greedy_only, mode, ps, news, None) == _serve(sampling, mode, ps, news, None)
    with pytest.raises(pg.ContractValueError, match=r"requests \[1\] sample.*sampling=False"):
        _serve(greedy_only, "spec", ps[:2], [3, 3], [SP(), SP(temperature=0.5)])
    assert _released(greedy_only)


BAD_SAMPLING = [
    ("too few", [SP()], pg.ContractValueError, "2 prompts but 1 sampling"),
    ("not params", [SP(), {"temperature": 1.0}], pg.ContractTypeError, "request 1: sampling must"),
    ("a dict", {"temperature": 1.0}, pg.ContractTypeError, "sampling must be a SamplingParams"),
]


@pytest.mark.parametrize("case", BAD_SAMPLING, ids=[c[0] for c in BAD_SAMPLING])
def test_bad_sampling_fails_before_any_request_is_admitted(models, case):
    _, sampling, exc, msg = case
    target, head = models["random"]
    w = _engine(target, head)
    with pytest.raises(exc, match=msg):
        _serve(w, "spec", _prompts(target.cfg.vocab_size)[:2], [3, 3], sampling)
    assert _released(w)


# ---------------------------------------------------------------- the padding contract

def _decode_call(w, gen, bs, lanes=None):
    raw = checks.sampler(w, "decode")(gen)
    while raw["seq_lens"].shape[0] != bs:
        raw = checks.sampler(w, "decode")(gen)
    if lanes is not None:
        raw.update(lanes)
    return raw


def _hot(bs, seed0=100):
    return dict(temperature=torch.full((bs,), 1.3), top_k=torch.full((bs,), 3, dtype=torch.int32),
                top_p=torch.full((bs,), 0.8), min_p=torch.full((bs,), 0.01),
                seed=torch.arange(seed0, seed0 + bs))


@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_padded_lanes_read_their_declared_pads(models, backend):
    """A call of 3 in bucket 4 after a call of 4 with other parameters: the body sees the pads
    (temperature 0, top_k 0, top_p 1, min_p 0, seed 0) on lane 3, not the earlier call's."""
    dev = "cuda" if backend == "cuda" else "cpu"
    target, head = _on(dev, models["random"])
    w = _engine(target, head, backend=backend, buckets=(4,)).worker
    checks.own_slots(w)
    seen = []
    decode = llm_bodies.decode_body(target)

    def spy(x):
        seen.append({n: x[n].clone() for n in ("temperature", "top_k", "top_p", "min_p", "seed")})
        return decode(x)
    runner = pg.compile(w.programs["decode"], spy, backend, state=w.state("decode"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for bs in (4, 3):
            raw = _decode_call(w, gen, bs, _hot(bs))
            runner(**{k: v.to(dev) for k, v in raw.items()})
    pads = {n: w.programs["decode"].inputs[n].pad.value for n in seen[-1]}
    assert {n: t[3].item() for n, t in seen[-1].items()} == pytest.approx(pads)
    assert pads == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0}


@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_parameters_at_capture_never_reach_live_calls(models, backend):
    """Compile (cuda: capture) every bucket of decode and verify under one set of parameters,
    then serve others: each call's tokens equal the body run eagerly on the raw call."""
    dev = "cuda" if backend == "cuda" else "cpu"
    target, head = _on(dev, models["random"])
    w = _engine(target, head, backend=backend).worker
    checks.own_slots(w)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("decode", "verify"):
            for bs in (1, 2, 4, 8):                      # every bucket, under the capture set
                raw = checks.sampler(w, name)(gen)
                n = raw["seq_lens"].shape[0]
                raw.update(_hot(n, seed0=7))
                w.runner(name)(**{k: v.to(dev) for k, v in raw.items()})
            fresh = pg.compile(w.programs[name], w.bodies[name], "reference", state=w.state(name))
            for _ in range(4):
                raw = {k: v.to(dev) for k, v in checks.sampler(w, name)(gen).items()}
                saved = w.kv.req_to_token.clone()
                got = {k: v.clone() for k, v in w.runner(name)(**raw).items()}
                w.kv.req_to_token.copy_(saved)          # verify commits; the eager run redoes it
                want = fresh(**raw)
                key = "next_token" if name == "decode" else "out_tokens"
                assert torch.equal(got[key], want[key]), name


# ---------------------------------------------------------------- pg.check and the shadow

def test_check_flags_raw_lanes_that_read_padded_parameters(models):
    """A decode body that samples the whole batch at its mean temperature (pads included) makes
    a raw lane's token depend on the bucket: `pg.check` reports pad leakage on `next_token`.
    The correct body passes (`test_runners.test_check_runner_programs`)."""
    target, head = models["random"]
    w = _engine(target, head).worker

    def batch_temperature(x):
        logits, _ = target.forward_decode(x.input_ids, x.positions, llm_bodies.Batch.from_view(x))
        lanes = {n: x[n] for n in llm_bodies.SAMPLING_INPUTS}
        lanes["temperature"] = x.temperature.mean().expand_as(x.temperature) + 0.5
        return {"next_token": llm_bodies.draw(logits, lanes, x.positions + 1),
                "top2_gap": logits[:, 0]}
    checks.own_slots(w)
    with torch.no_grad():
        res = pg.check(w.programs["decode"], batch_temperature, state=w.state("decode"),
                       sample=checks.sampler(w, "decode"), trials=3)
        good = pg.check(w.programs["decode"], w.bodies["decode"], state=w.state("decode"),
                        sample=checks.sampler(w, "decode"), trials=3)
    assert not res.ok and any("next_token" in str(f.buffer) for f in res.findings), str(res)
    assert good.ok, str(good)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_shadow_verifies_sampled_calls_without_false_positives(models, backend):
    """Every call shadow-verified (eager padded re-run and exact run): sampled EAGLE and decode
    runs raise nothing, and serve the unshadowed engine's tokens."""
    dev = "cuda" if backend == "cuda" else "cpu"
    target, head = _on(dev, models["oracle"])
    ps, news = _prompts(target.cfg.vocab_size), [n for _, n in LENS]
    shadowed = _engine(target, head, backend=backend,
                       compile_options={"shadow": pg.Shadow(every=1)})
    plain = _engine(target, head, backend=backend)
    for mode in ("spec", "greedy"):
        assert _serve(shadowed, mode, ps, news, MIX) == _serve(plain, mode, ps, news, MIX)


def test_shadow_flags_a_body_that_samples_from_the_global_generator(models):
    """`torch.multinomial` draws from torch's global generator: the eager re-run draws other
    numbers, so the shadow reports the call (a keyed stream, as `sample` uses, re-draws the
    same)."""
    target, head = models["random"]
    w = _engine(target, head).worker
    checks.own_slots(w)

    def global_generator(x):
        logits, _ = target.forward_decode(x.input_ids, x.positions, llm_bodies.Batch.from_view(x))
        tok = torch.multinomial(torch.softmax(logits / 0.05, -1), 1)[:, 0]
        return {"next_token": tok, "top2_gap": logits[:, 0]}
    runner = pg.compile(w.programs["decode"], global_generator, "reference",
                        state=w.state("decode"), shadow=pg.Shadow(every=1))
    raw = _decode_call(w, torch.Generator().manual_seed(2), 6)
    with torch.no_grad(), pytest.raises(pg.ShadowMismatch, match="next_token"):
        runner(**raw)


# ---------------------------------------------------------------- distribution

def _exact_joint(target, prompt, params: SP, n_tok: int) -> dict:
    """{tokens: probability} of the first n_tok sampled tokens, from the dense forward and the
    reference sampler's distribution (`sampling_probs`), enumerated over its support."""
    lanes = (torch.tensor([params.temperature]), torch.tensor([params.top_k], dtype=torch.int32),
             torch.tensor([params.top_p]), torch.tensor([params.min_p]))
    out = {}

    def walk(seq, prefix, prob):
        if len(prefix) == n_tok:
            out[tuple(prefix)] = prob
            return
        logits, _ = target.forward_dense(torch.tensor([seq]), last_only=True)
        p = sampling_probs(logits, *lanes)[0].double()
        for t in p.nonzero()[:, 0].tolist():
            walk(seq + [t], prefix + [t], prob * float(p[t]))
    with torch.no_grad():
        walk(list(prompt), [], 1.0)
    return out


def _joint_counts(w, prompt, params: SP, n: int, n_tok: int) -> dict:
    """{tokens: count} of the first n_tok tokens of n requests of `prompt` (seeds 0 .. n-1)."""
    counts: dict = {}
    for lo in range(0, n, w.max_bs):
        seeds = range(lo, min(n, lo + w.max_bs))
        sampling = [dataclasses.replace(params, seed=s, max_new_tokens=n_tok) for s in seeds]
        with torch.no_grad():
            reqs, _ = w.generate_spec([prompt] * len(sampling), None, sampling=sampling)
        for r in reqs:
            counts[tuple(r.output)] = counts.get(tuple(r.output), 0) + 1
    return counts


def _p_value(counts: dict, exact: dict) -> float:
    cells = sorted(set(exact) | set(counts))
    _, _, p = chi_square(torch.tensor([counts.get(c, 0) for c in cells]),
                         torch.tensor([exact.get(c, 0.0) for c in cells]))
    return p


def support_only(logits, x, spec):
    """A wrong acceptance rule: a child is accepted whenever the target could emit it at all
    (p > 0), however unlikely; otherwise the node's decode draw."""
    bs, k = x.bucket, spec.num_draft_tokens
    lanes = {n: x[n].repeat_interleave(k) for n in llm_bodies.SAMPLING_INPUTS}
    probs = sampling_probs(logits, lanes["temperature"], lanes["top_k"], lanes["top_p"],
                           lanes["min_p"]).view(bs, k, -1)
    tokens, par = x.input_ids.view(bs, k), ops.tree_parents(x.tree_mask)      # [bs, k]
    at_parent = probs.gather(1, par.clamp_min(0)[:, :, None].expand(-1, -1, probs.shape[2]))
    ok = (at_parent.gather(2, tokens[:, :, None])[..., 0] > 0) & (par >= 0)
    predict = llm_bodies.drawn_at_nodes(logits, x, spec)
    nodes = torch.arange(k, device=tokens.device)
    for j in reversed(range(1, k)):            # the lowest child index wins, as the walk takes
        hit = ok[:, j:j + 1] & (nodes[None] == par[:, j:j + 1])
        predict = torch.where(hit, tokens[:, j:j + 1], predict)
    return predict


JOINT = SP(temperature=0.03, top_k=3)


@pytest.mark.parametrize("rule", ["rejection", "draws", "support-only"])
def test_eagle_joint_distribution_of_the_first_tokens_is_the_targets(models, rule, monkeypatch):
    """The first three tokens (the prefill's draw, then a round's accepted drafts and residual
    or bonus draw) of 400 requests with seeds 0..399, against the exact joint of sampling from
    the target (27 outcomes: top-k 3 at a temperature where the three differ): chi-square
    p >= 1e-3 for both exact rules with a draft that proposes the target's own top-2 (long
    accepted paths and rejections both), and p < 1e-3 for a rule that accepts any child the
    target could emit."""
    target, head = models["oracle"]
    if rule == "support-only":
        monkeypatch.setitem(llm_bodies.SPEC_RULES, "rejection", support_only)
    w = Engine(target, head, SpecConfig(steps=2, topk=2, num_draft_tokens=4), max_bs=100,
               max_context=32, buckets=pg.Buckets([100]), overlap=False,
               spec_sampling="draws" if rule == "draws" else "rejection")
    prompt = _prompts(target.cfg.vocab_size)[0]
    exact = _exact_joint(target, prompt, JOINT, 3)
    p = _p_value(_joint_counts(w, prompt, JOINT, 400, 3), exact)
    assert (p >= P_MIN) == (rule != "support-only"), f"{rule}: p = {p:.2e}"
