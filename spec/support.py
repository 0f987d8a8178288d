"""Helpers of the conformance cases: uniform messages, extents to try, probes that see the view.

A backend may run the body only once per bucket (capture), so cases never record what the body
saw in Python: the body copies what it reads into a *probe* — bound state the test reads back.
"""
from __future__ import annotations

import random

import torch

import padgraph as pg

SENTINEL = -777  # what a probe holds where the body wrote nothing


def msg(name: str, got, expected, case: str) -> str:
    """The one failure message shape of the suite."""
    return f"{name}={got}, but should be {expected} [{case}]"


def _show(t) -> str:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return f"tensor({t.tolist() if t.numel() <= 24 else f'shape {tuple(t.shape)}'})"
    return repr(t)


def assert_equal(name: str, got, expected, case: str) -> None:
    """Bitwise equality of tensors (shape, dtype, values), or == of anything else."""
    if isinstance(expected, torch.Tensor):
        got_t = got.detach().cpu() if isinstance(got, torch.Tensor) else got
        exp_t = expected.detach().cpu()
        ok = (isinstance(got_t, torch.Tensor) and got_t.shape == exp_t.shape and got_t.dtype == exp_t.dtype
              and torch.equal(got_t, exp_t))
    else:
        ok = got == expected
    assert ok, msg(name, _show(got), _show(expected), case)


def assert_close(name: str, got: torch.Tensor, expected: torch.Tensor, case: str,
                 rtol: float | None = None, atol: float | None = None) -> None:
    """Equality within the dtype's default tolerance (exact for integers and bools)."""
    if not expected.dtype.is_floating_point:
        return assert_equal(name, got, expected, case)
    got, expected = got.detach().cpu(), expected.detach().cpu()
    ok = got.shape == expected.shape and got.dtype == expected.dtype
    if ok:
        try:
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            ok = False
    assert ok, msg(name, _show(got), _show(expected), case)


LADDER = (1, 2, 4, 8)


def extents(ladder=LADDER, n_random: int = 4, seed: int = 0) -> list[tuple[str, int]]:
    """Raw extents of the bucketed axis to try: hand-picked edges, then seeded random draws."""
    picks = [("raw=1", 1)]
    picks += [(f"raw=bucket{b}", b) for b in ladder if b > 1]
    picks += [(f"raw=bucket{b}+1", b + 1) for b in ladder[:-1] if b + 1 not in ladder]
    picks += [(f"raw=past-ladder{ladder[-1] + 1}", ladder[-1] + 1)]
    rng = random.Random(seed)
    picks += [(f"raw=random{i}:{n}", n) for i, n in enumerate(rng.randint(1, ladder[-1]) for _ in range(n_random))]
    return picks


def ids(cases) -> list[str]:
    return [c[0] for c in cases]


def bucket_of(n: int, ladder=LADDER) -> int | None:
    return next((b for b in ladder if b >= n), None)


def ints(shape, lo: int, hi: int, dtype, device, seed: int) -> torch.Tensor:
    """Seeded random ints in [lo, hi), built on the CPU then moved (same values on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g).to(dtype).to(device)


def probe(shape, dtype, device) -> torch.Tensor:
    """A probe: bound state the body copies its view into; SENTINEL elsewhere."""
    return torch.full(shape, SENTINEL, dtype=dtype, device=device)


def write_probe(p: torch.Tensor, t: torch.Tensor) -> None:
    """In the body: probe[:t's shape] = t, every other lane = SENTINEL (graph-capturable)."""
    p.fill_(SENTINEL)
    region = p
    for d, n in enumerate(t.shape):
        region = region.narrow(d, 0, n)
    region.copy_(t)


def read_probe(p: torch.Tensor, shape) -> torch.Tensor:
    region = p
    for d, n in enumerate(shape):
        region = region.narrow(d, 0, n)
    return region.detach().clone().cpu()


def expected_padded(raw: torch.Tensor, shape, pad, dims) -> torch.Tensor:
    """The padded view SPEC.md's Terms define, computed independently of core (clamped indices)."""
    raw = raw.detach().cpu()
    if not dims:
        return raw.clone()
    if isinstance(pad, pg.Edge):
        if any(raw.shape[d] == 0 for d in dims):
            return torch.full(shape, pad.default, dtype=raw.dtype)
        idx = [torch.arange(n).clamp(max=raw.shape[d] - 1) if d in dims else torch.arange(n)
               for d, n in enumerate(shape)]
        return raw[torch.meshgrid(*idx, indexing="ij")]
    value = pad.value if isinstance(pad, pg.Fill) else pad
    out = torch.full(shape, value, dtype=raw.dtype)
    out[tuple(slice(0, n) for n in raw.shape)] = raw
    return out


def padded_shape(program: pg.Program, name: str, size: int) -> tuple:
    """Shape of input/output `name` at a size of the bucketed axis, from the declaration."""
    return pg.Plan(program).shape(name, size)


def dims_of(program: pg.Program, name: str) -> list[int]:
    spec = program.inputs.get(name) or program.outputs[name]
    return [i for i, d in enumerate(spec.shape) if not isinstance(d, int)]


def fit(program: pg.Program, ext: dict) -> int:
    """The bucket a call with these extents must take (rule 3), by brute force over sizes."""
    axes = program.axes
    holds = lambda b: all(a.cap(b) >= ext[a.name] for a in axes)
    on_ladder = [b for b in program.buckets if holds(b)]
    if on_ladder:
        return on_ladder[0]
    return next(n for n in range(1, 1 << 20) if holds(n))
