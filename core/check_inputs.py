"""The raw inputs pg.check draws when the caller passes no `sample=`: from what the program declares.

Most integer inputs of a serving program are indices, and random small integers are not valid
ones: two raw lanes drawing the same KV slot, or a raw lane drawing the sink row, break the
contract on their own and would flood a check with findings that are not the body's. The
declaration says which inputs are indices into state and what is valid there:

    an integer input whose pad is `Fill(r)` with r a sink row of a declared state indexes dim 0 of
    that state (that is what a sink is: the row a padded lane's index lands on), so its raw lanes
    draw distinct rows of dim 0 that are no sink of any state r is a sink of, below the smallest
    dim 0 among them (valid for whichever of those states the body indexes), and among the lowest
    rows (`_distinct_rows`: an input that shares the pad by coincidence, token ids padded with 0,
    stays small).

Every other input is drawn as `observe.default_sample` draws it (extents uniform within the
ladder; small ints in 0..3, floats from a normal, bools); a body whose other integer inputs are
indices (positions into a page table, cumulative offsets) needs `sample=`, and pg.check says so.
"""
from __future__ import annotations

import torch

from .observe import default_sample
from .pads import Fill
from .program import Program


def index_inputs(program: Program, state) -> dict[str, tuple[int, frozenset]]:
    """input name -> (rows of dim 0 to draw below, rows to leave out: sinks and canaries) for every
    integer input whose Fill pad is a sink row of a declared state; `state` the BoundState."""
    leaves = [(state.specs[label], t) for label, t in state.named() if t.dim() >= 1]
    out = {}
    for name, spec in program.inputs.items():
        if spec.dtype == torch.bool or spec.dtype.is_floating_point or not isinstance(spec.pad, Fill):
            continue
        hits = [(st, t) for st, t in leaves if spec.pad.value in st.sink_rows]
        if hits and spec.padded:
            # no lane may draw a sink (padded lanes write it) nor a canary row (no lane may write it)
            banned = frozenset(r for st, _ in hits for r in (*st.sink_rows, *getattr(st, "canary_rows", ())))
            out[name] = (min(t.shape[0] for _, t in hits), banned)
    return out


def declared_sample(program: Program, state, device=None):
    """A sampler fn(gen) -> raw inputs: `default_sample`'s draw, index inputs redrawn as distinct
    non-sink rows of the state they index (see the module docstring)."""
    indices = index_inputs(program, state)

    def sample(gen: torch.Generator) -> dict:
        raw = default_sample(program, gen, device)
        for name, (n_rows, sinks) in indices.items():
            raw[name] = _distinct_rows(n_rows, sinks, raw[name], gen)
        return raw

    sample.index_inputs = indices
    return sample


def _distinct_rows(n_rows: int, sinks: frozenset, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """`like`'s shape and dtype, every element a row of [0, n_rows) that is no sink: distinct
    while there are enough such rows, else drawn with repeats (never a sink, never out of range).
    Drawn among the lowest 2n + |sinks| + 1 rows (n the elements): an integer input whose pad is
    a sink row by coincidence (token ids padded with 0 beside a KV cache whose sink is row 0)
    stays as small as distinct rows allow, valid for a vocabulary of more than that."""
    window = min(n_rows, 2 * like.numel() + len(sinks) + 1)
    free = torch.tensor([r for r in range(window) if r not in sinks], dtype=torch.int64)
    if free.numel() == 0:
        return like
    if like.numel() <= free.numel():
        picks = torch.randperm(free.numel(), generator=gen)[:like.numel()]
    else:
        picks = torch.randint(0, free.numel(), (like.numel(),), generator=gen)
    return free[picks].view(like.shape).to(dtype=like.dtype, device=like.device)
