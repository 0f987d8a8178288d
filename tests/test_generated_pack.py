"""The one-launch pack kernel (interpreted on the CPU) against the oracle, on generated programs.

Every input layout, dtype and pad the generator draws, raw inputs at their host bounds, device
extents below those bounds (the source then keeps its host row stride while the kernel reads
fewer rows / cols), and the extents the kernel writes for `x.extent`. The kernel must write, bit
for bit, the padded view SPEC's Terms define (`padgraph.spec.oracle`), which never goes through
the pack table.
"""
import torch
import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

import padgraph as pg
from padgraph.backends.triton import pack as TP
from padgraph.spec import generated as G
from padgraph.spec import strategies as SG
from padgraph.spec import oracle as O

pytestmark = pytest.mark.skipif(not TP.triton_available(), reason="triton not importable")


@st.composite
def packed_calls(draw):
    recipe = draw(SG.recipes())
    call = draw(SG.call_lists(recipe))[0]
    return recipe, call, draw(st.sampled_from(recipe.ladder))


@seed(31)
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(packed_calls())
def test_pack_kernel_equals_oracle(case):
    recipe, call, size = case
    program = G.build_program(recipe)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    raw = G.make_raw(recipe, call, device, host_ok=False)
    ext = O.extents(program, raw)
    size = max(size, O.bucket(program, ext)[0])
    eff = O.effective(program, ext, dict(call.dev))
    plan = pg.Plan(program)
    table = plan.pack_table(size)
    entries = TP.kernel_entries(table)
    dsts = {e.name: _poisoned(e, program, device) for e in entries}
    keep = [raw[e.name].contiguous() for e in entries]
    rows = torch.from_numpy(TP.encode(entries, table.axes, [dsts[e.name] for e in entries])).to(device)
    srcs = torch.tensor([t.data_ptr() for t in keep], dtype=torch.int64, device=device)
    bounds = torch.tensor([ext[a] for a in table.axes], dtype=torch.int32, device=device)
    dev = torch.tensor([dict(call.dev).get(a, ext[a]) for a in table.axes], dtype=torch.int32, device=device)
    eff_out = torch.full_like(bounds, -9)
    TP.launch(rows, srcs, bounds, TP.grid_programs(entries), dev, eff_out)
    for e in entries:
        want = O.padded_input(program.inputs[e.name], raw[e.name], size, eff)
        got = dsts[e.name]
        assert torch.equal(O.bits(got), O.bits(want)), (
            f"{e.name}={got.cpu()}, but should be {want} [{e.layout} {e.shape} dev={call.dev} ext={ext}]")
    if entries:     # the kernel writes the extents used (without jobs, torch ops do: no launch)
        assert eff_out.tolist() == [eff[a] for a in table.axes]


def _poisoned(entry, program, device) -> torch.Tensor:
    """A destination whose every byte is 0x5A: a lane the kernel skips shows."""
    dtype = program.inputs[entry.name].dtype
    n = torch.Size(entry.shape).numel() * dtype.itemsize
    return torch.full((n,), 0x5A, dtype=torch.uint8, device=device).view(dtype).view(entry.shape)
