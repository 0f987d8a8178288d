"""How pg.check observes a run: raw inputs drawn at random (`default_sample`), bound state as
labelled flat tensors with sinks and poisonable leaves (`_State`), the rows a run changed, and
dtype-aware comparison of what two runs left (`tolerance`, `_same`)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

from .plan import Plan
from .program import Program

POISON = 7.3125          # exact in bf16/fp16/fp32; a value a body is unlikely to write by chance


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


# ---- state: labels, sinks, snapshots, poison --------------------------------------------------
def _state_name(label: str) -> str:
    """The declared state a label belongs to: 'kv[3]' -> 'kv', 'cache.k[0]' -> 'cache'."""
    return re.split(r"[\[.]", label, maxsplit=1)[0]


def _labels(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """One label per state tensor; elements of a list state that share a name get '[i]'."""
    names = [n for n, _ in named]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if names.count(n) > 1:
            out.append(f"{n}[{seen.get(n, 0)}]")
            seen[n] = seen.get(n, 0) + 1
        else:
            out.append(n)
    return out


@dataclass(frozen=True)
class _State:
    """The bound state as check sees it: flat tensors with their labels, sinks and poisonability."""

    labels: tuple
    tensors: tuple
    sinks: tuple      # set of sink rows per tensor
    poison: tuple     # bool per tensor: floating-point data, filled with POISON in view 2
    rows: tuple = ()  # bool per tensor: batch-ordered (pg.State(rows=bs)): padded lanes own [n, size)
    bound: object = None  # the BoundState the tensors are the leaves of (its snapshot/restore)

    @classmethod
    def of(cls, st) -> "_State":
        named = st.named()
        tensors = tuple(t for _, t in named)
        labels = tuple(_labels(named))
        sinks = tuple(set(st.specs[_state_name(lb)].sink_rows) for lb in labels)
        poison = tuple((t.is_floating_point() or t.is_complex()) and t.numel() > 0 for t in tensors)
        rows = tuple(st.specs[_state_name(lb)].rows is not None for lb in labels)
        return cls(labels, tensors, sinks, poison, rows, st)

    def allowed(self, ext: Mapping, size: int, axis: str) -> list[set[int]]:
        """Rows padded lanes may write at `size`: sinks, and [n, size) of batch-ordered state."""
        own = set(range(ext[axis], size))
        return [s | own if r else s for s, r in zip(self.sinks, self.rows)]

    def snapshot(self) -> list[torch.Tensor]:
        return self.bound.snapshot()

    def restore(self, snap: list[torch.Tensor]) -> None:
        self.bound.restore(snap)

    def poisoned(self) -> list[torch.Tensor]:
        """Fill the poisonable tensors with row-distinct poison; returns every tensor's contents
        after. Distinct rows: a padded lane copying one row onto another changes the target even
        where the bound values of both rows were equal (a cache that starts at zeros)."""
        for t, p in zip(self.tensors, self.poison):
            if p:
                t.copy_(poison_like(t))
        return self.snapshot()


_MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, torch.bfloat16: 7, torch.float16: 10}


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """Values in [1, 2) that differ between rows (and columns): element (r, c) is
    1 + ((r * 97 + c) mod 2^m) / 2^m, m = the dtype's mantissa bits (at most 20), so every value
    is exact in the dtype and two rows are equal only when their indices agree mod 2^m."""
    m = _MANTISSA.get(t.dtype if not t.is_complex() else torch.float32, 20)
    if t.dim() == 0:
        return torch.full_like(t, POISON)
    rows = torch.arange(t.shape[0], dtype=torch.int64, device=t.device).view(-1, *[1] * (t.dim() - 1))
    cols = torch.arange(max(t[0].numel(), 1), dtype=torch.int64, device=t.device).view(t.shape[1:]) \
        if t.dim() > 1 else torch.zeros((), dtype=torch.int64, device=t.device)
    frac = (rows * 97 + cols) % (1 << m)
    return (1 + frac.double() / (1 << m)).to(t.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors (1-byte floats: CPU torch compares few of them) as float32, which holds every
    fp8 value exactly; anything else as given."""
    return t.float() if t.dtype.is_floating_point and t.element_size() == 1 else t


def _changed_rows(now: torch.Tensor, before: torch.Tensor) -> set[int]:
    now, before = _wide(now), _wide(before)
    if now.dim() == 0:
        return {0} if not torch.equal(now, before) else set()
    diff = (now != before) & ~(now.isnan() & before.isnan()) if now.is_floating_point() else now != before
    return set(diff.reshape(diff.shape[0], -1).any(1).nonzero().flatten().tolist())


# (rtol, atol) by dtype: a few units in the last place of the dtype, at least torch.testing's
_TOLERANCE = {torch.float16: (2e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float32: (1.3e-6, 1e-5),
              torch.float64: (1e-7, 1e-7), torch.float8_e4m3fn: (0.125, 1e-3), torch.float8_e5m2: (0.25, 1e-3),
              torch.complex64: (1.3e-6, 1e-5), torch.complex128: (1e-7, 1e-7), torch.complex32: (2e-3, 1e-5)}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """The default (rtol, atol) pg.check compares raw lanes of a `dtype` output with across sizes."""
    return _TOLERANCE.get(dtype, (0.0, 0.0))


def row_scale(b: torch.Tensor, lanes: tuple[int, ...] | None = None) -> torch.Tensor:
    """Each element's magnitude for the relative tolerance: the largest finite |value| of its row,
    the elements that share its lane of the padded dims `lanes` (an output's; None or none:
    its row of dim 0, as a state's rows are; a 0-d or 1-d tensor: the element's own). So one
    request's scale never comes from another's values, in any layout ((bs, D), (D, bs),
    (L, bs, D)). A GEMM picked by row count (the padded run has more rows than the exact one)
    rounds a dot product to within its terms' scale, not its result's: an element that cancels
    to near zero may differ by many of its own ulps (bf16 K rows on a GPU did, at 15 rows
    against 16; fp32 on a CPU's BLAS at 1 row against 2). A leak smaller than rtol of the row's
    largest value passes: pg.check takes ROW_RTOL there."""
    mag = b.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    if b.dim() < 2 or b.numel() == 0:
        return mag
    if lanes:
        rest = [d for d in range(b.dim()) if d not in lanes]
        return torch.maximum(mag, mag.amax(dim=rest, keepdim=True)) if rest else mag
    rows = mag.reshape(b.shape[0], -1).amax(1)                     # [rows]
    return torch.maximum(mag, rows.view(-1, *([1] * (b.dim() - 1))))


# pg.check's relative tolerance on the row's scale: a dot product accumulated in fp32 (or wider)
# and rounded into any dtype moves by its terms' scale at fp32's precision, the element's own by
# the dtype's; so a bf16 leak of a few percent of a row's largest value is still a finding there
ROW_RTOL = _TOLERANCE[torch.float32][0]


def beyond_tolerance(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float,
                     row_rtol: float | None = None, lanes: tuple[int, ...] | None = None) -> torch.Tensor:
    """Floating or complex a, b of one shape: where they differ by more than atol +
    max(rtol * |b|, row_rtol * the largest |value| of b's row) (`row_scale` with the padded
    dims `lanes`; row_rtol None: rtol), NaN equal to NaN, an infinity equal to itself. Complex
    values compare as (real, imaginary) pairs: a lane differs where either part does."""
    if a.is_complex():
        pair = torch.view_as_real
        return beyond_tolerance(pair(a.resolve_conj()), pair(b.resolve_conj()), rtol, atol,
                                row_rtol, lanes).any(-1)
    row_rtol = rtol if row_rtol is None else row_rtol
    a64, b64 = _wide(a).double(), _wide(b).double()
    tol = atol + torch.maximum(rtol * b64.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0),
                               row_rtol * row_scale(b64, lanes))
    return ~((a64 - b64).abs() <= tol) & ~(a64.isnan() & b64.isnan()) & (a64 != b64)


def check_mismatch(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float,
                   lanes: tuple[int, ...] | None = None) -> torch.Tensor:
    """pg.check's `beyond_tolerance`: rtol of the element, at most ROW_RTOL of its row's largest."""
    return beyond_tolerance(a, b, rtol, atol, min(rtol, ROW_RTOL), lanes)


# torch's messages for a read past a tensor's end: indexing, gather / take / index_put ("out of
# bounds"), select ("out of range"), narrow ("exceeds dimension size"), unfold ("maximum size
# for tensor at dimension")
_OUT_OF_BOUNDS = ("out of bounds", "out of range", "exceeds dimension size",
                  "maximum size for tensor at dimension")


def out_of_bounds(e: Exception) -> bool:
    """A body's error from indexing past a tensor (raw lanes that read padded ones, run exact)."""
    return isinstance(e, IndexError) or any(m in str(e) for m in _OUT_OF_BOUNDS)


def _same(a: torch.Tensor, b: torch.Tensor, rtol: float | None, atol: float | None,
          lanes: tuple[int, ...] | None = None) -> tuple[bool, str]:
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    d_rtol, d_atol = tolerance(a.dtype)
    rtol, atol = (d_rtol if rtol is None else rtol), (d_atol if atol is None else atol)
    a, b = _wide(a), _wide(b)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ok = not bool(check_mismatch(a, b, rtol, atol, lanes).any())
        wide = torch.complex128 if a.dtype.is_complex else torch.float64
        diff = (a.to(wide) - b.to(wide)).abs().nan_to_num(0).max().item() if a.numel() else 0.0
        return ok, f"max |diff| {diff:.3g}"
    ok = torch.equal(a, b)
    return ok, f"{int((a != b).sum())} of {a.numel()} elements differ"


def _drop_rows(t: torch.Tensor, rows: set[int]) -> torch.Tensor:
    """`t` without the given rows of dim 0 (sinks: padded lanes may legitimately write those)."""
    if not rows or t.dim() == 0:
        return t
    keep = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    keep[sorted(rows)] = False
    return t[keep]
