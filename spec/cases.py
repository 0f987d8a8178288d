"""One generated case judged by the oracle: `run_case(recipe, calls, backend=..., device=...)`
compiles the recipe (`generated.py`), runs the calls and asserts after each: outputs bit for bit
as the oracle says, outputs never require grad, bound state as the oracle left its copy (sink
rows aside), rejected calls raise padgraph's own error and change nothing, outputs of
`copy_outputs=True` calls stay as they were. `repro` prints a case as a runnable program.
"""
from __future__ import annotations

import dataclasses

import torch

import padgraph as pg
from padgraph.spec import oracle as O
from padgraph.spec.generated import (Recipe, _int_view, build_program, clone_state, leaves, make_body, make_hook,
                                     make_raw, make_state, reject, wrap_state)


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
    x = O.view(program, size, snapshot, eff, state_at(recipe, mirror, size), device)
    with torch.no_grad():
        if hook is not None:
            hook(x)
        return O.finish(program, body(x), ext, eff)


def state_at(recipe: Recipe, state: dict, size: int) -> dict:
    """Rule 7c: batch-ordered state as the body sees it, every leaf cut to rows [0, size)."""
    if recipe.state != "rows":
        return state
    out = dict(state)
    a, b = leaves(state["kv"])[:2] if recipe.state_form != "tensor" else (state["kv"], None)
    out["kv"] = wrap_state(recipe.state_form, a[:size], None if b is None else b[:size])
    return out


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
        g, w = O.bits(got), O.bits(want)
        differ = g != w
        if name.startswith("z_"):   # arithmetic, not a copy: a NaN's payload and sign may differ (inductor)
            differ &= ~(_nans(got) & _nans(want))
        if bool(differ.any()):
            lane = differ.nonzero()[0].tolist()
            raise AssertionError(f"{name}[{lane}]={got.cpu()[tuple(lane[:got.dim()])]!r}, but should be "
                                 f"{want[tuple(lane[:want.dim()])]!r} (bits differ at lane {lane}) [{case}]")


def _nans(t: torch.Tensor) -> torch.Tensor:
    """NaN lanes of t, shaped like O.bits(t) (complex: each part)."""
    t = t.detach().cpu()
    return torch.view_as_real(t).isnan() if t.is_complex() else t.isnan()


def same_state(recipe: Recipe, state: dict, mirror: dict, case: str) -> None:
    for name in state:
        for i, (got, want) in enumerate(zip(leaves(state[name]), leaves(mirror[name]))):
            g, w = O.bits(got), O.bits(want)
            if name == "kv" and recipe.state == "sink":
                keep = torch.ones(g.shape[0], dtype=torch.bool)
                keep[list(recipe.sinks)] = False
                g, w = g[keep], w[keep]
            if not torch.equal(g, w):
                row = (g != w).nonzero()[0].tolist()
                raise AssertionError(f"state {name} leaf {i} (non-sink) differs at {row}: "
                                     f"got {g[row[0]].tolist()}, but should be {w[row[0]].tolist()} [{case}]")


def repro(recipe: Recipe, calls, backend: str, device, options: dict) -> str:
    """A runnable reproduction of a case (printed by the suite with a shrunk failure)."""
    text = (f"import torch\nfrom padgraph.spec.generated import Recipe, Call\nfrom padgraph.spec.cases import run_case\n"
            f"run_case({recipe!r},\n         {list(calls)!r},\n         backend={backend!r}, "
            f"device={str(device)!r}{''.join(f', {k}={v!r}' for k, v in options.items())})")
    for word in ("nan", "inf"):
        text = text.replace(f" {word}", f" float('{word}')").replace(f"-{word}", f"-float('{word}')")
    return text
