"""The CUDA backend's side of the contract holes (cuda marker): a host that never waits, capture
failures that name their cause, state on the wrong device, every pack strategy equal to the
reference on every layout."""
import time

import pytest
import torch

import padgraph as pg
from padgraph.backends.cuda import staging
from padgraph.backends.triton import pack as tpack

pytestmark = pytest.mark.cuda

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 2)


def mixed_program():
    return pg.Program(
        "mixed",
        inputs={"ids": pg.Input((tok,), torch.int64, pad=0),
                "lens": pg.Input((bs,), torch.int32, pad=1),
                "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
                "h": pg.Input((bs, 16), torch.bfloat16, pad=0.0),
                "trail": pg.Input((3, bs), torch.int16, pad=-1),
                "two": pg.Input((bs, tok), torch.int32, pad=pg.Edge(default=4)),
                "nd": pg.Input((2, bs, tok), torch.int8, pad=3),
                "fixed": pg.Input((5,), torch.float32)},
        outputs={"a": pg.Output((bs, 16), torch.float32), "b": pg.Output((tok,), torch.int64),
                 "c": pg.Output((bs,), torch.int64)},
        buckets=pg.Buckets([1, 2, 4, 8, 12]),
    )


def mixed_body(x):
    a = x.h.float() * x.lens[:, None] + x.fixed.sum() + x.trail.sum(0)[:, None]
    b = x.ids * 3 + x.extent("tokens") + x.two.sum(0).long().sum()
    c = x.cu[1:].long() + x.nd.long().sum((0, 2)) + x.two.view(-1)[: x.two.shape[0]]
    return {"a": a, "b": b, "c": c}


def mixed_raw(n, t, device, seed):
    g = torch.Generator().manual_seed(seed)
    ri = lambda shape, dt: torch.randint(-5, 9, shape, generator=g).to(dt).to(device)
    return {"ids": ri((t,), torch.int64), "lens": ri((n,), torch.int32), "cu": ri((n + 1,), torch.int32),
            "h": torch.randn(n, 16, generator=g).bfloat16().to(device), "trail": ri((3, n), torch.int16),
            "two": ri((n, t), torch.int32), "nd": ri((2, n, t), torch.int8), "fixed": torch.randn(5, generator=g).to(device)}


@pytest.mark.parametrize("strategy,copy", [("in-graph", "cudart"), ("in-graph", "torch"), ("eager", "cudart"),
                                           ("torch", "torch")])
def test_every_pack_strategy_equals_the_reference(strategy, copy, monkeypatch):
    if strategy == "torch":
        monkeypatch.setattr(tpack, "triton_available", lambda: False)
    prepare = (lambda x: None) if strategy == "eager" else None
    prog = mixed_program()
    runner = pg.compile(prog, mixed_body, backend="cuda", prepare=prepare, copy=copy)
    assert runner.pack.strategy == strategy and runner.pack.block.copier.name == copy
    ref = pg.compile(prog, mixed_body, backend="reference", prepare=prepare)
    for i, (n, t) in enumerate([(1, 0), (3, 5), (12, 24), (7, 1), (2, 4), (9, 13)]):
        raw = mixed_raw(n, t, "cuda", i)
        if i % 2:
            raw = {k: v.cpu() for k, v in raw.items()}       # host-resident inputs, staged
        got = runner(**raw)
        want = ref(**{k: v.cuda() for k, v in raw.items()})
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=f"{k} [{strategy} n={n} t={t}]")


@pytest.mark.parametrize("copy", ["cudart", "torch"])
def test_many_calls_queued_behind_a_long_kernel_return_at_once(copy):
    prog = pg.Program("queued", inputs={"v": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, buckets=pg.Buckets([1, 2, 4, 8]))
    runner = pg.compile(prog, lambda x: {"y": x.v * 2 + x.extent("bs")}, backend="cuda", copy_outputs=True,
                        copy=copy)
    assert runner.pack.block.copier.name == copy
    raws = [torch.arange(1 + i % 8, device="cuda") + i for i in range(300)]
    torch.cuda.synchronize()
    cycles = int(0.5 * torch.cuda.get_device_properties(0).clock_rate * 1e3)   # ~0.5 s of GPU time
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    outs = [runner(v=r).y for r in raws]
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host_s < 0.25, f"300 calls behind a 0.5 s kernel took {host_s:.3f} s on the host: a call waited for the GPU"
    assert len(runner.pack.block.slots) > runner.pack.block.ring.batch + 1   # the ring grew instead of waiting
    for r, o in zip(raws, outs):
        assert torch.equal(o, r * 2 + r.numel())


def test_capture_failure_names_the_host_sync_and_the_next_compile_works():
    prog = pg.Program("syncs", inputs={"v": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, buckets=pg.Buckets([1, 2]))

    def bad(x):
        n = int(x.v.sum().item())          # a host sync: cannot be captured
        return {"y": x.v + n}

    with pytest.raises(pg.CaptureError) as e:
        pg.compile(prog, bad, backend="cuda")
    msg = str(e.value)
    assert "host-device sync" in msg and "test_cuda_contract.py" in msg, msg
    assert "previous error during capture" not in msg.split(";")[0], msg
    good = pg.compile(prog, lambda x: {"y": x.v + 1}, backend="cuda")
    assert good(v=torch.arange(2, device="cuda")).y.tolist() == [1, 2]
    torch.cuda.synchronize()


def test_host_resident_state_is_rejected_at_compile():
    prog = pg.Program("hoststate", inputs={"v": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, state={"kv": pg.State(sink=0)},
                      buckets=pg.Buckets([1, 2]))
    with pytest.raises(pg.ContractValueError, match="'hoststate'.*'kv'.*cuda"):
        pg.compile(prog, lambda x: {"y": x.v}, backend="cuda", state={"kv": torch.zeros(4)})


def test_restore_state_opt_out_keeps_compile_writes():
    prog = pg.Program("counter", inputs={"v": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, state={"n": pg.State()},
                      buckets=pg.Buckets([1, 2]))
    n = torch.zeros(1, dtype=torch.int64, device="cuda")

    def body(x):
        x.n.add_(1)
        return {"y": x.v}

    pg.compile(prog, body, backend="cuda", state={"n": n}, warmup=2)
    assert n.item() == 0, "compile must leave bound state as it found it"
    pg.compile(prog, body, backend="cuda", state={"n": n}, warmup=2, restore_state=False)
    assert n.item() == 4, "with restore_state=False the warm-up writes stay (2 buckets x 2 runs)"


def test_pack_table_is_what_the_backend_applies():
    prog = mixed_program()
    runner = pg.compile(prog, mixed_body, backend="cuda")
    text = runner.pack.describe(4)
    assert "in-graph" in text and "two" in text and "grid" in text and "nd" in text
    assert isinstance(runner.pack.block, staging.CallBlock)


def test_a_callers_change_to_an_output_never_reaches_a_later_call():
    """Each call lends its own alias of the cached output views: changing one's metadata in place
    leaves later calls' outputs as declared, and an earlier call's alias is stale (rule 6.2)."""
    prog = pg.Program("views", inputs={"v": pg.Input((bs, 2), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs, 2), torch.int64)}, buckets=pg.Buckets([4]))
    runner = pg.compile(prog, lambda x: {"y": x.v + 1}, backend="cuda")
    v = torch.arange(6, device="cuda").view(3, 2)
    a = runner(v=v).y
    a.t_()                               # the caller changed its metadata in place
    b = runner(v=v).y
    assert b is not a and b.shape == (3, 2) and torch.equal(b, v + 1)
    with pytest.raises(pg.StaleOutputError):
        a.sum()
    c = runner(v=v * 2).y
    assert torch.equal(c, v * 2 + 1) and not c.requires_grad


@pytest.mark.cuda
def test_graphs_own_their_cublas_workspace():
    """Clearing torch's cuBLAS workspace cache after compile (torch.compile's cudagraph trees do
    when they record; destroying another graph of the same stream does) must not free memory the
    captured graphs still use: replays neither write into memory handed out since nor fault."""
    bs = pg.Axis("bs")
    prog = pg.Program("mm", inputs={"x": pg.Input((bs, 4096), torch.bfloat16, pad=0.0)},
                      outputs={"y": pg.Output((bs, 4096), torch.bfloat16)}, buckets=pg.Buckets([4, 8]))
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    runner = pg.compile(prog, lambda x: {"y": x.x @ w}, backend="cuda")
    torch._C._cuda_clearCublasWorkspaces()
    hogs = [torch.full((8 << 20,), 7.0, device="cuda") for _ in range(64)]   # reclaim freed blocks
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        y = runner(x=x).y.clone()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x @ w)
    assert all(bool((h == 7.0).all()) for h in hogs), "a replay wrote into memory freed from its workspace"
