"""`torch_compile=`: one torch.compile of the body for the whole ladder, on every backend."""
import pytest
import torch

import padgraph as pg

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 2)


def program():
    return pg.Program(
        "compiled",
        inputs={"h": pg.Input((bs, 8), torch.float32, pad=0.0), "ids": pg.Input((tok,), torch.int64, pad=0),
                "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge())},
        outputs={"y": pg.Output((bs, 8), torch.float32), "z": pg.Output((tok,), torch.int64)},
        state={"w": pg.State()},
        buckets=pg.Buckets([1, 2, 4, 8, 16]),
    )


def body(x):
    y = torch.relu(x.h @ x.w) * x.cu[1:, None] + x.bucket
    return {"y": y, "z": x.ids * 2 + x.extent("tokens")}


def raw(n, t, device="cpu"):
    g = torch.Generator().manual_seed(n * 31 + t)
    return {"h": torch.randn(n, 8, generator=g).to(device), "ids": torch.arange(t, device=device),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=device)}


CALLS = [(16, 3), (5, 7), (3, 1), (9, 18), (2, 2), (12, 1), (1, 0)]


def test_one_compilation_serves_the_ladder_on_the_reference_backend():
    w = torch.randn(8, 8)
    runner = pg.compile(program(), body, backend="reference", state={"w": w}, torch_compile=True)
    eager = pg.compile(program(), body, backend="reference", state={"w": w})
    for n, t in CALLS:
        a, b = runner(**raw(n, t)), eager(**raw(n, t))
        torch.testing.assert_close(a.y, b.y, msg=f"n={n} t={t}")
        assert torch.equal(a.z, b.z)
    # one graph for every bucket >= 2; torch specialises size 1, so bucket 1 adds one
    assert runner.stats.compiles <= 2 and runner.stats.recompiles <= 1, runner.stats.table()
    assert "torch.compile graphs" in runner.stats.table()


def test_reduce_overhead_is_refused_with_the_reason():
    with pytest.raises(pg.ContractValueError, match="captures the CUDA graphs itself"):
        pg.compile(program(), body, backend="reference", state={"w": torch.zeros(8, 8)},
                   torch_compile={"mode": "reduce-overhead"})


@pytest.mark.cuda
def test_inductor_kernels_are_captured_in_padgraphs_graphs():
    torch._logging.set_logs(recompiles=True)        # a failure shows torch's reason for each recompile
    w = torch.randn(8, 8, device="cuda")
    runner = pg.compile(program(), body, backend="cuda", state={"w": w},
                        torch_compile={"mode": "max-autotune-no-cudagraphs"})
    eager = pg.compile(program(), body, backend="reference", state={"w": w})
    assert runner.stats.compiles <= 2 and runner.stats.recompiles <= 1, runner.capture_report()
    assert "torch.compile" in runner.capture_report()
    compiles = runner.stats.compiles
    for n, t in CALLS:
        a, b = runner(**raw(n, t, "cuda")), eager(**raw(n, t, "cuda"))
        torch.testing.assert_close(a.y, b.y, msg=f"n={n} t={t}")
        assert torch.equal(a.z, b.z)
    assert runner.stats.compiles == compiles            # calls replay graphs: nothing compiles
