"""Bucket ladders: the sizes of the bucketed axis a program is planned (and captured) for.

Every malformed ladder is a ContractValueError (SPEC 3.3: "anything else is a ValueError").
"""
from __future__ import annotations

from typing import Iterable

from .errors import ContractValueError


def _default_sizes(max_size: int) -> list[int]:
    # Close to SGLang's: 1, 2, 4, 8, 12, 16, 24, 32, ... by 8 to 256, then by 16.
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, 257, 8)) + list(range(272, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _require_positive(owner: str, what: str, v) -> None:
    if not _positive_int(v):
        raise ContractValueError(f"{owner}: {what} must be an int >= 1, got {v!r} ({type(v).__name__})")


class Buckets(tuple):
    """A validated ladder: sorted, unique, positive ints (optionally all multiples of m)."""

    def __new__(cls, sizes: Iterable[int], multiple_of: int | None = None):
        try:
            sizes = list(sizes)
        except TypeError:
            raise ContractValueError(f"Buckets: sizes must be an iterable of ints, got {sizes!r}") from None
        if not sizes:
            raise ContractValueError("Buckets: the ladder must hold at least one size, got []")
        for s in sizes:
            if not _positive_int(s):
                raise ContractValueError(f"Buckets: every size must be an int >= 1, got {s!r} in {sizes}")
        if sizes != sorted(set(sizes)):
            raise ContractValueError(f"Buckets: sizes must be sorted and unique, got {sizes}")
        if multiple_of is not None:
            _require_positive("Buckets", "multiple_of", multiple_of)
            bad = [s for s in sizes if s % multiple_of]
            if bad:
                raise ContractValueError(f"Buckets: every size must be a multiple of {multiple_of}, got {bad}")
        return super().__new__(cls, sizes)

    @classmethod
    def pow2(cls, max_size: int) -> "Buckets":
        """1, 2, 4, ... up to max_size (included when it is a power of two)."""
        _require_positive("Buckets.pow2", "max_size", max_size)
        return cls([1 << i for i in range(max_size.bit_length()) if 1 << i <= max_size])

    @classmethod
    def default(cls, max_size: int = 256) -> "Buckets":
        """SGLang-like ladder: 1,2,4,8,12,16,24,32,... by 8 to 256, then by 16 to max_size."""
        _require_positive("Buckets.default", "max_size", max_size)
        sizes = _default_sizes(max_size)
        if sizes[-1] != max_size:
            sizes.append(max_size)
        return cls(sizes)

    @property
    def largest(self) -> int:
        return self[-1]

    def __repr__(self) -> str:
        return f"Buckets({list(self)})"
