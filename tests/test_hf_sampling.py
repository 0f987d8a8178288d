"""padgraph.hf sampling against Hugging Face's own `generate(do_sample=True)`, on the CPU.

The reference distribution is HF's: `model.generate(..., do_sample=True, output_scores=True)`
returns the processed scores its multinomial draws from (temperature, top-k, top-p, min-p in its
order), so softmax(scores) is exactly what HF samples. The first two tokens' joint distribution
is P(t1) * P(t2 | t1), each factor from HF's scores. `Decoder.generate(do_sample=True)` draws many
rows (each its own seed, some rows left-padded further) and Pearson's chi-square must accept its
counts (p >= P_MIN) on four architectures; the same counts against a deliberately wrong rule
(top-p before the temperature, a second token drawn as if the first were not there) must fail.

The tiny models' logits are nearly flat at init; their lm_head is scaled (`SHARPEN`) so the
next-token distribution has a few nats of entropy, like a real model's, and the filters bite.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402
from sampling_stats import P_MIN, chi_square, one_thread  # noqa: E402,F401
from test_hf_models import VOCAB, build  # noqa: E402

SHARPEN = 40.0      # lm_head scale: next-token entropy ~1-3 nats instead of ~log(128)
ROWS, CALLS = 64, 40          # draws = ROWS * CALLS per test
PROMPT = [5, 17, 99, 3, 42, 7]
EXTRA_PAD = 3       # left pads of every other call


def sharpened(name: str):
    model = build(name)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN)
    return model


def hf_probs(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    """HF's next-token distribution [n, V] after each row of `ids` (no padding), from its processed scores."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=1,
                             output_scores=True, return_dict_in_generate=True, **kw)
    return torch.softmax(out.scores[0].double(), -1)


def hf_joint(model, **kw) -> torch.Tensor:
    """HF's distribution of the first two new tokens [V, V] after PROMPT."""
    p1 = hf_probs(model, torch.tensor([PROMPT]), **kw)[0]                                # [V]
    support = p1.nonzero()[:, 0]
    rows = torch.tensor([PROMPT + [int(t)] for t in support])
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    joint[support] = p1[support, None] * hf_probs(model, rows, **kw)                     # [k, V]
    return joint


def batch(pads: int = EXTRA_PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPT in ROWS rows after `pads` left pads: (input_ids, attention_mask) [ROWS, P + pads]."""
    ids = torch.tensor([[0] * pads + PROMPT]).repeat(ROWS, 1)
    mask = (torch.arange(ids.shape[1]) >= pads).long().repeat(ROWS, 1)
    return ids, mask


def draws(dec, new: int, **kw) -> torch.Tensor:
    """ROWS * CALLS draws of the first `new` tokens [draws, new] from `dec.generate`, every other
    call left-padded (the padding must not move a draw)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for c in range(CALLS):
        ids, mask = batch(EXTRA_PAD * (c % 2))
        out.append(dec.generate(ids, mask, max_new_tokens=new, generator=gen, **kw)[:, ids.shape[1]:])
    return torch.cat(out)


def decoder(model):
    return pghf.Decoder(model, max_batch=ROWS, max_len=len(PROMPT) + EXTRA_PAD + 2, backend="reference")


def wrong_top_p_first(model, temperature: float, top_p: float) -> torch.Tensor:
    """The first token's distribution [V] with top-p applied to the unscaled logits, then the temperature."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].double()
    probs = torch.softmax(logits, -1)
    ordered, idx = probs.sort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[idx] = (ordered.cumsum(0) - ordered) < top_p
    return torch.softmax(torch.where(keep, logits / temperature, float("-inf")), -1)


SETTINGS = {   # architecture -> generate keywords
    "llama": dict(temperature=1.3, top_p=0.8, top_k=0),
    "qwen3": dict(temperature=0.7, top_k=6, min_p=0.05),
    "qwen2": dict(temperature=0.6, top_p=0.7),          # HF's default top_k (50) too
    "mixtral": dict(temperature=1.0),                   # a mixture of experts; HF's default top_k
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_first_token_equals_hf_sampling(name):
    model, kw = sharpened(name), SETTINGS[name]
    probs = hf_probs(model, torch.tensor([PROMPT]), **kw)[0]
    ours = draws(decoder(model), 1, do_sample=True, **kw)[:, 0]
    stat, df, p = chi_square(torch.bincount(ours, minlength=VOCAB), probs)
    assert p >= P_MIN, f"{name}: padgraph.hf's draws against HF's distribution: chi2={stat:.1f} df={df} p={p:.2e}"
    with torch.random.fork_rng(devices=[]):      # HF's own draws pass the same test (the reference is HF's)
        torch.manual_seed(7)
        rows = torch.tensor([PROMPT]).repeat(ROWS * CALLS, 1)
        with torch.no_grad():
            theirs = model.generate(rows, attention_mask=torch.ones_like(rows), do_sample=True, max_new_tokens=1,
                                    **kw)[:, -1]
    assert chi_square(torch.bincount(theirs, minlength=VOCAB), probs)[2] >= P_MIN
    if "top_p" in kw:       # and the test fails a sampler that filters before the temperature
        wrong = wrong_top_p_first(model, kw["temperature"], kw["top_p"])
        stat, df, p = chi_square(torch.bincount(ours, minlength=VOCAB), wrong)
        assert p < P_MIN, f"{name}: top-p before temperature not told apart: chi2={stat:.1f} p={p:.2e}"


@pytest.mark.parametrize("name", list(SETTINGS))
def test_first_two_tokens_joint_equals_hf_sampling(name):
    model, kw = sharpened(name), SETTINGS[name]
    joint = hf_joint(model, **kw)                                                         # [V, V]
    pairs = draws(decoder(model), 2, do_sample=True, **kw)
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    stat, df, p = chi_square(counts, joint.reshape(-1))
    assert p >= P_MIN, f"{name}: joint of 2 tokens against HF's: chi2={stat:.1f} df={df} p={p:.2e}"
    # a second token drawn as if the first were not in the context (a stale cache) fails
    p1 = joint.sum(1)
    stale = p1[:, None] * hf_probs(model, torch.tensor([PROMPT]), **kw)[0][None, :]
    assert chi_square(counts, stale.reshape(-1))[2] < P_MIN, f"{name}: a stale second token not told apart"


def test_model_generation_config_is_the_default():
    """As HF: with no keywords, the model's own generation_config decides (here: sampling)."""
    model = sharpened("llama")
    model.generation_config.update(do_sample=True, temperature=0.7, top_k=5)
    probs = hf_probs(model, torch.tensor([PROMPT]))[0]
    assert int((probs > 0).sum()) == 5
    ours = draws(decoder(model), 1)[:, 0]
    assert chi_square(torch.bincount(ours, minlength=VOCAB), probs)[2] >= P_MIN
    greedy = decoder(model).generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)
    model.generation_config.update(do_sample=False)
    with torch.no_grad():
        assert torch.equal(greedy, model.generate(torch.tensor([PROMPT]), max_new_tokens=4))


def test_generation_config_object_and_keywords_take_precedence():
    from transformers import GenerationConfig
    model = sharpened("llama")
    dec = decoder(model)
    ids = torch.tensor([PROMPT])
    cfg = GenerationConfig(do_sample=True, temperature=0.8, top_k=1)       # top-k 1: the argmax, sampled
    greedy = dec.generate(ids, max_new_tokens=4)
    assert torch.equal(dec.generate(ids, max_new_tokens=4, generation_config=cfg, seed=3), greedy)
    sampled = [dec.generate(ids, max_new_tokens=4, generation_config=cfg, top_k=0, temperature=5.0, seed=s)
               for s in range(4)]
    assert any(not torch.equal(s, greedy) for s in sampled)


def test_seed_and_generator_reproduce_and_differ():
    model = sharpened("qwen3")
    dec = decoder(model)
    ids, mask = batch()
    kw = dict(do_sample=True, temperature=1.5, max_new_tokens=2)
    a = dec.generate(ids, mask, seed=11, **kw)
    assert torch.equal(a, dec.generate(ids, mask, seed=11, **kw))
    assert not torch.equal(a, dec.generate(ids, mask, seed=12, **kw))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(dec.generate(ids, mask, generator=g1, **kw), dec.generate(ids, mask, generator=g2, **kw))
    torch.manual_seed(9)
    b = dec.generate(ids, mask, **kw)
    torch.manual_seed(9)
    assert torch.equal(b, dec.generate(ids, mask, **kw))


def test_do_sample_false_is_greedy_whatever_the_temperature():
    model = sharpened("llama")
    dec = decoder(model)
    ids, mask = batch()
    with torch.no_grad():
        ref = model.generate(ids[:4], attention_mask=mask[:4], do_sample=False, max_new_tokens=2)
    assert torch.equal(dec.generate(ids[:4], mask[:4], max_new_tokens=2, do_sample=False, temperature=3.0), ref)


def test_sampled_rows_end_at_an_end_token_as_hf():
    """eos_token_id given to the call: after a row's end token, pad_token_id; the output stops once
    every row has ended. Every token but one is an end token here, so rows end early."""
    model = sharpened("llama")
    dec = decoder(model)
    ids, mask = batch()
    eos = list(range(1, VOCAB))
    out = dec.generate(ids, mask, max_new_tokens=2, do_sample=True, temperature=2.0, eos_token_id=eos,
                       pad_token_id=0, seed=1)[:, ids.shape[1]:]
    ended = torch.isin(out[:, 0], torch.tensor(eos))
    assert bool(ended.any())
    assert bool((out[ended, 1:] == 0).all())
    assert out.shape[1] == (1 if bool(ended.all()) else 2)


@pytest.mark.parametrize("kw, match", [
    (dict(do_sample=True, temperature=0.0), "temperature must be a number > 0"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(seed=1, generator=torch.Generator()), "at most one of them"),
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(generation_config="greedy"), "generation_config must be None or a transformers.GenerationConfig"),
])
def test_bad_sampling_arguments_raise(kw, match):
    dec = decoder(sharpened("llama"))
    with pytest.raises(pghf.ArgumentError, match=match) if "generation_config" not in kw else \
            pytest.raises(pghf.ArgumentTypeError, match=match):
        dec.generate(torch.tensor([PROMPT]), max_new_tokens=2, **kw)


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1.2), ("num_beams", 2), ("typical_p", 0.5),
                                          ("no_repeat_ngram_size", 2), ("min_new_tokens", 2), ("min_length", 9),
                                          ("assistant_ensemble_weight", 0.3), ("token_healing", True),
                                          ("speculation_type", "mtp")])
def test_a_processor_padgraph_does_not_apply_is_refused(field, value):
    from transformers import GenerationConfig
    dec = decoder(sharpened("llama"))
    cfg = GenerationConfig(**{field: value}, eos_token_id=3)
    with pytest.raises(pghf.ArgumentError, match=f"generation_config.{field}"):
        dec.generate(torch.tensor([PROMPT]), max_new_tokens=2, generation_config=cfg)


def test_a_minimum_length_without_end_tokens_is_served():
    """HF's minimum lengths only suppress end tokens: with none, they change nothing, and are served."""
    from transformers import GenerationConfig
    model = sharpened("llama")
    dec = decoder(model)
    cfg = GenerationConfig(min_new_tokens=2, min_length=9, max_new_tokens=3)
    with torch.no_grad():
        ref = model.generate(torch.tensor([PROMPT]), generation_config=cfg)
    assert torch.equal(dec.generate(torch.tensor([PROMPT]), generation_config=cfg), ref)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_speculative_sampling_joint_equals_hf_sampling(name):
    """With an EAGLE head (draft=...), sampled rows go through padgraph.llm's exact speculative
    acceptance: the first two tokens' joint distribution is still HF's."""
    model, kw = sharpened(name), SETTINGS[name]
    dec = pghf.Decoder(model, max_batch=ROWS, max_len=len(PROMPT) + EXTRA_PAD + 2, backend="reference",
                       draft=pghf.Eagle(distill=dict(n_seq=16, prompt_len=8, gen_len=16, steps=30, lr=3e-3)))
    joint = hf_joint(model, **kw)
    pairs = draws(dec, 2, do_sample=True, **kw)
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    stat, df, p = chi_square(counts, joint.reshape(-1))
    assert p >= P_MIN, f"{name} with EAGLE: joint of 2 tokens against HF's: chi2={stat:.1f} df={df} p={p:.2e}"
    assert dec.last_stats.accepted > dec.last_stats.request_rounds, f"{name}: no draft token accepted"
    stale = joint.sum(1)[:, None] * hf_probs(model, torch.tensor([PROMPT]), **kw)[0][None, :]
    assert chi_square(counts, stale.reshape(-1))[2] < P_MIN


def test_a_rows_tokens_do_not_depend_on_its_padding_or_the_bucket():
    """The random stream is keyed by (row seed, position of the token drawn): the same prompt
    and seed give the same tokens left-padded or not, and in a batch that runs another bucket."""
    dec = decoder(sharpened("qwen2"))
    kw = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=2, seed=21)
    plain, padded = batch(0), batch(EXTRA_PAD)
    a = dec.generate(*plain, **kw)[:, len(PROMPT):]
    assert torch.equal(a, dec.generate(*padded, **kw)[:, len(PROMPT) + EXTRA_PAD:])
    assert torch.equal(a[:3], dec.generate(plain[0][:3], plain[1][:3], **kw)[:, len(PROMPT):])
    assert len(set(map(tuple, a.tolist()))) > 1      # the rows draw apart


def test_top_p_zero_keeps_the_top_token_as_hf():
    model = sharpened("llama")
    assert int((hf_probs(model, torch.tensor([PROMPT]), top_p=0.0)[0] > 0).sum()) == 1
    dec = decoder(model)
    ids = torch.tensor([PROMPT])
    greedy = dec.generate(ids, max_new_tokens=3)
    assert all(torch.equal(dec.generate(ids, max_new_tokens=3, do_sample=True, top_p=0.0, temperature=2.0, seed=s),
                           greedy) for s in range(3))
