"""The sampler's torch reference (`padgraph.llm.sampling`): parameters, the counter-based stream,
the distribution against Hugging Face's processors, goodness of fit of the draws (and a wrong
sampler failing the same test), greedy lanes, reproducibility, no host sync."""
from __future__ import annotations

import math

import pytest
import torch
from sampling_stats import P_MIN, chi_square, counts_of, exact_half_row, one_thread  # noqa: F401

import padgraph as pg
from padgraph.llm import sampling as S
from padgraph.llm.sampling import (PURPOSE_ACCEPT, PURPOSE_DECODE, SamplingParams, sample,
                                   sampling_probs)

V = 37


def lanes(n, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, position=None):
    """Per-lane parameter tensors [n], scalars broadcast."""
    def col(v, dtype):
        t = torch.as_tensor(v, dtype=dtype)
        return t.expand(n).clone() if t.dim() == 0 else t
    return dict(temperature=col(temperature, torch.float32), top_k=col(top_k, torch.int32),
                top_p=col(top_p, torch.float32), min_p=col(min_p, torch.float32),
                seed=col(torch.arange(n) if seed is None else seed, torch.int64),
                position=col(7 if position is None else position, torch.int64))


def probs_of(logits, p):
    return sampling_probs(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"])


def draw(logits, p, purpose=PURPOSE_DECODE, impl="torch"):
    return sample(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seed"],
                  p["position"], purpose, impl=impl)


def row(seed=0, scale=2.0):
    return torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * scale


# ------------------------------------------------------------------------------ helpers

def test_chi_square_passes_a_fair_die_and_fails_a_loaded_one():
    g = torch.Generator().manual_seed(0)
    p = torch.full((6,), 1 / 6, dtype=torch.float64)
    fair = torch.multinomial(p, 20000, replacement=True, generator=g)
    assert chi_square(counts_of(fair, 6), p)[2] >= P_MIN
    q = p.clone()
    q[0] += 0.03
    q[1] -= 0.03
    loaded = torch.multinomial(q, 20000, replacement=True, generator=g)
    assert chi_square(counts_of(loaded, 6), p)[2] < P_MIN


# --------------------------------------------------------------------------- parameters

@pytest.mark.parametrize("field,value,error", [
    ("temperature", -0.1, pg.ContractValueError),
    ("temperature", float("nan"), pg.ContractValueError),
    ("temperature", float("inf"), pg.ContractValueError),
    ("temperature", "1", pg.ContractTypeError),
    ("top_k", -1, pg.ContractValueError), ("top_k", 2.0, pg.ContractTypeError),
    ("top_p", 0.0, pg.ContractValueError), ("top_p", 1.01, pg.ContractValueError),
    ("min_p", -0.01, pg.ContractValueError), ("min_p", 1.5, pg.ContractValueError),
    ("seed", -1, pg.ContractValueError), ("seed", 2 ** 63, pg.ContractValueError),
    ("seed", 1.0, pg.ContractTypeError), ("max_new_tokens", 0, pg.ContractValueError),
    ("stop_token_ids", (1, -2), pg.ContractValueError), ("top_k", True, pg.ContractTypeError),
])
def test_params_reject_bad_values_naming_the_field(field, value, error):
    with pytest.raises(error, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_params_defaults_are_greedy_and_valid_values_pass():
    assert SamplingParams().greedy
    p = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=2 ** 63 - 1,
                       stop_token_ids=[2, 7], max_new_tokens=3)
    assert not p.greedy and p.stop_token_ids == (2, 7)
    assert SamplingParams(top_p=1, temperature=1).top_p == 1


def test_sample_checks_shapes_and_dtypes_naming_the_argument():
    logits = row()
    p = lanes(1, temperature=1.0)
    with pytest.raises(pg.ContractValueError, match="'top_k'.*shape"):
        draw(logits, {**p, "top_k": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(pg.ContractTypeError, match="'seed'.*dtype"):
        draw(logits, {**p, "seed": torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(pg.ContractValueError, match="'logits'.*shape"):
        draw(logits[0], p)


# ------------------------------------------------------------------------------ stream

def test_stream_is_uniform_and_independent_across_neighbouring_keys():
    """53-bit uniforms over 40000 (seed, position) keys: 64 equal bins fit; pairs at
    consecutive positions fill an 8 x 8 grid evenly (no correlation between neighbours)."""
    seeds = torch.arange(200).repeat_interleave(200)
    pos = torch.arange(200).repeat(200)
    u = S.uniform(seeds, pos, PURPOSE_DECODE)
    flat = torch.full((64,), 1 / 64, dtype=torch.float64)
    assert chi_square(counts_of((u * 64).long(), 64), flat)[2] >= P_MIN
    nxt = S.uniform(seeds, pos + 1, PURPOSE_DECODE)
    cell = (u * 8).long() * 8 + (nxt * 8).long()
    assert chi_square(counts_of(cell, 64), flat)[2] >= P_MIN
    other = S.uniform(seeds, pos, PURPOSE_ACCEPT)
    cell = (u * 8).long() * 8 + (other * 8).long()
    assert chi_square(counts_of(cell, 64), flat)[2] >= P_MIN
    bits = S.random_bits(seeds, pos, PURPOSE_DECODE)
    ones = torch.stack([((bits >> b) & 1).sum() for b in range(64)]).double() / bits.numel()
    assert ((ones - 0.5).abs() < 0.01).all()          # 40000 draws: 5 sigma is 0.0125


def test_stream_is_a_pure_function_of_its_key():
    a = S.random_bits(torch.tensor([5, 5, 6]), torch.tensor([9, 10, 9]), 2, torch.tensor(3))
    b = S.random_bits(torch.tensor([6, 5]), torch.tensor([9, 9]), 2, torch.tensor(3))
    assert a[0] == b[1] and a[2] == b[0]
    assert len(set(a.tolist())) == 3
    assert S.random_bits(5, 9, 2, 4) != S.random_bits(5, 9, 2, 3)
    assert S.random_bits(5, 9, 1, 3) != S.random_bits(5, 9, 2, 3)


def test_fixed_exp_and_mulhi62_are_exact_where_they_claim():
    d = torch.linspace(-27.5, 0, 200001)
    w = S.fixed_exp(d)
    ref = d.double().exp() * 2.0 ** 40
    big = ref > 2 ** 20
    assert ((w.double() - ref).abs() / ref)[big].max() < 2e-6
    assert bool((w[1:] >= w[:-1]).all())               # monotone in d
    assert S.fixed_exp(torch.tensor([0.0, -0.0]))[0] == 2 ** 40
    assert (S.fixed_exp(torch.tensor([-28.0, -100.0, float("-inf")])) == 0).all()
    g = torch.Generator().manual_seed(1)
    u = torch.randint(0, 2 ** 62, (2000,), generator=g)
    z = torch.randint(0, 2 ** 58 + 1, (2000,), generator=g)
    want = torch.tensor([(a * b) >> 62 for a, b in zip(u.tolist(), z.tolist())])
    assert torch.equal(S.mulhi62(u, z), want)


# ------------------------------------------------------------------- the distribution

def hf_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, order=None):
    """Hugging Face's processors (transformers.generation.logits_process), in HF's order
    (`_get_logits_processor`: temperature, top-k, top-p, min-p) unless `order` says otherwise,
    then softmax."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    procs = {"temperature": lp.TemperatureLogitsWarper(temperature),
             "top_k": top_k and lp.TopKLogitsWarper(top_k),
             "top_p": top_p < 1 and lp.TopPLogitsWarper(top_p),
             "min_p": min_p and lp.MinPLogitsWarper(min_p)}
    scores = logits.float()
    for name in order or ("temperature", "top_k", "top_p", "min_p"):
        if procs[name]:
            scores = procs[name](None, scores)
    return scores.softmax(-1)


COMBOS = [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=0.7, top_k=5),
          dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1),
          dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
          dict(temperature=2.0, top_p=0.5), dict(temperature=1.0, top_k=1)]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampling_probs_are_hugging_faces_distribution(combo):
    for seed in range(3):
        logits = row(seed)
        got = probs_of(logits, lanes(1, **combo))
        assert torch.allclose(got, hf_probs(logits, **combo), atol=2e-6, rtol=1e-5)


def test_sample_fits_sampling_probs_for_every_combination():
    """20000 independent keys per combination, all combinations in one call (one batch)."""
    n = 20000
    logits = row(3).expand(n * len(COMBOS), V)
    cols = {k: torch.tensor([c.get(k, d) for c in COMBOS]).repeat_interleave(n)
            for k, d in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))}
    p = lanes(n * len(COMBOS), **cols)
    tokens = draw(logits, p).view(len(COMBOS), n)
    probs = probs_of(logits, p).view(len(COMBOS), n, V)[:, 0]
    for i, combo in enumerate(COMBOS):
        stat, df, pval = chi_square(counts_of(tokens[i], V), probs[i])
        assert pval >= P_MIN, f"{combo}: chi2={stat:.1f} df={df} p={pval:.2e}"
        assert torch.allclose(probs[i], hf_probs(row(3), **combo), atol=2e-6, rtol=1e-5)


def test_a_sampler_applying_top_p_before_temperature_fails_the_same_test():
    """The wrong order's draws (same stream) against the reference distribution: p < P_MIN;
    the right order's draws pass."""
    n, combo = 20000, dict(temperature=2.0, top_p=0.6)
    logits = row(4)
    ref = probs_of(logits, lanes(1, **combo))[0]
    wrong = hf_probs(logits, **combo, order=("top_p", "temperature"))[0]
    u = S.uniform(torch.arange(n), 7, PURPOSE_DECODE)
    tokens = S._draw_probs(wrong.expand(n, V), u)
    assert chi_square(counts_of(tokens, V), ref)[2] < P_MIN
    right = S._draw_probs(ref.expand(n, V), u)
    assert chi_square(counts_of(right, V), ref)[2] >= P_MIN


def test_top_k_keeps_every_tie_at_the_boundary_as_hugging_face():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    probs = probs_of(logits, lanes(1, temperature=1.0, top_k=2))
    assert (probs[0] > 0).tolist() == [True, False, True, True, True, False]
    assert torch.allclose(probs, hf_probs(logits, 1.0, top_k=2))


def test_top_p_compares_the_weight_above_strictly():
    """Keep a token iff the weight strictly above it is < top_p * total: at exactly equal the
    tie group goes; one float above, it stays (both ties, never one of them)."""
    logits = exact_half_row()
    def kept(top_p):
        probs = probs_of(logits, lanes(1, temperature=1.0, top_p=top_p))[0]
        return (probs > 0).nonzero().flatten().tolist()
    assert kept(0.5) == [0]
    assert kept(float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)))) == [0, 1, 2]


def test_top_p_keeps_the_top_token_and_ties_together():
    logits = torch.tensor([[5.0, 1.0, 1.0, 1.0, 0.0]])
    assert (probs_of(logits, lanes(1, temperature=1.0, top_p=1e-6))[0] > 0).sum() == 1
    flat = torch.zeros(1, 6)
    assert (probs_of(flat, lanes(1, temperature=1.0, top_p=0.3))[0] > 0).all()


# ----------------------------------------------------------------------- greedy lanes

def test_greedy_lanes_are_argmax_bit_for_bit_beside_sampled_ones():
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 3, (64, V), generator=g).float()      # many ties
    logits[5, 9] = float("nan")
    logits[6] = float("-inf")
    logits[7, 2] = float("inf")
    temps = torch.where(torch.arange(64) % 2 == 0, 0.0, 0.9)
    tokens = draw(logits.to(torch.bfloat16), lanes(64, temperature=temps, top_p=0.9))
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits.to(torch.bfloat16).argmax(-1)[greedy])
    onehot = probs_of(logits, lanes(64, temperature=temps))[greedy]
    assert torch.equal(onehot.argmax(-1), logits.argmax(-1)[greedy])


def test_non_finite_logits_in_sampled_lanes():
    """NaN and -inf never drawn; +inf entries share the row's mass evenly; a row without a
    finite or +inf value returns argmax."""
    n = 4000
    logits = torch.zeros(n, 6)
    logits[:, 1] = float("nan")
    logits[:, 4] = float("-inf")
    tokens = draw(logits, lanes(n, temperature=1.0))
    assert not ((tokens == 1) | (tokens == 4)).any()
    logits[:, 0] = float("inf")
    logits[:, 3] = float("inf")
    tokens = draw(logits, lanes(n, temperature=0.5))
    half = torch.tensor([0.5, 0, 0, 0.5, 0, 0], dtype=torch.float64)
    assert chi_square(counts_of(tokens, 6), half)[2] >= P_MIN
    dead = torch.full((2, 6), float("-inf"))
    dead[1, 2] = float("nan")
    assert draw(dead, lanes(2, temperature=1.0)).tolist() == [0, 2]


# -------------------------------------------------------------------- reproducibility

def test_a_lanes_token_depends_only_on_its_logits_params_and_keys():
    """Same keys give the same tokens whatever the row order, the batch size and the
    neighbours; another seed or position gives other draws."""
    g = torch.Generator().manual_seed(6)
    n = 48
    logits = torch.randn(n, V, generator=g) * 2
    p = lanes(n, temperature=torch.rand(n, generator=g) + 0.3,
              top_k=torch.randint(0, 8, (n,), generator=g), top_p=0.95,
              min_p=torch.where(torch.arange(n) % 3 == 0, 0.05, 0.0),
              seed=torch.randint(0, 2 ** 62, (n,), generator=g),
              position=torch.randint(0, 4096, (n,), generator=g))
    base = draw(logits, p)
    perm = torch.randperm(n, generator=g)
    assert torch.equal(draw(logits[perm], {k: v[perm] for k, v in p.items()}), base[perm])
    assert torch.equal(draw(logits[:5], {k: v[:5] for k, v in p.items()}), base[:5])
    noisy = logits.clone()
    noisy[1:] = torch.randn(n - 1, V, generator=g)
    other = {k: v.clone() for k, v in p.items()}
    other["seed"][1:] += 1
    assert draw(noisy, other)[0] == base[0]
    flat = torch.zeros(1000, V)
    assert len(set(draw(flat, lanes(1000, temperature=1.0)).tolist())) > 30
    same_seed = lanes(1000, temperature=1.0, seed=3, position=torch.arange(1000))
    assert len(set(draw(flat, same_seed).tolist())) > 30


def test_sampler_and_verifiers_never_sync_with_the_host():
    """On the meta device any .item(), nonzero or data-dependent shape would raise."""
    n, k = 4, 3
    logits = torch.randn(n, V, device="meta")
    p = {key: v.to("meta") for key, v in lanes(n, temperature=1.0, top_k=3, top_p=0.9,
                                                min_p=0.1).items()}
    assert draw(logits, p).shape == (n,)
    assert probs_of(logits, p).shape == (n, V)
    probs = torch.rand(n, k + 1, V, device="meta")
    toks = torch.zeros(n, k, dtype=torch.long, device="meta")
    acc, out = S.verify_chain_sampled(probs, toks, None, p["seed"],
                                      torch.zeros(n, k + 1, dtype=torch.long, device="meta"))
    assert acc.shape == (n,) and out.shape == (n, k + 1)
    mask = torch.ones(n, 4, 4, dtype=torch.bool, device="meta")
    res = S.verify_tree_sampled(torch.zeros(n, 4, dtype=torch.long, device="meta"), mask,
                                torch.rand(n, 4, V, device="meta"), None, p["seed"],
                                torch.zeros(n, 3, dtype=torch.long, device="meta"), 2)
    assert [t.shape for t in res] == [(n,), (n, 3), (n, 3)]


def test_sampled_rows_cover_large_vocabularies_and_reject_oversized_ones():
    logits = torch.randn(2, 5000)
    assert draw(logits, lanes(2, temperature=1.0, top_p=0.5)).max() < 5000
    with pytest.raises(pg.ContractValueError, match="vocabulary size"):
        draw(torch.zeros(1, S.kernels.V_MAX + 1), lanes(1, temperature=1.0))
    assert math.isclose(float(probs_of(logits, lanes(2, temperature=1.0)).sum(-1)[0]), 1.0,
                        rel_tol=1e-6)


def test_under_torch_compile_the_sampler_is_one_opaque_op_with_the_eager_tokens():
    """Traced whole (fullgraph: no graph break, no host sync); the compiled call returns the
    eager call's tokens and probabilities bit for bit."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(12, V, generator=g) * 2
    p = lanes(12, temperature=torch.rand(12, generator=g), top_k=3, top_p=0.9, min_p=0.05)

    def fn(logits, temperature, top_k, top_p, min_p, seed, position):
        tokens = sample(logits, temperature, top_k, top_p, min_p, seed, position, PURPOSE_DECODE)
        return tokens, sampling_probs(logits, temperature, top_k, top_p, min_p)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = [logits, *p.values()]
    for got, want in zip(compiled(*args), fn(*args)):
        assert torch.equal(got, want)


def test_lanes_keep_the_meaning_of_extreme_parameters():
    """The engine's fp32 / int32 lanes: a top_p just below 1 stays below 1 (HF's filter, not
    off), a top_k past int32 packs as "keep all" instead of failing after admission."""
    from padgraph.llm.state import SamplingLanes
    warper = pytest.importorskip("transformers.generation.logits_process").TopPLogitsWarper
    params = [SamplingParams(temperature=1.0, top_p=0.99999999), SamplingParams(top_k=2 ** 40),
              SamplingParams(top_p=1.0, top_k=5)]
    lanes = SamplingLanes.of(params, [1, 2, 3], torch.device("cpu"))
    assert lanes.top_p[0] < 1 and lanes.top_p[2] == 1
    assert lanes.top_k.tolist() == [0, 2 ** 31 - 1, 5]
    x = torch.tensor([[10.0, 0.0, -9.0]])
    kept = sampling_probs(x, lanes.temperature[:1], lanes.top_k[:1], lanes.top_p[:1],
                          lanes.min_p[:1], impl="torch") > 0
    assert kept.tolist() == (warper(0.99999999)(None, x.clone()) > -float("inf")).tolist()


@pytest.mark.parametrize("temperature", [2.0 ** -99, 1e-30, 1e-38, 1e-39, 1e-45])
def test_a_tiny_temperature_is_the_greedy_limit(temperature):
    """|logit| / T overflowing fp32 must not spread the mass over the positive logits: requests
    below GREEDY_BELOW are greedy, and their lanes hold 0; above it the scaled logits stay
    finite. Shifting the logits changes nothing."""
    from padgraph.llm.sampling import GREEDY_BELOW, SamplingParams, sampling_probs
    from padgraph.llm.state import SamplingLanes
    params = SamplingParams(temperature=temperature)
    assert params.greedy == (temperature < GREEDY_BELOW)
    lanes = SamplingLanes.of([params], [0], torch.device("cpu"))
    assert (float(lanes.temperature[0]) == 0.0) == params.greedy
    for shift in (0.0, -4.0, 40.0):
        logits = torch.tensor([[3.0, 3.5, 4.0, -1.0]]) + shift
        probs = sampling_probs(logits, lanes.temperature, lanes.top_k, lanes.top_p, lanes.min_p)
        assert probs[0].tolist() == [0.0, 0.0, 1.0, 0.0], (shift, probs)
