"""`backends.cuda.passes.unfuse_addmm`: inductor's residual `addmm(x, h, W^T)` back to
`x + mm(h, W^T)` — no copy of x into the GEMM's output, the eager layer's rounding."""
import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import padgraph as pg
from padgraph.backends.cuda.passes import UnfuseAddmm, unfuse_addmm


def layer(x, h, w, norm_w):
    """A decoder layer's residual add and the RMSNorm after it."""
    x = x + F.linear(h, w)
    v = x.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    return x, v.to(x.dtype) * norm_w


def inputs(device, dtype, m=4, k=64, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, h = torch.randn(m, n, generator=g), torch.randn(m, k, generator=g)
    w, nw = torch.randn(n, k, generator=g) / k ** 0.5, 1 + torch.rand(n, generator=g)
    return [t.to(device, dtype) for t in (x, h, w, nw)]


def compiled(fn, passes=None):
    """fn through inductor with `passes` as its post-grad custom pass: (fn', the pass)."""
    torch._dynamo.reset()
    opts = {"post_grad_custom_post_pass": passes, "fx_graph_cache": False} if passes else \
        {"fx_graph_cache": False}
    return torch.compile(fn, fullgraph=True, options=opts)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_residual_add_leaves_the_gemm_and_rounds_as_eager(device, dtype):
    args = inputs(device, dtype)
    with torch.no_grad():
        want = layer(*args)
        _, plain = run_and_get_code(compiled(layer), *args)
        assert "addmm" in "\n".join(plain), "inductor no longer fuses the add: the test sees nothing"
        p = UnfuseAddmm()
        got, code = run_and_get_code(compiled(layer, p), *args)
    src = "\n".join(code)
    assert p.rewritten == 1
    assert "addmm" not in src and "extern_kernels.mm(" in src
    # the GEMM's output rounded, then the sum rounded: the eager layer's bits
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_with_emulated_casts_the_norm_after_the_add_reads_the_rounded_sum():
    """Inductor fuses the add into the RMSNorm's kernel, which reads the fp32 sum before its
    rounding; with its `emulate_precision_casts` option it rounds first, as eager does: in bf16
    on the CPU the norm's output is then the eager layer's bits too (without the pass, the
    addmm's single rounding still differs)."""
    def norm_bits(passes, seed):
        torch._dynamo.reset()
        opts = {"fx_graph_cache": False, "emulate_precision_casts": True}
        if passes is not None:
            opts["post_grad_custom_post_pass"] = passes
        args = inputs("cpu", torch.bfloat16, m=8, k=256, n=512, seed=seed)
        with torch.no_grad():
            return torch.equal(torch.compile(layer, fullgraph=True, options=opts)(*args)[1],
                               layer(*args)[1])
    assert all(norm_bits(UnfuseAddmm(), seed) for seed in range(3))
    assert not any(norm_bits(None, seed) for seed in range(3))


@pytest.mark.parametrize("device", DEVICES)
def test_a_bias_and_a_scaled_add_keep_their_addmm(device):
    """A bias [N] broadcast over the rows (cuBLAS adds it in its epilogue, no copy) and an
    addmm with beta or alpha not 1 are left as they are."""
    x, h, w, nw = inputs(device, torch.float32)
    b = nw.clone()

    def fn(x, h, w, b):
        return F.linear(h, w, b), torch.addmm(x, h, w.t(), beta=0.5), torch.addmm(x, h, w.t(), alpha=2.0)
    p = UnfuseAddmm()
    with torch.no_grad():
        got, code = run_and_get_code(compiled(fn, p), x, h, w, b)
    assert p.rewritten == 0
    assert "\n".join(code).count("addmm") >= 1
    for g, e in zip(got, fn(x, h, w, b)):
        torch.testing.assert_close(g, e)


def test_beta_and_alpha_of_one_are_a_residual_add():
    x, h, w, _ = inputs("cpu", torch.float32)

    def fn(x, h, w):
        return torch.addmm(x, h, w.t(), beta=1, alpha=1) * 2
    p = UnfuseAddmm()
    with torch.no_grad():
        got = compiled(fn, p)(x, h, w)
    assert p.rewritten == 1
    torch.testing.assert_close(got, (x + h @ w.t()) * 2)


def test_through_pg_compile_options_on_the_reference_and_a_ladder():
    """The pass as `pg.compile` users pass it (inductor options), every bucket of a ladder: the
    residual sum equals the eager body's bits at every raw size."""
    bs = pg.Axis("bs")
    prog = pg.Program("residual", inputs={"x": pg.Input((bs, 32), torch.bfloat16, pad=0.0),
                                          "h": pg.Input((bs, 64), torch.bfloat16, pad=0.0)},
                      outputs={"y": pg.Output((bs, 32), torch.bfloat16),
                               "n": pg.Output((bs, 32), torch.bfloat16)},
                      state={"w": pg.State(), "nw": pg.State()}, buckets=pg.Buckets([2, 4, 8]))
    _, _, w, nw = inputs("cpu", torch.bfloat16)

    def body(s):
        y, n = layer(s.x, s.h, s.w, s.nw)
        return {"y": y, "n": n}
    torch._dynamo.reset()
    r = pg.compile(prog, body, backend="reference", state={"w": w, "nw": nw},
                   torch_compile={"fullgraph": True,
                                  "options": {"post_grad_custom_post_pass": unfuse_addmm}})
    for m in (1, 3, 8):
        x, h, _, _ = inputs("cpu", torch.bfloat16, m=m, seed=m)
        with torch.no_grad():
            out, want = r(x=x, h=h), layer(x, h, w, nw)
        assert torch.equal(out["y"], want[0]), m
        torch.testing.assert_close(out["n"], want[1])


def test_the_pass_keys_inductors_cache_by_its_source():
    assert unfuse_addmm.uuid() == UnfuseAddmm().uuid() and len(unfuse_addmm.uuid()) == 32
