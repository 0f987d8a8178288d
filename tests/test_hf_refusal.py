"""padgraph.hf refuses at `Decoder(...)` what it cannot serve exactly, and never what it can.

Silent mismatch (the probe must catch each, naming the layer):
  - a token mixer that keeps state across tokens with no cache argument and no attention call
    (a token shift: invisible to the survey, visible in decode's logits);
  - attention sink logits dropped by the attention path (the bug gpt-oss hit);
  - an attention mask of the model's own that padgraph's attention is not (a dynamic mask: Doge;
    a chunked one whose rule the survey did not read from HF's mask factory).
Raises: bad arguments to every public entry point, each naming the argument, the value and what
is allowed (`ArgumentError` / `ArgumentTypeError`, ContractError family).
Never flagged: the probe passes on correct paths at fp32, bf16 and fp16.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph as pg  # noqa: E402
import padgraph.hf as pghf  # noqa: E402
from padgraph.hf import attention  # noqa: E402
from test_hf_models import build, prompts  # noqa: E402

import hf_zoo  # noqa: E402


class TokenShift(torch.nn.Module):
    """Mixes the previous token's hidden state into each token's (RWKV's token shift): state kept
    across tokens, with no cache argument, no parameter named like a recurrence, no attention."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):                                   # x [b, t, H]
        prev = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        return self.mlp(x + prev)


def test_probe_refuses_state_it_cannot_see_naming_the_layer():
    model = build("llama")
    model.model.layers[1].mlp = TokenShift(model.model.layers[1].mlp)
    with pytest.raises(pghf.UnsupportedModelError, match=r"model\.layers\.1 is the first") as err:
        pghf.Decoder(model, max_batch=2, max_len=32, backend="reference")
    assert "decode step 1" in str(err.value) and "across tokens" in str(err.value)


def test_probe_refuses_dropped_sinks(monkeypatch):
    """gpt-oss's sink logits served, then dropped on purpose: the probe names layer 0."""
    model = hf_zoo.build_type("gpt_oss")
    pghf.Decoder(model, max_batch=3, max_len=32, backend="reference")          # served as is
    real = attention.attend
    monkeypatch.setattr(attention, "attend", lambda q, k, v, visible, layer: real(
        q, k, v, visible, attention.Layer(layer.scaling, layer.sliding_window, layer.softcap, None)))
    with pytest.raises(pghf.UnsupportedModelError, match=r"model\.layers\.0 is the first"):
        pghf.Decoder(model, max_batch=3, max_len=32, backend="reference")


def test_probe_names_a_chunked_mask_the_survey_did_not_read(monkeypatch):
    """Llama 4's chunks (4 tokens, inside the probe's sequences) are served from its mask factory;
    with that reading dropped, the probe's value check alone still refuses it, naming the mask."""
    if "llama4_text" not in transformers.CONFIG_MAPPING:
        pytest.skip("no Llama 4 in this transformers")
    from padgraph.hf import target as target_mod
    pghf.Decoder(hf_zoo.build_type("llama4_text"), max_batch=3, max_len=32, backend="reference")
    monkeypatch.setattr(target_mod, "mask_horizons", lambda *a: {})
    with pytest.raises(pghf.UnsupportedModelError, match="HF's attention mask is not causal"):
        pghf.Decoder(hf_zoo.build_type("llama4_text"), max_batch=3, max_len=32, backend="reference")


def test_probe_names_a_dynamic_mask():
    """Doge builds its mask in its own code (finite biases): no factory to read, the probe names it."""
    if "doge" not in transformers.CONFIG_MAPPING:
        pytest.skip("no Doge in this transformers")
    with pytest.raises(pghf.UnsupportedModelError, match="finite biases"):
        pghf.Decoder(hf_zoo.build_type("doge"), max_batch=3, max_len=32, backend="reference")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2_moe"])
def test_probe_passes_correct_paths_at_half_precision(name, dtype):
    model = build(name).to(dtype)
    pghf.Decoder(model, max_batch=3, max_len=32, backend="reference")


def test_probe_can_be_skipped_and_still_refuses_by_survey():
    model = build("llama")
    model.model.layers[1].mlp = TokenShift(model.model.layers[1].mlp)
    pghf.Decoder(model, max_batch=2, max_len=32, backend="reference", probe=False)   # the user's call
    with pytest.raises(pghf.UnsupportedModelError, match="keeps state"):
        pghf.Decoder(hf_zoo.build_type("minimax"), max_batch=2, max_len=32, backend="reference", probe=False)


# ---- arguments ---------------------------------------------------------------------------------
DECODER_BAD = [   # (keyword arguments, error, words the message must hold)
    (dict(max_len=0), pghf.ArgumentError, "max_len must be an int >= 2, got 0"),
    (dict(max_len=2.5), pghf.ArgumentTypeError, "max_len must be an int >= 2, got 2.5"),
    (dict(max_batch=0), pghf.ArgumentError, "max_batch must be an int >= 1, got 0"),
    (dict(max_batch=True), pghf.ArgumentTypeError, "max_batch must be an int >= 1, got True"),
    (dict(backend=3), pghf.ArgumentTypeError, "backend must be"),
    (dict(torch_compile=1.0), pghf.ArgumentTypeError, "torch_compile must be"),
    (dict(torch_compile="bogus"), pg.ContractValueError, "torch_compile must be"),
    (dict(draft="eagle"), pghf.ArgumentTypeError, "draft must be None or padgraph.hf.Eagle"),
    (dict(probe="no"), pghf.ArgumentTypeError, "probe must be True or False, got 'no'"),
]


@pytest.mark.parametrize("kwargs, error, words", DECODER_BAD)
def test_decoder_arguments(kwargs, error, words):
    args = {**dict(max_batch=2, max_len=16, backend="reference"), **kwargs}
    with pytest.raises(error) as err:
        pghf.Decoder(build("llama"), **args)
    assert isinstance(err.value, pg.ContractError) and words in str(err.value), str(err.value)


def test_decoder_refuses_a_model_that_is_not_one():
    with pytest.raises(pghf.ArgumentTypeError, match="model must be a Hugging Face PreTrainedModel"):
        pghf.Decoder(torch.nn.Linear(2, 2), max_batch=2, max_len=16)


def _generate_bad():
    ids, mask = prompts(2, seed=3)
    return [   # (generate's arguments, error, words)
        (dict(input_ids=ids[:, :0], attention_mask=mask[:, :0]), pghf.ArgumentError, "non-empty"),
        (dict(input_ids=ids[:0], attention_mask=mask[:0]), pghf.ArgumentError, "non-empty"),
        (dict(input_ids=ids + 1000, attention_mask=mask), pghf.ArgumentError, "token ids in [0, vocab_size=128)"),
        (dict(input_ids=ids - 5, attention_mask=mask), pghf.ArgumentError, "token ids in [0, vocab_size=128)"),
        (dict(input_ids=ids.tolist(), attention_mask=mask), pghf.ArgumentTypeError, "input_ids must be a torch.Tensor"),
        (dict(input_ids=ids.int(), attention_mask=mask), pghf.ArgumentError, "int64"),
        (dict(input_ids=ids, attention_mask=mask, max_new_tokens=2.5), pghf.ArgumentTypeError,
         "max_new_tokens must be an int >= 1, got 2.5"),
        (dict(input_ids=ids, attention_mask=mask, max_new_tokens=0), pghf.ArgumentError, "max_new_tokens"),
        (dict(input_ids=ids, attention_mask=mask.tolist()), pghf.ArgumentTypeError, "attention_mask must be None"),
        (dict(input_ids=ids, attention_mask=mask * 2), pghf.ArgumentError, "0s and 1s"),
        (dict(input_ids=ids, attention_mask=mask[:, 1:]), pghf.ArgumentError, "input_ids' shape"),
    ]


@pytest.mark.parametrize("case", range(len(_generate_bad())))
def test_generate_arguments(case):
    dec = pghf.Decoder(build("llama"), max_batch=2, max_len=32, backend="reference", probe=False)
    kwargs, error, words = _generate_bad()[case]
    with pytest.raises(error) as err:
        dec.generate(**kwargs)
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("distill, error, words", [
    ({"steps": 10}, pghf.ArgumentError, "distill['steps'] must be an int >= 20, got 10"),
    ({"stepz": 30}, pghf.ArgumentError, "DistillOptions field"),
    ({"lr": 0}, pghf.ArgumentError, "distill['lr'] must be a positive number"),
    ({"n_seq": 2.5}, pghf.ArgumentTypeError, "distill['n_seq'] must be an int"),
    ([("steps", 30)], pghf.ArgumentTypeError, "distill must be a mapping"),
])
def test_eagle_arguments(distill, error, words):
    with pytest.raises(error) as err:
        pghf.Eagle(distill=distill)
    assert words in str(err.value), str(err.value)


def test_eagle_refuses_a_spec_of_another_type():
    with pytest.raises(pghf.ArgumentTypeError, match="spec must be a padgraph.llm.SpecConfig"):
        pghf.Eagle(spec={"steps": 3})


def test_check_arguments():
    dec = pghf.Decoder(build("llama"), max_batch=2, max_len=16, backend="reference", probe=False)
    with pytest.raises(pghf.ArgumentError, match="trials must be an int >= 1, got 0"):
        dec.check(trials=0)


def longrope(model_type: str, original: int):
    """A tiny `model_type` with longrope whose long factors switch on past `original` positions."""
    params = dict(rope_type="longrope", rope_theta=100.0, short_factor=[1.0] * 8,
                  long_factor=[4.0 + i for i in range(8)],
                  original_max_position_embeddings=original)
    return hf_zoo.build_type(model_type, max_position_embeddings=128, sliding_window=None,
                             original_max_position_embeddings=original, rope_parameters=params)


@pytest.mark.parametrize("model_type", ["phi3", "llama"])
def test_longrope_past_its_switch_refused(model_type):
    """Longrope picks short or long factors by the longest position of each forward: Phi-3's
    generate re-encodes the sequence when it crosses original_max_position_embeddings, and
    in a batch a finished row HF keeps stepping switches the others. padgraph's cache keeps
    keys as written, so a max_len that reaches past the switch is refused, naming it."""
    with pytest.raises(pghf.UnsupportedModelError, match=r"'longrope'.*pass 8\b"):
        pghf.Decoder(longrope(model_type, 8), max_batch=2, max_len=24, backend="reference")


def assert_served_exactly(model, n: int, seed: int):
    """n left-padded prompts: the Decoder (max_len 24) gives model.generate's greedy tokens."""
    dec = pghf.Decoder(model, max_batch=n, max_len=24, backend="reference")
    ids, mask = prompts(n, seed=seed)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=6).tolist() == ref.tolist()


def test_longrope_below_its_switch_served_exactly():
    assert_served_exactly(longrope("phi3", 64), 3, seed=4)


def test_dynamic_rope_past_max_positions_refused_and_served_below():
    """Dynamic NTK rescales once a forward's positions pass max_position_embeddings (and resets
    below it): refused where max_len reaches past it, served where it cannot."""
    params = dict(rope_type="dynamic", factor=4.0, rope_theta=10.0)
    with pytest.raises(pghf.UnsupportedModelError, match=r"'dynamic'.*pass 16\b"):
        pghf.Decoder(hf_zoo.build_type("llama", max_position_embeddings=16, rope_parameters=params),
                     max_batch=2, max_len=24, backend="reference")
    assert_served_exactly(hf_zoo.build_type("llama", max_position_embeddings=128,
                                            rope_parameters=params), 2, seed=5)


def test_rope_switch_read_per_layer_type():
    """A rotary embedding keyed by layer type (Gemma 3's) names each type's switch."""
    from padgraph.hf.target import rope_switch_lengths

    class Rotary(torch.nn.Module):
        rope_type = {"sliding_attention": "default", "full_attention": "longrope"}
        original_max_seq_len = 128

        class config:  # noqa: N801
            max_position_embeddings = 128
            rope_parameters = {"sliding_attention": {"rope_type": "default"},
                               "full_attention": {"rope_type": "longrope",
                                                  "original_max_position_embeddings": 32}}

    holder = torch.nn.Module()
    holder.rotary = Rotary()
    assert rope_switch_lengths(holder) == [("longrope", 32)]
    assert rope_switch_lengths(build("llama")) == []
