"""Shadow verification of live calls: `pg.compile(..., shadow=pg.Shadow(every=N, first=K))`.

A sampled call (the first K calls of each bucket, then every N-th call) runs as usual, and then
twice more on the same device from a copy of the bound state as the call found it:

  1. the eager padded path at the same bucket (the body as given, never its compiled form):
     the replay's outputs and state must equal it. A graph that baked a Python scalar or a host
     tensor in at capture, a pack that read a freed temporary, a static buffer a hook left stale:
     each makes the replay differ from the eager run of the same padded view.
  2. the exact run (every axis's capacity = its raw extent, no padded lane): the raw lanes of
     the padded run must equal it, and every state row the padded run wrote that the exact run
     did not must be a sink or a batch-ordered row padded lanes own. A hook that built metadata
     from a raw buffer, a padded lane writing a non-sink row, a body reading lanes past an extent:
     each makes the padded run differ from the exact one.

The state is then put back as the replay left it. A mismatch raises `pg.ShadowMismatch` (or is
logged, or handed to a callable) naming the program, the bucket, the raw extents, the buffer, the
first differing lane or row, and both values. Calls that are not sampled pay one integer test.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from .eager import exact_run, mask_outputs, run_padded
from .observe import _State, tolerance
from .pack import bit_view
from .errors import ContractTypeError, ContractValueError, ShadowMismatch, where

log = logging.getLogger("padgraph")

@dataclass(frozen=True)
class Shadow:
    """Which calls to shadow-verify, and what to do on a mismatch.

    every: verify every N-th call of the runner (after `first`); first: the first K calls of each
    bucket are verified; on_mismatch: "raise" (pg.ShadowMismatch), "log" (a logging error) or a
    callable taking the ShadowMismatch; exact: also compare with the exact run (no padded lane);
    rtol / atol: float tolerance (default by dtype: compiled bodies and GEMMs picked by shape may
    round differently in the last bits)."""

    every: int = 1000
    first: int = 1
    on_mismatch: object = "raise"
    exact: bool = True
    rtol: float | None = None
    atol: float | None = None

    def __post_init__(self):
        for name in ("every", "first"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "every" else 0):
                raise ContractValueError(f"pg.Shadow: {name} must be an int >= {1 if name == 'every' else 0}, got {v!r}")
        if self.on_mismatch not in ("raise", "log") and not callable(self.on_mismatch):
            raise ContractTypeError(f"pg.Shadow: on_mismatch must be 'raise', 'log' or a callable, got {self.on_mismatch!r}")


class Sampler:
    """Which calls a runner verifies: per-bucket first calls, then every N-th call."""

    def __init__(self, spec: Shadow):
        self.spec, self.seen, self.n = spec, {}, 0

    def sampled(self, bucket: int) -> bool:
        self.n += 1
        k = self.seen.get(bucket, 0)
        self.seen[bucket] = k + 1
        return k < self.spec.first or self.n % self.spec.every == 0


def verify(runner, spec: Shadow, call: tuple, replay_outs: Mapping, before: list, after: list) -> str | None:
    """What differs between the replay of `call` = (bucket, raw, extents, device extents) (outputs
    `replay_outs`, state `after`) and the eager runs from state `before`; None when nothing does.
    Leaves the state as `after`."""
    bucket, raw, ext, dev = call
    run_ext, run_raw = runner._cut(raw, ext, dev) if dev else (ext, raw)
    state = runner.state
    try:
        state.restore(before)
        eager = run_padded(runner, bucket, run_raw, run_ext, runner.device, body=runner._eager_body)
        if dev:
            eager = mask_outputs(runner.program, eager, runner._device_dims, run_ext.__getitem__)
        eager_state = state.snapshot()
        found = _outputs(runner, spec, replay_outs, eager, ext, "the replay", "the eager padded path")
        found = found or _state(runner, spec, after, eager_state, None, "the replay", "the eager padded path")
        if found is None and spec.exact:
            found = _against_exact(runner, spec, eager, eager_state, before, run_raw, run_ext, bucket)
    finally:
        state.restore(after)
    return found


def _against_exact(runner, spec, eager, eager_state, before, raw, ext, bucket) -> str | None:
    state = runner.state
    state.restore(before)
    try:
        exact = exact_run(runner, raw, ext, body=runner._eager_body)
    except Exception as e:  # noqa: BLE001 - a body that cannot run unpadded: that part is skipped
        runner.stats.shadow_exact_skipped += 1
        log.debug("padgraph shadow: exact run of %r skipped (%s: %s)", runner.program.name, type(e).__name__, e)
        return None
    exact_state = state.snapshot()
    found = _outputs(runner, spec, eager, exact, ext, "the padded run", "the exact run (no padded lane)")
    if found is None:
        own = _State.of(runner.state).allowed(ext, bucket, runner.plan.bucket_axis)   # sinks, own rows
        found = _state(runner, spec, eager_state, exact_state, (before, own), "the padded run", "the exact run")
    return found


def _outputs(runner, spec, got: Mapping, want: Mapping, ext, got_name: str, want_name: str) -> str | None:
    for name, dims in runner._out_slices.items():
        a, b = got[name], want[name]
        for d, axis, af in dims:
            n = af.scale * ext[axis] + af.offset
            a, b = a.narrow(d, 0, n), b.narrow(d, 0, n)
        lane = _first_difference(a, b, spec)
        if lane is not None:
            return (f"output {name!r}, lane {lane}: {got_name} gave {_at(a, lane)}, {want_name} gives "
                    f"{_at(b, lane)}")
    return None


def _state(runner, spec, got: list, want: list, writes, got_name: str, want_name: str) -> str | None:
    """State leaves compared row by row. writes=(before, allowed rows): rows `got` changed from
    `before` that `want` did not are padded lanes' writes; outside the allowed rows, a finding."""
    for (label, _), g, w, i in zip(runner.state.named(), got, want, range(len(got))):
        if writes is not None and g.dim() > 0:
            before, allowed = writes[0][i], writes[1][i]
            extra = _changed(g, before) - _changed(w, before) - allowed
            if extra:
                row = min(extra)
                return (f"state {label!r}, row {row}: {got_name} wrote it and {want_name} did not, and it is "
                        f"not a sink (a padded lane writes a non-sink row): {_at(g, (row,))} instead of "
                        f"{_at(before, (row,))}")
        lane = _first_difference(g, w, spec)
        if lane is not None:
            return f"state {label!r}, lane {lane}: {got_name} left {_at(g, lane)}, {want_name} leaves {_at(w, lane)}"
    return None


def _changed(now: torch.Tensor, before: torch.Tensor) -> set:
    diff = bit_view(now) != bit_view(before)
    return set(diff.reshape(diff.shape[0], -1).any(1).nonzero().flatten().tolist())


def _first_difference(a: torch.Tensor, b: torch.Tensor, spec: Shadow) -> tuple | None:
    if a.shape != b.shape:
        return ()
    if a.is_floating_point():
        rtol, atol = tolerance(a.dtype)        # pg.check's, by dtype
        rtol = rtol if spec.rtol is None else spec.rtol
        atol = atol if spec.atol is None else spec.atol
        a64, b64 = a.double(), b.double()
        bad = ~((a64 - b64).abs() <= atol + rtol * b64.abs()) & ~(a64.isnan() & b64.isnan()) & (a64 != b64)
    else:
        bad = bit_view(a) != bit_view(b)
    if not bool(bad.any()):
        return None
    return tuple(bad.nonzero()[0].tolist())


def _at(t: torch.Tensor, lane: tuple):
    if lane == ():
        return f"shape {tuple(t.shape)}"
    v = t[lane]
    return v.tolist() if v.numel() <= 8 else f"a row of {v.numel()} values starting {v.flatten()[:4].tolist()}"


def report(runner, spec: Shadow, bucket: int, ext, what: str) -> None:
    """Raise, log or hand over the mismatch, by `spec.on_mismatch`."""
    err = ShadowMismatch(f"{where(runner.program.name)}: a shadow-verified call (bucket {bucket}, raw extents "
                         f"{dict(ext)}) must match the eager runs of its padded view, got {what}")
    runner.stats.shadow_mismatches += 1
    if spec.on_mismatch == "raise":
        raise err
    if spec.on_mismatch == "log":
        log.error("%s", err)
    else:
        spec.on_mismatch(err)
