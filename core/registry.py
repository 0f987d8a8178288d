"""Backend registry and `pg.compile`. Core names backends by import path; it never imports them."""
from __future__ import annotations

import importlib
from typing import Callable, Mapping

from .errors import ContractTypeError, ContractValueError
from .program import Program

_BACKENDS: dict[str, object] = {
    "reference": "padgraph.reference:ReferenceRunner",
    "cuda": "padgraph.backends.cuda:CudaGraphRunner",
}
_BUILTIN = frozenset(_BACKENDS)


def register_backend(name: str, runner_cls) -> None:
    """Register a Runner subclass (or a 'module:Class' path to one, imported on first use) under
    a backend name. The built-in names ('reference', 'cuda') cannot be replaced."""
    if not isinstance(name, str) or not name or name != name.strip():
        raise ContractTypeError(f"register_backend: name must be a non-empty str without surrounding spaces, "
                                f"got {name!r} ({type(name).__name__})")
    if name in _BUILTIN:
        raise ContractValueError(f"register_backend: name must not be a built-in backend {sorted(_BUILTIN)}, "
                                 f"got {name!r}; register yours under a name of its own")
    if isinstance(runner_cls, str):
        module, sep, attr = runner_cls.partition(":")
        if not sep or not attr.isidentifier() or not all(p.isidentifier() for p in module.split(".")):
            raise ContractValueError(f"register_backend({name!r}): runner_cls must be a pg.Runner subclass or a "
                                     f"'package.module:RunnerClass' path, got {runner_cls!r}")
    else:
        _runner_class(name, runner_cls)
    _BACKENDS[name] = runner_cls


def _runner_class(name: str, cls) -> type:
    from .runtime import Runner      # local: the registry is imported before the runtime is needed
    if not (isinstance(cls, type) and issubclass(cls, Runner)):
        got = f"{cls!r} ({'a class, not a pg.Runner subclass' if isinstance(cls, type) else type(cls).__name__})"
        raise ContractTypeError(f"register_backend({name!r}): runner_cls must be a pg.Runner subclass "
                                f"(or a 'module:Class' path to one), got {got}")
    return cls


def backend_names() -> list[str]:
    """Registered backend names. (Not `backends`: that is the padgraph.backends subpackage.)"""
    return sorted(_BACKENDS)


def resolve(name: str):
    """The Runner class registered under `name` (imported on first use)."""
    return _resolve(name)


def _resolve(name: str):
    if not isinstance(name, str):
        raise ContractTypeError(f"backend must be a str, one of {backend_names()}, got {name!r} ({type(name).__name__})")
    try:
        entry = _BACKENDS[name]
    except KeyError:
        raise ContractValueError(f"backend must be one of {backend_names()}, got {name!r}") from None
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _runner_class(name, getattr(importlib.import_module(module), attr))
        _BACKENDS[name] = entry
    return entry


def compile(program: Program, body: Callable, backend: str = "reference", *, state: Mapping | None = None,
            **options):
    """Lower a program and its body onto a backend; returns a callable Runner.

    state: the bound state (tensors, or containers of them) the body reads and writes.
    options: every backend's `pg.Options` (prepare, overflow, copy_outputs, torch_compile, shadow,
    device; documented there) and the backend's own (cuda: `CudaOptions`: pool, warmup, progress,
    restore_state, copy, pack). Every option is checked here, by name and value: one the backend
    does not have is a ContractTypeError naming the ones it has.
    """
    if not isinstance(program, Program):
        raise ContractValueError(f"compile: program must be a pg.Program, got {program!r} ({type(program).__name__})")
    return _resolve(backend)(program, body, state=state, **options)
