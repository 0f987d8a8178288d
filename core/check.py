"""`pg.check`: the debug tool. Runs a program on the reference backend over random raw inputs and
several sizes, and reports pad leakage, state writes outside raw targets and sinks, nondeterminism,
and bodies that raise on the default sampler's inputs.

The baseline of a trial is the *exact* run: the body sees the raw tensors themselves (every axis's
capacity equals its raw extent, `x.bucket` is the raw extent of the bucketed axis), so no lane of
any axis is padded. What it writes to state are the raw lanes' targets; what it returns is what
every padded size must return on the raw lanes. A body that cannot run exact (it shapes tensors
from `x.bucket`, or fails on an empty dependent axis) falls back to the tightest size, noted in
the result: padded lanes of dependent axes then count as raw there.

Trials: odd trials first run another draw at the largest bucket (a previous call) and start from
the state it leaves, so padded lanes that reuse an earlier call's leftovers (a stale slot table)
are seen writing rows no raw lane targets. Each bucket also runs once with every lane padded (raw
extents 0, as a capture's warm-up): rows it writes outside the sinks (and outside rows the body
writes with no lane at all, exact at raw extents 0, such as a counter) are padded lanes' writes
whatever the order of the writes.
A sink row that a raw lane wrote in the exact run must keep that write at every size. After the
largest size of a trial the same raw inputs run once more, from the state that size left and from
the state the exact run left: raw lanes that read what padded lanes wrote (a sink slot filled by
one call, read by the next) differ there, though each single call matched. An exact
run that indexes out of bounds while padded sizes run is a pad-leakage finding: its raw lanes
read padded ones. The exact run gets row-major copies of the raw inputs, as every runner's body.

Which rows a run writes is seen twice, so a padded lane that writes the value a row already held
is still caught:
  1. on the state as bound: rows whose contents changed;
  2. on a poisoned copy: every floating-point state tensor is filled with POISON first, and rows
     that no longer hold it were written.
A row escapes only if its write leaves both backgrounds unchanged, i.e. the written value is the
row's own old value (`kv[i] = kv[i]`, `kv[i] += 0`); such a write is a no-op anyway.

Why poison state and not the pads: the body must see the declared pads, since they decide where
padded lanes write (`out_cache_loc` = the sink slot) and what they compute; other "detection pads"
would move the writes they are meant to observe. State contents are different for floating-point
tensors: they are data (KV caches, hidden rows) that decide values, not addresses, so replacing
them changes what a lane writes but not where. Integer and bool state (page tables such as
`req_to_token`, counters) holds addresses and control, so it is never poisoned: there an
equal-value write is seen only by 1. Outputs of poisoned runs are ignored; if a body raises on
poisoned state, that trial keeps view 1 only and the result says so.

Without `sample=` the inputs come from the declaration (`check_inputs.declared_sample`): an
integer input whose pad is a sink row of a state is an index into that state, so its raw lanes
draw distinct rows that are no sink; other inputs are small random values. Every finding says
where: the first differing lane of an output (`Finding.lane`), the rows of a state
(`Finding.rows`), with both values.

Errors: a ContractError (wrong output shapes, bad inputs) always propagates. Any other exception
from the body under the *default* sampler is a `body-error` finding that points to `sample=`: the
default sampler draws other integers in 0..3, which are often not valid lengths or offsets for a
real body. Under a caller's sampler the exception propagates, with a note naming the trial's
extents and size.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .eager import exact_run as _exact_run, make_view
from .findings import MAX_GROUPS, CheckResult, Finding, _rows  # noqa: F401 (MAX_GROUPS: public)
from .pack import bit_view
from .observe import POISON, _changed_rows, _drop_rows, _same, _State, _wide, check_mismatch, default_sample, out_of_bounds, poison_like, tolerance  # noqa: F401 (public re-exports)
from .check_inputs import declared_sample
from .errors import ContractError, ContractTypeError, ContractValueError, mismatch
from .plan import Plan
from .program import Program, padded_dims
from .reference import ReferenceRunner

# ---- runs --------------------------------------------------------------------------------------
class _BodyRaised(Exception):
    """A body (or hook) raised something other than a ContractError at `size`."""

    def __init__(self, size: int, error: Exception):
        super().__init__(f"{type(error).__name__}: {error}")
        self.size, self.error = size, error


def _guarded(size: int, run: Callable) -> Callable:
    def call():
        try:
            return run()
        except ContractError:
            raise
        except Exception as e:
            raise _BodyRaised(size, e) from e
    return call


@dataclass
class _Seen:
    """One run observed: its outputs, the state after it, and the rows it wrote (views 1 and 2)."""

    outs: dict
    state: list
    written: list
    what: str = "the exact run"      # how findings name this run when it is the baseline


def _observe(ctx: "_Ctx", snap: list, run: Callable) -> _Seen:
    ctx.state.restore(snap)
    outs = run()
    after = ctx.state.snapshot()
    written = [_changed_rows(a, b) for a, b in zip(after, snap)]
    if any(ctx.state.poison):
        ctx.state.restore(snap)
        before = ctx.state.poisoned()
        try:
            run()
        except Exception as e:   # poison is check's own doing: keep view 1, say so
            ctx.note("poison", f"the body raised on poisoned float state ({type(e).__name__}: {e}); writes of "
                     f"a row's own value were not checked in that trial and any like it")
        else:
            written = [w | _changed_rows(t, b) if p else w
                       for w, t, b, p in zip(written, ctx.state.tensors, before, ctx.state.poison)]
    ctx.state.restore(snap)
    return _Seen(outs, after, written)


# ---- the check ---------------------------------------------------------------------------------
_UNSET = object()


@dataclass
class _Ctx:
    """What every trial of one check shares."""

    runner: ReferenceRunner
    state: _State
    result: CheckResult
    rtol: float
    atol: float
    noted: set = field(default_factory=set)
    all_pad_done: set = field(default_factory=set)   # sizes whose all-pad run was checked
    lane_free: object = _UNSET                       # `_lane_free_writes`, once a check

    def note(self, key: str, text: str) -> None:
        """Add a note once per key (the first occurrence's text)."""
        if key not in self.noted:
            self.noted.add(key)
            self.result.notes.append(text)

    def add(self, kind, buffer, detail, ext, size, trial, rows=(), lane=()) -> None:
        self.result.findings.append(Finding(kind, buffer, detail, dict(ext), size, trial, tuple(rows), tuple(lane)))

    def differ(self, kind, buffer, what, ref, got, at, tol, rows=False, output=None) -> None:
        """A finding for `got` differing from `ref` (output `output`, or state with rows=True): the
        first differing lane (for state: its row) and both values. at: (raw extents, size,
        trial). An output's values are scaled by their lane of its padded dims
        (`observe.row_scale`), a state's by their row."""
        (ext, size, trial), (rtol, atol) = at, tol
        lanes = tuple(d for d, _, _ in self.runner._out_slices.get(output, ())) if output else None
        ok, how = _same(ref, got, rtol, atol, lanes)
        if ok:
            return
        lane = _first_lane(ref, got, rtol, atol, lanes)
        if lane is None:
            where_ = ""
        elif rows:
            where_ = f" at row {lane[0]} (element {list(lane)}: {_at(got, lane)} here, {_at(ref, lane)} in the baseline)"
        else:
            where_ = f" at lane {list(lane)} ({_at(got, lane)} here, {_at(ref, lane)} in the baseline)"
        self.add(kind, buffer, f"{what}{where_}: {how}", ext, size, trial,
                 rows=(lane[0],) if rows and lane else (), lane=lane or ())


SIZES_PER_TRIAL = 3     # padded sizes each trial's raw inputs run at (the fitting bucket and larger)


def check(program: Program, body: Callable, *, state: Mapping | None = None, prepare: Callable | None = None,
          sample: Callable | None = None, trials: int = 16, seed: int = 0,
          tolerance: tuple[float, float] | None = None) -> CheckResult:
    """Run `body` on the reference backend over random raw inputs; report contract findings.

    sample: fn(gen: torch.Generator) -> raw inputs dict. Default: from the declaration: extents
    at random within the ladder, an integer input whose pad is a sink row of a state drawn as
    distinct non-sink rows of it, other values small and random (a body whose other integer
    inputs are indices or offsets needs its own sampler; the result's notes say which).
    trials: raw draws, each run at up to SIZES_PER_TRIAL padded sizes; seed: the draws' generator.
    tolerance: (rtol, atol) of raw lanes across sizes; default by dtype (`observe.tolerance`),
    rtol relative to the element, and at most fp32's (`observe.ROW_RTOL`) relative to the largest
    value of its row (`observe.row_scale`: an output's lane of its padded dims, a state's row of
    dim 0): a GEMM whose row count changes may round differently
    in the last bits of its terms' scale.
    State is restored after every run; see the module docstring for how writes are detected.
    """
    _check_args(program, sample, trials, seed, tolerance)
    # canary=False: the caller's canary rows stay as they are; a write there is a finding anyway
    runner = ReferenceRunner(program, body, state=state, prepare=prepare, canary=False)
    gen = torch.Generator().manual_seed(seed)
    rtol, atol = tolerance if tolerance is not None else (None, None)
    ctx = _Ctx(runner, _State.of(runner.state), CheckResult(program.name, trials), rtol, atol)
    draw = sample if sample is not None else declared_sample(program, runner.state, runner.state.device())
    for trial in range(trials):
        raw = draw(gen)
        ext = runner.plan.extents(raw, runner.device)
        # odd trials start from the state a previous call leaves (another draw, run at the
        # largest bucket), as a runner's calls follow each other: padded lanes that reuse what an
        # earlier call left (a stale slot table) then write rows no raw lane of this call targets
        prev = draw(gen) if trial % 2 == 1 else None
        try:
            with _after(ctx, runner, prev, trial):
                _trial(ctx, raw, ext, gen, SIZES_PER_TRIAL, trial)
        except _BodyRaised as e:
            if sample is not None:
                _add_note(e.error, f"pg.check({program.name!r}): trial {trial}, raw extents {ext}, size {e.size}")
                raise e.error from None
            drew = (f", and {sorted(draw.index_inputs)} as distinct non-sink rows of the state whose sink "
                    f"their pad is" if draw.index_inputs else "")
            ctx.add("body-error", "body", f"raised {e} on inputs of the default sampler, which draws "
                    f"integers in 0..3 (often not valid indices, lengths or offsets){drew}: pass "
                    f"sample=fn(gen) -> raw inputs that this body accepts", ext, e.size, trial)
    if sample is None:
        _sampler_notes(ctx, program, draw.index_inputs)
    return ctx.result


def _sampler_notes(ctx: _Ctx, program: Program, indices: dict) -> None:
    """Say what the default sampler drew as indices, and which integer inputs it could not place."""
    if indices:
        ctx.note("indices", "the default sampler drew " + ", ".join(
            f"{n!r} as distinct rows in [0, {rows}) (the lowest first) but {sorted(sinks)}"
            for n, (rows, sinks) in indices.items()) + " (their pad is a sink row of the state they index: sinks and canary rows left out)")
    others = [n for n in _int_inputs(program) if n not in indices]
    if ctx.result.findings and others:
        ctx.note("sampler", f"the default sampler drew the integer inputs {others} in 0..3; if they "
                 f"are indices, findings may come from invalid draws: pass sample= to check real inputs")


def _check_args(program, sample, trials, seed, tolerance) -> None:
    """pg.check's own arguments (body, state and prepare are checked as pg.compile checks them)."""
    if not isinstance(program, Program):
        raise ContractValueError(f"pg.check: program must be a pg.Program, got {program!r} ({type(program).__name__})")
    if sample is not None and not callable(sample):
        raise ContractTypeError(mismatch(program.name, None, "pg.check sample", "a callable fn(gen) -> raw inputs, or None",
                                         f"{sample!r} ({type(sample).__name__})"))
    for name, v, low in (("trials", trials, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ContractTypeError(mismatch(program.name, None, f"pg.check {name}", "an int", f"{v!r} ({type(v).__name__})"))
        if v < low:
            raise ContractValueError(mismatch(program.name, None, f"pg.check {name}", f"an int >= {low}", repr(v)))
    ok = tolerance is None or (isinstance(tolerance, (tuple, list)) and len(tolerance) == 2 and all(
        t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0) for t in tolerance))
    if not ok:
        raise ContractValueError(mismatch(program.name, None, "pg.check tolerance", "None or (rtol, atol), each a "
                                          "number >= 0 or None (the dtype's default)", repr(tolerance)))


@contextlib.contextmanager
def _after(ctx: _Ctx, runner: ReferenceRunner, prev: dict | None, trial: int):
    """Run `prev` (raw inputs of a previous call) first, and restore the state after the trial."""
    if prev is None:
        yield
        return
    snap = ctx.state.snapshot()
    try:
        try:
            with torch.no_grad():
                runner.run_at(runner.plan.buckets[-1], **prev)
        except Exception as e:
            ctx.note("previous", f"a previous call (trial {trial}) raised ({type(e).__name__}: {e}); "
                     f"such trials start from the state as bound")
            ctx.state.restore(snap)
        yield
    finally:
        ctx.state.restore(snap)


def _add_note(e: Exception, text: str) -> None:
    if hasattr(e, "add_note"):      # Python >= 3.11
        e.add_note(text)


def _int_inputs(program: Program) -> list[str]:
    return [n for n, s in program.inputs.items()
            if not (s.dtype.is_floating_point or s.dtype.is_complex or s.dtype == torch.bool)]


def _sizes(plan: Plan, fit: int, gen: torch.Generator, n: int) -> list[int]:
    ladder = [b for b in plan.buckets if b >= fit]
    if not ladder:
        return [fit + 1, 2 * fit]
    picks = {ladder[0], ladder[-1]}
    while len(picks) < min(n, len(ladder)):
        picks.add(ladder[int(torch.randint(0, len(ladder), (), generator=gen))])
    return sorted(picks)


def _baseline(ctx: _Ctx, raw, ext, snap, trial: int) -> tuple[_Seen, Callable]:
    """The exact run observed (else the tightest size's, noted), and how to run it again."""
    runner = ctx.runner
    bs = ext[runner.plan.bucket_axis]
    exact = _guarded(bs, lambda: _exact_run(runner, raw, ext))
    try:
        return _observe(ctx, snap, exact), exact
    except (ContractError, _BodyRaised) as e:
        fit = runner.plan.fit(ext)
        tight = _guarded(fit, lambda: runner.run_at(fit, **raw))
        seen = _observe(ctx, snap, tight)           # raises when the body fails padded too
        seen.what = f"the tightest size {fit}"
        if isinstance(e, _BodyRaised) and out_of_bounds(e.error):
            # it ran padded but indexed past the raw tensors exact: raw lanes read padded ones
            ctx.add("pad-leakage", "body", f"the exact run (raw tensors, no padded lane) indexed out "
                    f"of bounds ({e}) while padded sizes ran: the raw lanes read padded lanes",
                    ext, ext[runner.plan.bucket_axis], trial)
        ctx.note("exact", f"the exact run (raw tensors, no padded lane on any axis) failed ({e}); in that trial "
                 f"and any like it the baseline is the tightest size, whose padded lanes on dependent axes count as raw")
        return seen, tight


def _lane_free_writes(ctx: _Ctx, cut: dict, zero: dict) -> list | None:
    """Rows of each state leaf the exact run writes with every raw extent 0 (no lane, raw or
    padded: a call counter), computed once a check, from the state as bound; None where the body
    cannot run so (the all-pad runs then leave the trial's own targets aside instead)."""
    if ctx.lane_free is _UNSET:
        snap = ctx.state.snapshot()
        try:
            with torch.no_grad():
                _exact_run(ctx.runner, cut, zero)
            ctx.lane_free = [_changed_rows(a, b) for a, b in zip(ctx.state.snapshot(), snap)]
        except Exception:           # noqa: BLE001 - an empty batch the body does not take
            ctx.lane_free = None
        finally:
            ctx.state.restore(snap)
    return ctx.lane_free


def _all_pad_writes(ctx: _Ctx, raw: dict, ext: dict, size: int, trial: int, targets: list) -> None:
    """Once per size: every lane padded (raw extents 0, as a capture's warm-up runs), from the
    state as the trial found it. A row written there outside the sinks (and, for batch-ordered
    state, the padded lanes' own rows) is a padded lane's write, whatever the order of the
    lanes' writes; rows the exact run wrote (`targets`: written whatever the lanes, as a call
    counter) are left to the other views."""
    if size in ctx.all_pad_done:
        return
    ctx.all_pad_done.add(size)
    runner, plan = ctx.runner, ctx.runner.plan
    zero = {a: 0 for a in ext}
    cut = {}
    for n, spec in runner.program.inputs.items():
        t = raw[n]
        for d, af in padded_dims(spec.shape):
            t = t.narrow(d, 0, max(0, af.offset))
        cut[n] = t
    device = runner.device or next(iter(raw.values())).device
    snap = ctx.state.snapshot()
    try:
        with torch.no_grad():
            x = make_view(runner, size, cut, zero, device)
            if runner.prepare is not None:
                runner.prepare(x)
            runner.body(x)
    except Exception as e:      # the cuda backend's capture would fail the same way
        ctx.note(f"all-pad {size}", f"the body raised with every lane padded at size {size} "
                 f"({type(e).__name__}: {e}), as a capture's warm-up runs it: writes were not checked there")
        return
    finally:
        after = ctx.state.snapshot()
        ctx.state.restore(snap)
    allowed = ctx.state.allowed({plan.bucket_axis: 0}, size, plan.bucket_axis)
    changed = [_changed_rows(a, b) for a, b in zip(after, snap)]
    _outside_view(ctx, changed, size, zero, size, trial, f"the all-pad run at size {size}")
    lane_free = _lane_free_writes(ctx, cut, zero)
    if lane_free is not None:      # rows written with no lane at all: not a padded lane's doing
        targets = lane_free
    for label, ok_rows, rows, t, is_rows in zip(ctx.state.labels, allowed, changed, targets, ctx.state.rows):
        past_view = {r for r in rows if r >= size} if is_rows else set()     # reported just above
        extra = rows - ok_rows - t - past_view
        if extra:
            ctx.add("state-write", f"state {label!r}", f"rows {_rows(sorted(extra))} written with every "
                    f"lane padded (raw extents 0), that are not sinks", zero, size, trial, sorted(extra))


def _trial(ctx: _Ctx, raw: dict, ext: dict, gen, n_sizes: int, trial: int) -> None:
    runner = ctx.runner
    bs = ext[runner.plan.bucket_axis]
    snap = ctx.state.snapshot()
    try:
        base, again_run = _baseline(ctx, raw, ext, snap, trial)
        exact_rows = bs if base.what == "the exact run" else runner.plan.fit(ext)
        _outside_view(ctx, base.written, exact_rows, ext, exact_rows, trial, base.what)
        again = again_run()
        _compare(ctx, "nondeterminism", base, _Seen(again, ctx.state.snapshot(), []), (ext, bs, trial), (0.0, 0.0))
        sizes = _sizes(runner.plan, runner.plan.fit(ext), gen, n_sizes)
        # every bucket once with every lane padded (the first trial that gets here runs them
        # all), not only the sizes the trials draw: a bug of a small-batch path shows at its own
        for size in runner.plan.buckets:
            _all_pad_writes(ctx, raw, ext, size, trial, base.written)
        for size in sizes:
            seen = _observe(ctx, snap, _guarded(size, lambda: runner.run_at(size, **raw)))
            stray = _state_writes(ctx, base.written, seen.written, ext, size, trial)
            _compare(ctx, "pad-leakage", base, seen, (ext, size, trial), (ctx.rtol, ctx.atol), stray)
            if size == sizes[-1] and size != bs:
                _next_call(ctx, base, seen, again_run, ext, size, trial, stray)
    finally:
        ctx.state.restore(snap)


def _next_call(ctx: _Ctx, base: _Seen, seen: _Seen, run: Callable, ext, size, trial, stray) -> None:
    """The same raw inputs again, after the padded call at `size` and after the baseline call: the
    two states differ only by what padded lanes were allowed to write (sinks, their own rows), so
    raw lanes that read it (a sink slot a padded lane filled) differ here, though each single call
    matched the baseline (both calls of one chain start from the state that call left)."""
    after_padded = _run_from(ctx, seen.state, run)
    after_exact = _run_from(ctx, base.state, run)
    at, tol = (ext, size, trial), (ctx.rtol, ctx.atol)
    for name in after_exact.outs:
        ctx.differ("pad-leakage", f"output {name!r}",
                   f"raw lanes of the next call (the same raw inputs) differ after a call at size {size} from "
                   f"after {base.what}: they read what padded lanes left (a sink)",
                   after_exact.outs[name], after_padded.outs[name], at, tol, output=name)
    allowed = ctx.state.allowed(ext, size, ctx.runner.plan.bucket_axis)
    for label, sinks, ref, t, skip in zip(ctx.state.labels, allowed, after_exact.state,
                                          after_padded.state, stray):
        drop = sinks | skip
        ctx.differ("state-leakage", f"state {label!r}",
                   f"contents after the next call (the same raw inputs) differ after a call at size {size} "
                   f"from after {base.what}: raw lanes copied what padded lanes left",
                   _kept(ref, drop), _kept(t, drop), at, tol, rows=True)


def _run_from(ctx: _Ctx, start: list, run: Callable) -> _Seen:
    snap = ctx.state.snapshot()
    try:
        ctx.state.restore(start)
        outs = run()
        return _Seen(outs, ctx.state.snapshot(), [])
    finally:
        ctx.state.restore(snap)


def _compare(ctx: _Ctx, kind: str, base: _Seen, seen: _Seen, at: tuple, tol: tuple, stray: list | None = None) -> None:
    """Outputs and state contents against the baseline; sinks and rows already reported as
    state-writes (`stray`) are left out of the state comparison. at: (raw extents, size, trial);
    tol: (rtol, atol), None for the dtype's default."""
    ext, size, _ = at
    what = base.what if kind == "pad-leakage" else "the same run repeated"
    stray = stray or [set() for _ in ctx.state.tensors]
    for name in base.outs:
        ctx.differ(kind, f"output {name!r}", f"raw lanes differ from {what}", base.outs[name], seen.outs[name], at, tol,
                   output=name)
    allowed = ctx.state.allowed(ext, size, ctx.runner.plan.bucket_axis)
    wrote = base.written or [set() for _ in ctx.state.tensors]
    for label, sinks, ref, t, skip, own in zip(ctx.state.labels, allowed, base.state, seen.state,
                                               stray, wrote):
        # a sink row a raw lane wrote in the baseline must keep that write (a padded lane's
        # write there would replace a raw request's data)
        drop = (sinks - own) | skip
        k = "state-leakage" if kind == "pad-leakage" else kind
        ctx.differ(k, f"state {label!r}", f"contents differ from {what}", _kept(ref, drop), _kept(t, drop),
                   at, tol, rows=True)


def _kept(t: torch.Tensor, drop: set[int]) -> torch.Tensor:
    """`t` with the rows in `drop` set equal in both runs compared (0), so that the row numbers a
    finding names stay the state's own (`_drop_rows` would renumber them)."""
    if not drop or t.dim() == 0:
        return t
    out = _wide(t).clone()          # fp8 as float32: CPU torch writes few ops of it
    # by bit pattern: index_put has no kernel for every dtype (uint16 / uint32 / uint64)
    bit_view(out)[sorted(r for r in drop if r < t.shape[0])] = 0
    return out


def _first_lane(ref: torch.Tensor, got: torch.Tensor, rtol, atol, lanes=None) -> tuple | None:
    """The index of the first element where `got` differs from `ref` beyond the tolerance
    `_same` applies (NaN equal to NaN), or None (shapes differ)."""
    if ref.shape != got.shape:
        return None
    d_rtol, d_atol = tolerance(ref.dtype)
    rtol, atol = (d_rtol if rtol is None else rtol), (d_atol if atol is None else atol)
    a, b = _wide(ref), _wide(got)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        bad = check_mismatch(a, b, rtol, atol, lanes)
    else:
        bad = a != b
    hits = bad.reshape(bad.shape or (1,)).nonzero()
    return tuple(hits[0].tolist()) if len(hits) and a.dim() else (() if len(hits) else None)


def _at(t: torch.Tensor, lane: tuple):
    return t[lane].item() if t.dim() else t.item()


def _outside_view(ctx: _Ctx, written: list, rows: int, ext, size, trial, run: str) -> None:
    """Batch-ordered state: the body was handed rows [0, rows) of each leaf (x.<state>); a row at
    or past that was written through another reference (a closure over the full tensor)."""
    for label, is_rows, wrote in zip(ctx.state.labels, ctx.state.rows, written):
        past = sorted(r for r in wrote if r >= rows) if is_rows else []
        if past:
            ctx.add("state-write", f"state {label!r}",
                    f"rows {_rows(past)} written in {run}, outside the rows [0, {rows}) that x.<state> holds "
                    f"there: the body writes batch-ordered state it was not handed (a closure over the whole "
                    f"tensor instead of x.<state>?)", ext, size, trial, past)


def _state_writes(ctx: _Ctx, targets: list, written: list, ext, size, trial) -> list[set[int]]:
    """Report rows written that are neither targets of the exact run nor sinks; returns them."""
    _outside_view(ctx, written, size, ext, size, trial, f"a run at size {size}")
    stray = []
    allowed = ctx.state.allowed(ext, size, ctx.runner.plan.bucket_axis)
    for label, sinks, target, rows in zip(ctx.state.labels, allowed, targets, written):
        extra = rows - target - sinks
        stray.append(extra)
        if extra:
            ctx.add("state-write", f"state {label!r}",
                    f"rows {_rows(sorted(extra))} written that are neither a raw lane's target nor a sink"
                    + (" nor a padded lane's own row" if any(ctx.state.rows) else ""),
                    ext, size, trial, sorted(extra))
    return stray
