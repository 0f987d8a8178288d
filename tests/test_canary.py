"""The canary (padgraph/canary.py): declared rows no call may write, checked after every run of the
body, reported at a later call without a sync. Both directions: a correct program never trips it,
and a write to a canary row by a padded lane, a stale index or a body bug is reported with the row."""
import warnings

import pytest
import torch

import padgraph as pg
from padgraph.canary import SENTINEL

bs = pg.Axis("bs")
N_SLOTS, SINK, CANARY = 32, 0, 1


def program(canary=CANARY):
    return pg.Program(
        "kv_write",
        inputs={"loc": pg.Input((bs,), torch.int64, pad=SINK), "val": pg.Input((bs, 4), torch.float32, pad=0)},
        outputs={"y": pg.Output((bs, 4), torch.float32)},
        state={"kv": pg.State(sink=SINK, canary=canary)},
        buckets=pg.Buckets([1, 2, 4, 8]),
    )


def body(x):
    x.kv.index_copy_(0, x.loc, x.val)
    return {"y": x.kv.index_select(0, x.loc) * 2}


def kv_pool(device="cpu"):
    return [torch.randn(N_SLOTS, 4, device=device), torch.randn(N_SLOTS, 4, device=device)]


def pool_body(x):
    for t in x.kv:
        t.index_copy_(0, x.loc, x.val)
    return {"y": x.kv[0].index_select(0, x.loc) * 2}


def raw(n, g, lo=2):
    return {"loc": torch.randperm(N_SLOTS - lo, generator=g)[:n] + lo, "val": torch.randn(n, 4, generator=g)}


@pytest.mark.parametrize("backend", ["reference"])
def test_correct_program_never_trips(backend):
    kv = kv_pool()
    run = pg.compile(program(), pool_body, backend=backend, state={"kv": kv})
    assert (kv[0][CANARY].view(torch.uint8) == SENTINEL).all()          # armed at compile
    g = torch.Generator().manual_seed(0)
    for n in (3, 1, 7, 8, 2, 5):
        run(**raw(n, g))                     # padded lanes write the sink: allowed
    run.canary_check()


def test_padded_lane_writing_canary_is_reported_at_next_call():
    prog = pg.Program("kv_write", inputs=program().inputs, outputs=program().outputs,
                      state={"kv": pg.State(sink=SINK, canary=CANARY)}, buckets=pg.Buckets([4]))

    def clamped(x):                          # the bug: padded lanes' slot clamped to 1, not the sink
        loc = torch.where(x.loc == SINK, torch.ones_like(x.loc), x.loc)
        x.kv.index_copy_(0, loc, x.val)
        return {"y": x.val * 2}

    kv = torch.randn(N_SLOTS, 4)
    run = pg.compile(prog, clamped, backend="reference", state={"kv": kv})
    g = torch.Generator().manual_seed(1)
    run(**raw(4, g))                         # no padded lane: nothing written at row 1
    run(**raw(4, g))
    run(**raw(3, g))                         # one padded lane writes row 1
    with pytest.raises(pg.CanaryError, match=r"state 'kv'.*canary row 1 of kv") as e:
        run(**raw(4, g))
    assert "call 4" in str(e.value)
    run(**raw(4, g))                         # re-armed: the runner stays usable
    run.canary_check()


def test_each_leaf_and_row_is_named():
    prog = pg.Program("kv_write", inputs=program().inputs, outputs=program().outputs,
                      state={"kv": pg.State(sink=SINK, canary=(1, N_SLOTS - 1))}, buckets=pg.Buckets([4]))

    def stray(x):                            # writes the last slot of the second pool tensor
        x.kv[1][N_SLOTS - 1] = 0.0
        return {"y": x.val * 2}

    run = pg.compile(prog, stray, backend="reference", state={"kv": kv_pool()})
    g = torch.Generator().manual_seed(2)
    run(**raw(2, g))                         # writes the row; reported by the next call
    with pytest.raises(pg.CanaryError, match=r"kv\[1\] row 31"):
        run(**raw(2, g))


@pytest.mark.parametrize("mode", ["warn", False])
def test_modes(mode):
    prog = program()

    def stray(x):
        x.kv[CANARY] = 0.0                  # (+= 1 would leave 1.5e16 as it is)
        return {"y": x.val * 2}

    run = pg.compile(prog, stray, backend="reference", state={"kv": torch.randn(N_SLOTS, 4)}, canary=mode)
    g = torch.Generator().manual_seed(3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        run(**raw(2, g))
        run(**raw(2, g))
    hits = [x for x in w if "canary row" in str(x.message)]
    assert len(hits) == (1 if mode == "warn" else 0)


def test_declaration_errors():
    with pytest.raises(pg.ContractValueError, match="canary rows"):
        program(canary=SINK)                                  # a sink is written by padded lanes
    with pytest.raises(pg.ContractTypeError, match="canary"):
        program(canary=1.5)
    with pytest.raises(pg.ContractValueError, match="canary"):
        pg.compile(program(canary=N_SLOTS + 3), body, backend="reference", state={"kv": torch.randn(N_SLOTS, 4)})
    with pytest.raises(pg.ContractValueError, match="canary"):
        pg.compile(program(), body, backend="reference", state={"kv": torch.randn(N_SLOTS, 4)}, canary="loud")


def test_torch_compile_body_keeps_the_check():
    kv = torch.randn(N_SLOTS, 4)

    def stray(x):
        x.kv.index_copy_(0, torch.clamp(x.loc, min=CANARY), x.val)   # padded lanes onto row 1
        return {"y": x.val * 2}

    run = pg.compile(program(), stray, backend="reference", state={"kv": kv}, torch_compile=True)
    g = torch.Generator().manual_seed(4)
    run(**raw(3, g))
    with pytest.raises(pg.CanaryError):
        run(**raw(4, g))


def _rows(sizes, offset=0, device="cpu"):
    """Canary rows of `sizes` bytes, each a view starting `offset` bytes into its own buffer."""
    return [torch.full((n + 16,), SENTINEL, dtype=torch.uint8, device=device)[offset:offset + n] for n in sizes]


def test_triton_checker_matches_torch_reference():
    pytest.importorskip("triton")
    from padgraph.backends.triton import canary as tc
    from padgraph.canary import torch_checker
    rows = _rows((1, 7, 1023, 1025, 3000))
    for bad in (None, 0, 2, 3, 4):
        if bad is not None:
            rows[bad][-1] = 0
        flag, ref = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        tc.checker(rows, flag)()
        torch_checker(rows, ref)
        assert bool(flag[0]) == bool(ref[0]) == (bad is not None)
        if bad is not None:
            assert int(flag[0]) - 1 in {i for i, r in enumerate(rows) if (r != SENTINEL).any()}


def _long_unaligned_rows(offset, device):
    pytest.importorskip("triton")
    from padgraph.backends.triton import canary as tc
    sizes = (5, 2 * tc.CHUNK + 13, 64)
    n = sizes[1]
    for where in (None, 0, 4, 5, n // 2, tc.CHUNK + offset, tc.CHUNK + 8, n - 2, n - 1):
        rows = _rows(sizes, offset, device)
        if where is not None:
            rows[1][where] = 0
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=device == "cuda")
        tc.checker(rows, flag)()
        if device == "cuda":
            torch.cuda.synchronize()
        assert int(flag[0]) == (0 if where is None else 2), where


@pytest.mark.parametrize("offset", [0, 3])
def test_triton_checker_finds_any_byte_of_long_unaligned_rows(offset):
    """Rows of several chunks, starting off an 8-byte boundary: a byte changed in the unaligned
    head, in any chunk of the word body, at a chunk seam or in the tail is found, and the flag
    names its row; untouched rows leave the flag at 0."""
    _long_unaligned_rows(offset, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 3])
def test_cuda_checker_finds_any_byte_of_long_unaligned_rows(offset):
    """The same on the GPU, the flag in pinned host memory as the runners keep it."""
    _long_unaligned_rows(offset, "cuda")


def test_triton_checker_chunks_tile_every_row():
    """The chunks cover each row's bytes exactly once: byte chunks under 8 bytes, word chunks
    8-byte aligned and at most CHUNK bytes."""
    from padgraph.backends.triton import canary as tc
    for offset in (0, 1, 5):
        rows = _rows((1, 8, 9, 100, 3 * tc.CHUNK + 7), offset)
        seen = {i: [] for i in range(len(rows))}
        for addr, n, tag in tc.chunks(rows):
            i, words = divmod(tag, 2)
            size = 8 * n if words else n
            assert (addr % 8 == 0 and size <= tc.CHUNK) if words else n < 8
            seen[i].append((addr, addr + size))
        for i, r in enumerate(rows):
            spans = sorted(seen[i])
            assert spans[0][0] == r.data_ptr() and spans[-1][1] == r.data_ptr() + r.numel()
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.cuda
def test_cuda_graph_checks_every_replay():
    kv = kv_pool("cuda")
    prog = pg.Program("kv_write", inputs=program().inputs, outputs=program().outputs,
                      state={"kv": pg.State(sink=SINK, canary=CANARY)}, buckets=pg.Buckets([1, 2, 4, 8]))
    good = pg.compile(prog, pool_body, backend="cuda", state={"kv": kv})
    g = torch.Generator().manual_seed(5)
    for n in (3, 1, 7, 8):
        good(**{k: v.cuda() for k, v in raw(n, g).items()})
    good.canary_check()

    def clamped(x):
        loc = torch.where(x.loc == SINK, torch.full_like(x.loc, CANARY), x.loc)
        for t in x.kv:
            t.index_copy_(0, loc, x.val)
        return {"y": x.val * 2}

    bad = pg.compile(prog, clamped, backend="cuda", state={"kv": kv_pool("cuda")})
    with pytest.raises(pg.CanaryError, match=r"canary row 1 of kv\[\d\].*at compile"):
        bad(**{k: v.cuda() for k, v in raw(4, g).items()})   # compile's all-pad warm-up runs wrote it
    for n in (4, 8):
        bad(**{k: v.cuda() for k, v in raw(n, g).items()})
    bad.canary_check()                                 # full buckets: no padded lane
    bad(**{k: v.cuda() for k, v in raw(3, g).items()})  # a padded lane writes row 1, inside the graph
    with pytest.raises(pg.CanaryError, match=r"kv\[0\] row 1"):
        bad.canary_check()
