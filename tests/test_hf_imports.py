"""padgraph.hf's modules import one way: no import cycle among them, counting imports inside
functions (a cycle kept alive by a deferred import works or fails by import order), and
the paged-attention plumbing comes from its own module, not the Llama reference model."""
from __future__ import annotations

import ast
import pathlib

import padgraph.hf
import padgraph.llm

HF, LLM = (pathlib.Path(m.__file__).parent for m in (padgraph.hf, padgraph.llm))


def local_imports(path: pathlib.Path) -> set[str]:
    """The sibling modules `path` imports anywhere (`from .x import ...`, `from . import x`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path, or None."""
    state: dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m, path + [m])):
                return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n, [n])):
            return found
    return None


def test_hf_modules_import_one_way():
    mods = {p.stem: local_imports(p) for p in HF.glob("*.py") if p.stem != "__init__"}
    assert cycle(mods) is None, f"padgraph.hf import cycle: {' -> '.join(cycle(mods))}"


def test_cycle_finder_finds_one():
    assert cycle({"decoder": {"speculative"}, "speculative": {"target"}, "target": {"decoder"}}) == \
        ["decoder", "speculative", "target", "decoder"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_paged_plumbing_has_its_own_module():
    """Targets, heads and bodies take AttnPlan / store_kv / the batch plans from padgraph.llm.paged."""
    plumbing = {"AttnPlan", "PagedForwards", "store_kv", "decode_batch", "extend_batch", "tree_batch",
                "last_tokens"}
    files = [*(LLM / "models").glob("*.py"), LLM / "bodies.py", *HF.glob("*.py")]
    for path in files:
        if path.name == "llama.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("llama"):
                taken = plumbing & {a.name for a in node.names}
                assert not taken, f"{path.name} imports {sorted(taken)} from {node.module}, not padgraph.llm.paged"
