"""A runner's options: what `pg.compile(..., **options)` sets, checked before anything is built.

Every backend takes `Options`; a backend with its own knobs subclasses it (the cuda backend's
`CudaOptions`: capture pool, warm-up runs, the pack strategy, ...) and names the subclass in its
runner's `Options` attribute. A misspelt or foreign option is a `ContractTypeError` that lists
the backend's options, never a bare `TypeError` from a constructor. Every value is checked at
`pg.compile`, never at the first call: a field annotated `bool`, `int` or `str` (optionally
`| None`) must be one (a bool is no int, a string no bool), a field named in `CHOICES` must be
one of its values, and the common options have their own rules below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

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
        kernels); see padgraph/compiled.py. False or None: the body as given.
    shadow: a `pg.Shadow(...)` re-checking sampled calls against the eager padded path.
    canary: what a write to a canary row of bound state (`pg.State(canary=...)`) does: True or
        "raise" (pg.CanaryError at the first call that sees it), "warn", "log", or False (no
        check). On by default; it costs nothing where no state declares canary rows.
    """

    prepare: Callable | None = None
    overflow: str = "eager"
    copy_outputs: bool = False
    device: Any = None
    torch_compile: Any = None
    shadow: Any = None
    canary: Any = True

    # string options and the values they may take; a subclass extends it ({**Options.CHOICES, ...})
    CHOICES: ClassVar[Mapping[str, tuple]] = {"overflow": ("eager", "error")}

    @classmethod
    def parse(cls, program: str, backend: str, options: Mapping[str, Any]) -> "Options":
        """`options` as this class, after checking their names and values."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names), key=repr)
        if unknown:
            raise ContractTypeError(f"{where(program)}: backend {backend!r} has no option "
                                    f"{', '.join(map(repr, unknown))}; its options are {', '.join(names)}")
        opts = cls(**options)
        for f in dataclasses.fields(cls):
            _check_field(program, f, getattr(opts, f.name), cls.CHOICES.get(f.name))
        _check_common(program, opts)
        if opts.torch_compile is False:     # False and None: no compilation; {} and True: defaults
            opts = dataclasses.replace(opts, torch_compile=None)
        return opts


# annotation (as written) -> (the types a value must have, how a message names them)
_SIMPLE = {"bool": ((bool,), "a bool (True or False)"), "int": ((int,), "an int"),
           "str": ((str,), "a str"), "float": ((int, float), "a number")}


def _check_field(program: str, f: dataclasses.Field, value, choices: tuple | None) -> None:
    """A field's value against its annotation (`bool`, `int`, `str`, `float`, each `| None`)
    and its CHOICES; other annotations are checked by the option's own rule."""
    ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None) or str(f.type)
    parts = [p.strip() for p in ann.split("|")]
    optional = "None" in parts
    simple = [p for p in parts if p != "None"]
    if len(simple) == 1 and simple[0] in _SIMPLE and not (optional and value is None):
        types, text = _SIMPLE[simple[0]]
        is_bool = isinstance(value, bool)
        if not isinstance(value, types) or (is_bool and bool not in types):
            raise ContractTypeError(mismatch(program, None, f"option {f.name}", text + (" or None" if optional else ""),
                                             f"{value!r} ({type(value).__name__})"))
    if choices is not None and not (isinstance(value, str) and value in choices):
        raise ContractValueError(mismatch(program, None, f"option {f.name}", " or ".join(map(repr, choices)),
                                          repr(value)))


def _check_common(program: str, opts: Options) -> None:
    """prepare and torch_compile: the values pg.compile would otherwise trip over at the first call."""
    if opts.prepare is not None and not callable(opts.prepare):
        raise ContractTypeError(mismatch(program, None, "option prepare", "a callable fn(x) or None",
                                         f"{opts.prepare!r} ({type(opts.prepare).__name__})"))
    tc = opts.torch_compile
    if tc is None or isinstance(tc, bool):
        return
    if not isinstance(tc, Mapping):
        raise ContractTypeError(mismatch(program, None, "option torch_compile",
                                         "True, False, None or a dict of torch.compile options "
                                         "({'mode': ..., 'fullgraph': ..., 'regions': ..., 'passes': ...})",
                                         f"{tc!r} ({type(tc).__name__})"))
    bad = [k for k in tc if not isinstance(k, str)]
    if bad:
        raise ContractTypeError(mismatch(program, None, "option torch_compile", "a dict with str keys",
                                         f"keys {bad!r}"))
