"""Pad policies: what each padded lane of an input holds. A plain number means Fill(number).

A policy is plain data and never raises when built; `pg.Program` checks it against the input's
dtype (`pad_problem`), since only there are the dtype, the input and the program known.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Union

import torch

from .errors import ContractTypeError, ContractValueError


@dataclass(frozen=True)
class Fill:
    """Every padded lane holds `value` (e.g. seq_lens=1, out_cache_loc=sink slot 0)."""

    value: Union[int, float, bool]

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


def as_pad(p):
    """Normalise a declared pad: numbers become Fill; None stays None (no padded axis).

    Anything else is kept as given, for `pg.Program` to reject with the program and input named.
    """
    p = as_number(p)
    return Fill(p) if is_number(p) else p


def as_number(p):
    """A numpy scalar (np.int64(3), np.float32(0.5), np.bool_(True)) or another real number
    (Fraction(1, 2), an Integral type) as the Python bool / int / float it holds, which is what
    torch writes; anything else as given."""
    if type(p).__module__ == "numpy" and hasattr(p, "item") and getattr(p, "ndim", None) == 0:
        v = p.item()
        return v if isinstance(v, (bool, int, float)) else p
    if isinstance(p, (bool, int, float)) or not isinstance(p, numbers.Real):
        return p
    if isinstance(p, numbers.Integral):
        return int(p)
    if isinstance(p, numbers.Rational) and p.denominator == 1:
        return int(p.numerator)       # exact, also past float's 2**53
    return float(p)


def is_number(p) -> bool:
    """A real number as a pad: bool, int, float (numpy scalars through `as_number` first)."""
    return isinstance(p, numbers.Real)


def pad_value(pad: Pad):
    """The number a policy writes: Fill's value, Edge's default (for an empty raw extent)."""
    return pad.default if isinstance(pad, Edge) else pad.value


def stored(value, dtype: torch.dtype):
    """`value` as a `dtype` tensor holds it: a float rounded to the dtype (so a literal such as
    -3.4028235e38, or 65519 for float16, is written as the dtype's own nearest value instead of
    failing torch's overflow check on every fill), an int or bool unchanged."""
    v = as_number(value)
    if isinstance(v, bool) or not (dtype.is_floating_point or dtype.is_complex):
        return v
    return torch.tensor(float(v), dtype=torch.float64).to(real_dtype(dtype)).item()


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The float dtype of a complex dtype's parts (a real dtype as itself)."""
    return {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)


def pad_problem(pad, dtype: torch.dtype) -> tuple[type, str, str] | None:
    """Why `pad` cannot pad a `dtype` input: (error class, expected, given), or None when it can.

    ContractTypeError for something that is not a policy or not a number; ContractValueError for
    a number the dtype cannot hold exactly (rounding a finite float to a float dtype is fine).
    """
    if not isinstance(pad, (Fill, Edge)):
        return ContractTypeError, "a number, pg.Fill(v) or pg.Edge(default)", f"{pad!r} ({type(pad).__name__})"
    v = as_number(pad_value(pad))
    if not isinstance(v, numbers.Real):
        return ContractTypeError, "a number (bool, int or float)", f"{v!r} ({type(v).__name__})"
    expected = _holds(v, dtype)
    return None if expected is None else (ContractValueError, expected, repr(v))


def _holds(v, dtype: torch.dtype) -> str | None:
    """None when `dtype` holds v exactly; else what a value of that dtype must be."""
    if dtype == torch.bool:
        return None if v in (0, 1) else "0, 1, False or True (a bool dtype)"
    if dtype.is_complex:        # outputs only (Program rejects complex inputs): a real pad
        return None if _fits_float(v, real_dtype(dtype)) else f"a real value {dtype} holds"
    if dtype.is_floating_point:
        if _fits_float(v, dtype):
            return None
        return f"a value {dtype} holds: finite within +-{torch.finfo(dtype).max:g}, or nan/inf where {dtype} has them"
    try:
        info = torch.iinfo(dtype)
    except TypeError:
        return f"a dtype padgraph can pad (bool, an integer or a float), not {dtype}"
    whole = isinstance(v, numbers.Integral) or float(v).is_integer()     # nan and inf are not
    return None if whole and info.min <= v <= info.max else f"an integer in [{info.min}, {info.max}] ({dtype})"


def _fits_float(v, dtype: torch.dtype) -> bool:
    """v survives conversion to dtype: a finite value stays finite, nan and +-inf stay what they are."""
    try:
        fv = float(v)
    except OverflowError:
        return False   # an int past float64's range
    held = torch.tensor(fv, dtype=torch.float64, device="cpu").to(dtype).item()
    if math.isfinite(fv):
        return math.isfinite(held)
    return (math.isnan(fv) and math.isnan(held)) or held == fv
