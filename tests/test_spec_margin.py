"""The speculative reservation lives once, on `SpecConfig`: the request pool's admission, the
engine's overlap check and the runner checks' sampler all read `SpecConfig.margin` /
`overlap_margin` / `reservation` (a copy of the arithmetic elsewhere would drift from it)."""
from __future__ import annotations

import pytest
import torch

import padgraph as pg
from padgraph.llm import SpecConfig, Worker, checks
from padgraph.llm.models.llama import LlamaConfig, LlamaModel

SPECS = [SpecConfig(steps=1, topk=1, num_draft_tokens=2), SpecConfig(steps=3, topk=4, num_draft_tokens=8),
         SpecConfig(steps=2, topk=8, num_draft_tokens=17), SpecConfig(steps=5, topk=2, num_draft_tokens=4)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_reservation_reads_the_spec(spec):
    assert spec.margin == max(spec.num_draft_tokens, spec.steps * spec.topk) + 1 == spec.tree_positions + 1
    assert spec.reservation(100) == 100 + spec.margin
    assert spec.reservation(100, overlap=True) == 100 + spec.margin + spec.overlap_margin


@pytest.mark.parametrize("spec", SPECS[1:], ids=str)
def test_check_sampler_leaves_the_spec_margin_after_every_sequence(spec):
    """The runner checks draw sequence lengths up to max_context - margin (a round's tree fits
    after each); a max_context leaving no room past steps + 2 tokens is refused, naming the
    tree's positions."""
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    fits = Worker(target, None, spec, max_bs=2, max_context=spec.margin + spec.steps + 3)
    lens = checks.sampler(fits, "decode")(torch.Generator().manual_seed(0))["seq_lens"]
    assert int(lens.max()) <= fits.max_context - spec.margin
    tight = Worker(target, None, spec, max_bs=2, max_context=spec.margin + spec.steps + 2)
    with pytest.raises(pg.ContractValueError, match=f"round of {spec.tree_positions} tree positions"):
        checks.sampler(tight, "decode")
