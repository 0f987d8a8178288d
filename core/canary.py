"""The canary: state rows no lane of any call may write, checked inside every call, read without a sync.

`pg.State(sink=0, canary=1)` declares row 1 of dim 0 of every tensor of that state padgraph's own:
nothing the program does may write it (the engines' reserved KV slot, whose corruption SGLang's
KV canary detects). At compile the runner fills each canary row with the sentinel byte 0x5A, and
after every run of the body (each replay's graph holds the check; eager runs do it eagerly) it
compares the rows against the sentinel. A row that changed sets a flag in pinned host memory that
the device writes directly, so the host reads it at a later call with no copy, event or sync: the
first call that sees the flag raises `pg.CanaryError` (or warns, `canary="warn"`) naming the
program, the state tensor and the row, before it runs anything. The GPU may be several calls
behind the host, so a hit is reported at the next call or a few later; `runner.canary_check()`
waits for the device and reports at once. After a report the rows are re-armed.

What the canary catches is any write to a declared row, whoever makes it: a padded lane whose
index was clamped onto a live row, a stale request's slot, a kernel writing past its extent into
the next row. It cannot see writes to rows it does not watch: sink rows (padded lanes write
there by contract) and live rows (the shadow and `pg.check` compare those).
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable

import torch

from .errors import CanaryError, ContractValueError, mismatch

log = logging.getLogger("padgraph")

SENTINEL = 0x5A          # every byte of a canary row: a finite value in every float dtype (fp32 1.5e16)
MODES = ("raise", "warn", "log")


class CanaryWarning(UserWarning):
    """A canary row was written (canary="warn")."""


def parse_mode(program: str, value) -> str | None:
    """The `canary=` option as a mode, or None for off: True / "raise", "warn", "log", False / None."""
    if value is True:
        return "raise"
    if value is False or value is None:
        return None
    if isinstance(value, str) and value in MODES:
        return value
    raise ContractValueError(mismatch(program, None, "canary", f"True, False or one of {list(MODES)}", repr(value)))


def torch_checker(regions: list[torch.Tensor], flag_dev: torch.Tensor) -> None:
    """flag_dev[0] = (index + 1) of a canary row that lost its sentinel, else unchanged; torch ops,
    no host sync (one `any` per row, fine for eager runs)."""
    for i, r in enumerate(regions):
        hit = (r != SENTINEL).any().to(flag_dev.dtype) * (i + 1)          # 0 or i + 1
        torch.maximum(flag_dev, hit.reshape(1), out=flag_dev)


class Canary:
    """The canary rows of one runner's bound state, their check and the flag it sets."""

    def __init__(self, program, state, mode: str, device, checker: Callable | None = None):
        """`checker(regions, flag) -> check()`: a backend's one-launch check (None: torch ops)."""
        self.program, self.mode = program.name, mode
        self.regions, self.labels = [], []              # uint8 views of each canary row; "kv[3] row 1"
        for name, label, t in _canary_leaves(program, state):
            for row in program.state[name].canary_rows:
                self.regions.append(_row_bytes(program.name, name, label, t, row))
                self.labels.append((name, label, row))
        on_cuda = device is not None and torch.device(device).type == "cuda"
        # the flag the host reads: pinned (device-writable through unified addressing) on CUDA
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=on_cuda)
        self._flag_np = self.flag.numpy()
        self._dev_flag = None
        self._check = checker(self.regions, self.flag) if checker is not None and self.regions else None
        if self._check is None and on_cuda:             # torch ops on the device, then a copy
            self._dev_flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.arm()

    def __len__(self) -> int:
        return len(self.regions)

    def arm(self) -> None:
        """Fill every canary row with the sentinel and clear the flag."""
        with torch.no_grad():
            for r in self.regions:
                r.fill_(SENTINEL)
        if self._dev_flag is not None:
            self._dev_flag.zero_()
        self._flag_np[0] = 0

    def check(self) -> None:
        """Enqueue the check of every canary row (after a run of the body; inside a graph on CUDA)."""
        if self._check is not None:
            self._check()
        elif self._dev_flag is not None:
            torch_checker(self.regions, self._dev_flag)
            self.flag.copy_(self._dev_flag, non_blocking=True)
        else:
            torch_checker(self.regions, self.flag)

    def wrap(self, body: Callable) -> Callable:
        """`body` followed by the check: what a runner runs (graphs capture the check with it)."""
        def checked(x):
            outs = body(x)
            self.check()
            return outs
        checked.__wrapped__ = body
        return checked

    def poll(self, call: int) -> None:
        """At a call's start: report a hit the device has flagged by now (no sync)."""
        if self._flag_np[0]:
            self._report(call)

    def _report(self, call: int) -> None:
        hit = int(self._flag_np[0]) - 1
        name, label, row = self.labels[hit]
        bad = [f"{lb} row {rw}" for r, (_, lb, rw) in zip(self.regions, self.labels) if bool((r != SENTINEL).any())]
        when = ("by a run at compile (a warm-up's all-pad view: padded lanes wrote it)" if call == 1 else
                f"by a call before call {call} (the device may run a few calls behind)")
        msg = (f"program {self.program!r}, state {name!r}: canary row {row} of {label} must never be written "
               f"(no lane of any call may write it), got a write {when}; rows written: {', '.join(bad) or label + f' row {row}'}. A padded lane's index "
               f"clamped onto a live row, a stale request's slot or a write past an extent are the usual causes. "
               f"The rows are re-armed")
        self.arm()
        if self.mode == "raise":
            raise CanaryError(msg)
        if self.mode == "warn":
            warnings.warn(msg, CanaryWarning, stacklevel=4)
        else:
            log.error(msg)


def _canary_leaves(program, state):
    for name, label, t in zip(state._names, state._labels, state._tensors):
        if program.state[name].canary_rows:
            yield name, label, t


def _row_bytes(program: str, name: str, label: str, t: torch.Tensor, row: int) -> torch.Tensor:
    """Row `row` of dim 0 of t as a flat uint8 view (a dense row: the check reads its bytes)."""
    if t.dim() == 0 or row >= t.shape[0]:
        got = "a 0-d tensor" if t.dim() == 0 else f"{row} (dim 0 of {label} is {t.shape[0]})"
        raise ContractValueError(mismatch(program, name, "canary rows", "rows of dim 0 of every bound tensor",
                                          got, kind="state"))
    r = t[row]
    if not r.is_contiguous():
        raise ContractValueError(mismatch(program, name, f"canary row {row} of {label}", "a dense row (contiguous "
                                          "trailing dims)", f"strides {tuple(t.stride())}", kind="state"))
    return r.reshape(-1).view(torch.uint8) if r.dim() else r.reshape(1).view(torch.uint8)
