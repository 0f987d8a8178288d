"""padgraph.hf's `Target` as a plain (non-speculative) target of padgraph.llm's engine: the
engine's decode program, KV layout, request-to-token table, sampler and stop tokens over an
unmodified HF model's layers, with no draft head. Greedy tokens equal HF's `generate`; sampled
ones follow HF's `generate(do_sample=True)` distribution (the parameters resolved from HF's
keywords by `padgraph.hf.generation`, as `Decoder.generate` resolves them)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402
from padgraph.hf import generation  # noqa: E402
from padgraph.llm import Engine, SpecConfig  # noqa: E402
from sampling_stats import P_MIN, chi_square, one_thread  # noqa: E402,F401
import hf_zoo  # noqa: E402
from test_hf_models import MAX_LEN, NEW, VOCAB, build, configs, prompts  # noqa: E402
from test_hf_sampling import PROMPT, SETTINGS, hf_joint, sharpened  # noqa: E402


def engine(model, max_bs: int) -> Engine:
    spec = SpecConfig()
    return Engine(pghf.Target(model, MAX_LEN + spec.margin + spec.overlap_margin, draft=False), None, spec,
                  backend="reference", max_bs=max_bs, max_context=MAX_LEN + spec.margin + spec.overlap_margin)


@pytest.mark.parametrize("name", ["llama", "qwen3", "mixtral", "bamba", "deepseek_v3"])
def test_engine_decodes_an_hf_target_to_hf_greedy_tokens(name):
    """Attention-only models, a hybrid (its SSM and convolution states in the Target's pools, one
    row per request row) and MLA (keys wider than values): HF generate's greedy tokens."""
    model = build(name) if name in configs() else hf_zoo.build_type(name, num_key_value_heads=4)
    eng = engine(model, 5)
    ids, mask = prompts(5, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)[:, ids.shape[1]:]
    reqs, _ = eng.generate_greedy([i[m.bool()].tolist() for i, m in zip(ids, mask)], [NEW] * 5)
    assert [r.output for r in reqs] == ref.tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_engine_samples_an_hf_target_as_hf(name):
    model, kw = sharpened(name), SETTINGS[name]
    plan = generation.resolve(model, len(PROMPT), do_sample=True, max_new_tokens=2, **kw)
    eng = engine(model, 64)
    joint, pairs = hf_joint(model, **kw), []
    for call in range(40):
        seeds = generation.row_seeds(64, seed=call)
        params = [dataclasses.replace(plan.params, seed=int(s)) for s in seeds]
        reqs, _ = eng.generate_greedy([PROMPT] * 64, [2] * 64, sampling=params)
        pairs += [r.output for r in reqs]
    pairs = torch.tensor(pairs)
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    stat, df, p = chi_square(counts, joint.reshape(-1))
    assert p >= P_MIN, f"{name}: the engine's joint of 2 tokens against HF's: chi2={stat:.1f} df={df} p={p:.2e}"


def test_a_prefill_runner_is_refused_for_an_hf_target():
    """The Target's extend reads the prompts' width on the host, so it cannot be captured: the
    worker refuses prefill="runner" at construction, naming the way out."""
    model = build("llama")
    spec = SpecConfig()
    target = pghf.Target(model, MAX_LEN + spec.margin + spec.overlap_margin, draft=False)
    with pytest.raises(ValueError, match="prefill='eager'"):
        Engine(target, None, spec, backend="reference", max_bs=2, prefill="runner",
               max_context=MAX_LEN + spec.margin + spec.overlap_margin)
