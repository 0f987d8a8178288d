"""Bound state: tensors a runner keeps, with a guard that their storage never moved (rule 7)."""
from __future__ import annotations

import bisect
from typing import Mapping

import torch

from .errors import ContractTypeError, ContractValueError, StateStorageError, where
from .program import Program


def _tensors(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class BoundState:
    """The state a runner was compiled with; `check()` raises if any tensor's storage changed."""

    def __init__(self, program: Program, state: Mapping[str, object] | None):
        state = dict(state or {})
        declared, given = set(program.state), set(state)
        if declared != given:
            raise ContractValueError(
                f"{where(program.name)}: state must bind exactly {sorted(declared)}; "
                f"missing {sorted(declared - given)}, unknown {sorted(given - declared)}")
        for name, value in state.items():
            for t in _tensors(value):
                if not isinstance(t, torch.Tensor):
                    raise ContractTypeError(
                        f"{where(program.name, name, 'state')}: must be a tensor or a list of tensors, got {type(t).__name__}")
        self.program = program.name
        self.specs = dict(program.state)
        self.values = state
        self._flat = [(name, t) for name, v in state.items() for t in _tensors(v)]
        self._sigs = [_signature(t) for _, t in self._flat]
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n, t.device)
                       for n, t in self._flat)
        self._ranges = spans
        self._starts = [s[0] for s in spans]
        # ranges that contain a later range's start break the sorted early exit: check them all
        self._long = [s for i, s in enumerate(spans) if any(o[0] < s[1] for o in spans[i + 1:])]

    def check(self) -> None:
        for (name, t), sig in zip(self._flat, self._sigs):
            if _signature(t) != sig:
                raise StateStorageError(
                    f"{where(self.program, name, 'state')}: storage must stay as bound "
                    f"(data_ptr, shape, stride, dtype = {sig}), got {_signature(t)}; a resize, set_() "
                    f"or re-allocation would make the runner read stale memory. Re-compile with the new tensor.")

    def device(self) -> torch.device | None:
        return self._flat[0][1].device if self._flat else None

    def overlaps(self, t: torch.Tensor) -> str | None:
        """Name of a state tensor whose memory overlaps t's, if any (bisect over sorted ranges)."""
        if not self._ranges:
            return None
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        i = bisect.bisect_right(self._starts, hi - 1) - 1
        while i >= 0:
            start, end, name, dev = self._ranges[i]
            if end <= lo:
                break  # sorted by start; earlier ranges may still be long, checked below
            if dev == t.device and start < hi:
                return name
            i -= 1
        for start, end, name, dev in self._long:
            if dev == t.device and start < hi and lo < end:
                return name
        return None

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for _, t in self._flat]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for (_, t), s in zip(self._flat, snap):
            t.copy_(s)

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._flat)
