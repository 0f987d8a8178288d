"""Bound state: tensors, or pytrees of tensors, a runner keeps (rule 7).

A state value is walked once, at bind time, into leaves (tensors, each labelled with its path:
"kv", "kv[3]", "cache.key_cache[1]") and the mutable containers that hold them. `check()` runs
on every call, so it only compares cached facts: each container still holds the very objects it
was bound with, and each leaf still has its data pointer, shape, strides and dtype. `overlaps(t)`
says whether an input shares a byte with a leaf, from sizes and strides (rule 2.4).

Cost: the data pointers are compared on every call; shapes, strides and dtypes only when a
leaf's version counter moved. Every in-place op bumps it (set_, resize_, t_, as_strided_, and
value writes too), so a graph replay, which runs no Python op, leaves it alone and the check
stays at two cached lists. The one change it cannot see is `t.data = u` with u at the same
address (a re-typed or re-shaped view of t's own memory): the runner then still reads the very
bytes t holds. Inference tensors have no version counter: their leaves are checked in full.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
from itertools import accumulate
from operator import attrgetter
from typing import Mapping

import torch
import torch.utils._pytree as pytree

from .errors import ContractTypeError, ContractValueError, StateStorageError, mismatch, where
from .program import Program
from .state_memory import _runs, _Span, _tensors_share, byte_span
from .state_tree import _element, _is_pytree_leaf, _structure_change, _walk, check_round_trip

_T = torch.Tensor
_dtype = attrgetter("dtype")
_version = attrgetter("_version")
_UNSET = object()     # not computed yet


def _versions(tensors: list[torch.Tensor]) -> list[int] | None:
    try:
        return list(map(_version, tensors))
    except RuntimeError:                        # an inference tensor: no version counter
        return None


# ---- the bound state ------------------------------------------------------------------------------
class BoundState:
    """The state a runner was compiled with; `check()` raises if any storage or structure changed.

    `values`: each state name's object as given (the body sees it). `specs`: the pg.State of each
    state name and of each leaf label, so a finding's label ("kv[3]") finds its sinks.
    """

    def __init__(self, program: Program, state: Mapping[str, object] | None):
        if state is not None and not isinstance(state, Mapping):
            raise ContractTypeError(mismatch(program.name, None, "state=",
                                             "a mapping of state name -> tensor or pytree of tensors",
                                             type(state).__name__))
        state = dict(state or {})
        declared, given = set(program.state), set(state)
        if declared != given:
            raise ContractValueError(
                f"{where(program.name)}: state must bind exactly {sorted(declared)}; "
                f"missing {sorted(declared - given)}, unknown {sorted(given - declared, key=repr)}")
        leaves, nodes = [], []
        for name, value in state.items():
            _walk(program.name, name, name, value, leaves, nodes, set(), program.state[name].flatten)
        self.program = program.name
        self.values = state
        self.specs = dict(program.state)
        self.specs.update((label, program.state[name]) for name, label, _ in leaves)
        _check_sinks(program, leaves)
        _check_rows(program, leaves)
        _check_round_trips(program, state)
        self._rows = {n for n, spec in program.state.items() if spec.rows is not None}
        self._at: dict[int, tuple] = {}   # size -> (values as the body sees them, their cut leaves)
        self._names = [name for name, _, _ in leaves]
        self._labels = [label for _, label, _ in leaves]
        self._tensors = [t for _, _, t in leaves]
        self._watch = nodes
        L = self._tensors
        self._ptrs, self._sizes = list(map(_T.data_ptr, L)), list(map(_T.size, L))
        self._strides, self._dtypes = list(map(_T.stride, L)), list(map(_dtype, L))
        self._versions = _versions(L)          # None when a leaf keeps no version counter
        self._index_spans()

    # ---- rule 7.2: storage and structure stay as bound ----------------------------------------
    def check(self) -> None:
        for node in self._watch:
            if not node.same():
                raise StateStorageError(
                    f"{where(self.program, node.name, 'state')}: the structure bound at compile must stay "
                    f"(the same containers holding the same tensors), got: {_structure_change(node)}. A runner "
                    f"keeps reading the tensors it was bound with; re-compile with the new structure.")
        L = self._tensors
        if list(map(_T.data_ptr, L)) != self._ptrs:
            raise self._storage_error()
        if self._versions is not None:
            now = list(map(_version, L))
            if now == self._versions:
                return                         # no in-place op since the last full check
        if (list(map(_T.size, L)) != self._sizes or list(map(_T.stride, L)) != self._strides
                or list(map(_dtype, L)) != self._dtypes):
            raise self._storage_error()
        if self._versions is not None:
            self._versions = now

    def _storage_error(self) -> StateStorageError:
        for i, t in enumerate(self._tensors):
            was = (self._ptrs[i], tuple(self._sizes[i]), self._strides[i], self._dtypes[i])
            now = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
            if now != was:
                name, label = self._names[i], self._labels[i]
                return StateStorageError(
                    f"{where(self.program, name, 'state')}{_element(name, label)}: storage must stay as bound "
                    f"(data_ptr, shape, stride, dtype = {was}), got {now}; a resize, set_() or re-allocation "
                    f"would make the runner read stale memory. Re-compile with the new tensor.")
        return StateStorageError(f"{where(self.program)}: bound state changed")  # unreachable: check() saw a change

    def device(self) -> torch.device | None:
        return self._tensors[0].device if self._tensors else None

    # ---- rule 2.4: inputs share no byte with state ---------------------------------------------
    def _index_spans(self) -> None:
        spans = []
        for label, t in zip(self._labels, self._tensors):
            span = byte_span(t) if t.device.type != "meta" else None
            if span is not None:
                spans.append(_Span(span[0], span[1], label, t.device, t))
        spans.sort(key=lambda s: s.lo)
        self._spans = spans
        self._starts = [s.lo for s in spans]
        self._reach = list(accumulate((s.hi for s in spans), max))   # [i]: highest end in spans[:i + 1]
        self._runs: dict[int, object] = {}   # span index -> its runs, listed on first need

    def overlaps(self, t: torch.Tensor) -> str | None:
        """Label of a state tensor sharing a byte with t, if any.

        Bisect over the leaves' true byte spans (sizes and strides); only where spans intersect
        are the bytes compared exactly, so a strided or expanded input beside state passes.
        """
        span = byte_span(t) if self._spans else None
        if span is None:
            return None
        lo, hi = span
        i = bisect.bisect_left(self._starts, hi) - 1      # spans that start before t ends
        mine = _UNSET
        while i >= 0 and self._reach[i] > lo:
            s = self._spans[i]
            if s.hi > lo and s.device == t.device:
                mine = _runs(t) if mine is _UNSET else mine
                if _tensors_share(t, s.tensor, mine, self._state_runs(i)):
                    return s.label
            i -= 1
        return None

    def _state_runs(self, i: int):
        if i not in self._runs:
            self._runs[i] = _runs(self._spans[i].tensor)
        return self._runs[i]

    # ---- batch-ordered state (pg.State(rows=bs)) ---------------------------------------------
    def at(self, size: int) -> Mapping[str, object]:
        """State values as the body sees them at `size`: batch-ordered ones cut to rows [0, size)
        (the structure rebuilt around the cut leaves, once per size); the others as bound."""
        return self._cut(size)[0] if self._rows else self.values

    def row_leaves(self, size: int) -> list[torch.Tensor]:
        """The cut leaves inside at(size) (their dim 0 follows the bucketed axis)."""
        return self._cut(size)[1] if self._rows else []

    def _cut(self, size: int) -> tuple[dict, list]:
        got = self._at.get(size)
        if got is None:
            for name, label, t in zip(self._names, self._labels, self._tensors):
                if name in self._rows and t.shape[0] < size:
                    raise ContractValueError(mismatch(self.program, name, f"rows of {label} (batch-ordered state)",
                                                      f">= the size the body runs at ({size})", t.shape[0], kind="state"))
            leaves: list[torch.Tensor] = []
            shared = self._shared_row_storages()

            def cut(t):
                # leaves that share storage (K and V columns of one buffer, a buffer and a view
                # of it) are cut as views: dynamo then sees their aliasing through a common base,
                # where set_-made tensors over one storage fail its compile
                if t.untyped_storage().data_ptr() in shared:
                    leaves.append(t.narrow(0, 0, size))
                else:
                    leaves.append(_rows_prefix(t, size))
                return leaves[-1]

            values = {n: _rebuild(v, cut, self.specs[n]) if n in self._rows else v for n, v in self.values.items()}
            got = (values, leaves)
            if len(self._at) < 1024:
                self._at[size] = got
        return got

    def _shared_row_storages(self) -> set[int]:
        """Storages that hold a leaf of batch-ordered state and another state leaf."""
        seen: dict[int, int] = {}
        for t in self._tensors:
            p = t.untyped_storage().data_ptr()
            seen[p] = seen.get(p, 0) + 1
        return {t.untyped_storage().data_ptr() for name, t in zip(self._names, self._tensors)
                if name in self._rows and seen[t.untyped_storage().data_ptr()] > 1}

    # ---- for pg.check ----------------------------------------------------------------------------
    def snapshot(self) -> list[torch.Tensor]:
        """Copies of every leaf, byte for byte (bool through its bytes: a copy of a bool tensor
        turns any nonzero byte into 1, which would overwrite a canary's sentinel)."""
        with torch.no_grad():      # a Parameter's copy without autograd history
            return [_bytes_of(t).clone().view(t.dtype) for t in self._tensors]

    def restore(self, snap: list[torch.Tensor]) -> None:
        with torch.no_grad():      # in place into a Parameter (a leaf that requires grad)
            for t, s in zip(self._tensors, snap):
                _bytes_of(t).copy_(_bytes_of(s))

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(label, tensor) of every leaf: "kv" for a tensor, "kv[3]", "cache.key_cache[1]" inside one."""
        return list(zip(self._labels, self._tensors))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor as its bytes (uint8, the same view), anything else as it is."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _rebuild(value, cut, spec=None):
    """The same structure with every tensor leaf replaced by cut(leaf)."""
    if spec is not None and spec.flatten is not None:
        leaves, ctx = spec.flatten(value)
        return spec.unflatten([cut(t) for t in leaves], ctx)
    if isinstance(value, torch.Tensor):
        return cut(value)
    if isinstance(value, list):
        items = [_rebuild(v, cut) for v in value]
        if type(value) is list:
            return items
        new = copy.copy(value)               # a list subclass keeps its type (bound as a list)
        list.__setitem__(new, slice(None), items)
        return new
    if type(value) is tuple:
        return tuple(_rebuild(v, cut) for v in value)
    if type(value) is dict:
        return {k: _rebuild(v, cut) for k, v in value.items()}
    if isinstance(value, dict) and _is_pytree_leaf(value):   # a dict subclass pytree does not know
        new = copy.copy(value)                                # (bound as a dict: _container)
        for k, v in value.items():
            dict.__setitem__(new, k, _rebuild(v, cut))
        return new
    if not _is_pytree_leaf(value):
        kids, tree = pytree.tree_flatten(value, is_leaf=lambda c: c is not value)
        return pytree.tree_unflatten([_rebuild(k, cut) for k in kids], tree)
    if dataclasses.is_dataclass(value):
        fs = dataclasses.fields(value)
        new = dataclasses.replace(value, **{f.name: _rebuild(getattr(value, f.name), cut)
                                            for f in fs if f.init})
        for f in fs:                   # init=False fields: replace() leaves them to __post_init__
            if not f.init and hasattr(value, f.name):
                object.__setattr__(new, f.name, _rebuild(getattr(value, f.name), cut))
        return new
    return value


def _rows_prefix(t: torch.Tensor, size: int) -> torch.Tensor:
    """Rows [0, size) of t over t's own storage, made with set_ (not a view): a traced body sees a
    plain tensor of the bucket's size rather than a view of the full cache."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), (size, *t.shape[1:]), t.stride())


def _check_rows(program: Program, leaves) -> None:
    """Every leaf of a batch-ordered state has a row for each lane of the largest bucket."""
    largest = program.buckets[-1]
    for name, label, t in leaves:
        if program.state[name].rows is None:
            continue
        if t.dim() == 0 or t.shape[0] < largest:
            raise ContractValueError(mismatch(
                program.name, name, f"dim 0 of {label} (batch-ordered: one row per lane of the largest bucket)",
                f">= {largest}", "0-d" if t.dim() == 0 else f"{t.shape[0]} (shape {tuple(t.shape)})", kind="state"))


def _check_round_trips(program: Program, state: Mapping[str, object]) -> None:
    """Every flatten/unflatten pair is inverse, tried as the body will see it: batch-ordered state
    at the smallest bucket's rows (a cut that differs from the bound leaves), the rest as bound."""
    for name, value in state.items():
        spec = program.state[name]
        if spec.flatten is not None:
            check_round_trip(program.name, name, value, spec, program.buckets[0] if spec.rows is not None else None)


def _check_sinks(program: Program, leaves) -> None:
    """Every sink row exists in dim 0 of every tensor of its state."""
    for name, label, t in leaves:
        rows = program.state[name].sink_rows
        if not rows:
            continue
        if t.dim() == 0:
            raise ContractValueError(mismatch(program.name, name, f"sink rows {list(rows)}",
                                              f"rows of dim 0, but {label} is 0-d", "a 0-d tensor", kind="state"))
        if max(rows) >= t.shape[0]:
            raise ContractValueError(mismatch(
                program.name, name, "sink rows", f"< dim 0 of every bound tensor ({t.shape[0]} for {label}, "
                f"shape {tuple(t.shape)})", list(rows), kind="state"))
