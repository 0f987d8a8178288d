"""What a call returns (`Outputs`, lent as `LentOutputs` until the next call) and what a runner
counts (`Stats`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping

from .errors import ContractAttributeError, ContractKeyError, where
from .lifetimes import Lent, lend

_PROGRAM = "<program>"      # Outputs.__dict__ key of the program's name: no attribute can shadow it


def _named(outs) -> str:
    name = outs.__dict__.get(_PROGRAM)
    return f"{where(name)}: " if name is not None else ""


class Outputs(dict):
    """The outputs of one call, by name: `out.logits` or `out["logits"]`."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise ContractAttributeError(
                f"{_named(self)}no output {name!r}: outputs must be one "
                f"of {sorted(self)}, got {name!r}") from None

    def __missing__(self, name):          # out["nope"]: as out.nope, a KeyError that names it
        raise ContractKeyError(f"{_named(self)}no output {name!r}: outputs must be one "
                               f"of {sorted(self)}, got {name!r}")


class LentOutputs(Outputs):
    """Outputs on loan until the runner's next call (rule 6.2): each is made a `Lent` alias under
    the call's lease when first read, so outputs never read cost nothing. Every way to read one
    (`out.y`, `out["y"]`, values(), items(), get(), pop(), popitem(), setdefault(), `{**out}`,
    dict(out)) goes through __getitem__."""

    def __init__(self, views: Mapping, lease):
        dict.update(self, views)                  # as dict's __init__, without super()'s lookup
        attrs = self.__dict__
        attrs[_PROGRAM] = lease.program
        attrs["<lease>"] = lease

    def __getitem__(self, name):
        t = dict.__getitem__(self, name)          # raises __missing__'s error for an unknown name
        if type(t) is not Lent:
            t = lend(t, self.__dict__["<lease>"], name)
            dict.__setitem__(self, name, t)
        return t

    def __iter__(self):                           # dict(out), {**out}: through keys() and __getitem__
        return iter(list(dict.keys(self)))

    def get(self, name, default=None):
        return self[name] if name in self else default

    def values(self):
        return [self[n] for n in dict.keys(self)]

    def items(self):
        return [(n, self[n]) for n in dict.keys(self)]

    _absent = object()

    def pop(self, name, default=_absent):
        """The output lent (as out[name]), removed from this mapping."""
        if name not in self:
            if default is LentOutputs._absent:
                return self[name]                 # __missing__'s error, naming the outputs
            return default
        t = self[name]
        dict.pop(self, name)
        return t

    def popitem(self):
        if not dict.__len__(self):
            return dict.popitem(self)             # KeyError, as a dict's
        name = next(reversed(list(dict.keys(self))))
        return name, self.pop(name)

    def setdefault(self, name, default=None):
        if name in self:
            return self[name]
        dict.__setitem__(self, name, default)
        return default

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{n!r}: {self[n]!r}" for n in dict.keys(self)) + "}"



@dataclass
class Stats:
    """Per-bucket call and padding counts, eager fallbacks, and backend extras (capture)."""

    calls: dict = field(default_factory=lambda: defaultdict(int))
    padded_lanes: dict = field(default_factory=lambda: defaultdict(int))   # bucket -> lanes of the bucketed axis
    raw_lanes: dict = field(default_factory=lambda: defaultdict(int))
    eager_fallbacks: int = 0
    shadow_calls: int = 0      # calls shadow-verified (pg.Shadow)
    shadow_mismatches: int = 0
    shadow_exact_skipped: int = 0   # verified calls whose exact run (no padded lane) could not run
    compiles: int = 0          # graphs inductor compiled for a torch_compile'd body
    recompiles: int = 0        # of those, compiled after the body's first call
    compile_seconds: float = 0.0   # wall time of the body calls that compiled (dynamo + inductor)

    def compile_counts(self) -> tuple:
        return self.compiles, self.recompiles, self.compile_seconds

    def defer_compiles(self, before: tuple, deferred: tuple | None) -> tuple:
        """Take back what a call that raised counted since `before`; returns it added to
        `deferred` (rule 10.6: a raising call changes no stats)."""
        taken = tuple(now - was for now, was in zip(self.compile_counts(), before))
        self.compiles, self.recompiles, self.compile_seconds = before
        return taken if deferred is None else tuple(a + b for a, b in zip(deferred, taken))

    def add_compiles(self, counts: tuple) -> None:
        self.compiles, self.recompiles, self.compile_seconds = (
            a + b for a, b in zip(self.compile_counts(), counts))
    capture: dict = field(default_factory=dict)                             # bucket -> {seconds, bytes}

    def record(self, bucket: int, raw: int) -> None:
        self.calls[bucket] += 1
        self.raw_lanes[bucket] += raw
        self.padded_lanes[bucket] += bucket - raw

    @property
    def padding_fraction(self) -> float:
        total = sum(self.raw_lanes.values()) + sum(self.padded_lanes.values())
        return sum(self.padded_lanes.values()) / total if total else 0.0

    def table(self) -> str:
        rows = ["bucket  calls  raw lanes  padded lanes"]
        for b in sorted(self.calls):
            rows.append(f"{b:>6}  {self.calls[b]:>5}  {self.raw_lanes[b]:>9}  {self.padded_lanes[b]:>12}")
        rows.append(f"eager fallbacks: {self.eager_fallbacks}   padding: {self.padding_fraction:.1%}"
                    + (f"   torch.compile graphs: {self.compiles} ({self.recompiles} recompiles, "
                       f"{self.compile_seconds:.1f} s)" if self.compiles else ""))
        return "\n".join(rows)
