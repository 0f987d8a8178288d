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

The second comparison assumes a raw lane is computed the same at any batch size, up to the
dtype's tolerance: a bf16 body whose GEMMs are chosen by row count and that takes a discrete
choice (argmax, top-k) on a near tie can differ there with no padded lane involved; such a body
is shadowed with `exact=False` (SPEC 7.8).

Both compare only what the contract makes deterministic: outputs on raw lanes, and every state
row except sink rows (rule 7.4) and the padded rows [n, bucket) of batch-ordered state (7.7),
where padded lanes may write anything (noise, or the racy result of a scatter of many padded
lanes onto one sink). Every other row and lane is compared strictly.

The eager runs read copies of the inputs taken before the call ran: an earlier output of this
runner fed back as an input (a decode loop) lives in memory the run overwrites. A verification
that raises still ends the previous call's lease (its outputs' memory holds this call's values
now), and the state is put back as the replay left it. A mismatch raises `pg.ShadowMismatch` (or
is logged, or handed to a callable) naming the program, the bucket, the raw extents, the buffer,
the first differing lane (output) or row (state), and both values. Calls that are not sampled
pay one integer test; a sampled one also copies its inputs once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from .eager import exact_run, mask_outputs, run_padded
from .observe import _State, beyond_tolerance, out_of_bounds, tolerance
from .pack import bit_view
from .errors import ContractTypeError, ContractValueError, ShadowMismatch, where

log = logging.getLogger("padgraph")
_SHAPE = ("shape",)      # the lane _first_difference gives two tensors of different shapes


@dataclass(frozen=True)
class Shadow:
    """Which calls to shadow-verify, and what to do on a mismatch.

    every: verify every N-th call of the runner (after `first`); first: the first K calls of each
    bucket are verified; on_mismatch: "raise" (pg.ShadowMismatch), "log" (a logging error) or a
    callable taking the ShadowMismatch; exact: also compare with the exact run (no padded lane;
    False for a body that rounds differently by batch size and takes discrete choices on the
    result, e.g. a bf16 draft's top-k: SPEC 7.8);
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
        if not isinstance(self.exact, bool):
            raise ContractTypeError(f"pg.Shadow: exact must be a bool, got {self.exact!r} ({type(self.exact).__name__})")
        for name in ("rtol", "atol"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise ContractValueError(f"pg.Shadow: {name} must be a number >= 0 or None, got {v!r}")


class Sampler:
    """Which calls a runner verifies: per-bucket first calls, then every N-th call."""

    def __init__(self, spec: Shadow):
        self.spec, self.seen, self.n = spec, {}, 0

    def sampled(self, bucket: int) -> bool:
        self.n += 1
        k = self.seen.get(bucket, 0)
        self.seen[bucket] = k + 1
        return k < self.spec.first or self.n % self.spec.every == 0


def shadowed(runner, spec: Shadow, bucket: int, raw: Mapping, ext, dev) -> Mapping[str, torch.Tensor]:
    """A sampled call: the backend's run, then `verify`; the run's padded outputs."""
    mine = {n: t.clone() for n, t in raw.items()}   # as the call found them: the run may overwrite
    mine_dev = {a: t.clone() for a, t in dev.items()} if dev else dev   # an input, or an extent,
    before = runner.state.snapshot()                 # that is an earlier output's memory
    outs = runner._run_device(bucket, raw, ext, dev) if dev else runner._run(bucket, raw, ext)
    try:
        after = runner.state.snapshot()
        runner.stats.shadow_calls += 1
        found = verify(runner, spec, (bucket, mine, ext, mine_dev), outs, before, after)
        if found is not None:
            report(runner, spec, bucket, ext, found)
    except BaseException:
        runner._next_lease()     # the run rewrote the previous call's outputs: they read as stale
        raise
    return outs


def verify(runner, spec: Shadow, call: tuple, replay_outs: Mapping, before: list, after: list) -> str | None:
    """What differs between the replay of `call` = (bucket, raw, extents, device extents) (outputs
    `replay_outs`, state `after`) and the eager runs from state `before`; None when nothing does.
    Leaves the state as `after`."""
    bucket, raw, ext, dev = call
    run_ext, run_raw = runner._cut(raw, ext, dev) if dev else (ext, raw)
    state = runner.state
    free = _State.of(state).allowed(run_ext, bucket, runner.plan.bucket_axis)   # sinks, padded lanes' rows
    try:
        state.restore(before)
        eager = run_padded(runner, bucket, run_raw, run_ext, runner.device, body=runner._eager_body)
        if dev:     # on copies: an output may be (a view of) state, which its pad must not reach
            eager = {n: t.clone() for n, t in eager.items()}
            eager = mask_outputs(runner.program, eager, runner._device_dims, run_ext.__getitem__)
        eager_state = state.snapshot()
        found = _outputs(runner, spec, replay_outs, eager, ext, "the replay", "the eager padded path")
        found = found or _state(runner, spec, (after, eager_state), free, None, "the replay", "the eager padded path")
        if found is None and spec.exact:
            found = _against_exact(runner, spec, (eager, eager_state), before, free, run_raw, run_ext)
    finally:
        state.restore(after)
    return found


def _against_exact(runner, spec, padded: tuple, before: list, free: list, raw, ext) -> str | None:
    state = runner.state
    state.restore(before)
    try:
        exact = exact_run(runner, raw, ext, body=runner._eager_body)
    except Exception as e:  # noqa: BLE001 - a body that cannot run unpadded: that part is skipped
        if out_of_bounds(e) and ext[runner.plan.bucket_axis] > 0:
            # the padded run read there: raw lanes read padded ones (pg.check's finding too)
            return (f"the exact run (no padded lane) indexed out of bounds ({type(e).__name__}: {e}) where the "
                    f"padded run ran: raw lanes read lanes past their extent")
        level = logging.DEBUG if runner.stats.shadow_exact_skipped else logging.WARNING   # once a runner
        runner.stats.shadow_exact_skipped += 1
        log.log(level, "padgraph shadow: exact run of %r skipped (%s: %s); its calls are verified against "
                "the eager padded run only (stats.shadow_exact_skipped counts them)", runner.program.name,
                type(e).__name__, e)
        return None
    eager, eager_state = padded
    found = _outputs(runner, spec, eager, exact, ext, "the padded run", "the exact run (no padded lane)")
    return found or _state(runner, spec, (eager_state, state.snapshot()), free, before, "the padded run",
                           "the exact run")


def _outputs(runner, spec, got: Mapping, want: Mapping, ext, got_name: str, want_name: str) -> str | None:
    for name, dims in runner._out_slices.items():
        a, b = got[name], want[name]
        for d, axis, af in dims:
            n = af.scale * ext[axis] + af.offset
            a, b = a.narrow(d, 0, n), b.narrow(d, 0, n)
        lane = _first_difference(a, b, spec, lanes=tuple(d for d, _, _ in dims))
        if lane is not None:
            return (f"output {name!r}, lane {lane}: {got_name} gave {_at(a, lane)}, {want_name} gives "
                    f"{_at(b, lane)}")
    return None


def _state(runner, spec, runs: tuple, free: list, before, got_name: str, want_name: str) -> str | None:
    """State leaves of two runs (got, want) compared row by row, outside the rows padded lanes
    may write (`free`: sinks, padded rows of batch-ordered state). With `before`: rows `got`
    changed that `want` did not are padded lanes' writes; outside `free`, a finding."""
    for i, (label, _) in enumerate(runner.state.named()):
        g, w = runs[0][i], runs[1][i]
        if before is not None and g.dim() > 0:
            # rows the padded run moved beyond the tolerance (a raw lane rewriting its own row
            # may round it by an ulp where the exact run's GEMM left it bit-identical)
            extra = (_changed(g, before[i]) - _changed(w, before[i]) - free[i]) & _rows(
                _beyond(g, before[i], spec))
            if extra:
                row = min(extra)
                return (f"state {label!r}, row {row}: {got_name} wrote it and {want_name} did not, and it is "
                        f"not a sink (a padded lane writes a non-sink row): {_at(g, (row,))} instead of "
                        f"{_at(before[i], (row,))}")
        lane = _first_difference(g, w, spec, free[i])
        if lane is not None:
            return (f"state {label!r}, {_row(lane, g)}: {got_name} left {_at(g, lane)}, {want_name} leaves "
                    f"{_at(w, lane)}")
    return None


def _changed(now: torch.Tensor, before: torch.Tensor) -> set:
    return _rows(bit_view(now) != bit_view(before))


def _rows(diff: torch.Tensor) -> set:
    """The rows of dim 0 where `diff` holds anywhere."""
    if diff.numel() == 0:
        return set()
    return set(diff.reshape(diff.shape[0], -1).any(1).nonzero().flatten().tolist())


def _first_difference(a: torch.Tensor, b: torch.Tensor, spec: Shadow, skip_rows: set = frozenset(),
                      lanes: tuple[int, ...] | None = None) -> tuple | None:
    """The first lane where a and b differ beyond tolerance, rows of dim 0 in `skip_rows` aside
    (lanes: an output's padded dims, the tolerance's rows; None: rows of dim 0); _SHAPE when
    their shapes differ; None when they agree."""
    if a.shape != b.shape:
        return _SHAPE
    bad = _beyond(a, b, spec, lanes)
    if skip_rows and bad.dim() > 0:
        bad[torch.tensor(sorted(skip_rows), device=bad.device)] = False
    if not bool(bad.any()):
        return None
    return tuple(bad.nonzero()[0].tolist())


def _beyond(a: torch.Tensor, b: torch.Tensor, spec: Shadow, lanes: tuple[int, ...] | None = None) -> torch.Tensor:
    """Where a and b (one shape) differ: floating and complex values beyond the dtype's
    tolerance (pg.check's, or the Shadow's own) scaled by their row (`row_scale`), anything
    else bit for bit. One entry a lane of a and b (complex: not a part of one)."""
    if a.is_floating_point() or a.is_complex():
        rtol, atol = tolerance(a.dtype)        # pg.check's, by dtype
        rtol = rtol if spec.rtol is None else spec.rtol
        atol = atol if spec.atol is None else spec.atol
        return beyond_tolerance(a, b, rtol, atol, lanes=lanes)
    return bit_view(a) != bit_view(b)


def _row(lane: tuple, t: torch.Tensor) -> str:
    """A state lane as its row of dim 0 (and where in the row)."""
    if lane is _SHAPE:
        return "shape"
    if t.dim() <= 1:
        return "its value" if t.dim() == 0 else f"row {lane[0]}"
    return f"row {lane[0]}, column {lane[1]}" if t.dim() == 2 else f"row {lane[0]}, element {lane[1:]} of it"


def _at(t: torch.Tensor, lane: tuple):
    if lane is _SHAPE:
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
