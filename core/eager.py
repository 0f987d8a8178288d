"""The eager padded run both runtimes share: fresh padded inputs at a size, then prepare + body.

The reference backend runs every call this way; every backend runs overflow calls (raw extents
past the ladder) this way. Inputs are padded through the Plan's pack table (`pack.padded`).
"""
from __future__ import annotations

from typing import Mapping

import torch

from .pack import padded
from .view import PaddedView


def make_view(runner, size: int, raw: Mapping[str, torch.Tensor], ext: Mapping[str, int],
              device: torch.device) -> PaddedView:
    """Fresh dense padded tensors of every input at `size`, bound state, and device extents."""
    table = runner.plan.pack_table(size)
    buffers: dict[str, object] = {e.name: padded(e, raw[e.name], ext, device) for e in table.entries}
    buffers.update(runner.state.at(size))
    extents = {a: torch.tensor(ext[a], dtype=torch.int32, device=device) for a in table.axes}
    return PaddedView(runner.program.name, size, buffers, extents)


def run_padded(runner, size: int, raw, ext, device) -> Mapping[str, torch.Tensor]:
    """prepare + body on one padded view at `size` (no autograd); outputs checked."""
    x = make_view(runner, size, raw, ext, device)
    with torch.no_grad():
        if runner.prepare is not None:
            runner.prepare(x)
        outs = runner.body(x)
    runner.check_outputs(outs, size)
    return outs
