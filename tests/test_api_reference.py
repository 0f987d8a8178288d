"""docs/api.md is generated from the docstrings of `padgraph.__all__` (docs/gen_api.py): it must
match what the generator writes for the code as it is."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("padgraph_gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_current():
    gen = _generator()
    expected = gen.render()
    current = gen.API_MD.read_text() if gen.API_MD.exists() else ""
    if current != expected:
        import difflib
        diff = "".join(difflib.unified_diff(current.splitlines(True), expected.splitlines(True),
                                            "docs/api.md", "generated", n=1))
        raise AssertionError(f"docs/api.md is stale: run python docs/gen_api.py\n{diff[:4000]}")


def test_every_public_name_is_documented():
    import padgraph as pg
    text = _generator().render()
    missing = [n for n in pg.__all__ if f"### `pg.{n}`" not in text]
    assert not missing, f"public names missing from the API reference: {missing}"
