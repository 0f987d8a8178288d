"""docs/api.md is generated (docs/gen_api.py): it must be what the generator writes for the code as
it is, name every public module and name, and carry each docstring whole."""
import importlib
import importlib.util
import inspect
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The modules a user imports; each must be in the reference with every name of its __all__.
USER_MODULES = ("padgraph", "padgraph.spec", "padgraph.llm", "padgraph.llm.models", "padgraph.hf",
                "padgraph.backends.cuda", "padgraph.backends.triton.attention")


@lru_cache(maxsize=1)
def _generator():
    spec = importlib.util.spec_from_file_location("padgraph_gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=1)
def _rendered() -> str:
    return _generator().render()


def test_api_reference_is_current():
    gen = _generator()
    current = gen.API_MD.read_text() if gen.API_MD.exists() else ""
    message = gen.stale_message(current, _rendered())
    assert message is None, message


def test_a_stale_reference_is_reported_with_the_line_and_the_command():
    gen, text = _generator(), _rendered()
    assert gen.stale_message(text, text) is None
    lines = text.splitlines(True)
    at = next(i for i, line in enumerate(lines) if line.startswith("### `padgraph.hf.Decoder`")) + 5
    edited = "".join(lines[:at] + ["an edit by hand\n"] + lines[at + 1:])
    message = gen.stale_message(edited, text)
    assert message and f"line {at + 1}" in message and "python docs/gen_api.py" in message, message
    assert "python docs/gen_api.py" in gen.stale_message(text[: len(text) // 2], text)


def test_the_check_command_exits_1_when_stale_and_0_when_current(tmp_path, monkeypatch, capsys):
    gen = _generator()
    monkeypatch.setattr(gen, "render", lambda: "# API reference\n")
    monkeypatch.setattr(gen, "API_MD", tmp_path / "api.md")
    gen.API_MD.write_text("# API reference, edited\n")
    assert gen.main(["--check"]) == 1 and "stale" in capsys.readouterr().err
    gen.API_MD.write_text("# API reference\n")
    assert gen.main(["--check"]) == 0


@pytest.mark.parametrize("module_name", USER_MODULES)
def test_every_name_of_a_user_module_is_documented(module_name):
    module = importlib.import_module(module_name)
    text = _rendered()
    assert f"## `{module_name}`" in text, f"{module_name} has no section in docs/api.md"
    section = text.split(f"## `{module_name}`\n", 1)[1].split("\n## `", 1)[0]
    names = getattr(module, "__all__", None) or _generator().public_names(module)
    assert names, f"{module_name} has no public names to check"
    missing = [n for n in names if f"### `{module_name}.{n}`" not in section and f"`{n}` (`" not in section]
    assert not missing, f"{module_name}: public names missing from docs/api.md: {missing}"


def test_every_public_module_of_every_package_is_documented():
    text = _rendered()
    packages = ("padgraph", "padgraph.spec", "padgraph.llm", "padgraph.llm.models", "padgraph.hf",
                "padgraph.backends.cuda", "padgraph.backends.triton")
    for package in packages:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.glob("*.py")):
            if not path.stem.startswith(("_", "test", "conftest")):
                assert f"## `{package}.{path.stem}`" in text, f"{package}.{path.stem} is not in docs/api.md"


@pytest.mark.parametrize("module_name", ("padgraph", "padgraph.llm", "padgraph.hf", "padgraph.llm.models"))
def test_docstrings_are_whole(module_name):
    """Each docstring is in the reference from its first line to its last: pg.check's `sample=`
    contract is in its third paragraph, Decoder's options in its second."""
    module, text = importlib.import_module(module_name), _rendered()
    cut = []
    for name in module.__all__:
        obj = getattr(module, name)
        doc = inspect.cleandoc(obj.__doc__) if isinstance(getattr(obj, "__doc__", None), str) else ""
        generated = inspect.isclass(obj) and doc.startswith(name + "(")   # a dataclass's own
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and doc and not generated and doc.strip() not in text:
            cut.append(name)
    assert not cut, f"{module_name}: docstrings not whole in docs/api.md: {cut}"
    if module_name == "padgraph":
        assert "sample: fn(gen: torch.Generator)" in text.split("### `padgraph.check`", 1)[1].split("### ", 1)[0]


def test_methods_are_documented_with_their_docstrings():
    from padgraph.llm import Engine
    text = _rendered()
    methods = [n for n, f in vars(Engine).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert methods, "Engine has no public methods to check"
    for name in methods:
        assert f"#### `Engine.{name}`" in text, f"Engine.{name} is not in docs/api.md"
        doc = inspect.getdoc(getattr(Engine, name)) or ""
        assert doc.strip() in text, f"Engine.{name}'s docstring is not whole in docs/api.md"


def test_output_names_no_machine_path_or_object_address():
    text = _rendered()
    for bad in (str(ROOT), " at 0x", "<factory>", "<function ", "<built-in "):
        assert bad not in text, f"docs/api.md contains {bad!r}: the output must depend on the code only"


def test_padgraph_hf_imports_without_transformers():
    """transformers is an extra: importing padgraph.hf (and so generating the reference) must not need it."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'transformers': raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import padgraph.hf\n"
            "assert padgraph.hf.Decoder and 'transformers' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
