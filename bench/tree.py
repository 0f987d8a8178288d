"""Import `padgraph` from another checkout of this repository (a benchmark's baseline).

The editable install maps `padgraph`, `padgraph.backends`, ... to this checkout's folders
(pyproject's package-dir). `use(tree)` puts a finder ahead of it that maps the same names to
`tree`'s folders, so one process times an older commit through the same benchmark code. Call it
before anything imports padgraph.
"""
from __future__ import annotations

import sys
import tomllib
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location
from pathlib import Path


class _TreeFinder:
    """A meta path finder for the packages of one checkout (package name -> folder)."""

    def __init__(self, tree: Path, folders: dict[str, Path]):
        self.tree, self.folders = tree, folders

    def find_spec(self, fullname, path=None, target=None):
        folder = self.folders.get(fullname)
        if folder is not None:
            return spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])
        parent = fullname.rpartition(".")[0]
        if parent in self.folders:      # a module of a mapped package: found in its folder only
            return PathFinder.find_spec(fullname, [str(self.folders[parent])])
        return None


def package_folders(tree: Path) -> dict[str, Path]:
    """pyproject's package-dir of the checkout at `tree`, as absolute folders."""
    cfg = tomllib.loads((tree / "pyproject.toml").read_text())
    dirs = cfg["tool"]["setuptools"]["package-dir"]
    return {name: (tree / folder).resolve() for name, folder in dirs.items()}


def use(tree: str | Path) -> Path:
    """Make `import padgraph` (and its subpackages) load from the checkout at `tree` (again: no-op)."""
    tree = Path(tree).resolve()
    if any(isinstance(f, _TreeFinder) and f.tree == tree for f in sys.meta_path):
        return tree
    if any(name == "padgraph" or name.startswith("padgraph.") for name in sys.modules):
        raise RuntimeError(f"padgraph is already imported; call bench.tree.use({str(tree)!r}) before importing it")
    sys.meta_path.insert(0, _TreeFinder(tree, package_folders(tree)))
    return tree
