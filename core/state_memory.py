"""The bytes a tensor touches, from its sizes and strides: whether an input shares memory with a
bound state leaf (rule 2.4), exactly where the runs of elements are few and by halves where not."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ---- memory a tensor touches --------------------------------------------------------------------
_MAX_RUNS = 1 << 22   # runs listed at once per tensor by the exact overlap test; past it, halves


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, last byte + 1) of t's elements, from sizes and strides; None when t is empty."""
    if t.numel() == 0:
        return None
    lo = t.data_ptr()
    if t.is_contiguous():
        return lo, lo + t.numel() * t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


def _runs(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """t's bytes as sorted run starts (int64, CPU) of `length` bytes each; None when too many runs.

    Dims by increasing stride: one whose stride equals the run so far lengthens the dense run; the
    rest are enumerated. Broadcast (stride 0) and size-1 dims touch no further byte: dropped.
    """
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1 and s != 0)
    run = 1
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    if math.prod(n for _, n in dims) > _MAX_RUNS:
        return None
    cpu = torch.device("cpu")                                # metadata only: never the default device
    starts = torch.zeros(1, dtype=torch.int64, device=cpu)   # [n_runs] element offsets
    for s, n in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64, device=cpu) * s).flatten()
    size = t.element_size()
    return torch.sort(starts).values * size + t.data_ptr(), run * size


def _tensors_share(a: torch.Tensor, b: torch.Tensor, ra=None, rb=None) -> bool:
    """Whether tensors a and b share a byte, exactly. ra / rb: their `_runs` if already listed.

    Byte spans first; then the runs. A tensor with more than _MAX_RUNS runs is split in two
    along its largest dim and each half compared (only halves whose spans meet go further), so
    memory stays bounded and no overlap is ever assumed."""
    sa, sb = byte_span(a), byte_span(b)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    ra = _runs(a) if ra is None else ra
    if ra is None:
        return any(_tensors_share(h, b, rb=rb) for h in _halves(a))
    rb = _runs(b) if rb is None else rb
    if rb is None:
        return any(_tensors_share(a, h, ra=ra) for h in _halves(b))
    return _share_a_byte(ra, rb)


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t split in two along its largest dim that touches new bytes (size > 1, stride != 0)."""
    d = max((i for i in range(t.dim()) if t.shape[i] > 1 and t.stride(i) != 0),
            key=lambda i: t.shape[i])
    n = t.shape[d]
    return t.narrow(d, 0, n // 2), t.narrow(d, n // 2, n - n // 2)


def _share_a_byte(a: tuple[torch.Tensor, int] | None, b: tuple[torch.Tensor, int] | None) -> bool:
    """Whether a run of a and a run of b share a byte (runs from `_runs`; None: assume they do)."""
    if a is None or b is None:
        return True
    (sa, la), (sb, lb) = a, b
    # for each run [x, x+la) of a: the first run [y, y+lb) of b ending after x; it overlaps iff y < x+la
    i = torch.searchsorted(sb, sa - lb, right=True)
    y = sb[i.clamp(max=len(sb) - 1)]
    return bool(((i < len(sb)) & (y < sa + la)).any())


@dataclass(frozen=True)
class _Span:
    lo: int
    hi: int
    label: str
    device: torch.device
    tensor: torch.Tensor
