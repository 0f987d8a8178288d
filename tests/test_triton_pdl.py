"""A user's own Triton kernel with programmatic dependent launch inside a padgraph program, written
with `padgraph.backends.triton.pdl` (docs/pdl.md): the toy GEMV-like layer below loads its weight
tile and bias, waits for the kernel before (`pdl.wait_for_previous`, before the row loop), then
reads the previous layer's output and writes its own. A program chains it through two ping-pong
buffers, so each kernel reads what the kernel before wrote and overwrites what the kernel before
read: both hazards PDL's wait must order.

On the CPU the kernel runs in the interpreter (the helpers are no-ops there) inside a reference
program; on a GPU (cuda marker) inside CUDA graphs, with and without PDL, over replays of changing
inputs. tests/test_triton_sm90_compile.py compiles it for sm_90 with PDL on."""
import os

import pytest
import torch
import triton
import triton.language as tl

import padgraph as pg
from padgraph.backends.triton import fused_decode as fd
from padgraph.backends.triton import pdl


@triton.jit
def _toy_linear_kernel(X, W, B, Y, M, N, K, stride_x, stride_w, stride_y,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Y[m, n] = relu(X[m, :] @ W[n, :] + B[n]) for the program's BLOCK_N columns n, every row m
    < M; the whole of K (<= BLOCK_K) in one tile."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    k_ok = k < K
    w = tl.load(W + n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)                                                  # [BLOCK_N, BLOCK_K]
    b = tl.load(B + n, mask=n_ok, other=0.0)                                # [BLOCK_N]
    # W and B: no kernel of the program writes them, so they load before the wait. X (the
    # kernel before's output) and Y (a buffer the kernel before may still read) only after it;
    # the wait comes before the row loop, so no load of X can be hoisted above it
    pdl.wait_for_previous(PDL)
    for m in range(M):
        x = tl.load(X + m * stride_x + k, mask=k_ok, other=0.0)             # [BLOCK_K]
        y = tl.sum(w * x[None, :], axis=1) + b                              # [BLOCK_N]
        tl.store(Y + m * stride_y + n, tl.maximum(y, 0.0), mask=n_ok)


def toy_linear(x, w, b, out, *, use_pdl: bool = True, block_n: int = 16):
    """out [M, N] = relu(x [M, K] @ w [N, K].T + b [N]), fp32; launched with PDL where
    `use_pdl` and `pdl.supported(x.device)`."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and b.shape == (n,) and out.shape == (m, n) and w.stride(1) == 1
    on = use_pdl and pdl.supported(x.device)
    _toy_linear_kernel[(triton.cdiv(n, block_n),)](
        x, w, b, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_N=block_n,
        BLOCK_K=triton.next_power_of_2(k), PDL=on, **pdl.launch_options(x.device, on))
    return out


def toy_reference(x, ws, bs):
    for w, b in zip(ws, bs):
        x = torch.relu(x @ w.T + b)
    return x


def toy_program(d: int, buckets) -> pg.Program:
    rows = pg.Axis("bs")
    return pg.Program("pdl_toy", inputs={"hidden": pg.Input((rows, d), torch.float32, pad=0.0)},
                      outputs={"out": pg.Output((rows, d), torch.float32)},
                      buckets=pg.Buckets(list(buckets)))


def toy_body(ws, bs, use_pdl: bool):
    """The layers through two ping-pong buffers: layer i reads what layer i-1 wrote and writes
    the buffer layer i-1 read."""
    def body(x):
        bufs = (torch.empty_like(x.hidden), torch.empty_like(x.hidden))
        h = x.hidden
        for i, (w, b) in enumerate(zip(ws, bs)):
            h = toy_linear(h, w, b, bufs[i % 2], use_pdl=use_pdl)
        return {"out": h.clone()}
    return body


def toy_weights(n_layers: int, d: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(d, d, generator=gen) / d ** 0.5).to(device) for _ in range(n_layers)]
    bs = [(torch.randn(d, generator=gen) * 0.1).to(device) for _ in range(n_layers)]
    return ws, bs


# ------------------------------------------------------------------------------- the decision

def test_pdl_is_off_on_the_cpu():
    cpu = torch.device("cpu")
    assert not pdl.supported(cpu) and not pdl.supported("cpu")
    assert pdl.launch_options(cpu) == {} and pdl.launch_options(cpu, enabled=False) == {}


@pytest.fixture
def hopper(monkeypatch):
    """A compiled-kernel process on an sm_90 device with a Triton that has PDL, as `supported`
    sees it (no GPU needed: the decision reads only these)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PADGRAPH_PDL", raising=False)
    monkeypatch.setattr(pdl, "_TRITON_HAS_PDL", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return torch.device("cuda")


def test_supported_is_the_one_decision(hopper, monkeypatch):
    """sm_90+, a Triton with PDL, compiled kernels, PADGRAPH_PDL not "0": each turns it off
    alone, and padgraph's own kernels (fused decode, its tail) follow the same decision."""
    assert pdl.supported(hopper) and pdl.launch_options(hopper) == {"launch_pdl": True}
    assert pdl.launch_options(hopper, enabled=False) == {}
    one_row = fd._launch(fd.FusedDecodePolicy(pdl=True), hopper)
    assert one_row["PDL"] is True and one_row["launch_pdl"] is True
    tc = fd.launch_tc(fd.FusedDecodePolicy(pdl=True), hopper)      # tc_pdl off by default
    assert tc["PDL"] is False and "launch_pdl" not in tc
    assert "launch_pdl" not in fd._launch(fd.FusedDecodePolicy(pdl=False), hopper)
    offs = [("PADGRAPH_PDL", "0"), ("TRITON_INTERPRET", "1")]
    for var, value in offs:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert not pdl.supported(hopper), f"{var}={value} should turn PDL off"
            assert pdl.launch_options(hopper) == {}
            assert fd._launch(fd.FusedDecodePolicy(pdl=True), hopper)["PDL"] is False
            assert not fd.pdl_supported(hopper)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
        assert not pdl.supported(hopper), "sm_89 has no PDL"
    with monkeypatch.context() as m:
        m.setattr(pdl, "_TRITON_HAS_PDL", False)
        assert not pdl.supported(hopper), "a Triton without launch_pdl / gdc_wait has no PDL"


# ------------------------------------------------------------------- the toy kernel on the CPU

@pytest.mark.parametrize("flag", [False, True])
def test_toy_kernel_matches_its_reference_in_the_interpreter(flag):
    """PDL=True compiles and runs in the interpreter too (the helpers are no-ops there)."""
    gen = torch.Generator().manual_seed(1)
    m, n, k = 5, 37, 23                  # awkward: a masked column tile and a masked K
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    y = torch.full((m, n), float("nan"))
    _toy_linear_kernel[(triton.cdiv(n, 16),)](x, w, b, y, m, n, k, x.stride(0), w.stride(0),
                                              y.stride(0), BLOCK_N=16, BLOCK_K=32, PDL=flag)
    torch.testing.assert_close(y, torch.relu(x @ w.T + b), rtol=1e-5, atol=1e-5)


def test_toy_kernel_inside_a_reference_program():
    d, n_layers = 24, 3
    ws, bs = toy_weights(n_layers, d, "cpu")
    runner = pg.compile(toy_program(d, (1, 2, 4, 8)), toy_body(ws, bs, True), backend="reference")
    gen = torch.Generator().manual_seed(2)
    for rows in (3, 1, 8, 5):
        hidden = torch.randn(rows, d, generator=gen)
        out = runner(hidden=hidden).out
        assert out.shape == (rows, d)
        torch.testing.assert_close(out, toy_reference(hidden, ws, bs), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- inside CUDA graphs (GPU)

@pytest.mark.cuda
def test_cuda_pdl_is_on_on_hopper():
    """On an sm_90+ GPU with a Triton that has PDL, the decision is on (a broken detection would
    otherwise silently run the PDL tests below as plain launches)."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9 or not pdl._TRITON_HAS_PDL:
        pytest.skip("PDL needs sm_90+ and a Triton with launch_pdl and gdc_wait")
    assert pdl.supported(dev) or os.environ.get("PADGRAPH_PDL") == "0"


@pytest.mark.cuda
def test_cuda_toy_kernel_in_cuda_graphs_with_pdl_gives_the_values_without_it():
    """Eight chained layers (1000 columns: 63 programs, a 16 x 1024 fp32 tile each) in a CUDA-graph
    program launched with PDL and without it, over replays of every bucket with new inputs:
    the same bits either way, and the torch reference's values."""
    d, n_layers, buckets = 1000, 8, (1, 2, 4, 8, 16)
    ws, bs = toy_weights(n_layers, d, "cuda")
    program = toy_program(d, buckets)
    with_pdl = pg.compile(program, toy_body(ws, bs, True), backend="cuda")
    without = pg.compile(program, toy_body(ws, bs, False), backend="cuda")
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        rows = (1, 3, 16, 7, 2, 9)[step % 6]
        hidden = torch.randn(rows, d, generator=gen).cuda()
        a = with_pdl(hidden=hidden).out.clone()
        b = without(hidden=hidden).out.clone()
        assert torch.equal(a, b), f"PDL changed the values at replay {step} ({rows} rows)"
        torch.testing.assert_close(a, toy_reference(hidden, ws, bs), rtol=1e-4, atol=1e-4)
