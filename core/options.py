"""A runner's options: what `pg.compile(..., **options)` sets, checked before anything is built.

Every backend takes `Options`; a backend with its own knobs subclasses it (the cuda backend's
`CudaOptions`: capture pool, warm-up runs, the pack strategy, ...) and names the subclass in its
runner's `Options` attribute. A misspelt or foreign option is a `ContractTypeError` that lists
the backend's options, never a bare `TypeError` from a constructor.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .errors import ContractTypeError, ContractValueError, mismatch, where


@dataclass(frozen=True)
class Options:
    """Options every backend takes.

    prepare: fn(x) run eagerly before each call on the same padded view (host-side metadata).
    overflow: "eager" (run past the ladder eagerly, counted and warned once) or "error".
    copy_outputs: False: outputs are views valid until the runner's next call; True: copies.
    device: where the runner's buffers live (default: the bound state's device, else the
        backend's default).
    torch_compile: True or torch.compile options ({"mode": "max-autotune-no-cudagraphs",
        "fullgraph": True, "regions": [...], "size_oblivious": True, ...}): one compilation of the
        body for the whole ladder, inductor's CUDA graphs off (graph backends capture its
        kernels); see padgraph/compiled.py.
    shadow: a `pg.Shadow(...)` re-checking sampled calls against the eager padded path.
    """

    prepare: Callable | None = None
    overflow: str = "eager"
    copy_outputs: bool = False
    device: Any = None
    torch_compile: Any = None
    shadow: Any = None

    @classmethod
    def parse(cls, program: str, backend: str, options: Mapping[str, Any]) -> "Options":
        """`options` as this class, after checking their names and the common values."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ContractTypeError(f"{where(program)}: backend {backend!r} has no option "
                                    f"{', '.join(map(repr, unknown))}; its options are {', '.join(names)}")
        opts = cls(**options)
        if opts.overflow not in ("eager", "error"):
            raise ContractValueError(mismatch(program, None, "overflow", "'eager' or 'error'", repr(opts.overflow)))
        if opts.torch_compile is False:     # False and None: no compilation; {} and True: defaults
            opts = dataclasses.replace(opts, torch_compile=None)
        return dataclasses.replace(opts, copy_outputs=bool(opts.copy_outputs))
