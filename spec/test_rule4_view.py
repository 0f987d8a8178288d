"""Rule 4: one padded view per call — body, hook and derived metadata — never a raw tensor."""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")


def program():
    return pg.Program(
        "view",
        inputs={"seq_lens": pg.Input((bs,), torch.int32, pad=1), "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge())},
        outputs={"total": pg.Output((1,), torch.int64), "y": pg.Output((bs,), torch.int32)},
        state={"meta": pg.State(), "seen": pg.State(), "ext": pg.State()},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body(x):
    x.ext.copy_(x.extent("bs").reshape(1).to(x.ext.dtype))
    S.write_probe(x.seen, x.seq_lens)
    total = x.seq_lens.sum(dtype=torch.int64).reshape(1)
    return {"total": total, "y": x.seq_lens + x.meta[0].to(torch.int32)}


def _state(device):
    return {"meta": torch.zeros(2, dtype=torch.int64, device=device),
            "seen": S.probe((2 * S.LADDER[-1],), torch.int32, device),
            "ext": torch.zeros(1, dtype=torch.int64, device=device)}


@pytest.mark.parametrize("label,n", S.extents(seed=4), ids=S.ids(S.extents(seed=4)))
def test_r4_view_hook_and_body(compile, device, label, n):
    """4.1 x.bucket/x.extent; 4.2 the hook sees the padded view, before the body, whose reads
    include its writes; 4.3 a sum from the hook equals the body's, pads included."""
    st = _state(device)
    hook_saw = []

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        S.assert_equal("x.extent('bs') dtype/shape", (x.extent("bs").dtype, tuple(x.extent("bs").shape)),
                       (torch.int32, ()), label)
        S.assert_equal("x.extent('bs') device type", x.extent("bs").device.type, torch.device(device).type, label)
        hook_saw.append((x.bucket, x.seq_lens.detach().cpu().clone(), x.cu.detach().cpu().clone()))
        x.meta[0].fill_(int(x.seq_lens.sum()))            # host-side metadata from the padded view
        x.seq_lens[0].fill_(x.seq_lens[0] + 1000)          # the body of this call must read this

    runner = compile(program(), body, state=st, prepare=prepare)
    g = torch.Generator().manual_seed(n)
    sl = torch.randint(2, 90, (n,), generator=g, dtype=torch.int32).to(device)
    cu = torch.cumsum(torch.randint(1, 5, (n + 1,), generator=g), 0).int().to(device)
    out = runner(seq_lens=sl, cu=cu)
    size = S.fit(program(), {"bs": n})
    want_sl = S.expected_padded(sl, (size,), pg.Fill(1), [0])
    want_cu = S.expected_padded(cu, (size + 1,), pg.Edge(), [0])
    S.assert_equal("hook calls", len(hook_saw), 1, label)
    bucket, h_sl, h_cu = hook_saw[0]
    S.assert_equal("x.bucket in the hook", bucket, size, label)
    S.assert_equal("seq_lens seen by the hook", h_sl, want_sl, label)
    S.assert_equal("cu seen by the hook", h_cu, want_cu, label)
    hooked = want_sl.clone()
    hooked[0] += 1000
    S.assert_equal("seq_lens seen by the body", S.read_probe(st["seen"], (size,)), hooked, label)
    S.assert_equal("x.extent('bs') in the body", int(st["ext"][0]), n, label)
    padded_sum = int(want_sl.sum())
    S.assert_equal("hook's sum of seq_lens", int(st["meta"][0]), padded_sum, label)
    S.assert_equal("body's sum of seq_lens", int(out.total[0]), padded_sum + 1000, label)
    S.assert_equal("y", out.y.cpu(), (hooked + padded_sum)[:n], label)


def test_r4_2_hook_runs_every_call_before_body(compile, device):
    st = _state(device)
    order = []

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        order.append("prepare")
        x.meta[1].fill_(len(order))            # the body of this call reads it

    def body2(x):
        return {"total": x.meta[1:2] * 1, "y": x.seq_lens * 1}

    runner = compile(program(), body2, state=st, prepare=prepare)
    for i, n in enumerate([3, 3, 8, 1, 5]):
        out = runner(seq_lens=torch.ones(n, dtype=torch.int32, device=device),
                     cu=torch.arange(n + 1, dtype=torch.int32, device=device))
        S.assert_equal("hook calls so far", len(order), i + 1, f"call {i}")
        S.assert_equal("value the hook wrote, as the body read it", int(out.total[0]), i + 1, f"call {i}")
