"""pytest plugin of the conformance suite: `--backend`, `--device`, `--xfails` and the fixtures.

Loaded by `python -m padgraph.spec` and by `pytest -p padgraph.spec.plugin --pyargs padgraph.spec`.
The backend is resolved once, in `pytest_configure`, before any case is collected: a name that is
not a backend, or a backend that cannot run on this machine (`Runner.unavailable()`), stops the
session with one usage error instead of failing every case. The device is the backend's own
choice (`Runner.default_device()`) unless `--device` names one.
"""
from __future__ import annotations

import functools

import pytest
import torch

import padgraph as pg
from padgraph import registry

_RUNNER = pytest.StashKey[type]()


def pytest_addoption(parser):
    group = parser.getgroup("padgraph", "padgraph conformance suite")
    group.addoption("--backend", default="reference",
                    help="backend to test: a registered name (pg.backend_names()) or module:RunnerClass")
    group.addoption("--device", default=None,
                    help="device the cases build tensors on (default: the backend's Runner.default_device())")
    group.addoption("--torch-compile", action="store_true", default=False,
                    help="compile every case's body with torch_compile=True (the compiled path "
                         "keeps the contract too)")
    group.addoption("--generated", type=int, default=60,
                    help="generated programs (each with a call sequence) that test_generated runs, in all")
    group.addoption("--seed", type=int, default=0, help="seed of the generated programs")
    group.addoption("--no-shrink", action="store_true", default=False,
                    help="report a generated failure as drawn, without hypothesis' shrinking (long GPU runs)")
    group.addoption("--pack", default=None,
                    help="the cuda backend's pack strategy under test: in-graph, eager or torch (default: auto)")
    group.addoption("--xfails", default=None,
                    help="file of test ids (or id substrings) this backend is known to fail, one a line")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cuda: the case only means something on a CUDA device")
    # expected warnings: cases call past the ladder on purpose (a case that checks the warning
    # turns warnings back on), and inductor's first import warns about torch's own torch.jit use
    config.addinivalue_line("filterwarnings", "ignore::padgraph.OverflowWarning")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    config.stash[_RUNNER] = _runner_class(config.getoption("--backend"))


def _runner_class(backend: str) -> type:
    """The Runner class under test; a pytest.UsageError (no case runs) when it cannot run here."""
    if ":" in backend and backend not in pg.backend_names():
        pg.register_backend(backend, backend)   # a third party's Runner, by import path
    try:
        cls = registry.resolve(backend)
    except pg.ContractValueError as e:
        raise pytest.UsageError(f"padgraph.spec: --backend {backend!r} is not a backend: {e} "
                                f"(or give module:RunnerClass)") from None
    except (ImportError, AttributeError) as e:
        raise pytest.UsageError(f"padgraph.spec: --backend {backend!r} cannot be imported: "
                                f"{type(e).__name__}: {e}") from None
    unavailable = getattr(cls, "unavailable", None)
    reason = unavailable() if unavailable is not None else None
    if reason:
        raise pytest.UsageError(f"padgraph.spec: backend {backend!r} cannot run on this machine, so no "
                                f"case was run: {reason}")
    return cls


def _xfail_ids(path: str | None) -> list[str]:
    if not path:
        return []
    with open(path) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return [line for line in lines if line]


def pytest_collection_modifyitems(config, items):
    xfails = _xfail_ids(config.getoption("--xfails"))
    device = _device(config)
    backend = config.getoption("--backend")
    for item in items:
        if "needs_cuda" in item.keywords and device.type != "cuda":
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device; backend {backend!r} runs on {device}"))
        if any(x in item.nodeid for x in xfails):
            item.add_marker(pytest.mark.xfail(reason=f"in the xfail list of backend {backend!r}", strict=False))


def _device(config) -> torch.device:
    dev = config.getoption("--device")
    if dev is not None:
        return torch.device(dev)
    default = getattr(config.stash[_RUNNER], "default_device", None)
    return torch.device(default()) if default is not None else torch.device("cpu")


@pytest.fixture(scope="session")
def backend(pytestconfig) -> str:
    """The backend name the cases compile for."""
    return pytestconfig.getoption("--backend")


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device the cases build raw inputs and bound state on."""
    return _device(pytestconfig)


@pytest.fixture(scope="session")
def compile(backend, device, pytestconfig):
    """`pg.compile` bound to the backend under test and its device (and `torch_compile=True`
    under `--torch-compile`; a case's own `torch_compile=` wins)."""
    return functools.partial(pg.compile, backend=backend, device=device, **compile_options(pytestconfig))


def compile_options(config) -> dict:
    """The options `--torch-compile` and `--pack` add to every case's compile."""
    extra = {"torch_compile": True} if config.getoption("--torch-compile") else {}
    if config.getoption("--pack"):
        extra["pack"] = config.getoption("--pack")
    return extra


@pytest.fixture(scope="session")
def options(pytestconfig) -> dict:
    """compile options of the run (`--torch-compile`, `--pack`), for cases that call pg.compile themselves."""
    return compile_options(pytestconfig)


def pytest_sessionfinish(session):
    """Under pytest-xdist, a worker hands its generated counts to the controller."""
    from . import cases
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["padgraph_generated"] = dict(cases.COUNTS)


def pytest_testnodedown(node, error):
    """The controller adds up the workers' counts (pytest-xdist)."""
    from . import cases
    for k, v in getattr(node, "workeroutput", {}).get("padgraph_generated", {}).items():
        cases.COUNTS[k] += v


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line for the generated cases: programs, calls, rejected calls, failing shards."""
    from . import cases
    c = cases.COUNTS
    if not c["programs"]:
        return
    failed = sum(1 for r in terminalreporter.stats.get("failed", []) if "test_generated" in r.nodeid)
    variant = ", ".join(f"{k}={v}" for k, v in compile_options(config).items()) or "default"
    terminalreporter.write_line(
        f"padgraph.spec generated: backend={config.getoption('--backend')} ({variant}) seed={config.getoption('--seed')} "
        f"programs={c['programs']} calls={c['calls']} rejected_calls={c['rejected']} failing_shards={failed}")


@pytest.fixture(scope="session")
def reference(device):
    """`pg.compile` on the reference backend, on the same device (the oracle for rule 8)."""
    return functools.partial(pg.compile, backend="reference", device=device)
