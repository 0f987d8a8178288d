"""sweep_eagle on the CPU (reference backend, tiny target): every tree gets its rows, the oracle
head keeps greedy's tokens, and the files are written."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import sweep_eagle  # noqa: E402


def test_sweep_writes_a_row_per_tree_and_size(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    sweep_eagle.main(["--device", "cpu", "--trees", "2,2,3;3,2,4", "--new-tokens", "6"])
    d = json.loads((tmp_path / "sweep_eagle_cpu.json").read_text())
    assert [(t["steps"], t["topk"], t["k"]) for t in d["trees"]] == [(2, 2, 3), (3, 2, 4)]
    for t in d["trees"]:
        assert set(t["rows"]) == {"1", "4"}
        for r in t["rows"].values():
            assert r["accept_len"] >= 1.0 and r["tok_s"] > 0 and r["ms_per_round"] > 0
            assert set(r["phases_ms"]) >= {"draft", "verify", "draft_extend"}
            n = int(r["exact_greedy"].split("/")[1])
            assert n in (2, 4) and r["exact_greedy"] == f"{n}/{n}"
            assert r["greedy_match"].startswith(f"{n}/{n} ({n} exact")
    assert (tmp_path / "sweep_eagle_cpu.md").read_text().count("\n| ") == 3   # header + 2 trees
