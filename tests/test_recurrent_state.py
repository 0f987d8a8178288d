"""The hybrid-model padding bug, caught by the contract: padded lanes of a batch writing a live
request's recurrent row.

A decode step of a hybrid layer reads and rewrites each request's rows of two slot-indexed pools:
its convolution window `conv [n_slots, d, k - 1]` and its SSM state `ssm [n_slots, n_heads,
head_dim, d_state]`. The correct body declares slot 0 the sink (`pg.State(sink=0)`, slot input
padded with 0). The two reported bugs:

- clamped pad: the program marks padded lanes with slot -1 and declares the sink at the pool's
  last row, but the body clamps the index to 0, a live request's slot;
- stale index: the body keeps a persistent lane -> slot table and updates only the raw lanes,
  so padded lanes use the slots of an earlier, larger batch (requests that are live but not in
  this call).

Each is reported by `pg.check` and by the shadow (`pg.Shadow(every=1)`), and the correct body
passes both with no finding: with the torch references, with the Triton kernels (interpreted on
CPU), with the body under torch.compile, and on CUDA through the cuda backend's graphs.
"""
import pytest
import torch

import padgraph as pg
from padgraph.backends.triton.conv_state import conv_state_update
from padgraph.backends.triton.ssm import ssm_decode_update

bs = pg.Axis("bs")
LADDER = (1, 2, 4, 8)
N_SLOTS, N_HEADS, HEAD_DIM, D_STATE, K = 10, 2, 3, 4, 3
D = N_HEADS * HEAD_DIM


def weights(device):
    """The layer's parameters, on the device before any capture (a host copy cannot be captured)."""
    g = torch.Generator().manual_seed(0)
    w_conv, a_log = torch.randn(D, K, generator=g), torch.randn(N_HEADS, generator=g)
    d_skip = torch.randn(N_HEADS, generator=g)
    return {"w_conv": w_conv.to(device), "A": (-torch.exp(a_log)).to(device), "D": d_skip.to(device)}


def mixer(x_in, conv, ssm, slot, w, impl):
    """A Mamba2-like decode step over the pools: conv window, then the selective state update."""
    u = conv_state_update(conv, slot, x_in, w["w_conv"], activation="silu", impl=impl)      # [bs, D]
    dt, B, C = u[:, :N_HEADS], u[:, None, :D_STATE], u[:, None, D - D_STATE:]
    y = ssm_decode_update(ssm, slot, u.view(-1, N_HEADS, HEAD_DIM).contiguous(), dt.contiguous(), w["A"],
                          B.contiguous(), C.contiguous(), D=w["D"], impl=impl)            # [bs, N_HEADS, HEAD_DIM]
    return y.sum((1, 2))


def program(kind):
    """correct: sink 0, pad 0. clamped: pad -1, sink the last row. stale: sink 0 and a lane table."""
    sink, pad = (N_SLOTS - 1, -1) if kind == "clamped" else (0, 0)
    state = {"conv": pg.State(sink=sink), "ssm": pg.State(sink=sink)}
    if kind == "stale":
        state["lane_slot"] = pg.State()
    return pg.Program(f"hybrid_decode_{kind}",
                      inputs={"slot": pg.Input((bs,), torch.int64, pad=pad),
                              "x": pg.Input((bs, D), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)}, state=state, buckets=pg.Buckets(list(LADDER)))


def body_of(kind, impl, device="cpu"):
    w = weights(device)

    def body(x):
        slot = x.slot
        if kind == "clamped":
            slot = slot.clamp(min=0)              # the bug: padded lanes (-1) land on live slot 0
        if kind == "stale":
            # the bug: only raw lanes refresh the table; padded lanes keep an earlier batch's slots
            table = x.lane_slot[: x.bucket]
            raw = torch.arange(x.bucket, device=slot.device) < x.extent("bs")
            table.copy_(torch.where(raw, slot, table))
            slot = table
        return {"y": mixer(x.x, x.conv, x.ssm, slot, w, impl)}
    return body


def live_slots(kind):
    """Slots the engine hands to requests: all but the sink."""
    return list(range(N_SLOTS - 1)) if kind == "clamped" else list(range(1, N_SLOTS))


def pools(device, kind="correct"):
    g = torch.Generator().manual_seed(1)
    st = {"conv": torch.randn(N_SLOTS, D, K - 1, generator=g).to(device),
          "ssm": torch.randn(N_SLOTS, N_HEADS, HEAD_DIM, D_STATE, generator=g).to(device)}
    if kind == "stale":
        st["lane_slot"] = torch.zeros(LADDER[-1], dtype=torch.int64, device=device)
    return st


def sampler(kind, device):
    live = torch.tensor(live_slots(kind))

    def sample(gen):
        n = int(torch.randint(1, LADDER[-1] + 1, (), generator=gen))
        slot = live[torch.randperm(len(live), generator=gen)[:n]]
        return {"slot": slot.to(device), "x": torch.randn(n, D, generator=gen).to(device)}
    return sample


def calls(device):
    """A decode loop: a full batch, then smaller batches of live requests that are not the one in
    slot 0 (clamped) / not the previous batch's tail (stale), so a padded lane's write is visible."""
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    later = [[6, 7, 8], [3, 5, 8, 7, 4], [2]]
    g = torch.Generator().manual_seed(2)
    return [{"slot": torch.tensor(s).to(device), "x": torch.randn(len(s), D, generator=g).to(device)}
            for s in [first, *later]]


def _state_findings(result) -> set[str]:
    """The pools pg.check found written where they must not be (a padded lane's write, or a raw
    row that differs from the exact run)."""
    return {name for f in result.findings for name in ("conv", "ssm")
            if f.kind in ("state-write", "state-leakage") and f.buffer == f"state {name!r}"}


IMPLS = ["torch", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
def test_check_passes_the_correct_body_with_no_finding(impl):
    result = pg.check(program("correct"), body_of("correct", impl), state=pools("cpu"),
                      sample=sampler("correct", "cpu"), trials=4 if impl == "triton" else 8)
    assert result.ok and not result.findings, str(result)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["clamped", "stale"])
def test_check_reports_padded_lanes_writing_a_live_row(kind, impl):
    result = pg.check(program(kind), body_of(kind, impl), state=pools("cpu", kind), sample=sampler(kind, "cpu"),
                      trials=4 if impl == "triton" else 8)
    assert _state_findings(result) == {"conv", "ssm"}, str(result)
    if kind == "clamped":      # the live slot the clamp lands on is named
        assert any("rows [0]" in f.detail for f in result.findings if f.kind == "state-write"), str(result)


def _run_shadowed(kind, impl, backend, device, **options):
    st = pools(device, kind)
    runner = pg.compile(program(kind), body_of(kind, impl, device), backend=backend, state=st, device=device,
                        shadow=pg.Shadow(every=1), **options)
    for raw in calls(device):
        runner(**raw)
    return st


def _assert_rows_equal_an_unpadded_run(st, tol=None):
    """The same calls without padded lanes (the torch reference on the CPU): every live slot's rows agree."""
    want = pools("cpu")
    for raw in calls("cpu"):
        mixer(raw["x"], want["conv"], want["ssm"], raw["slot"], weights("cpu"), "torch")
    for name in ("conv", "ssm"):
        torch.testing.assert_close(st[name][1:].cpu(), want[name][1:], rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
def test_shadow_passes_the_correct_body_and_rows_equal_an_unpadded_run(impl):
    _assert_rows_equal_an_unpadded_run(_run_shadowed("correct", impl, "reference", "cpu"))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["clamped", "stale"])
def test_shadow_reports_padded_lanes_writing_a_live_row(kind, impl):
    with pytest.raises(pg.ShadowMismatch) as e:
        _run_shadowed(kind, impl, "reference", "cpu")
    text = str(e.value)
    assert f"hybrid_decode_{kind}" in text and ("'conv'" in text or "'ssm'" in text), text
    # the live row each bug lands on: slot 0 (clamped); slot 4, the previous batch's lane 3 (stale)
    assert ("row 0" if kind == "clamped" else "row 4") in text, text


def test_compiled_bodies_keep_it_too():
    """torch_compile=True: the kernels' torch references inside inductor's graph (the correct body
    passes the shadow, the clamped one is still reported)."""
    _assert_rows_equal_an_unpadded_run(_run_shadowed("correct", "auto", "reference", "cpu", torch_compile=True))
    with pytest.raises(pg.ShadowMismatch, match="row 0"):
        _run_shadowed("clamped", "auto", "reference", "cpu", torch_compile=True)


# ---- CUDA: the cuda backend (graphs), the Triton kernels ---------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch_compile"])
def test_cuda_check_and_shadow_pass_the_correct_body(compiled):
    dev = torch.device("cuda")
    result = pg.check(program("correct"), body_of("correct", "auto", dev), state=pools(dev),
                      sample=sampler("correct", dev), trials=8)
    assert result.ok and not result.findings, str(result)
    st = _run_shadowed("correct", "auto", "cuda", dev, torch_compile=compiled)
    _assert_rows_equal_an_unpadded_run(st, tol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["clamped", "stale"])
def test_cuda_check_and_shadow_report_padded_lanes_writing_a_live_row(kind):
    dev = torch.device("cuda")
    result = pg.check(program(kind), body_of(kind, "auto", dev), state=pools(dev, kind), sample=sampler(kind, dev),
                      trials=8)
    assert _state_findings(result) == {"conv", "ssm"}, str(result)
    with pytest.raises(pg.ShadowMismatch):
        _run_shadowed(kind, "auto", "cuda", dev)
