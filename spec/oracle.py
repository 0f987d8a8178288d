"""The oracle of the generated suite: SPEC.md's rules as a small pure-torch model.

It is written from SPEC.md's Terms and rules 1-8, not from padgraph's code: it never touches a
`Plan`, a pack table or a backend. Given a declaration (`pg.Program`, plain data), raw inputs and
the device extents of one call it says what a backend must do:

    extents       rule 2.3: n_a from each padded dimension's raw size
    bucket        rule 3: the smallest ladder entry (or whole size past the ladder) holding all
    padded view   rule 1 / Terms: raw region, then Fill's value (as the dtype stores it) or Edge's
                  clamped coordinate (default where a padded dim has no raw lane)
    outputs       rule 6: lanes past a device extent hold the output's pad; sliced to raw extents

Values are compared as bit patterns (`bits`): NaN payloads, -0.0 and every dtype alike. Outputs
the body computes by arithmetic (not copies) are compared with `arith_same`: there a NaN's
payload and a zero's sign are the compiler's choice, not padgraph's.
"""
from __future__ import annotations

import math

import torch

import padgraph as pg

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as same-size signed integers (complex: its real/imaginary parts), on the CPU."""
    t = t.detach().cpu().contiguous()
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.dtype != torch.int64 else t


def arith_same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Lanes of `bits(got)` that equal `want` as results of arithmetic: the same bits, both NaN,
    or both zero (either sign): inductor may compute `-v` as `0 - v` and drop `+ 0`, so the
    sign of a zero and the payload of a NaN can differ from eager without any padgraph bug."""
    g, w = _parts(got), _parts(want)
    return (bits(got) == bits(want)) | (g.isnan() & w.isnan()) | ((g == 0) & (w == 0))


def _parts(t: torch.Tensor) -> torch.Tensor:
    """t on the CPU as floats shaped like `bits(t)` (complex: its real/imaginary parts)."""
    t = t.detach().cpu()
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.float() if t.dtype.is_floating_point and t.element_size() == 1 else t


def stored(value, dtype: torch.dtype):
    """The number a `dtype` tensor holds after being filled with `value` (round to nearest)."""
    if dtype.is_floating_point or dtype.is_complex:
        real = {torch.complex32: torch.float16, torch.complex64: torch.float32,
                torch.complex128: torch.float64}.get(dtype, dtype)
        return torch.tensor(float(value), dtype=torch.float64).to(real).item()
    return bool(value) if dtype == torch.bool else int(value)


def filled(shape, value, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A tensor of `shape` whose every lane holds `value` as `dtype` stores it."""
    v = stored(value, dtype)
    if dtype.is_floating_point and dtype.itemsize == 1:      # float8: no fill kernel everywhere
        return torch.full(shape, v, dtype=torch.float32, device=device).to(dtype)
    return torch.full(shape, v, dtype=dtype, device=device)


def _affine(d):
    if isinstance(d, pg.Axis):
        return d, 1, 0
    if isinstance(d, pg.Affine):
        return d.axis, d.scale, d.offset
    return None


def padded_dims(shape) -> list[tuple[int, pg.Axis, int, int]]:
    """(dim, axis, scale, offset) of each padded dimension of a declared shape."""
    return [(i, *af) for i, d in enumerate(shape) if (af := _affine(d)) is not None]


def extents(program: pg.Program, raw) -> dict[str, int]:
    """Rule 2.3: every axis's raw extent, from the first padded dimension that carries it."""
    out = {}
    for name, spec in program.inputs.items():
        for d, axis, scale, offset in padded_dims(spec.shape):
            out.setdefault(axis.name, (raw[name].shape[d] - offset) // scale)
    return out


def capacity(axis: pg.Axis, size: int) -> int:
    return size if axis.capacity is None else axis.capacity.at(size)


def bucket(program: pg.Program, ext) -> tuple[int, bool]:
    """Rule 3: (size, on the ladder): the smallest ladder entry holding every extent, else the
    smallest whole size that does (3.2, eager)."""
    axes = {a.name: a for a in program.axes}
    holds = lambda b: all(capacity(axes[n], b) >= e for n, e in ext.items())
    for b in program.buckets:
        if holds(b):
            return b, True
    return next(n for n in range(1, 1 << 24) if holds(n)), False


def shape_at(shape, size: int) -> tuple[int, ...]:
    """A declared shape at `size` of the bucketed axis (Terms: padded dimension)."""
    out = list(d if isinstance(d, int) else 0 for d in shape)
    for d, axis, scale, offset in padded_dims(shape):
        out[d] = scale * capacity(axis, size) + offset
    return tuple(out)


def effective(program: pg.Program, ext, device_ext) -> dict[str, int]:
    """Rule 11: a device extent clamped into [0, host bound]; other axes keep their host extent."""
    out = dict(ext)
    for axis, v in (device_ext or {}).items():
        out[axis] = min(max(int(v), 0), ext[axis])
    return out


def padded_input(spec: pg.Input, raw: torch.Tensor, size: int, eff) -> torch.Tensor:
    """The padded view of one input at `size` (Terms), on the CPU; raw cut to the effective extents."""
    dims = padded_dims(spec.shape)
    src = raw.detach().cpu()
    for d, axis, scale, offset in dims:
        src = src.narrow(d, 0, scale * eff[axis.name] + offset)
    shape = shape_at(spec.shape, size)
    if not dims:
        return src.clone()
    pad = spec.pad
    as_bits = bits(src).view(src.shape)
    if isinstance(pad, pg.Edge):
        if any(src.shape[d] == 0 for d, *_ in dims):
            return filled(shape, pad.default, spec.dtype)
        index = [torch.arange(n) for n in shape]
        for d, *_ in dims:
            index[d] = index[d].clamp(max=src.shape[d] - 1)
        out = as_bits[torch.meshgrid(*index, indexing="ij")] if math.prod(shape) else as_bits.new_empty(shape)
        return out.view(spec.dtype)
    out = bits(filled(shape, pad.value, spec.dtype)).view(shape)
    out[tuple(slice(0, n) for n in src.shape)] = as_bits
    return out.view(spec.dtype)


def view(program: pg.Program, size: int, raw, eff, state, device) -> pg.PaddedView:
    """The padded view a body must see (rule 4): inputs padded, state as bound, extents as 0-d int32."""
    buffers = {n: padded_input(s, raw[n], size, eff).to(device) for n, s in program.inputs.items()}
    buffers.update(state)
    ext = {a.name: torch.tensor(eff[a.name], dtype=torch.int32, device=device) for a in program.axes}
    return pg.PaddedView(program.name, size, buffers, ext)


def finish(program: pg.Program, outs, ext, eff) -> dict[str, torch.Tensor]:
    """Rule 6 and 11: lanes past a device extent hold the output's pad; sliced to host extents."""
    res = {}
    for name, spec in program.outputs.items():
        t = outs[name].detach().clone()
        for d, axis, scale, offset in padded_dims(spec.shape):
            limit = scale * eff[axis.name] + offset
            if limit < t.shape[d]:
                t.narrow(d, limit, t.shape[d] - limit).copy_(filled((), spec.pad, spec.dtype, t.device))
        for d, axis, scale, offset in padded_dims(spec.shape):
            t = t.narrow(d, 0, scale * ext[axis.name] + offset)
        res[name] = t.cpu()
    return res
