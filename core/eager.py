"""The eager padded run both runtimes share: fresh padded inputs at a size, then prepare + body.

The reference backend runs every call this way; every backend runs overflow calls (raw extents
past the ladder) this way. Inputs are padded through the Plan's pack table (`pack.padded`).
"""
from __future__ import annotations

from typing import Mapping

import torch

from .pack import bit_view, padded
from .pads import real_dtype, stored
from .program import padded_dims
from .errors import ContractValueError, mismatch
from .view import PaddedView


def make_view(runner, size: int, raw: Mapping[str, torch.Tensor], ext: Mapping[str, int],
              device: torch.device) -> PaddedView:
    """Fresh dense padded tensors of every input at `size`, bound state, and device extents."""
    table = runner.plan.pack_table(size)
    buffers: dict[str, object] = {e.name: padded(e, raw[e.name], ext, device) for e in table.entries}
    buffers.update(runner.state.at(size))
    extents = {a: torch.tensor(ext[a], dtype=torch.int32, device=device) for a in table.axes}
    return PaddedView(runner.program.name, size, buffers, extents)


def run_padded(runner, size: int, raw, ext, device, body=None) -> Mapping[str, torch.Tensor]:
    """prepare + body (default: the runner's) on one padded view at `size` (no autograd);
    outputs checked."""
    x = make_view(runner, size, raw, ext, device)
    with torch.no_grad():
        if runner.prepare is not None:
            runner.prepare(x)
        outs = (runner.body if body is None else body)(x)
    runner.check_outputs(outs, size, device)
    return outs


def exact_run(runner, raw: Mapping[str, torch.Tensor], ext: Mapping[str, int], body=None) -> dict:
    """prepare + body on the raw tensors themselves (no padded lane on any axis); outputs cloned."""
    plan, name = runner.plan, runner.program.name
    device = runner.device or next(iter(raw.values())).device
    # row-major copies, as every runner hands its body dense inputs (rule 10.1)
    buffers: dict[str, object] = {n: raw[n].to(device).clone(memory_format=torch.contiguous_format)
                                  for n in runner.program.inputs}
    buffers.update(runner.state.at(ext[plan.bucket_axis]))
    extents = {a: torch.tensor(n, dtype=torch.int32, device=device) for a, n in ext.items()}
    x = PaddedView(name, ext[plan.bucket_axis], buffers, extents)
    if runner.prepare is not None:
        runner.prepare(x)
    outs = (runner.body if body is None else body)(x)
    if not isinstance(outs, Mapping) or set(outs) != set(runner.program.outputs):
        got = sorted(outs) if isinstance(outs, Mapping) else type(outs).__name__
        raise ContractValueError(mismatch(name, None, "the body's return value (exact run)",
                                          f"a dict with keys {sorted(runner.program.outputs)}", got))
    for n, spec in runner.program.outputs.items():
        t, shape = outs[n], plan.raw_shape(n, ext)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != spec.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ContractValueError(mismatch(name, n, "shape and dtype at raw extents (exact run)",
                                              f"{shape} {spec.dtype}", got, kind="output"))
    return {n: t.clone() for n, t in outs.items()}


def device_axis_dims(specs: Mapping) -> dict[str, tuple]:
    """buffer -> ((dim, axis, scale, offset), ...) for its dims along a device-extent axis."""
    out = {}
    for name, spec in specs.items():
        dims = tuple((d, af.axis.name, af.scale, af.offset) for d, af in padded_dims(spec.shape)
                     if af.axis.device_extent)
        if dims:
            out[name] = dims
    return out


def mask_outputs(program, outs: Mapping[str, torch.Tensor], dims: Mapping[str, tuple], extent_of) -> dict:
    """Output lanes past a device extent hold the output's pad. extent_of(axis): an int (eager:
    filled in place) or a 0-d device tensor (graph-capturable: a where over the lanes)."""
    res = dict(outs)
    for name, along in dims.items():
        t = res[name]
        pad = stored(program.outputs[name].pad, t.dtype)
        for d, axis, scale, offset in along:
            limit = scale * extent_of(axis) + offset
            if isinstance(limit, int):          # a dim k*a + c with c < 0: empty at extent 0
                limit = max(0, limit)
                t.narrow(d, limit, t.shape[d] - limit).fill_(pad)
            else:
                t = _keep_below(t, d, limit, pad)
        res[name] = t
    return res


def _keep_below(t: torch.Tensor, d: int, limit: torch.Tensor, pad) -> torch.Tensor:
    """t with lanes >= limit along dim d set to pad, as a where over bit patterns (torch.where has
    no kernel for every dtype: uint16, float8, complex)."""
    fill = torch.full((), pad, dtype=t.dtype, device=t.device).expand(t.shape)
    bits, fill_bits = bit_view(t), bit_view(fill)
    shape = [1] * bits.dim()
    shape[d] = t.shape[d]
    lane = torch.arange(t.shape[d], device=t.device).view(shape)
    kept = torch.where(lane < limit, bits, fill_bits)
    if t.dtype.is_complex:
        return torch.view_as_complex(kept.view(real_dtype(t.dtype)))
    return kept.view(t.dtype)
