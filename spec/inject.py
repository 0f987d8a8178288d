"""`python -m padgraph.spec --inject NAME|all [--backend B] [--out DIR]`: the safety net against the
fault catalogue (`faults.py`), both ways.

Each fault runs with the bug and without it under every detector:
  generated   generated programs (the conformance suite's, `--inject-programs` of them) on the
              faulty runner, judged by the oracle: the program at which it first fails
  oracle      the fault's own calls, each against a fresh eager run of the program (a fresh body
              and a mirror of the state): the conformance oracle on these calls
  check       `pg.check` of the body (program faults): findings, or none
  shadow      `pg.Shadow(every=1)`: the call that raises `pg.ShadowMismatch`
  canary      the program's canary rows: the call at which `pg.CanaryError` is raised
  enforced    the runner's own checks (stale outputs, moved state, extents): the call that raises
A cell reads "call k" (caught within k calls; "program k" for generated), "-" (ran, not caught)
or "n/a" (the detector does not apply to the fault's kind). A fault is caught when some detector
catches it; a clean case must be caught by none. Exit status 1 when either fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

import padgraph as pg

from . import faults as F

DETECTORS = ("generated", "oracle", "check", "shadow", "canary", "enforced")
APPLIES = {"backend": {"generated", "oracle", "shadow", "canary", "enforced"},
           "program": {"oracle", "check", "shadow", "canary", "enforced"},
           "usage": {"shadow", "canary", "enforced"}}


def _calls(case: F.Case, device):
    for raw, dev in case.calls:
        if case.before_call is not None:
            case.before_call(raw)
        raw = {n: t.to(device) for n, t in raw.items()}
        yield raw, ({a: torch.tensor(v, dtype=torch.int32, device=device) for a, v in dev.items()} if dev else None)


def _compile(case: F.Case, backend: str, device, state, **options):
    backend = case.runner if case.runner is not None else backend
    if isinstance(backend, type):
        pg.register_backend(backend.backend, backend)
        backend = backend.backend
    return pg.compile(case.program, case.make_body(), backend=backend, state=state, prepare=case.prepare,
                      device=device, **options)


def _drive(case: F.Case, backend: str, device, catch: type, after=None, **options) -> str:
    """Run the case's calls; "call k" at the first that raises `catch` (or `after` finds), else "-"."""
    state = case.make_state(device)
    runner = _compile(case, backend, device, state, **options)
    for i, (raw, dev) in enumerate(_calls(case, device)):
        try:
            out = runner.call(raw, extents=dev)
            if case.misuse is not None:
                case.misuse(runner, state, i, out)
            if after is not None:
                after(runner)
        except catch:
            return f"call {i + 1}"
        except pg.ContractError:         # another detector's catch (the runner's own checks)
            return "-"
    return "-"


def detect_shadow(case, backend, device):
    return _drive(case, backend, device, pg.ShadowMismatch, shadow=pg.Shadow(every=1, first=1), canary=False)


def detect_canary(case, backend, device):
    if not any(s.canary_rows for s in case.program.state.values()):
        return "n/a"
    return _drive(case, backend, device, pg.CanaryError, after=lambda r: r.canary_check())


def detect_enforced(case, backend, device):
    skip = (pg.ShadowMismatch, pg.CanaryError)

    class Enforced(Exception):
        pass

    state = case.make_state(device)
    try:
        runner = _compile(case, backend, device, state, canary=False)
    except pg.ContractError:
        return "compile"
    for i, (raw, dev) in enumerate(_calls(case, device)):
        try:
            out = runner.call(raw, extents=dev)
            if case.misuse is not None:
                case.misuse(runner, state, i, out)
        except skip:
            raise
        except pg.ContractError:
            return f"call {i + 1}"
    return "-"


def detect_oracle(case, backend, device):
    """Each call against a fresh eager run (fresh body, mirror state) at the same bucket."""
    state, mirror = case.make_state(device), case.make_state(device)
    try:
        runner = _compile(case, backend, device, state, canary=False)
    except pg.ContractError:
        return "-"
    for i, (raw, dev) in enumerate(_calls(case, device)):
        try:
            got = {n: t.clone() for n, t in runner.call(raw, extents=dev).items()}
        except pg.ContractError:
            return "-"
        ref = pg.compile(case.program, case.make_body(), backend="reference", state=mirror,
                         prepare=case.prepare, device=device, canary=False)
        want = ref.call(raw, extents=dev)
        same = all(torch.equal(got[n], want[n]) for n in want) and \
            all(torch.equal(a, b) for a, b in zip(_leaves(state), _leaves(mirror)))
        if not same:
            return f"call {i + 1}"
    return "-"


def detect_check(case, backend, device):
    if case.sample is None:
        return "n/a"
    sample = case.sample
    if case.before_call is not None:
        def sample(gen, _draw=case.sample):
            raw = _draw(gen)
            case.before_call(raw)
            return raw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = pg.check(case.program, case.make_body(), state=case.make_state(torch.device("cpu")),
                         prepare=case.prepare, sample=sample, trials=8)
    return f"{len(found.findings)} findings" if found.findings else "-"


def detect_generated(case, backend, device, programs: int = 60, seed: int = 0):
    """Generated programs on the faulty runner: the program number of the first failure."""
    if case.runner is None:
        return "-"
    from hypothesis import HealthCheck, Phase, given, settings, seed as hseed, strategies as st
    from . import cases as C, strategies as SG
    pg.register_backend(case.runner.backend, case.runner)
    seen = [0]

    @hseed(seed)
    @settings(max_examples=programs, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        recipe = data.draw(SG.recipes())
        calls = data.draw(SG.call_lists(recipe))
        seen[0] += 1
        C.run_case(recipe, calls, backend=case.runner.backend, device=device)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run()
        except Exception:                   # the oracle's assertion, as hypothesis re-raises it
            return f"program {seen[0]}"
    return "-"


RUN = {"generated": detect_generated, "oracle": detect_oracle, "check": detect_check,
       "shadow": detect_shadow, "canary": detect_canary, "enforced": detect_enforced}


def _leaves(state: dict) -> list[torch.Tensor]:
    out = []
    for v in state.values():
        out.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def run_fault(fault: F.Fault, backend: str, device, faulty: bool, programs: int) -> dict:
    """One row: each detector's cell for the fault's case with (faulty) or without the bug."""
    case = fault.build(faulty)
    row = {}
    for name in DETECTORS:
        if name not in APPLIES[fault.kind] or (case.graph_only and backend == "reference"):
            row[name] = "n/a"
            continue
        kw = {"programs": programs} if name == "generated" else {}
        row[name] = RUN[name](case, backend, device, **kw)
    return row


def caught(row: dict) -> bool:
    return any(v not in ("-", "n/a") for v in row.values())


def run_all(names, backend: str, device, programs: int = 60) -> list[dict]:
    rows = []
    for fault in F.FAULTS:
        if names != ["all"] and fault.name not in names:
            continue
        bug = run_fault(fault, backend, device, True, programs)
        clean = run_fault(fault, backend, device, False, programs)
        graph_only = fault.build(True).graph_only and backend == "reference"
        rows.append({"fault": fault.name, "kind": fault.kind, "bug": fault.bug, "seen": fault.seen,
                     "with_bug": bug, "clean": clean, "graph_only": graph_only,
                     "ok": (caught(bug) or graph_only) and not caught(clean)})
    return rows


def table(rows: list[dict], backend: str) -> str:
    head = "| fault | bug | " + " | ".join(DETECTORS) + " | clean case |"
    lines = [head, "|" + "---|" * (len(DETECTORS) + 3)]
    for r in rows:
        cells = [r["with_bug"][d] for d in DETECTORS]
        clean = "no alarm" if not caught(r["clean"]) else "FALSE ALARM: " + ", ".join(
            d for d in DETECTORS if r["clean"][d] not in ("-", "n/a"))
        if r["graph_only"]:
            clean += " (the bug needs a graph: run with --backend cuda)"
        lines.append(f"| {r['fault']} | {r['bug']} ({r['seen']}) | " + " | ".join(cells) + f" | {clean} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m padgraph.spec --inject", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inject", required=True, help="a fault's name, or all: " + ", ".join(f.name for f in F.FAULTS))
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default=None)
    ap.add_argument("--inject-programs", type=int, default=60, help="generated programs per backend fault")
    ap.add_argument("--out", default=None, help="write fault_injection.{md,json} into this folder")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if args.backend == "cuda" else "cpu"))
    names = args.inject.split(",")
    for n in names:
        if n != "all":
            F.by_name(n)
    rows = run_all(names, args.backend, device, args.inject_programs)
    text = table(rows, args.backend)
    print(text)
    bad = [r["fault"] for r in rows if not r["ok"]]
    print(f"padgraph.spec inject: backend={args.backend} faults={len(rows)} caught="
          f"{sum(caught(r['with_bug']) for r in rows)} false_alarms={sum(caught(r['clean']) for r in rows)}"
          + (f" FAILED: {', '.join(bad)}" if bad else ""))
    if args.out:
        write_page(Path(args.out), rows, text, args)
    return 1 if bad else 0


def write_page(out: Path, rows: list[dict], text: str, args) -> None:
    """fault_injection.{md,json}: the table, the machine and versions, the command."""
    import datetime
    import triton
    gpu = torch.cuda.get_device_name() if args.backend == "cuda" else "none (CPU, reference backend)"
    command = f"python -m padgraph.spec --inject {args.inject} --backend {args.backend} " \
              f"--inject-programs {args.inject_programs}"
    env = {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
           "triton": triton.__version__, "command": command}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fault_injection.json").write_text(json.dumps({"env": env, "backend": args.backend, "rows": rows}, indent=1))
    head = ["# Fault injection", "",
            "The safety net against the padding bugs engines shipped (`padgraph/spec/faults.py`), each",
            "injected into a small program, runner or caller, and run with and without the bug. A cell",
            "gives the call (or generated program) at which a detector caught the bug; `-`: it ran and",
            "did not; `n/a`: it does not apply to that kind of fault. The clean column must read",
            "\"no alarm\" everywhere: a detector that flags a correct program is a false alarm.", "",
            f"- date: {env['date']}", f"- GPU: {gpu}", f"- versions: torch {env['torch']}, triton {env['triton']}",
            f"- command (repo root): `{command}`", "", ""]
    (out / "fault_injection.md").write_text("\n".join(head) + text + "\n")


if __name__ == "__main__":
    sys.exit(main())
