"""`python -m padgraph.spec --backend NAME [pytest args]`: run the conformance suite on a backend.
`python -m padgraph.spec --inject NAME|all [--backend NAME]`: run the safety net against the fault
catalogue instead (padgraph/spec/inject.py)."""
import os
import sys

INSTALL_HINT = "padgraph.spec: the conformance suite runs under pytest, which is not installed: pip install pytest hypothesis (or, from a checkout of padgraph: pip install -e '.[spec]')"


def main(argv: list[str] | None = None) -> int:
    """Run every case in this folder under pytest with the suite's plugin; returns pytest's exit code."""
    try:
        import pytest
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--inject" or a.startswith("--inject=") for a in argv):
        from .inject import main as inject     # the fault catalogue, not the pytest suite
        return inject(argv)
    return int(pytest.main([here, "-p", "padgraph.spec.plugin", "-p", "no:cacheprovider", *argv]))


if __name__ == "__main__":
    sys.exit(main())
