"""examples/quickstart.py proves what it prints: its cache starts at a sentinel in every slot, so
the line about the sink holds only if the padded lanes wrote the sink and nothing else, and the
check behind that line fails for a body whose padded lanes write a live slot."""
import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest
import torch

import padgraph as pg

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


@pytest.fixture(scope="module")
def quickstart():
    return runpy.run_path(str(QUICKSTART), run_name="quickstart")


def test_the_quickstart_runs_and_shows_the_cache_it_checked(quickstart, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(QUICKSTART)])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        quickstart["main"]()
    text = out.getvalue()
    assert f"still hold {quickstart['SENTINEL']}" in text and "sink slot 0 holds 0.0" in text, text
    assert "no findings" in text, text


def _run(quickstart, body):
    """Two calls with padded token lanes; the cache starts at the sentinel. Returns (cache, written)."""
    cache = torch.full((quickstart["N_SLOTS"],), quickstart["SENTINEL"])
    runner = pg.compile(quickstart["program"], body, backend="reference", state={"cache": cache})
    written = {}
    for ids, locs in (([7], [3]), ([11, 12, 13], [4, 5, 6])):       # 1 of 2 and 3 of 8 token lanes
        n_req = len(ids)
        raw = {"input_ids": torch.tensor(ids), "out_cache_loc": torch.tensor(locs),
               "seq_lens": torch.full((n_req,), 4, dtype=torch.int32),
               "qo_indptr": torch.arange(n_req + 1, dtype=torch.int32),
               "hidden": torch.ones(n_req, quickstart["HIDDEN"])}
        runner(**raw)
        written.update(zip(locs, ids))
    return cache, written


def test_the_cache_check_passes_the_quickstart_body(quickstart):
    cache, written = _run(quickstart, quickstart["body"])
    assert "sink slot 0 holds 0.0" in quickstart["cache_report"](cache, written)


def test_the_cache_check_fails_a_body_whose_padded_lanes_write_a_live_slot(quickstart):
    def leaky(x):                                  # padded lanes (loc 0) write slot 9, not the sink
        x.cache[torch.where(x.out_cache_loc == 0, 9, x.out_cache_loc)] = x.input_ids.float()
        return {"scores": x.hidden.sum(-1), "new_tokens": x.qo_indptr[1:] - x.qo_indptr[:-1]}
    cache, written = _run(quickstart, leaky)
    with pytest.raises(SystemExit, match=r"slots \[9\] changed"):
        quickstart["cache_report"](cache, written)


def test_the_cache_check_fails_when_the_sink_was_never_written(quickstart):
    cache, written = _run(quickstart, quickstart["body"])
    cache[0] = quickstart["SENTINEL"]              # as if no padded lane had run: the line would prove nothing
    with pytest.raises(SystemExit, match="sink slot 0 holds -1.0"):
        quickstart["cache_report"](cache, written)
