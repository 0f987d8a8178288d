"""bench/sweep_decode_attention.py stays runnable: its CPU smoke run (interpreted, tiny) times
nothing, and every point of its launch-policy grid gives the default policy's output within
bf16 rounding (the splits and tiles change only the fp32 summation order)."""
import json

import pytest


def test_the_sweep_runs_and_every_point_agrees_with_the_default(tmp_path, monkeypatch):
    from bench import sweep_decode_attention as sweep

    monkeypatch.setenv("OUT", str(tmp_path))
    sweep.main(["--smoke"])
    data = json.loads((tmp_path / "sweep_decode_attention_d64.json").read_text())
    rows = data["rows"]
    assert rows[0]["policy"] == "default"
    points = {(r["num_splits"], r["block_n"], r["prefetch"]) for r in rows[1:]}
    assert points == {(s, 32, p) for s in (1, 2) for p in (False, True)}
    assert rows[0]["block_n"] == 128 and not rows[0]["prefetch"]   # d 64, bs 2: 16 pairs
    for r in rows:
        assert r["max_abs_diff"] < 2e-2 and r["agrees"], r


def test_a_point_that_disagrees_stops_the_run(tmp_path, monkeypatch):
    from bench import sweep_decode_attention as sweep

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sweep, "TOL", -1.0)         # every difference, 0 included, is too large
    with pytest.raises(SystemExit, match="differ from the default"):
        sweep.main(["--smoke"])
    assert (tmp_path / "sweep_decode_attention_d64.json").exists()


def test_the_tree_verify_sweep_runs_and_agrees(tmp_path, monkeypatch):
    """--tree K: K drafts a request under a random tree mask; the grid leaves out the
    double-buffered loop (decode's) and every point agrees with the default's output."""
    from bench import sweep_decode_attention as sweep

    monkeypatch.setenv("OUT", str(tmp_path))
    sweep.main(["--smoke", "--tree", "4"])
    rows = json.loads((tmp_path / "sweep_decode_attention_d64_tree4.json").read_text())["rows"]
    assert rows[0]["policy"] == "default" and not rows[0]["prefetch"]
    assert rows[0]["block_n"] == 64 and rows[0]["num_warps"] == 4
    assert {(r["num_splits"], r["block_n"], r["prefetch"]) for r in rows[1:]} == {
        (s, 32, False) for s in (1, 2)}
    for r in rows:
        assert r["agrees"], r


def test_bench_attention_grid_axes_replace_only_the_axes_given():
    """bench_attention --grid-block-n / --grid-stages / --grid-warps / --grid-splits: each axis
    given replaces that axis of the grid; the others keep the default grid's values."""
    from bench.attention_config import GRID_SPLITS, GRID_TILES
    from bench.bench_attention import grid_axes

    assert grid_axes(GRID_TILES, GRID_SPLITS) == (GRID_TILES, GRID_SPLITS)
    tiles, splits = grid_axes(GRID_TILES, GRID_SPLITS, block_n="64,128", split_counts="1,4")
    assert splits == (1, 4)
    assert tiles == tuple((n, s, w) for n in (64, 128) for s in (1, 2, 3) for w in (1, 2, 4))
    tiles, _ = grid_axes(GRID_TILES, GRID_SPLITS, stages="3", warps="4,8")
    assert tiles == tuple((n, 3, w) for n in (16, 32, 64) for w in (4, 8))


def test_a_run_at_a_fixed_context_names_its_file_by_it_and_sweeps_stages(tmp_path, monkeypatch):
    """--ctx N writes sweep_decode_attention_d<hd>_ctx<N>.json (the GPU suite runs several
    contexts into one $OUT), and --stages is a grid axis every row records."""
    from bench import sweep_decode_attention as sweep

    monkeypatch.setenv("OUT", str(tmp_path))
    sweep.main(["--sizes", "1", "--ctx", "64", "--layers", "1", "--splits", "1,2", "--block-n",
                "32", "--iters", "1", "--head-dim", "16", "--q-heads", "2", "--kv-heads", "1",
                "--stages", "1,2"])
    rows = json.loads((tmp_path / "sweep_decode_attention_d16_ctx64.json").read_text())["rows"]
    assert {(r["num_splits"], r["prefetch"], r["num_stages"]) for r in rows[1:]} == {
        (s, p, st) for s in (1, 2) for p in (False, True) for st in (1, 2)}
    assert all(r["agrees"] for r in rows)
