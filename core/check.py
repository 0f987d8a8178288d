"""`pg.check`: the debug tool. Runs a program on the reference backend over random raw extents
and several sizes, and reports pad leakage, state writes outside raw targets and sinks, and
nondeterminism. The baseline for each trial is the tightest size that fits (fewest pad lanes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .plan import Plan
from .program import Program
from .reference import ReferenceRunner


@dataclass(frozen=True)
class Finding:
    kind: str        # "pad-leakage" | "state-write" | "state-leakage" | "nondeterminism"
    buffer: str
    detail: str
    extents: dict
    size: int

    def __str__(self):
        return f"[{self.kind}] {self.buffer}: {self.detail} (raw extents {self.extents}, size {self.size})"


@dataclass
class CheckResult:
    program: str
    trials: int
    findings: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self):
        head = f"pg.check({self.program!r}): {self.trials} trials, "
        if self.ok:
            return head + "no findings"
        kinds = sorted({f.kind for f in self.findings})
        lines = [head + f"{len(self.findings)} findings ({', '.join(kinds)})"]
        lines += [f"  {f}" for f in self.findings[:20]]
        return "\n".join(lines)


def default_sample(program: Program, gen: torch.Generator, device=None) -> dict:
    """Random raw inputs: extents uniform within the ladder; small ints, random floats and bools."""
    plan = Plan(program)
    largest = plan.buckets[-1]
    bs = int(torch.randint(1, largest + 1, (), generator=gen))
    ext = {plan.bucket_axis: bs}
    for a in plan.axes[1:]:
        ext[a.name] = int(torch.randint(0, plan.capacity(a.name, bs) + 1, (), generator=gen))
    raw = {}
    for name, spec in program.inputs.items():
        shape = plan.raw_shape(name, ext)
        if spec.dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif spec.dtype.is_floating_point:
            t = torch.randn(shape, generator=gen).to(spec.dtype)
        else:
            t = torch.randint(0, 4, shape, generator=gen).to(spec.dtype)
        raw[name] = t.to(device) if device is not None else t
    return raw


def _same(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, str]:
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ok = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        diff = (a.double() - b.double()).abs().nan_to_num(0).max().item() if a.numel() else 0.0
        return ok, f"max |diff| {diff:.3g}"
    ok = torch.equal(a, b)
    return ok, f"{int((a != b).sum())} of {a.numel()} elements differ"


def _changed_rows(now: torch.Tensor, before: torch.Tensor) -> set[int]:
    if now.dim() == 0:
        return {0} if not torch.equal(now, before) else set()
    diff = (now != before) & ~(now.isnan() & before.isnan()) if now.is_floating_point() else now != before
    return set(diff.reshape(diff.shape[0], -1).any(1).nonzero().flatten().tolist())


def check(program: Program, body: Callable, *, state: Mapping | None = None, prepare: Callable | None = None,
          sample: Callable | None = None, trials: int = 16, seed: int = 0, sizes_per_trial: int = 3,
          rtol: float = 1e-5, atol: float = 1e-6) -> CheckResult:
    """Run `body` on the reference backend over random raw inputs; report contract findings.

    sample: fn(gen: torch.Generator) -> raw inputs dict (bodies that index with their inputs need
    one that draws valid indices); default draws extents and small values at random.
    """
    runner = ReferenceRunner(program, body, state=state, prepare=prepare)
    gen = torch.Generator().manual_seed(seed)
    result = CheckResult(program.name, trials)
    device = runner.state.device()
    for _ in range(trials):
        raw = sample(gen) if sample is not None else default_sample(program, gen, device)
        _trial(runner, raw, gen, sizes_per_trial, rtol, atol, result)
    return result


def _sizes(plan: Plan, fit: int, gen: torch.Generator, n: int) -> list[int]:
    ladder = [b for b in plan.buckets if b >= fit]
    if not ladder:
        return [fit + 1, 2 * fit]
    picks = {ladder[0], ladder[-1]}
    while len(picks) < min(n, len(ladder)):
        picks.add(ladder[int(torch.randint(0, len(ladder), (), generator=gen))])
    return sorted(picks)


def _trial(runner: ReferenceRunner, raw: dict, gen, n_sizes, rtol, atol, result: CheckResult) -> None:
    plan, st = runner.plan, runner.state
    ext = plan.extents(raw, runner.state.device())
    fit = plan.fit(ext)
    snap = st.snapshot()
    try:
        base = runner.run_at(fit, **raw)
        base_state = st.snapshot()
        st.restore(snap)
        again = runner.run_at(fit, **raw)
        _compare(result, "nondeterminism", base, again, st, base_state, ext, fit, rtol=0.0, atol=0.0)
        targets = [_changed_rows(b, s) for b, s in zip(base_state, snap)]
        for size in _sizes(plan, fit, gen, n_sizes):
            st.restore(snap)
            out = runner.run_at(size, **raw)
            _compare(result, "pad-leakage", base, out, st, base_state, ext, size, rtol, atol)
            _state_writes(result, st, snap, targets, ext, size)
    finally:
        st.restore(snap)


def _compare(result, kind, base, out, st, base_state, ext, size, rtol, atol) -> None:
    for name in base:
        ok, how = _same(base[name], out[name], rtol, atol)
        if not ok:
            result.findings.append(Finding(kind, f"output {name!r}", f"raw lanes differ from the tightest run: {how}", dict(ext), size))
    for (name, t), ref in zip(st.named(), base_state):
        ok, how = _same(_drop_sinks(ref, st, name), _drop_sinks(t, st, name), rtol, atol)
        if not ok:
            k = "state-leakage" if kind == "pad-leakage" else kind
            result.findings.append(Finding(k, f"state {name!r}", f"contents differ from the tightest run: {how}", dict(ext), size))


def _drop_sinks(t: torch.Tensor, st, name: str) -> torch.Tensor:
    """State rows other than the sinks (padded lanes may legitimately write those)."""
    sinks = st.specs[name].sink_rows
    if not sinks or t.dim() == 0:
        return t
    keep = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    keep[list(sinks)] = False
    return t[keep]


def _state_writes(result, st, snap, targets, ext, size) -> None:
    sinks = {name: set(spec.sink_rows) for name, spec in st.specs.items()}
    for (name, t), before, target in zip(st.named(), snap, targets):
        extra = _changed_rows(t, before) - target - sinks.get(name, set())
        if extra:
            rows = sorted(extra)
            result.findings.append(Finding(
                "state-write", f"state {name!r}",
                f"rows {rows[:8]}{'...' if len(rows) > 8 else ''} written that are neither a raw lane's target nor a sink",
                dict(ext), size))

