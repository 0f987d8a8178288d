"""The hybrid reference model (attention + Mamba2 layers, `padgraph.llm.models.hybrid`) served by
the engine: its recurrent state in slot pools indexed by request row (sink row 0, canary row 1).

Plain decoding, greedy and sampled, gives the tokens of the dense full-sequence forward (fp32, CPU,
reference backend), with continuous admission through fewer rows than requests and with every
row's old contents poisoned (a reused row starts from zeros, never read). EAGLE verify runs the
tree's nodes through the recurrent layers and keeps the accepted node's state: speculative
decoding gives greedy decoding's tokens (chain and tree, random and passthrough heads), a
partially accepted chain leaves the state decode leaves after the accepted tokens. `pg.check`
passes every runner program and reports a padded lane whose recurrent row is clamped onto a
live request's row. `cuda` tests replay the programs in CUDA graphs, bf16 and fp32.
"""
import pytest
import torch

import padgraph as pg
from padgraph.llm import Batch, Engine, SpecConfig, Worker, checks
from padgraph.llm.kv import CANARY, FIRST, SINK
from padgraph.llm.models import EagleHead
from padgraph.llm.models.hybrid import HybridConfig, HybridModel
from padgraph.llm.oracle import TIE_TOL, compare, first_divergences
from padgraph.llm.sampling import PURPOSE_DECODE, sample
from padgraph.llm.sampling import SamplingParams as SP
from padgraph.llm.state import pack_prompts

LENS = [(5, 6), (9, 4), (3, 7), (7, 5)]                    # (prompt, max_new)
MIX = [SP(temperature=1.0, seed=11), SP(), SP(temperature=0.7, top_k=20, top_p=0.9, seed=12),
       SP(temperature=0.5, min_p=0.1, seed=13)]
RECURRENT = ("conv_state", "ssm_state")


@pytest.fixture(scope="module")
def model():
    return HybridModel(HybridConfig.tiny()).eval()


def _prompts(vocab, lens=LENS, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n, _ in lens]


def _engine(target, head=None, spec=SpecConfig(3, 2, 5), max_bs=3, buckets=(2, 4), **kw):
    """max_bs 3 on buckets (2, 4): every batch of 1 or 3 requests has a padded lane."""
    return Engine(target, head, spec, max_bs=max_bs, max_context=32, buckets=pg.Buckets(list(buckets)), **kw)


def _serve(w, mode, prompts, news, sampling=None):
    gen = w.generate_spec if mode == "spec" else w.generate_greedy
    with torch.no_grad():
        reqs, stats = gen(prompts, news, sampling=sampling)
    return reqs, stats


def _dense(target, prompt, output, params: SP, seed: int):
    """The tokens the dense forward gives after `prompt` with `output` fed back (teacher forcing):
    the argmax, or drawn with the request's keys (seed, absolute position, PURPOSE_DECODE) as
    decode draws. Equal to `output` iff greedy / sampled decoding of the dense forward emits it."""
    with torch.no_grad():
        logits, _ = target.forward_dense(torch.tensor([prompt + output[:-1]]))
    logits = logits[0, len(prompt) - 1:]                                     # [n_out, V]
    n = logits.shape[0]
    lane = dict(temperature=torch.full((n,), float(params.temperature)),
                top_k=torch.full((n,), params.top_k, dtype=torch.int32),
                top_p=torch.full((n,), float(params.top_p)), min_p=torch.full((n,), float(params.min_p)),
                seed=torch.full((n,), seed, dtype=torch.int64))
    positions = len(prompt) + torch.arange(n)
    return sample(logits, **lane, position=positions, purpose=PURPOSE_DECODE).tolist()


def _assert_dense(target, prompts, reqs, params):
    for p, r, sp in zip(prompts, reqs, params):
        assert r.output == _dense(target, p, r.output, sp, r.seed), f"request {r.rid} ({sp})"


def _released(w):
    return w.pool.slots.all_free and w.pool.rows.all_free and not w.worker.kv.req_to_token[FIRST:].any()


def _passthrough(target):
    head = EagleHead(target)
    head.init_passthrough()                     # the target's bigram path: accepts some drafts
    return head.eval()


def _recurrent_pools(w):
    return [t for name in RECURRENT for t in w.worker.kv.state()[name]]


# ---------------------------------------------------------------- plain decoding

def test_greedy_and_sampled_decoding_equal_the_dense_forward(model):
    """Four requests through three rows (rows reused: continuous admission), padded lanes in
    every bucket: greedy and sampled tokens are the dense forward's, token for token."""
    w = _engine(model)
    ps, news = _prompts(model.cfg.vocab_size), [n for _, n in LENS]
    for params in ([SP()] * len(ps), MIX):
        reqs, stats = _serve(w, "greedy", ps, news, params)
        assert [len(r.output) for r in reqs] == news and stats.prefills > 1
        _assert_dense(model, ps, reqs, params)
    assert _released(w)
    assert sum(w.worker.runner("decode").stats.padded_lanes.values()) > 0


def test_reused_rows_start_from_zero_whatever_they_hold(model):
    """Every row of the recurrent and per-node pools but the canary filled with nan (a released
    row keeps its last occupant's state, SPEC 7.9.4): a prefill starts its requests from zeros by
    selection, a verify writes each node's row before reading it, and no raw lane reads the sink,
    so plain and speculative tokens are still the dense forward's."""
    w = _engine(model, _passthrough(model))
    ps, news = _prompts(model.cfg.vocab_size, seed=7), [n for _, n in LENS]
    for mode in ("greedy", "spec"):
        _serve(w, mode, ps[:1], news[:1])                    # runners compiled: canary rows armed
    rows = [r for r in range(w.worker.kv.req_to_token.shape[0]) if r != CANARY]
    for mode in ("greedy", "spec"):
        for t in (t for name in (*RECURRENT, "tree_conv", "tree_ssm") for t in w.worker.kv.state()[name]):
            t[rows] = float("nan")
        reqs, _ = _serve(w, mode, ps, news, MIX)
        _assert_dense(model, ps, reqs, MIX)


def test_the_tokens_depend_on_the_recurrent_state(model):
    """The tests above can fail: decoding whose recurrent rows are zeroed before every step (a
    decode that never reads the state the prefill and earlier steps left) gives other tokens."""
    class Forgetful(HybridModel):
        def _run(self, input_ids, positions, plan, kv):
            if plan.recurrent.cu_seqlens is None:          # decode: forget every row first
                for t in (*kv.conv, *kv.ssm):
                    t[FIRST:].zero_()
            return super()._run(input_ids, positions, plan, kv)

    forgetful = Forgetful(model.cfg).eval()
    ps, news = _prompts(model.cfg.vocab_size), [n for _, n in LENS]
    reqs, _ = _serve(_engine(forgetful), "greedy", ps, news)
    wrong = [r.rid for p, r in zip(ps, reqs) if r.output != _dense(model, p, r.output, SP(), 0)]
    assert len(wrong) >= 3, wrong


# ---------------------------------------------------------------- speculative decoding

@pytest.mark.parametrize("head_kind, spec", [("passthrough", SpecConfig(4, 1, 5)),
                                             ("passthrough", SpecConfig(3, 2, 5)),
                                             ("random", SpecConfig(3, 2, 5))],
                         ids=["passthrough-chain", "passthrough-tree", "random-tree"])
def test_speculative_decoding_emits_greedy_decodings_tokens(model, head_kind, spec):
    """EAGLE rounds over the hybrid target: each verify runs k tree nodes through the recurrent
    layers and keeps the accepted node's state. Greedy requests get greedy decoding's tokens
    (which are the dense forward's); the passthrough head accepts part of its drafts."""
    head = EagleHead(model).eval() if head_kind == "random" else _passthrough(model)
    w = _engine(model, head, spec)
    ps, news = _prompts(model.cfg.vocab_size), [n for _, n in LENS]
    spec_reqs, stats = _serve(w, "spec", ps, news)
    greedy, _ = _serve(w, "greedy", ps, news)
    assert [r.output for r in spec_reqs] == [r.output for r in greedy]
    _assert_dense(model, ps, greedy, [SP()] * len(ps))
    if head_kind == "passthrough":               # partial acceptance: between none and all
        assert 1.2 < stats.accept_len < spec.steps + 0.5, stats
    assert _released(w)


@pytest.mark.parametrize("opaque", [False, True], ids=["inductor", "opaque-ops"])
def test_compiled_bodies_serve_greedy_and_speculative_tokens(model, opaque):
    """The decoder layers compiled as regions (decode and verify; the reference backend on the
    CPU): greedy and EAGLE tokens equal the uncompiled engine's. With `opaque_recurrent` the
    traced Mamba layers hold padgraph's recurrent ops (decode: conv and SSM updates; verify: the
    tree updates); without, none (inductor's code for the references)."""
    target = HybridModel(model.cfg, opaque_recurrent=opaque).eval()
    target.load_state_dict(model.state_dict())
    head, spec = _passthrough(target), SpecConfig(3, 2, 5)
    ps, news = _prompts(model.cfg.vocab_size)[:2], [5, 4]
    eager = _engine(target, head, spec, buckets=(2,))
    want_greedy, want_spec = _serve(eager, "greedy", ps, news)[0], _serve(eager, "spec", ps, news)[0]
    graphs = []
    regions = {"regions": target.layers, "fullgraph": True, "passes": [lambda gm, _: graphs.append(str(gm.graph))]}
    compiled = _engine(target, head, spec, buckets=(2,), compile_options={"torch_compile": regions})
    greedy, spec_reqs = _serve(compiled, "greedy", ps, news)[0], _serve(compiled, "spec", ps, news)[0]
    assert [r.output for r in greedy] == [r.output for r in want_greedy]
    assert [r.output for r in spec_reqs] == [r.output for r in want_spec]
    ops = {op for op in ("ssm_decode_update", "conv_state_update", "ssm_tree_update", "conv_tree_update")
           if any(f"padgraph.{op}" in g for g in graphs)}
    assert graphs and ops == ({"ssm_decode_update", "conv_state_update", "ssm_tree_update", "conv_tree_update"}
                              if opaque else set()), ops
    assert _released(compiled)


def test_speculative_sampling_emits_what_plain_sampling_draws(model):
    """Sampled requests ("draws" rule): the speculative round emits what decode draws at the
    same positions with the same keys, through the rolled-back recurrent state."""
    w = _engine(model, _passthrough(model), SpecConfig(3, 2, 5))
    ps, news = _prompts(model.cfg.vocab_size, seed=9), [n for _, n in LENS]
    spec_reqs, stats = _serve(w, "spec", ps, news, MIX)
    plain, _ = _serve(w, "greedy", ps, news, MIX)
    assert [r.output for r in spec_reqs] == [r.output for r in plain]
    assert stats.accept_len > 1.1, stats


def _greedy_chain(target, prompt, n):
    """The dense forward's next n greedy tokens after `prompt`."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = target.forward_dense(torch.tensor([prompt + out]), last_only=True)
            out.append(int(logits[0].argmax()))
    return out


def test_verify_keeps_the_state_of_the_accepted_prefix(model):
    """A chain verify where request 0 accepts two of four drafts and request 1 none: each row
    then holds the state that decoding its accepted tokens one step at a time leaves, not the
    state of the chain's last node (which the per-node pools hold)."""
    spec = SpecConfig(steps=4, topk=1, num_draft_tokens=5)
    w = _engine(model, EagleHead(model).eval(), spec)
    ps = _prompts(model.cfg.vocab_size)[:2]
    reqs = w.admit(ps, [8, 8])
    with torch.no_grad():
        logits, _, b = w.worker.prefill(reqs)
    first = logits.argmax(-1).tolist()
    k, V = spec.num_draft_tokens, model.cfg.vocab_size
    chains, accepted = [], (2, 0)
    for p, f, n_ok in zip(ps, first, accepted):
        good = _greedy_chain(model, p + [f], k - 1)
        chains.append([f] + good[:n_ok] + [(t + 1) % V for t in good[n_ok:]])   # wrong after n_ok
    rows, L = b.rows, b.seq_lens
    pos = L.long()[:, None] + torch.arange(k)
    before = [t.clone() for t in _recurrent_pools(w)]
    with torch.no_grad():
        v = w.worker.runner("verify")(input_ids=torch.tensor(chains).view(-1), positions=pos.view(-1),
                               out_cache_loc=w.worker.kv.req_to_token[rows.long()[:, None], pos].long().view(-1),
                               seq_lens=L, req_pool_indices=rows,
                               tree_mask=torch.tril(torch.ones(k, k, dtype=torch.bool)).repeat(2, 1, 1),
                               **w.worker.lanes(reqs).inputs())
    assert v.accept_len.tolist() == [n + 1 for n in accepted]
    after_verify = [t[rows.long()].clone() for t in _recurrent_pools(w)]
    chain_end = [t[rows.long(), k - 1].clone() for t in w.worker.kv.state()["tree_ssm"]]
    for t, saved in zip(_recurrent_pools(w), before):           # back to the state after prefill
        t.copy_(saved)
    for r, (chain, n_ok) in enumerate(zip(chains, accepted)):  # decode the accepted tokens
        for i, tok in enumerate(chain[:n_ok + 1]):
            p = int(L[r]) + i
            with torch.no_grad():
                w.worker.runner("decode")(input_ids=torch.tensor([tok]), positions=torch.tensor([p]),
                                   seq_lens=torch.tensor([p + 1], dtype=torch.int32),
                                   req_pool_indices=rows[r:r + 1],
                                   out_cache_loc=w.worker.kv.req_to_token[rows[r].long(), p:p + 1].long(),
                                   **w.worker.lanes(reqs[r:r + 1]).inputs())
    for got, t in zip(after_verify, _recurrent_pools(w)):
        torch.testing.assert_close(got, t[rows.long()], rtol=1e-5, atol=1e-5)
    ssm_rows = after_verify[len(w.worker.kv.ssm):]
    for row_state, end in zip(ssm_rows, chain_end):             # the rejected tail was rolled back
        assert not torch.allclose(row_state, end, rtol=1e-3, atol=1e-3)
    for r in reqs:
        w.release(r)


# ---------------------------------------------------------------- the contract

def test_programs_declare_the_recurrent_pools_as_sink_state(model):
    """The target's runners declare the recurrent and per-node pools `pg.State(sink=0,
    canary=1)`, one row per request row; the draft head's runners keep only their K/V; a
    plain-decoding engine keeps no per-node pools."""
    spec = SpecConfig(3, 2, 5)
    w = _engine(model, EagleHead(model).eval(), spec)
    cfg, n_rows = model.cfg, w.worker.kv.req_to_token.shape[0]
    names = ("conv_state", "ssm_state", "tree_conv", "tree_ssm")
    for prog in ("decode", "verify"):
        state = w.worker.programs[prog].state
        assert all((state[n].sink, state[n].canary) == (SINK, CANARY) for n in names), state
    for prog in ("draft", "draft_extend"):
        assert set(w.worker.programs[prog].state) == {"k_cache", "v_cache", "req_to_token"}
    n_m = cfg.pattern.count("M")
    st = w.worker.kv.state()
    assert [t.shape for t in st["conv_state"]] == [(n_rows, cfg.conv_dim, cfg.conv_kernel - 1)] * n_m
    state_shape = (cfg.ssm_heads, cfg.ssm_head_dim, cfg.d_state)
    assert [t.shape for t in st["ssm_state"]] == [(n_rows, *state_shape)] * n_m
    assert [t.shape[:2] for t in st["tree_ssm"]] == [(n_rows, spec.num_draft_tokens)] * n_m
    assert len(st["k_cache"]) == cfg.pattern.count("A")
    per_row_node = 4 * (cfg.conv_dim * (cfg.conv_kernel - 1) + cfg.ssm_heads * cfg.ssm_head_dim * cfg.d_state)
    assert w.worker.kv.tree_nbytes() == n_rows * spec.num_draft_tokens * n_m * per_row_node
    plain = _engine(model)
    assert set(plain.worker.kv.state()) == {"k_cache", "v_cache", "conv_state", "ssm_state"}


CHECKED = ["decode", "verify", "draft", "draft_extend", "prefill", "draft_prefill"]


@pytest.fixture(scope="module")
def checked_worker(model):
    return Worker(model, EagleHead(model).eval(), SpecConfig(3, 2, 5), max_bs=4, max_context=16,
                  buckets=pg.Buckets([1, 2, 4]), prefill="runner", draft_prefill="runner", prefill_tokens=32)


@pytest.mark.parametrize("name", CHECKED)
def test_check_passes_every_runner_program(checked_worker, name):
    res = checks.check(checked_worker, names=[name], trials=2, tolerance=(1e-5, 1e-5))[name]
    assert res.ok and not res.findings, str(res)


class ClampedHybrid(HybridModel):
    """The bug: padded lanes' recurrent row clamped onto the first request row (a live one)."""

    def recurrent_slots(self, b):
        return b.req_pool_indices.long().clamp(min=FIRST)


@pytest.mark.parametrize("name", ["decode", "verify"])
def test_check_reports_a_padded_lane_clamped_onto_a_live_row(name):
    """The all-pad run writes the clamped row (state-write), and a raw lane on that row is
    overwritten by the padded lanes after it (state-leakage)."""
    bad = ClampedHybrid(HybridConfig.tiny()).eval()
    w = Worker(bad, EagleHead(bad).eval(), SpecConfig(3, 2, 5), max_bs=4, max_context=16,
               buckets=pg.Buckets([1, 2, 4]))
    res = checks.check(w, names=[name], trials=2)[name]
    found = {(f.kind, f.buffer.split("[")[0]) for f in res.findings}
    for pool in RECURRENT:
        assert {("state-write", f"state '{pool}"), ("state-leakage", f"state '{pool}")} <= found, str(res)
    recurrent = [f for f in res.findings if f.buffer.split("[")[0] in {f"state '{p}" for p in RECURRENT}]
    assert {row for f in recurrent for row in f.rows} == {FIRST}, str(res)   # the row the clamp lands on


def _tree_mask(parents):
    """[k, k] bool: node i sees itself and its ancestors (parents[i] < i, -1 at the root)."""
    k = len(parents)
    mask = torch.eye(k, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def test_triton_kernels_give_the_references_results(model):
    """The recurrent layers' Triton kernels (interpreted on the CPU) through the hybrid's own
    plumbing (strided views of the projections, the per-node pools flattened to one slot axis),
    on an extend, a decode step with a padded lane and a tree verify with its commit: the same
    hidden states and rows as the torch references."""
    spec = SpecConfig(3, 2, 5)
    w = _engine(model, EagleHead(model).eval(), spec)
    ps = _prompts(model.cfg.vocab_size)[:2]
    reqs = w.admit(ps, [4, 4])
    b, rt, k = pack_prompts(reqs, w.worker.kv.req_to_token), w.worker.kv.req_to_token, spec.num_draft_tokens
    rows = torch.cat([b.rows, torch.zeros(1, dtype=torch.int32)])              # + a padded lane: row 0
    L = torch.cat([b.seq_lens, torch.ones(1, dtype=torch.int32)])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (3 * (k + 1),), generator=g)
    mask = _tree_mask([-1, 0, 0, 1, 2]).repeat(3, 1, 1)          # two branches of depth 2
    pos_t = (L.long() + 1)[:, None] + torch.arange(k)
    state = [t for ts in w.worker.kv.state().values() for t in ts]
    start = [t.clone() for t in state]

    def run(impl):
        for t, s0 in zip(state, start):
            t.copy_(s0)
        with torch.no_grad():
            ext = Batch(w.worker.kv, rt, b.rows, b.seq_lens, b.loc, qo_indptr=b.qo, impl=impl)
            h_ext = model.forward_extend_hidden(b.ids, b.positions, ext)
            dec = Batch(w.worker.kv, rt, rows, L + 1, rt[rows.long(), L.long()].long(), impl=impl)
            _, h_dec = model.forward_decode(ids[:3], L.long(), dec)
            tree = Batch(w.worker.kv, rt, rows, L + 1 + k, rt[rows.long()[:, None], pos_t].long().view(-1),
                         tree_mask=mask, impl=impl)
            h_tree = model.forward_verify_hidden(ids[3:], pos_t.view(-1), tree)
            model.commit_tree(tree, torch.tensor([3, 4, 0]))
        return [h_ext, h_dec[:2], h_tree[:2 * k]] + [t[FIRST:].clone() for t in state]

    for want, got in zip(run("torch"), run("triton")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for r in reqs:
        w.release(r)


# ---------------------------------------------------------------- CUDA graphs

def _gpu_config():
    """Awkward sizes for the kernels' masks: 6 heads of 20 channels, d_state 24 in 2 groups."""
    return HybridConfig.tiny(vocab_size=1024, hidden_size=128, pattern="MAMMA", n_heads=4,
                             n_kv_heads=2, head_dim=32, ffn_size=256, ssm_heads=6, ssm_head_dim=20,
                             d_state=24, n_groups=2, init_std=0.06)


def _gpu_prompts(vocab, n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 30, (n,), generator=g).tolist()
    news = torch.randint(5, 30, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (m,), generator=g).tolist() for m in lens], news


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True, "opaque"], ids=["kernels", "torch_compile", "compile-opaque-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_serve_the_hybrid(dtype, compiled):
    """11 requests through 8 rows on the cuda backend (graphs), the recurrent layers in the Triton
    kernels (or inductor's code for their references, torch_compile; or the kernels as opaque ops
    inside the compiled bodies, `opaque_recurrent`): greedy equals the eager
    reference backend on the same GPU, speculative equals greedy (bf16: up to top-2 near-ties),
    fp32 greedy equals the CPU dense forward up to near-ties, sampled speculative equals sampled
    plain decoding (fp32), and every row comes back."""
    torch.manual_seed(0)
    cpu = HybridModel(_gpu_config()).eval()
    target = HybridModel(_gpu_config(), opaque_recurrent=compiled == "opaque").eval().cuda().to(dtype)
    head = _passthrough(target).cuda().to(dtype)
    spec = SpecConfig(4, 2, 6)
    kw = dict(max_bs=8, max_context=96, buckets=pg.Buckets([1, 2, 4, 8]))
    graphs = Engine(target, head, spec, backend="cuda", torch_compile=bool(compiled), **kw)
    eager = Engine(target, head, spec, backend="reference", **kw)
    ps, news = _gpu_prompts(target.cfg.vocab_size)
    greedy, _ = _serve(graphs, "greedy", ps, news)
    spec_reqs, stats = _serve(graphs, "spec", ps, news)
    ref, _ = _serve(eager, "greedy", ps, news)
    if not compiled:                # the same kernels at the same buckets, captured or not
        assert [r.output for r in greedy] == [r.output for r in ref]
    tol = 1e-3 if dtype == torch.float32 else TIE_TOL
    for other in (ref, spec_reqs):
        exact, ties, real = compare(greedy, other, tol)     # ties end a row's comparison: most
        assert not real and exact >= len(ps) // 2, (exact, ties, real)   # rows run to the end
    if dtype == torch.float32:
        dense = []
        for p, r in zip(ps, greedy):
            with torch.no_grad():
                logits, _ = cpu.forward_dense(torch.tensor([p + r.output[:-1]]))
            dense.append(logits[0, len(p) - 1:].argmax(-1).tolist())
        _, _, real = first_divergences(dense, [r.output for r in greedy], [r.gaps for r in greedy], 1e-3)
        assert not real, real
        params = [SP(temperature=0.8, top_k=50, seed=s) for s in range(len(ps))]
        a, _ = _serve(graphs, "spec", ps, news, params)
        b, _ = _serve(graphs, "greedy", ps, news, params)
        assert [r.output for r in a] == [r.output for r in b]
    assert stats.accept_len > 1.2, stats
    assert _released(graphs)


@pytest.mark.cuda
def test_cuda_check_passes_and_reports_the_clamped_lane():
    """`pg.check` with the state on the GPU (the Triton kernels, padded lanes racing at the sink):
    every runner program passes; the clamped variant is reported on its recurrent pools."""
    dev = torch.device("cuda")
    kw = dict(max_bs=4, max_context=24, buckets=pg.Buckets([1, 2, 4]), prefill="runner", prefill_tokens=64)
    good = HybridModel(_gpu_config()).eval().to(dev)
    w = Worker(good, EagleHead(good).eval().to(dev), SpecConfig(3, 2, 5), **kw)
    for name, res in checks.check(w, trials=2, tolerance=(1e-4, 1e-4)).items():
        assert res.ok and not res.findings, str(res)
    bad = ClampedHybrid(_gpu_config()).eval().to(dev)
    wb = Worker(bad, EagleHead(bad).eval().to(dev), SpecConfig(3, 2, 5), **kw)
    for name, res in checks.check(wb, names=["decode", "verify"], trials=2).items():
        found = {f.buffer.split("[")[0] for f in res.findings if f.kind == "state-write"}
        assert {f"state '{pool}" for pool in RECURRENT} <= found, str(res)

