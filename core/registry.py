"""Backend registry and `pg.compile`. Core names backends by import path; it never imports them."""
from __future__ import annotations

import importlib
from typing import Callable, Mapping

from .errors import ContractValueError
from .program import Program

_BACKENDS: dict[str, object] = {
    "reference": "padgraph.reference:ReferenceRunner",
    "cuda": "padgraph.backends.cuda:CudaGraphRunner",
}


def register_backend(name: str, runner_cls) -> None:
    """Register a Runner subclass (or 'module:Class' path) under a backend name."""
    _BACKENDS[name] = runner_cls


def backend_names() -> list[str]:
    """Registered backend names. (Not `backends`: that is the padgraph.backends subpackage.)"""
    return sorted(_BACKENDS)


def resolve(name: str):
    """The Runner class registered under `name` (imported on first use)."""
    return _resolve(name)


def _resolve(name: str):
    try:
        entry = _BACKENDS[name]
    except KeyError:
        raise ContractValueError(f"backend must be one of {backend_names()}, got {name!r}") from None
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        _BACKENDS[name] = entry
    return entry


def compile(program: Program, body: Callable, backend: str = "reference", *, state: Mapping | None = None,
            **options):
    """Lower a program and its body onto a backend; returns a callable Runner.

    state: the bound state (tensors, or containers of them) the body reads and writes.
    options: every backend's `pg.Options` (prepare, overflow, copy_outputs, torch_compile, shadow,
    device; documented there) and the backend's own (cuda: `CudaOptions`: pool, warmup, progress,
    restore_state, copy, pack). An option the backend does not have is a ContractTypeError
    naming the ones it has.
    """
    if not isinstance(program, Program):
        raise ContractValueError(f"compile: program must be a pg.Program, got {type(program).__name__}")
    return _resolve(backend)(program, body, state=state, **options)
