"""What pg.check reports: `Finding`s, grouped by kind and buffer in a `CheckResult`."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_GROUPS = 12          # groups shown by str(CheckResult); every finding stays in .findings


@dataclass(frozen=True)
class Finding:
    """One thing pg.check saw break the contract, at one trial's raw extents and one size."""

    kind: str        # "pad-leakage" | "state-write" | "state-leakage" | "nondeterminism" | "body-error"
    buffer: str      # "output 'y'", "state 'kv[3]'", "body"
    detail: str
    extents: dict
    size: int        # the size of the bucketed axis the finding was seen at (raw extent: exact run)
    trial: int | None = None
    rows: tuple = ()  # state findings: the offending rows of dim 0
    lane: tuple = ()  # pad-leakage / state-leakage / nondeterminism: the first differing element's index

    def __str__(self):
        return f"[{self.kind}] {self.buffer}: {self.detail} (raw extents {self.extents}, size {self.size})"


@dataclass
class CheckResult:
    """Every finding of a check (`findings`), what limited it (`notes`); str() groups by buffer."""

    program: str
    trials: int
    findings: list = field(default_factory=list)
    notes: list = field(default_factory=list)      # what limited the check (not findings)

    @property
    def ok(self) -> bool:
        return not self.findings

    def groups(self) -> dict[tuple[str, str], list[Finding]]:
        """Findings by (kind, buffer), in order of first appearance."""
        out: dict[tuple[str, str], list[Finding]] = {}
        for f in self.findings:
            out.setdefault((f.kind, f.buffer), []).append(f)
        return out

    def __str__(self):
        head = f"pg.check({self.program!r}): {self.trials} trials, "
        if self.ok:
            return "\n".join([head + "no findings"] + [f"  note: {n}" for n in self.notes])
        groups = self.groups()
        kinds = sorted({f.kind for f in self.findings})
        lines = [head + f"{_n(len(self.findings), 'finding')} in {_n(len(groups), 'group')} ({', '.join(kinds)})"]
        shown = list(groups.items())[:MAX_GROUPS]
        lines += [f"  {_group_line(kind, buf, fs)}" for (kind, buf), fs in shown]
        hidden = len(self.findings) - len(shown)
        if len(groups) > len(shown):
            rest = sum(len(fs) for fs in list(groups.values())[MAX_GROUPS:])
            lines.append(f"  ... {len(groups) - len(shown)} more groups ({rest} findings) not shown")
        lines.append(f"  (one example per group: {hidden} of {len(self.findings)} findings not shown; "
                     f"all are in result.findings)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _group_line(kind: str, buffer: str, fs: list[Finding]) -> str:
    first = fs[0]
    n_trials = len({f.trial for f in fs})
    rows = sorted({r for f in fs for r in f.rows})
    also = f"; rows over all: {_rows(rows)}" if len(fs) > 1 and rows else ""
    return (f"[{kind}] {buffer}: {_n(len(fs), 'finding')} over {_n(n_trials, 'trial')}, e.g. "
            f"{first.detail} (raw extents {first.extents}, size {first.size}){also}")


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'s' * (k != 1)}"


def _rows(rows: list[int]) -> str:
    return f"{rows[:8]}{'...' if len(rows) > 8 else ''}"
