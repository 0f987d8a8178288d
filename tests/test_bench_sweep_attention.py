"""bench/sweep_decode_attention.py stays runnable: its CPU smoke run (interpreted, tiny) times
nothing, and every point of its launch-policy grid gives the default policy's output within
bf16 rounding (the splits and tiles change only the fp32 summation order)."""
import json


def test_the_sweep_runs_and_every_point_agrees_with_the_default(tmp_path, monkeypatch):
    from bench import sweep_decode_attention as sweep

    monkeypatch.setenv("OUT", str(tmp_path))
    sweep.main(["--smoke"])
    data = json.loads((tmp_path / "sweep_decode_attention_d64.json").read_text())
    rows = data["rows"]
    assert rows[0]["policy"] == "default"
    points = {(r["num_splits"], r["block_n"], r["prefetch"]) for r in rows[1:]}
    assert points == {(s, 32, p) for s in (1, 2) for p in (False, True)}
    for r in rows:
        assert r["max_abs_diff"] < 2e-2, r
