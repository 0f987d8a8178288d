"""Symbolic axes: the bucketed axis and further padded axes whose capacity is affine in it.

`bs = Axis("bs")` is the bucketed axis: its capacity for bucket b is b. `Axis("tokens",
capacity=bs * 4)` is padded too, with its own raw extent, and capacity 4*b for bucket b. A shape
dimension is an int, an Axis, or an affine expression of one axis (`bs + 1`, `bs - 1`, `bs * k`,
`(bs + 1) * k`): an int added or subtracted, an int >= 1 multiplied. Any other arithmetic on an
axis (`bs / 2`, `bs * bs`, `5 - bs`, `-bs`, `bs < 3`) is a ContractTypeError naming the axis,
the operation and these forms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .errors import ContractTypeError, ContractValueError


@dataclass(frozen=True)
class Affine:
    """`scale * axis + offset`: a dimension or a capacity that moves with one axis."""

    axis: "Axis"
    scale: int = 1
    offset: int = 0

    def __post_init__(self):
        if not isinstance(self.axis, Axis):
            raise ContractTypeError(f"axis expression: axis must be a pg.Axis, got {self.axis!r} ({type(self.axis).__name__})")
        _field(self.scale, self.axis.name, "scale")
        _field(self.offset, self.axis.name, "offset")
        if self.scale < 1:
            raise ContractValueError(f"axis expression on {self.axis.name!r}: scale must be an int >= 1, got {self.scale!r}")

    def __add__(self, c: int) -> "Affine":
        return Affine(self.axis, self.scale, self.offset + _int(c, self, "+"))

    __radd__ = __add__

    def __sub__(self, c: int) -> "Affine":
        return Affine(self.axis, self.scale, self.offset - _int(c, self, "-"))

    def __mul__(self, k: int) -> "Affine":
        k = _int(k, self, "*")
        return Affine(self.axis, self.scale * k, self.offset * k)

    __rmul__ = __mul__

    def at(self, n: int) -> int:
        """The dimension's size when the axis has extent n."""
        return self.scale * n + self.offset

    def solve(self, size: int) -> int | None:
        """The axis extent n with `at(n) == size`, or None when there is none."""
        n, rem = divmod(size - self.offset, self.scale)
        return n if rem == 0 and n >= 0 else None

    def __repr__(self) -> str:
        s = self.axis.name if self.scale == 1 else f"{self.axis.name}*{self.scale}"
        return s if self.offset == 0 else f"{s}{self.offset:+d}"


ALLOWED = "an int added or subtracted (bs + 1, bs - 1) or an int >= 1 multiplied (bs * 4, (bs + 1) * 2)"


def _int(v, e: "Affine", op: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        role = "scale" if op == "*" else "offset"
        raise ContractTypeError(f"axis expression {e!r} {op} {v!r} on axis {e.axis.name!r}: the {role} must be an "
                                f"int, got {v!r} ({type(v).__name__}); an axis takes {ALLOWED}")
    return v


def _field(v, axis: str, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ContractTypeError(f"axis expression on {axis!r}: {what} must be an int, got {v!r} ({type(v).__name__})")
    return v


# (operator, dunder, operand first): arithmetic and order that no affine form has
_REFUSED = [("-", "__rsub__", True), ("-", "__neg__", None), ("abs", "__abs__", None),
            ("/", "__truediv__", False), ("/", "__rtruediv__", True), ("//", "__floordiv__", False),
            ("//", "__rfloordiv__", True), ("%", "__mod__", False), ("%", "__rmod__", True),
            ("**", "__pow__", False), ("**", "__rpow__", True), ("@", "__matmul__", False),
            ("@", "__rmatmul__", True), ("<", "__lt__", False), ("<=", "__le__", False),
            (">", "__gt__", False), (">=", "__ge__", False)]


def _refuse(op: str, reflected: bool | None):
    """A dunder raising a ContractTypeError that names the expression, the axis and ALLOWED."""
    def refuse(self, *other):
        expr = (f"{op}({self!r})" if reflected is None else
                f"{other[0]!r} {op} {self!r}" if reflected else f"{self!r} {op} {other[0]!r}")
        axis = self.name if isinstance(self, Axis) else self.axis.name
        raise ContractTypeError(f"axis expression {expr}: {op!r} is not an operation on axis {axis!r}; "
                                f"an axis takes {ALLOWED}")
    return refuse


def _refusing(cls: type) -> type:
    for op, dunder, reflected in _REFUSED:
        setattr(cls, dunder, _refuse(op, reflected))
    return cls


@dataclass(frozen=True, eq=False)
class Axis:
    """A padded axis. No capacity: the bucketed axis. Else `capacity` is affine in that axis."""

    name: str
    capacity: Union[Affine, "Axis", None] = None
    device_extent: bool = False   # its raw extent may come from a device scalar (runner.call(..., extents=))

    def __post_init__(self):
        if not isinstance(self.device_extent, bool):
            raise ContractTypeError(f"Axis {self.name!r}: device_extent must be a bool (True or False), got "
                                    f"{self.device_extent!r} ({type(self.device_extent).__name__})")
        if self.device_extent and self.capacity is None:
            raise ContractValueError(
                f"Axis {self.name!r}: device_extent=True needs a capacity (the bucket is chosen on the host "
                f"from the bucketed axis, so that axis's extent must be host-known)")
        if not isinstance(self.name, str):
            raise ContractTypeError(f"Axis name must be a str, got {self.name!r} ({type(self.name).__name__})")
        if not self.name.isidentifier():
            raise ContractValueError(f"Axis name must be an identifier, got {self.name!r}")
        cap = self.capacity
        if isinstance(cap, Axis):
            object.__setattr__(self, "capacity", Affine(cap))
        elif cap is not None and not isinstance(cap, Affine):
            raise ContractTypeError(
                f"Axis {self.name!r}: capacity must be an expression of the bucketed axis "
                f"(like bs * 4 or bs + 1), got {cap!r}")
        if isinstance(self.capacity, Affine) and self.capacity.axis.capacity is not None:
            raise ContractValueError(
                f"Axis {self.name!r}: capacity must be affine in the bucketed axis (one without "
                f"capacity), but {self.capacity.axis.name!r} has a capacity itself")

    @property
    def bucketed(self) -> bool:
        return self.capacity is None

    def cap(self, bucket: int) -> int:
        """This axis's capacity for a bucket of the bucketed axis."""
        return bucket if self.capacity is None else self.capacity.at(bucket)

    def __add__(self, c):
        return Affine(self) + c

    __radd__ = __add__

    def __sub__(self, c):
        return Affine(self) - c

    def __mul__(self, k):
        return Affine(self) * k

    __rmul__ = __mul__

    def __repr__(self) -> str:
        return self.name if self.capacity is None else f"{self.name}(cap={self.capacity!r})"


_refusing(Affine)
_refusing(Axis)


Dim = Union[int, Axis, Affine]


def as_affine(d: Dim) -> Affine | None:
    """The affine form of a padded dimension, or None for a fixed int dimension."""
    if isinstance(d, Axis):
        return Affine(d)
    return d if isinstance(d, Affine) else None
