"""Pad policies: what each padded lane of an input holds. A plain number means Fill(number)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Fill:
    """Every padded lane holds `value` (e.g. seq_lens=1, out_cache_loc=sink slot 0)."""

    value: Union[int, float, bool]

    def __post_init__(self):
        if isinstance(self.value, bool) or isinstance(self.value, (int, float)):
            return
        raise TypeError(f"Fill value must be a number or bool, got {self.value!r}")

    def __repr__(self):
        v = self.value
        return f"Fill({'nan' if isinstance(v, float) and math.isnan(v) else repr(v)})"


@dataclass(frozen=True)
class Edge:
    """Padded lanes repeat the last raw value along each padded axis (cumulative offsets).

    With a raw extent of 0 there is no last value; `default` is written instead.
    """

    default: Union[int, float, bool] = 0


Pad = Union[Fill, Edge]


def as_pad(p) -> Pad | None:
    """Normalise a declared pad: numbers become Fill; None stays None (no padded axis)."""
    if p is None or isinstance(p, (Fill, Edge)):
        return p
    if isinstance(p, (bool, int, float)):
        return Fill(p)
    raise TypeError(f"pad must be a number, pg.Fill(v) or pg.Edge(), got {p!r}")
