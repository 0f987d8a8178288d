"""Rule 10: one layout on every backend, and compile keeps the contract too.

10.1 every input reaches the body dense and row-major, whichever dims are padded;
10.2 every compile-time run (warm-up) sees the declared pads, re-applied before each run even
     after the body mutated its inputs, defined values (0) in fixed-shape inputs, extents 0;
10.3 compile writes bound state only at sinks and leaves bound state as it found it;
10.4 compile leaves the application's gc.freeze() as it found it;
10.5 runners are for inference: outputs never require grad, a call's inputs are not kept alive;
10.6 a rejected call changes nothing, not even the runner's device.
"""
import gc
import weakref

import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 2)
PAD = -3


NAMES = ("lead", "trail", "two", "edge")


def layout_program():
    return pg.Program(
        "layout",
        inputs={"lead": pg.Input((bs, 3), torch.int32, pad=PAD),
                "trail": pg.Input((4, bs), torch.int32, pad=PAD),
                "two": pg.Input((bs, tok), torch.int32, pad=PAD),
                "edge": pg.Input((2, bs + 1), torch.int32, pad=pg.Edge(default=5))},
        outputs={"y": pg.Output((bs,), torch.int32)},
        state={f"p_{n}": pg.State() for n in NAMES},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def layout_body(x):
    for n in NAMES:
        t = x[n]
        assert t.is_contiguous(), f"input {n!r} of shape {tuple(t.shape)} is not dense: strides {t.stride()}"
        S.write_probe(x[f"p_{n}"], t.view(-1))    # .view(-1) needs a dense tensor; order = data_ptr order
    return {"y": x.lead[:, 0]}


@pytest.mark.parametrize("n,t", [(1, 0), (3, 5), (5, 10), (8, 16)], ids=["n1t0", "n3t5", "n5t10", "n8t16"])
def test_r10_1_inputs_are_dense_row_major(compile, device, n, t):
    prog = layout_program()
    cap = 8 * 2 * 8 + 64
    state = {f"p_{k}": S.probe((cap,), torch.int32, device) for k in NAMES}
    runner = compile(prog, layout_body, state=state)
    raw = {"lead": S.ints((n, 3), 0, 9, torch.int32, device, 1), "trail": S.ints((4, n), 0, 9, torch.int32, device, 2),
           "two": S.ints((n, t), 0, 9, torch.int32, device, 3), "edge": S.ints((2, n + 1), 0, 9, torch.int32, device, 4)}
    size = S.fit(prog, {"bs": n, "tokens": t})
    runner(**raw)
    for name, r in raw.items():
        shape = S.padded_shape(prog, name, size)
        want = S.expected_padded(r, shape, prog.inputs[name].pad, S.dims_of(prog, name)).reshape(-1)
        got = S.read_probe(state[f"p_{name}"], want.shape)
        S.assert_equal(f"{name} as the body's dense view", got, want, f"n={n} t={t} size={size}")


def compile_program():
    return pg.Program(
        "compile_runs",
        inputs={"loc": pg.Input((bs,), torch.int64, pad=0), "lens": pg.Input((bs,), torch.int32, pad=1),
                "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge(default=0)), "fixed": pg.Input((3,), torch.int64)},
        outputs={"y": pg.Output((bs,), torch.int64)},
        state={"kv": pg.State(sink=0), "counter": pg.State()},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def test_r10_2_compile_runs_see_pads_and_defined_values(compile, device):
    seen = S.probe((4, S.LADDER[-1] + 1), torch.int64, device)     # not bound state: never restored

    def body(x):
        n = x.bucket
        seen[0, :n].copy_(x.loc)
        seen[1, :n].copy_(x.lens.long())
        seen[2, : n + 1].copy_(x.cu.long())
        seen[3, :3].copy_(x.fixed)
        seen[3, 3].copy_(x.extent("bs").long())
        x.kv.index_put_((x.loc,), torch.ones_like(x.loc, dtype=x.kv.dtype), accumulate=True)
        x.counter.add_(1)
        x.loc.fill_(7)          # the body mutates its inputs: the next run must see pads again
        x.lens.fill_(9)
        x.fixed.fill_(11)
        return {"y": x.loc + x.lens.long()}

    kv = torch.zeros(16, dtype=torch.int64, device=device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    runner = compile(compile_program(), body, state={"kv": kv, "counter": counter})
    if device.type == "cuda":
        torch.cuda.synchronize()
    got = seen.cpu()
    case = f"after compile on {runner.backend}"
    if bool((got == S.SENTINEL).all()):
        return      # this backend runs nothing at compile time
    b = S.LADDER[0]  # the last bucket warmed is the smallest
    S.assert_equal("loc seen at compile", got[0, :b], torch.zeros(b, dtype=torch.int64), case)
    S.assert_equal("lens seen at compile", got[1, :b], torch.ones(b, dtype=torch.int64), case)
    S.assert_equal("cu seen at compile", got[2, : b + 1], torch.zeros(b + 1, dtype=torch.int64), case)
    S.assert_equal("fixed input seen at compile", got[3, :3], torch.zeros(3, dtype=torch.int64), case)
    S.assert_equal("extent seen at compile", int(got[3, 3]), 0, case)


def test_r10_3_compile_leaves_state_as_it_found_it(compile, device):
    def body(x):
        x.kv.index_put_((x.loc,), torch.ones_like(x.loc, dtype=x.kv.dtype), accumulate=True)
        x.counter.add_(1)
        x.loc.fill_(5)          # a later compile-time run with this loc would write row 5
        return {"y": x.loc + x.lens.long()}

    kv = torch.arange(16, dtype=torch.int64, device=device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    runner = compile(compile_program(), body, state={"kv": kv, "counter": counter})
    S.assert_equal("kv after compile", kv.cpu(), torch.arange(16), f"{runner.backend}")
    S.assert_equal("counter after compile", counter.cpu(), torch.zeros(1, dtype=torch.int64), f"{runner.backend}")
    loc = torch.tensor([3, 4], device=device)
    runner(loc=loc, lens=torch.ones(2, dtype=torch.int32, device=device),
           cu=torch.arange(3, dtype=torch.int32, device=device), fixed=torch.zeros(3, dtype=torch.int64, device=device))
    want = torch.arange(16)
    want[3] += 1
    want[4] += 1
    want[0] += S.bucket_of(2) - 2     # padded lanes write the sink only
    S.assert_equal("kv after one call", kv.cpu(), want, f"{runner.backend}")


def test_r10_4_compile_leaves_gc_freeze_as_found(compile, device, monkeypatch):
    keep = [object() for _ in range(10)]
    calls = []
    for name in ("freeze", "unfreeze"):
        real = getattr(gc, name)
        monkeypatch.setattr(gc, name, lambda real=real, name=name: (calls.append(name), real())[1])
    gc.freeze()
    calls.clear()
    try:
        frozen = gc.get_freeze_count()
        enabled = gc.isenabled()
        compile(compile_program(), lambda x: {"y": x.loc}, state={"kv": torch.zeros(4, dtype=torch.int64, device=device),
                                                                   "counter": torch.zeros(1, device=device)})
        S.assert_equal("gc.freeze()/gc.unfreeze() calls", calls, [], "during compile")
        # frozen objects may die during compile (torch.compile drops some), none is frozen anew
        count = gc.get_freeze_count()
        S.assert_equal("0 < gc.get_freeze_count() <= frozen", 0 < count <= frozen, True,
                       f"after compile (count {count}, frozen {frozen})")
        S.assert_equal("gc.isenabled()", gc.isenabled(), enabled, "after compile")
    finally:
        monkeypatch.undo()
        gc.unfreeze()
    del keep


def _infer_program():
    return pg.Program("infer", inputs={"h": pg.Input((bs, 4), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((bs, 4), torch.float32)}, buckets=pg.Buckets(list(S.LADDER)))


class _W(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


def test_r10_5_outputs_never_require_grad_and_inputs_are_not_kept(compile, device):
    w = _W().to(device)
    runner = compile(_infer_program(), lambda x: {"y": w.lin(x.h)})
    h = torch.randn(3, 4, device=device, requires_grad=True)
    ref = weakref.ref(h)
    out = runner(h=h).y
    S.assert_equal("out.requires_grad", out.requires_grad, False, runner.backend)
    S.assert_equal("out.grad_fn", out.grad_fn, None, runner.backend)
    want = w.lin(h.detach())
    S.assert_close("y", out, want.detach(), runner.backend)
    del h
    gc.collect()
    S.assert_equal("input alive after the call", ref() is not None, False, runner.backend)


def test_r10_6_a_rejected_call_changes_nothing(compile, device):
    runner = compile(_infer_program(), lambda x: {"y": x.h * 2})
    before = runner.device
    for bad in ({"h": torch.zeros(2, 4, dtype=torch.float64, device=device)}, {"nope": torch.zeros(2, 4, device=device)}):
        with pytest.raises(pg.ContractError):
            runner(**bad)
        S.assert_equal("runner.device", runner.device, before, f"after a rejected call {sorted(bad)}")
        S.assert_equal("stats.calls", dict(runner.stats.calls), {}, "after a rejected call")
    out = runner(h=torch.ones(2, 4, device=device)).y
    S.assert_close("y", out, torch.full((2, 4), 2.0, device=device), "after rejected calls")
