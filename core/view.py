"""The padded view `x` a body and a prepare hook receive: one object per call, never raw tensors."""
from __future__ import annotations

from typing import Mapping

import torch

from .errors import ContractAttributeError, ContractKeyError


def read_only(program: str, name: str) -> str:
    return (f"program {program!r}: the padded view is read-only, got an assignment to x.{name}; "
            f"write into a buffer in place (x.<buffer>[...] = ..., x.<buffer>.copy_(...)) or keep "
            f"the value in a local")


class PaddedView:
    """`x.<input>` padded static tensors, `x.<state>` bound state, `x.bucket`, `x.extent(axis)`."""

    __slots__ = ("_buffers", "_extents", "bucket", "program")

    def __init__(self, program: str, bucket: int, buffers: Mapping[str, object],
                 extents: Mapping[str, torch.Tensor]):
        set_ = object.__setattr__       # the view itself is read-only (__setattr__ below)
        set_(self, "program", program)
        set_(self, "bucket", bucket)
        set_(self, "_buffers", buffers)
        set_(self, "_extents", extents)

    def __setattr__(self, name: str, value) -> None:
        raise ContractAttributeError(read_only(self.program, name))

    def __delattr__(self, name: str) -> None:
        raise ContractAttributeError(read_only(self.program, name))

    def __getattr__(self, name: str):
        try:
            return self._buffers[name]
        except KeyError:
            raise ContractAttributeError(self._no_buffer(name)) from None

    def __getitem__(self, name: str):
        try:
            return self._buffers[name]
        except KeyError:
            raise ContractKeyError(self._no_buffer(name)) from None

    def __contains__(self, name: str) -> bool:
        """`name in x`: whether the view has that buffer (traceable by torch.compile's fullgraph,
        where `hasattr` on a missing name is not)."""
        return name in self._buffers

    def _no_buffer(self, name) -> str:
        return (f"program {self.program!r}: the padded view's buffer must be one of {sorted(self._buffers)}, "
                f"got {name!r}")

    def extent(self, axis: str) -> torch.Tensor:
        """The raw extent of `axis` as a 0-d int32 device tensor (written on every call)."""
        try:
            return self._extents[axis]
        except KeyError:
            raise ContractKeyError(f"program {self.program!r}: x.extent(axis) must name one of the axes "
                                   f"{sorted(self._extents)}, got {axis!r}") from None

    def __repr__(self) -> str:
        return f"PaddedView({self.program!r}, bucket={self.bucket}, buffers={sorted(self._buffers)})"
