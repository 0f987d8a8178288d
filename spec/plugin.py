"""pytest plugin of the conformance suite: `--backend`, `--device`, `--xfails` and the fixtures.

Loaded by `python -m padgraph.spec` and by `pytest -p padgraph.spec.plugin --pyargs padgraph.spec`.
"""
from __future__ import annotations

import functools

import pytest
import torch

import padgraph as pg


def pytest_addoption(parser):
    group = parser.getgroup("padgraph", "padgraph conformance suite")
    group.addoption("--backend", default="reference",
                    help="backend to test: a registered name (pg.backend_names()) or module:RunnerClass")
    group.addoption("--device", default=None,
                    help="device the cases build tensors on (default: cuda for the cuda backend, else cpu)")
    group.addoption("--xfails", default=None,
                    help="file of test ids (or id substrings) this backend is known to fail, one a line")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_cuda: the case only means something on a CUDA device")
    backend = config.getoption("--backend")
    if ":" in backend and backend not in pg.backend_names():
        pg.register_backend(backend, backend)   # a third party's Runner, by import path


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
    if dev is None:
        dev = "cuda" if config.getoption("--backend") == "cuda" else "cpu"
    return torch.device(dev)


@pytest.fixture(scope="session")
def backend(pytestconfig) -> str:
    """The backend name the cases compile for."""
    return pytestconfig.getoption("--backend")


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device the cases build raw inputs and bound state on."""
    return _device(pytestconfig)


@pytest.fixture(scope="session")
def compile(backend, device):
    """`pg.compile` bound to the backend under test and its device."""
    return functools.partial(pg.compile, backend=backend, device=device)


@pytest.fixture(scope="session")
def reference(device):
    """`pg.compile` on the reference backend, on the same device (the oracle for rule 8)."""
    return functools.partial(pg.compile, backend="reference", device=device)
