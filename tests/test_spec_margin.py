"""The speculative reservation lives once, on `SpecConfig`: the worker's admission, the
tensor-parallel engine and padgraph.hf's context all read `SpecConfig.margin` /
`overlap_margin` (a copy of the arithmetic elsewhere would drift from it)."""
from __future__ import annotations

import pytest

from padgraph.hf.speculative import context_for
from padgraph.llm import SpecConfig
from padgraph.llm.tp import spec_margin

SPECS = [SpecConfig(steps=1, topk=1, num_draft_tokens=2), SpecConfig(steps=3, topk=4, num_draft_tokens=8),
         SpecConfig(steps=2, topk=8, num_draft_tokens=17), SpecConfig(steps=5, topk=2, num_draft_tokens=4)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_reservation_reads_the_spec(spec):
    assert spec_margin(spec) == spec.margin
    assert context_for(100, spec) == 100 + spec.margin + spec.overlap_margin

