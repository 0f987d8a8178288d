"""Generated programs and call sequences on the backend under test, judged by the oracle.

`--generated N` programs in all (default 60), `--seed S`, split into shards so that one failure
does not hide the others; each shard's failure is shrunk by hypothesis and printed with a
runnable reproduction (`generated.repro`). Keep a shrunk failure as a named case in
`test_regressions.py`.
"""
from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, Phase, given, note, seed, settings, strategies as st

import padgraph as pg
from padgraph.spec import cases as C
from padgraph.spec import strategies as SG

SHARDS = 16


@pytest.mark.parametrize("shard", range(SHARDS))
def test_generated(shard, backend, device, options, pytestconfig):
    total = pytestconfig.getoption("--generated")
    n = total // SHARDS + (shard < total % SHARDS)
    if n == 0:
        pytest.skip("no generated programs left for this shard (--generated is small)")

    shrink = [] if pytestconfig.getoption("--no-shrink") else [Phase.shrink]
    phases = [Phase.explicit, Phase.reuse, Phase.generate, *shrink]

    @seed(pytestconfig.getoption("--seed") * 1000 + shard)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck), phases=phases)
    @given(st.data())
    def run(data):
        recipe = data.draw(SG.recipes(), label="recipe")
        calls = data.draw(SG.call_lists(recipe), label="calls")
        note("reproduction:\n" + C.repro(recipe, calls, backend, device, options))
        C.run_case(recipe, calls, backend=backend, device=device, counts=C.COUNTS, **options)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pg.OverflowWarning)     # once per generated runner past its ladder
        run()
