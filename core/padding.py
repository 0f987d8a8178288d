"""Writing a raw tensor into a padded one, honouring the declared pad policy (torch ops).

The reference backend pads with this, and backends use it for buffers their fast pack does
not cover. Padded dims are handled in order, so a corner lane takes the pad of the later dim.
"""
from __future__ import annotations

import torch

from .pads import Edge, Fill, Pad


def pad_into(dst: torch.Tensor, raw: torch.Tensor, pad: Pad | None, dims: list[int]) -> None:
    """dst[:raw extents] = raw; every other lane along the padded `dims` = the pad value."""
    region = dst
    for d in range(raw.dim()):
        region = region.narrow(d, 0, raw.shape[d])
    region.copy_(raw)
    for d in dims:
        n_raw, n_all = raw.shape[d], dst.shape[d]
        if n_raw == n_all:
            continue
        tail = dst.narrow(d, n_raw, n_all - n_raw)
        if isinstance(pad, Fill):
            tail.fill_(pad.value)
        elif isinstance(pad, Edge) and n_raw > 0:
            tail.copy_(dst.narrow(d, n_raw - 1, 1).expand_as(tail))
        else:  # Edge with nothing to repeat
            tail.fill_(pad.default)


def padded_copy(raw: torch.Tensor, shape: tuple[int, ...], pad: Pad | None, dims: list[int],
                device: torch.device | None = None) -> torch.Tensor:
    """A fresh padded tensor of `shape` holding raw values and pad values."""
    out = torch.empty(shape, dtype=raw.dtype, device=device or raw.device)
    pad_into(out, raw, pad, dims)
    return out
