"""padgraph.hf.masks' census records the rule a factory applied to the masks it built, and no
other: a mask a factory returns as it was given, a factory that hands the call to another (the
causal ones to the bidirectional ones where `config.is_causal` is False), a mask dropped during
the forward whose id another tensor could take. It reads the factories of a model whose classes
live outside transformers (remote code, the user's own) as well."""
from __future__ import annotations

import sys
import types
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402
from padgraph.hf import masks  # noqa: E402

import hf_zoo  # noqa: E402

mu = pytest.importorskip("transformers.masking_utils")


def _embeds(n: int = 2, t: int = 3) -> torch.Tensor:
    return torch.zeros(n, t, 8)


def _padding(n: int = 2, t: int = 3) -> torch.Tensor:
    pad = torch.ones(n, t, dtype=torch.int64)
    pad[0, 0] = 0                                       # left-padded: HF builds a tensor
    return pad


def test_a_bidirectional_mask_behind_a_causal_factory_is_refused():
    """With `config.is_causal = False` HF's causal factory builds a bidirectional mask (through
    create_bidirectional_mask): the census names that rule, and the Decoder refuses the model
    at its survey, probe or not, instead of serving causal attention."""
    model = hf_zoo.build_type("llama")
    model.config.is_causal = False
    model.config._attn_implementation = "sdpa"
    with masks.census(model) as built:
        out = mu.create_causal_mask(config=model.config, inputs_embeds=_embeds(), attention_mask=_padding(),
                                    cache=None)
    assert isinstance(out, torch.Tensor)
    assert built.of(out).rule == "other", built.of(out)
    with pytest.raises(pghf.UnsupportedModelError, match="not causal"):
        pghf.Decoder(model, max_batch=2, max_len=32, backend="reference", probe=False)


def test_a_mask_a_factory_passes_through_keeps_its_own_rule_or_none():
    """HF's factories return a 4-D attention_mask as given: a mask no factory built stays
    unrecorded (not the passing factory's rule), and one built before keeps the rule it was
    built with."""
    model = hf_zoo.build_type("llama")
    cfg = model.config
    cfg._attn_implementation = "sdpa"
    with masks.census(model) as built:
        custom = torch.ones(2, 1, 3, 3, dtype=torch.bool)
        assert mu.create_sliding_window_causal_mask(cfg, _embeds(), custom, None) is custom
        assert built.of(custom) is None
        causal = mu.create_causal_mask(config=cfg, inputs_embeds=_embeds(), attention_mask=_padding(), cache=None)
        again = mu.create_sliding_window_causal_mask(config=cfg, inputs_embeds=_embeds(), attention_mask=causal,
                                                     cache=None)
        assert again is causal and built.of(causal) == masks.Horizon("causal")


def test_a_recorded_mask_outlives_its_last_use_in_the_forward():
    """The census keeps each mask it records alive, so a tensor made after a recorded mask is
    dropped never takes its id (and its rule)."""
    model = hf_zoo.build_type("llama")
    cfg = model.config
    cfg._attn_implementation = "sdpa"
    with masks.census(model) as built:
        out = mu.create_causal_mask(config=cfg, inputs_embeds=_embeds(), attention_mask=_padding(), cache=None)
        alive = weakref.ref(out)
        del out
        assert alive() is not None
        fresh = [torch.ones(2, 1, 3, 3, dtype=torch.bool) for _ in range(4)]
        assert all(built.of(t) is None for t in fresh)


def test_the_census_reads_a_factory_a_model_class_outside_transformers_imports(monkeypatch):
    """A model class defined outside transformers (remote code, a user's script) whose module
    imported HF's factory: the census wraps that module's name too, and gives it back after."""
    mod = types.ModuleType("user_decoder_blocks")
    mod.create_causal_mask = mu.create_causal_mask
    block = type("Block", (torch.nn.Module,), {"__module__": mod.__name__})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    model = hf_zoo.build_type("llama")
    model.block = block()
    cfg = model.config
    cfg._attn_implementation = "sdpa"
    with masks.census(model) as built:
        out = mod.create_causal_mask(config=cfg, inputs_embeds=_embeds(), attention_mask=_padding(), cache=None)
        assert built.of(out) == masks.Horizon("causal")
    assert mod.create_causal_mask is mu.create_causal_mask
