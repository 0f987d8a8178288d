"""Shadow verification on the CUDA backend: the hazards only a graph shows (a Python scalar baked
in at capture, a temporary freed before the pack reads it) and the ones the exact run shows, each
caught at the first sampled call that exhibits it; correct programs verified on every call find
nothing, eager and compiled: padded lanes writing anything at sinks and at their own
batch-ordered rows (a linear layer's bias, a racy scatter onto the sink), an output fed back as
the next input. A verification that raises leaves the previous call's outputs stale."""
import pytest
import torch

import padgraph as pg
from padgraph.backends.cuda import staging

pytestmark = pytest.mark.cuda
bs = pg.Axis("bs")


def _program(name="p", state=None):
    return pg.Program(name, inputs={"a": pg.Input((bs, 3), torch.float32, pad=0), "b": pg.Input((bs, 3), torch.float32, pad=0)},
                      outputs={"o": pg.Output((bs, 3), torch.float32)}, state=state or {}, buckets=pg.Buckets([4, 8]))


@pytest.mark.parametrize("tc", [None, True], ids=["eager", "compiled"])
def test_correct_program_every_call_verified(tc):
    r = pg.compile(_program(), lambda x: {"o": x.a * 2 + x.b}, backend="cuda", torch_compile=tc,
                   shadow=pg.Shadow(every=1))
    for n in (3, 7, 1, 8):
        a, b = torch.randn(n, 3, device="cuda"), torch.randn(n, 3, device="cuda")
        torch.testing.assert_close(r(a=a, b=b).o, a * 2 + b)
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (4, 0)


def test_a_python_scalar_baked_in_at_capture():
    step = {"pos": 0}
    r = pg.compile(_program(), lambda x: {"o": x.a + step["pos"]}, backend="cuda", shadow=pg.Shadow(every=1000))
    step["pos"] = 5          # HF's sliding-window layer keeps its position in a Python int like this
    with pytest.raises(pg.ShadowMismatch, match="output 'o'.*replay gave.*eager padded path"):
        r(a=torch.zeros(3, 3, device="cuda"), b=torch.zeros(3, 3, device="cuda"))


def test_a_temporary_freed_before_the_pack_reads_it(monkeypatch):
    def forgetful(t, keep):          # the pack's old staging: a dense copy nobody keeps
        return t.contiguous().data_ptr()
    monkeypatch.setattr(staging, "dense_source", forgetful)
    r = pg.compile(_program(), lambda x: {"o": (x.a + 100) + x.b * 2}, backend="cuda", shadow=pg.Shadow(every=1000))
    base = torch.arange(15., device="cuda").view(3, 5)
    with pytest.raises(pg.ShadowMismatch, match="output 'o'"):
        r(a=base[:, 1:4], b=base.t().contiguous().t()[:, :3])


def test_a_padded_lane_writing_a_non_sink_row():
    program = pg.Program("kv", inputs={"slot": pg.Input((bs,), torch.int64, pad=0), "v": pg.Input((bs,), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, state={"kv": pg.State(sink=0)}, buckets=pg.Buckets([4]))

    def body(x):
        x.kv.index_copy_(0, torch.where(x.slot == 0, torch.full_like(x.slot, 2), x.slot), x.v + 1)
        return {"o": x.v * 2}
    r = pg.compile(program, body, backend="cuda", state={"kv": torch.zeros(32, device="cuda")},
                   shadow=pg.Shadow(every=1000))
    with pytest.raises(pg.ShadowMismatch, match="row 2.*non-sink"):
        r(slot=torch.arange(3, device="cuda") + 8, v=torch.randn(3, device="cuda"))


def test_a_hook_building_metadata_from_a_raw_buffer():
    program = pg.Program("meta", inputs={"v": pg.Input((bs,), torch.float32, pad=0)}, outputs={"o": pg.Output((bs,), torch.float32)},
                         state={"kv": pg.State(sink=0), "loc": pg.State()}, buckets=pg.Buckets([4, 8]))
    batch = {"loc": torch.zeros(0, dtype=torch.int64, device="cuda")}     # what the capture's hook runs see

    def hook(x):
        x.loc[: batch["loc"].shape[0]].copy_(batch["loc"])
    state = {"kv": torch.zeros(64, device="cuda"), "loc": torch.zeros(8, dtype=torch.int64, device="cuda")}
    r = pg.compile(program, lambda x: (x.kv.index_copy_(0, x.loc[: x.bucket], x.v), {"o": x.v + 0})[1], backend="cuda",
                   state=state, prepare=hook, shadow=pg.Shadow(every=1000))
    batch["loc"] = torch.arange(6, device="cuda") + 10
    r(v=torch.randn(6, device="cuda"))
    batch["loc"] = torch.arange(3, device="cuda") + 40
    with pytest.raises(pg.ShadowMismatch, match="non-sink"):
        r(v=torch.randn(3, device="cuda"))


def test_lanes_read_past_a_device_extent():
    tok = pg.Axis("tok", capacity=bs * 2, device_extent=True)
    program = pg.Program("ext", inputs={"c": pg.Input((bs,), torch.int8, pad=0), "t": pg.Input((tok,), torch.float32, pad=0.5)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([2, 4]))
    r = pg.compile(program, lambda x: {"o": x.c.float() + x.t.sum()}, backend="cuda", shadow=pg.Shadow(every=1000))
    with pytest.raises(pg.ShadowMismatch, match="exact run"):
        r.call({"c": torch.zeros(2, dtype=torch.int8, device="cuda"), "t": torch.ones(3, device="cuda")},
               extents={"tok": torch.tensor(1, dtype=torch.int32, device="cuda")})


# ---- no false alarm where padded lanes may write anything (rules 7.4, 7.7) --------------------------
def _sink_program(name="sink"):
    return pg.Program(name, inputs={"loc": pg.Input((bs,), torch.int64, pad=0), "v": pg.Input((bs, 16), torch.float32, pad=0)},
                      outputs={"o": pg.Output((bs, 16), torch.float32)},
                      state={"rows": pg.State(sink=0), "own": pg.State(rows=bs)}, buckets=pg.Buckets([4, 8, 16]))


def _linear_body(lin):
    def body(x):
        h = lin(x.v)                                  # padded lanes (v = 0) give the bias, not 0
        x.rows.index_copy_(0, x.loc, h)               # ... written at the sink, row 0
        x.own.copy_(h * 2)                            # ... and at their own rows [n, bucket)
        return {"o": x.rows.index_select(0, x.loc) + x.own}
    return body


def _racy_body(x):
    """Every padded lane scatters a different value onto the sink: which one lands is a race."""
    pad = (torch.arange(x.bucket, device="cuda") >= x.extent("bs"))[:, None]
    vals = torch.where(pad, torch.rand_like(x.v), x.v)
    x.rows.index_put_((x.loc,), vals)
    x.own.copy_(torch.where(pad, torch.rand_like(x.v), x.v + 1))
    return {"o": x.v + 1}


@pytest.mark.parametrize("tc", [None, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("form", ["linear", "racy"])
def test_padded_lanes_writing_anything_at_sinks_and_own_rows_are_no_mismatch(tc, form):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16, device="cuda")
    body = _linear_body(lin) if form == "linear" else _racy_body
    st = {"rows": torch.zeros(64, 16, device="cuda"), "own": torch.zeros(16, 16, device="cuda")}
    r = pg.compile(_sink_program(), body, backend="cuda", torch_compile=tc, state=st, shadow=pg.Shadow(every=1))
    for n in (3, 5, 3, 13, 7, 2):
        loc, v = torch.randperm(63, device="cuda")[:n] + 1, torch.randn(n, 16, device="cuda")
        r(loc=loc, v=v)
        with torch.no_grad():
            want = lin(v) if form == "linear" else v
        torch.testing.assert_close(st["rows"][loc], want)
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (6, 0)


def test_padded_lanes_of_batch_ordered_state_writing_a_raw_row_are_caught():
    def body(x):
        x.own[(torch.arange(x.bucket, device="cuda") + 1) % x.bucket] = x.v      # last padded lane -> row 0
        return {"o": x.v + 0}
    st = {"rows": torch.zeros(64, 16, device="cuda"), "own": torch.zeros(16, 16, device="cuda")}
    r = pg.compile(_sink_program(), body, backend="cuda", state=st, shadow=pg.Shadow(every=1000))
    with pytest.raises(pg.ShadowMismatch, match=r"state 'own', row 0, column 0"):
        r(loc=torch.arange(3, device="cuda") + 8, v=torch.randn(3, 16, device="cuda") + 5)


# ---- an output fed back; a verification that raises ----------------------------------------------
@pytest.mark.parametrize("tc", [None, True], ids=["eager", "compiled"])
def test_an_output_fed_back_as_the_next_input_is_no_mismatch(tc):
    r = pg.compile(_program(), lambda x: {"o": x.a * 0.5 + x.b}, backend="cuda", torch_compile=tc,
                   shadow=pg.Shadow(every=1))
    b = torch.randn(3, 3, device="cuda")
    out = r(a=torch.randn(3, 3, device="cuda"), b=b)
    for _ in range(4):
        want = out.o.clone() * 0.5 + b
        out = r(a=out.o, b=b)                 # the decode loop: last call's output is this call's input
        torch.testing.assert_close(out.o, want)
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (5, 0)


def test_a_shadowed_call_that_raises_leaves_earlier_outputs_stale_not_changed():
    step = {"pos": 0}
    r = pg.compile(_program(), lambda x: {"o": x.a + step["pos"]}, backend="cuda", shadow=pg.Shadow(every=2, first=0))
    zeros = torch.zeros(3, 3, device="cuda")
    first = r(a=zeros, b=zeros)                       # not sampled: the graph adds the captured 0
    assert first.o.tolist() == [[0.0] * 3] * 3
    step["pos"] = 5                                   # baked in at capture: the eager run adds 5
    with pytest.raises(pg.ShadowMismatch, match="output 'o'"):
        r(a=torch.ones(3, 3, device="cuda"), b=zeros)    # its replay rewrote the memory `first` views
    with pytest.raises(pg.StaleOutputError, match="call 1"):
        first.o.sum()
    assert r(a=zeros + 2, b=zeros).o.tolist() == [[2.0] * 3] * 3     # not sampled: usable, as captured
