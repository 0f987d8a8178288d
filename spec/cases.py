"""One generated case judged by the oracle: `run_case(recipe, calls, backend=..., device=...)`
compiles the recipe (`generated.py`), runs the calls and asserts after each: outputs bit for bit
as the oracle says, outputs never require grad, bound state as the oracle left its copy (sink
rows aside), rejected calls raise padgraph's own error and change nothing, outputs of
`copy_outputs=True` calls stay as they were. Recurrent state (rule 7.9) is judged by the
recurrence applied lane by lane on the CPU, never by the body: raw lanes' rows and outputs equal
it bit for bit, the sink row (pool) and rows [n, bucket) (batch-ordered) are unspecified, every
other row is bitwise as it was. `repro` prints a case as a runnable program.
"""
from __future__ import annotations

import dataclasses

import torch

import padgraph as pg
from padgraph.spec import oracle as O
from padgraph.spec.generated import (REC_DECAY, REC_SINK, Recipe, _int_view, build_program, clone_state, leaves,
                                     make_body, make_hook, make_raw, make_state, rec_step, reject, wrap_state)


COUNTS = {"programs": 0, "calls": 0, "rejected": 0}


def run_case(recipe: Recipe, calls, *, backend: str = "reference", device="cpu", counts: dict | None = None,
             **options) -> None:
    """Compile `recipe` on `backend`, run `calls`, assert every rule the oracle models.
    counts: a dict whose programs / calls / rejected entries this case adds to."""
    counts = {"programs": 0, "calls": 0, "rejected": 0} if counts is None else counts
    device = torch.device(device)
    if options.get("pack") == "in-graph" and recipe.hook:
        recipe = dataclasses.replace(recipe, hook=False)     # a hook needs the packed view before the replay
    program = build_program(recipe)
    body, hook = make_body(recipe), make_hook(recipe)
    state = make_state(recipe, device)
    mirror = clone_state(state)
    runner = pg.compile(program, body, backend=backend, state=state, prepare=hook, device=device,
                        copy_outputs=recipe.copy_outputs, overflow=recipe.overflow, **options)
    counts["programs"] += 1
    same_state(recipe, state, mirror, "after compile (rule 10: compile leaves state as it found it)")
    kept = []
    for i, call in enumerate(calls):
        case = f"call {i} of {len(calls)}: {call}"
        release(state, mirror, call.poison)
        raw = make_raw(recipe, call, device, host_ok=runner.allow_host_inputs)
        if call.reject is not None:
            _rejected(runner, reject(raw, call.reject, recipe), case)
            same_state(recipe, state, mirror, f"{case} (rule 2.5: a rejected call changes nothing)")
            counts["rejected"] += 1
            continue
        expected = _expect(recipe, program, raw, call, mirror, body, hook, device)
        dev = {a: torch.tensor(v, dtype=torch.int32, device=device) for a, v in call.dev}
        if expected is None:        # past the ladder with overflow="error"
            _rejected(runner, raw, case, pg.BucketOverflowError, extents=dev or None)
            continue
        snapshot = {n: t.detach().clone() for n, t in raw.items()}
        out = runner.call(raw, extents=dev or None)
        if call.seed % 2 == 0:      # rule 5: the call wrote none of the caller's tensors
            same_inputs(raw, snapshot, case)
        scribble_after(raw, dev)    # the caller reuses its tensors at once (stream-ordered)
        same_outputs(out, expected, case)
        adopt_padded_rows(recipe, program, raw, state, mirror)
        same_state(recipe, state, mirror, case)
        counts["calls"] += 1
        if recipe.copy_outputs:
            kept.append((case, out, expected))
            for old_case, old, old_expected in kept:
                same_outputs(old, old_expected, f"{old_case}, read after {case} (rule 6: copy_outputs=True)")


def _expect(recipe, program, raw, call, mirror, body, hook, device):
    """The oracle's outputs for a call (mirror state written as the body writes it), or None when
    SPEC rejects the call as past the ladder."""
    ext = O.extents(program, raw)
    eff = O.effective(program, ext, dict(call.dev))
    size, on_ladder = O.bucket(program, ext)
    if not on_ladder and recipe.overflow == "error":
        return None
    snapshot = {n: t.detach().clone() for n, t in raw.items()}
    seen = state_at(recipe, mirror, size)
    if recipe.recurrent != "none":      # the body writes a scratch copy: the recurrence below is the oracle
        seen["rec"] = _cut(recipe.rec_form, clone_state({"rec": mirror["rec"]})["rec"],
                           size if recipe.recurrent == "rows" else None)
    x = O.view(program, size, snapshot, eff, seen, device)
    with torch.no_grad():
        if hook is not None:
            hook(x)
        expected = O.finish(program, body(x), ext, eff)
    if recipe.recurrent != "none":
        expected["r_out"] = recur(recipe, mirror, snapshot)
    return expected


def state_at(recipe: Recipe, state: dict, size: int) -> dict:
    """Rule 7c: batch-ordered state as the body sees it, every leaf cut to rows [0, size)."""
    out = dict(state)
    if recipe.state == "rows":
        out["kv"] = _cut(recipe.state_form, state["kv"], size)
    return out


def _cut(form: str, value, size: int | None):
    """A two-leaf state of structure `form` with its leaves cut to rows [0, size) (None: as is)."""
    if size is None:
        return value
    a, b = leaves(value)[:2] if form != "tensor" else (value, None)
    return wrap_state(form, a[:size], None if b is None else b[:size])


def recur(recipe: Recipe, mirror: dict, raw: dict) -> torch.Tensor:
    """Rule 7.9.1's oracle: the recurrence applied to the mirror lane by lane on the CPU, each raw
    lane on its own row (pool: its slot; rows: row i). Returns the first leaf's new rows, [n, width]."""
    fresh, x = raw["r_fresh"].cpu(), raw["r_x"].cpu()
    rows = raw["r_slot"].cpu().tolist() if recipe.recurrent == "pool" else list(range(fresh.shape[0]))
    news = [_recur_leaf(leaf, decay, rows, x, fresh) for leaf, decay in zip(leaves(mirror["rec"]), REC_DECAY)]
    return news[0]


def _recur_leaf(leaf: torch.Tensor, decay: float, rows: list, x: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One leaf's rows updated in place, one lane at a time; [n, width] the lanes' new rows."""
    news = leaf.new_empty((len(rows), leaf.shape[1]), device="cpu")
    for lane, row in enumerate(rows):
        news[lane] = rec_step(leaf[row:row + 1].cpu(), x[lane:lane + 1], fresh[lane:lane + 1], decay)[0]
        leaf[row].copy_(news[lane])
    return news


def release(state: dict, mirror: dict, rows) -> None:
    """The caller fills released recurrent rows with nan, in place (7.2), in both copies: a new
    occupant must start from its initial state, never from these."""
    if not rows:
        return
    for value in (state["rec"], mirror["rec"]):
        for leaf in leaves(value):
            leaf[list(rows)] = float("nan")


def adopt_padded_rows(recipe: Recipe, program, raw, state: dict, mirror: dict) -> None:
    """Rows [n, bucket) of batch-ordered recurrent state are the padded lanes' (7.7: unspecified):
    the mirror takes the runner's values there, so that later calls compare every other row."""
    if recipe.recurrent != "rows":
        return
    ext = O.extents(program, raw)
    n, size = ext["bs"], O.bucket(program, ext)[0]
    for got, want in zip(leaves(state["rec"]), leaves(mirror["rec"])):
        want[n:size].copy_(got[n:size].detach())


def _rejected(runner, raw, case, cls=pg.ContractError, extents=None) -> None:
    try:
        runner.call(raw, extents=extents)
    except cls:
        return
    except Exception as e:  # noqa: BLE001 - the point: any other error is a finding
        raise AssertionError(f"error={type(e).__name__}: {e}, but should be {cls.__name__} [{case}]") from e
    raise AssertionError(f"call returned, but should raise {cls.__name__} [{case}]")


def same_inputs(raw: dict, snapshot: dict, case: str) -> None:
    for name, t in raw.items():
        if not torch.equal(O.bits(t), O.bits(snapshot[name])):
            raise AssertionError(f"input {name!r} changed by the call, but should be the caller's, untouched "
                                 f"(rule 5) [{case}]")


def scribble_after(raw: dict, dev: dict) -> None:
    """Change every writable raw tensor and device extent in place right after the call."""
    seen = set()
    for t in list(raw.values()) + list(dev.values()):
        if id(t) in seen or 0 in t.stride() or t.numel() == 0:
            continue
        seen.add(id(t))
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            _int_view(t).bitwise_xor_(0x55)


def same_outputs(out, expected: dict, case: str) -> None:
    assert set(out) == set(expected), f"outputs={sorted(out)}, but should be {sorted(expected)} [{case}]"
    for name, want in expected.items():
        got = out[name]
        assert not got.requires_grad, f"{name}.requires_grad=True, but should be False (rule 10.5) [{case}]"
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), (
            f"{name}={tuple(got.shape)} {got.dtype}, but should be {tuple(want.shape)} {want.dtype} [{case}]")
        if name.startswith("z_"):   # arithmetic, not a copy: a NaN's payload and a zero's sign may differ (inductor)
            differ = ~O.arith_same(got, want)
        else:
            differ = O.bits(got) != O.bits(want)
        if bool(differ.any()):
            lane = differ.nonzero()[0].tolist()
            raise AssertionError(f"{name}[{lane}]={got.cpu()[tuple(lane[:got.dim()])]!r}, but should be "
                                 f"{want[tuple(lane[:want.dim()])]!r} (bits differ at lane {lane}) [{case}]")


def same_state(recipe: Recipe, state: dict, mirror: dict, case: str) -> None:
    for name in state:
        for i, (got, want) in enumerate(zip(leaves(state[name]), leaves(mirror[name]))):
            g, w = O.bits(got), O.bits(want)
            sinks = _sink_rows(recipe, name)
            if sinks:
                keep = torch.ones(g.shape[0], dtype=torch.bool)
                keep[list(sinks)] = False
                g, w = g[keep], w[keep]
            if not torch.equal(g, w):
                row = (g != w).nonzero()[0].tolist()
                raise AssertionError(f"state {name} leaf {i} (non-sink) differs at {row}: "
                                     f"got {g[row[0]].tolist()}, but should be {w[row[0]].tolist()} [{case}]")


def _sink_rows(recipe: Recipe, name: str) -> tuple:
    """Rows of state `name` that padded lanes may leave holding anything (7.4, 7.9.2)."""
    if name == "kv" and recipe.state == "sink":
        return tuple(recipe.sinks)
    return (REC_SINK,) if name == "rec" and recipe.recurrent == "pool" else ()


def repro(recipe: Recipe, calls, backend: str, device, options: dict) -> str:
    """A runnable reproduction of a case (printed by the suite with a shrunk failure)."""
    text = (f"import torch\nfrom padgraph.spec.generated import Recipe, Call\nfrom padgraph.spec.cases import run_case\n"
            f"run_case({recipe!r},\n         {list(calls)!r},\n         backend={backend!r}, "
            f"device={str(device)!r}{''.join(f', {k}={v!r}' for k, v in options.items())})")
    for word in ("nan", "inf"):
        text = text.replace(f" {word}", f" float('{word}')").replace(f"-{word}", f"-float('{word}')")
    return text
