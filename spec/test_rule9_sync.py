"""Rule 9: the call path makes no host-device synchronisation (CUDA backends only)."""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 4)


def program():
    return pg.Program(
        "nosync",
        inputs={"ids": pg.Input((tok,), torch.int64, pad=0), "seq_lens": pg.Input((bs,), torch.int32, pad=1),
                "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()), "h": pg.Input((bs, 8), torch.float32, pad=0)},
        outputs={"y": pg.Output((bs, 8), torch.float32), "z": pg.Output((tok,), torch.int64)},
        state={"kv": pg.State(sink=0)},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body(x):
    x.kv[: x.bucket].add_(x.seq_lens.to(x.kv.dtype))
    return {"y": x.h * x.seq_lens.unsqueeze(1), "z": x.ids + x.cu[-1]}


@pytest.mark.needs_cuda
def test_r9_1_no_host_sync_on_the_call_path(compile, device):
    runner = compile(program(), body, state={"kv": torch.zeros(64, device=device)})
    raws = []
    for n, n_tok in [(1, 1), (3, 9), (8, 32), (5, 0)]:
        raws.append({"ids": torch.arange(n_tok, device=device), "seq_lens": torch.ones(n, dtype=torch.int32, device=device),
                     "cu": torch.arange(n + 1, dtype=torch.int32, device=device), "h": torch.randn(n, 8, device=device)})
    for raw in raws:                      # warm: lazy allocations, first-call work
        runner(**raw)
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for raw in raws:
            out = runner(**raw)
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    S.assert_equal("shape of y", tuple(out.y.shape), (5, 8), "after the sync-checked calls")
