"""EAGLE on a Hugging Face target: `padgraph.hf.Decoder(model, ..., draft=Eagle(...))` distils an
EAGLE head from the model and decodes through padgraph.llm's prefill / draft / verify /
draft-extend programs. Its tokens equal HF's greedy `generate`; attention the paged kernels do
not compute (soft-caps, windows shorter than the context) is refused at `Decoder(...)`; the
target's bodies pass `pg.check`."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402
from padgraph.llm import SpecConfig  # noqa: E402
from test_hf_models import MAX_LEN, NEW, build, configs, prompts  # noqa: E402
from test_runners import SPEC  # noqa: E402

REFUSED = {"mistral": "sliding window", "gemma2": "soft-capped", "gemma3": "soft-capped"}
DISTIL = dict(n_seq=16, prompt_len=8, gen_len=16, steps=30, lr=3e-3)


def eagle_decoder(model, max_batch=5, max_len=MAX_LEN, spec=None):
    draft = pghf.Eagle(distill=DISTIL) if spec is None else pghf.Eagle(spec=spec, distill=DISTIL)
    return pghf.Decoder(model, max_batch=max_batch, max_len=max_len, backend="reference", draft=draft)


@pytest.mark.parametrize("name", [n for n in configs() if n not in REFUSED])
def test_eagle_tokens_equal_hf_generate(name):
    model = build(name)
    dec = eagle_decoder(model)
    rounds = tokens = 0
    for n in (1, 3, 5):
        ids, mask = prompts(n, seed=n)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist(), \
            f"{name} bs {n}: EAGLE's tokens differ from HF's generate"
        rounds += dec.last_stats.request_rounds
        tokens += dec.last_stats.accepted
    assert tokens > rounds, f"{name}: no draft token was ever accepted ({tokens} tokens in {rounds} request-rounds)"


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_the_paged_kernels_do_not_compute_is_refused_at_decoder(name):
    with pytest.raises(pghf.UnsupportedModelError, match=REFUSED[name]):
        eagle_decoder(build(name))


def test_a_window_as_long_as_the_context_is_served():
    """Mistral's window of 4 is refused above; a window covering the context is full attention."""
    model = build("mistral")
    model.config.sliding_window = 4 * MAX_LEN
    dec = eagle_decoder(model)
    ids, mask = prompts(3, seed=7)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist()


def test_hf_target_bodies_pass_check():
    """The engine's bodies over an HF target (`Decoder.check()` with a draft head: every runner
    program of the engine): no pad leakage, no state write outside the sinks."""
    dec = eagle_decoder(build("qwen3"), max_batch=8, max_len=40, spec=SPEC)
    results = dec.check(trials=2)
    assert set(results) == {"decode", "verify", "draft", "draft_extend"}
    for name, res in results.items():
        assert res.ok, f"{name}: {res}"


def test_spec_config_is_used():
    dec = eagle_decoder(build("llama"), spec=SpecConfig(steps=2, topk=2, num_draft_tokens=3))
    assert dec.engine.worker.spec.num_draft_tokens == 3


def test_a_config_window_only_generates_cache_applies_is_refused_and_served_without_the_probe():
    """Llama's config accepts `sliding_window` but its layers never pass it: the Target reads what
    the layers hand the attention function at run time, not the config field, and gives the
    model's forward's tokens (the reference: the same weights without the field). HF's generate
    windows its cache for such a config, unlike the forward, so the probe refuses the model, naming
    that disagreement; the check below runs without it."""
    ids, mask = prompts(2, seed=9)
    plain = build("llama")
    with torch.no_grad():
        ref = plain.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    model = build("llama")
    model.config.sliding_window = 4
    with pytest.raises(pghf.UnsupportedModelError, match="generate and forward disagree"):
        eagle_decoder(model)
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference", probe=False,
                       draft=pghf.Eagle(distill=DISTIL))
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist()


def test_distillation_leaves_the_users_model_as_it_was():
    """The head trains through the model's embedding and lm_head: no gradient lands on the model,
    no weight changes, and requires_grad is as the user set it."""
    model = build("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    eagle_decoder(model)
    for n, p in model.named_parameters():
        assert p.grad is None, n
        assert p.requires_grad == flags[n], n
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eagle_on_a_half_precision_model_gives_hfs_tokens(dtype):
    """A bf16 / fp16 model: the fp32 head distils against the model's half-precision embedding
    and lm_head (autocast, as on a GPU), and the tokens are HF's greedy ones, up to near ties
    (a first divergence only where HF's own top-2 logits lie within 4 bf16 steps of 2**-6)."""
    model = build("llama").to(dtype)
    dec = eagle_decoder(model, max_batch=3)
    ids, mask = prompts(3, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                             output_logits=True, return_dict_in_generate=True)
    got = dec.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    P = ids.shape[1]
    for row in range(3):
        differ = (got[row, P:] != ref.sequences[row, P:]).nonzero()
        if len(differ):
            step = int(differ[0])
            top2 = ref.logits[step][row].float().topk(2).values
            assert float(top2[0] - top2[1]) <= 4 * 2 ** -6, (row, step, top2)


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "olmo"])
def test_eagle_over_a_final_norm_of_another_name_gives_hfs_tokens(name):
    """A decoder whose final norm is `ln_f` / `final_layer_norm` / a LayerNorm without weight:
    the head starts from its weight where it has one, and the tokens are HF's."""
    import hf_zoo
    model = hf_zoo.build_type(name)
    dec = pghf.Decoder(model, max_batch=2, max_len=32, backend="reference",
                       draft=pghf.Eagle(distill=dict(n_seq=8, prompt_len=8, gen_len=8, steps=20)))
    ids, mask = prompts(2, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=8).tolist() == ref.tolist()
