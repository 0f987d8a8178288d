"""The CUDA-graph backend against the reference backend, on the GPU (cuda marker)."""
import random

import pytest
import torch

import padgraph as pg

pytestmark = pytest.mark.cuda

N_SLOTS, N_ROWS, D = 64, 16, 8


def decode_like(buckets=(1, 2, 4, 8, 12, 16)):
    bs = pg.Axis("bs")
    tok = pg.Axis("tokens", capacity=bs * 3)
    return pg.Program(
        "decode_like",
        inputs={
            "input_ids": pg.Input((bs,), torch.int64, pad=0),
            "positions": pg.Input((bs,), torch.int64, pad=0),
            "seq_lens": pg.Input((bs,), torch.int32, pad=1),
            "req_rows": pg.Input((bs,), torch.int32, pad=0),
            "out_cache_loc": pg.Input((bs,), torch.int64, pad=0),
            "cu_lens": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
            "tok_ids": pg.Input((tok,), torch.int64, pad=0),
            "hidden": pg.Input((bs, D), torch.float32, pad=0.0),
        },
        outputs={"next": pg.Output((bs,), torch.int64), "acc": pg.Output((bs, D), torch.float32),
                 "tok_out": pg.Output((tok,), torch.int64)},
        state={"cache": pg.State(sink=0)},
        buckets=pg.Buckets(list(buckets)),
    )


def body(x):
    # integer program: bitwise-comparable across backends
    x.cache[x.out_cache_loc] = x.input_ids * 7 + x.positions
    total = x.seq_lens.sum()                       # a sum over the padded view: pads are 1
    nxt = (x.cache[x.out_cache_loc] + x.seq_lens.long() * 3 + x.req_rows.long() + total
           + x.extent("bs").long() + (x.cu_lens[1:] - x.cu_lens[:-1]).long())
    acc = x.hidden * 2 + x.seq_lens[:, None].float()
    return {"next": nxt, "acc": acc, "tok_out": x.tok_ids * 2 + x.extent("tokens").long()}


def raw_inputs(bs, n_tok, device, gen):
    lens = torch.randint(1, 5, (bs,), generator=gen)
    return {
        "input_ids": torch.randint(0, 100, (bs,), generator=gen).to(device),
        "positions": torch.randint(0, 50, (bs,), generator=gen).to(device),
        "seq_lens": torch.randint(1, 40, (bs,), generator=gen).int().to(device),
        "req_rows": torch.randint(1, N_ROWS, (bs,), generator=gen).int().to(device),
        "out_cache_loc": torch.randperm(N_SLOTS - 1, generator=gen)[:bs].add(1).to(device),
        "cu_lens": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).int().to(device),
        "tok_ids": torch.randint(0, 9, (n_tok,), generator=gen).to(device),
        "hidden": torch.randn(bs, D, generator=gen).to(device),
    }


def pair(buckets=(1, 2, 4, 8, 12, 16), **kw):
    cache_c = torch.zeros(N_SLOTS, dtype=torch.int64, device="cuda")
    cache_r = torch.zeros(N_SLOTS, dtype=torch.int64, device="cuda")
    prog = decode_like(buckets)
    cuda = pg.compile(prog, body, backend="cuda", state={"cache": cache_c}, **kw)
    ref = pg.compile(prog, body, backend="reference", state={"cache": cache_r})
    return cuda, ref, cache_c, cache_r


def assert_same(a, b, ctx):
    for k in b:
        assert torch.equal(a[k], b[k]), f"{k}: cuda != reference [{ctx}]"


def test_every_bucket_matches_reference_bitwise():
    cuda, ref, cc, cr = pair()
    gen = torch.Generator().manual_seed(0)
    for bs in range(1, 17):
        for n_tok in (0, 1, bs, 3 * bs):
            raw = raw_inputs(bs, n_tok, "cuda", gen)
            assert_same(cuda(**raw), ref(**raw), f"bs={bs} tokens={n_tok}")
            assert torch.equal(cc, cr)
    assert set(cuda.stats.capture) == {1, 2, 4, 8, 12, 16}


def test_soak_10k_random_calls_match_reference():
    cuda, ref, cc, cr = pair()
    gen = torch.Generator().manual_seed(1)
    rnd = random.Random(1)
    mismatches = 0
    for i in range(10_000):
        bs = rnd.choice([rnd.randint(1, 16), rnd.randint(1, 20)])   # some past the ladder
        n_tok = rnd.randint(0, 3 * bs)
        raw = raw_inputs(bs, n_tok, "cuda", gen)
        a, b = cuda(**raw), ref(**raw)
        mismatches += any(not torch.equal(a[k], b[k]) for k in b)
    assert mismatches == 0
    assert cuda.stats.eager_fallbacks > 0 and torch.equal(cc, cr)


def test_host_inputs_go_through_pinned_staging():
    cuda, ref, _, _ = pair()
    gen = torch.Generator().manual_seed(2)
    for bs in (1, 5, 16):
        raw = raw_inputs(bs, 2 * bs, "cpu", gen)
        dev = {k: v.cuda() for k, v in raw.items()}
        assert_same(cuda(**raw), ref(**dev), f"host bs={bs}")


def test_call_path_makes_no_host_sync():
    cuda, _, _, _ = pair()
    gen = torch.Generator().manual_seed(3)
    raws = [raw_inputs(bs, bs, "cuda", gen) for bs in (1, 3, 7, 16, 2, 9)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for raw in raws * 3:
            cuda(**raw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_capture_failure_names_program_and_bucket():
    prog = decode_like((1, 2))

    def syncing(x):
        n = int(x.seq_lens.sum().item())     # host sync: not capturable
        return {"next": x.input_ids + n, "acc": x.hidden, "tok_out": x.tok_ids}

    with pytest.raises(pg.CaptureError) as ei:
        pg.compile(prog, syncing, backend="cuda", state={"cache": torch.zeros(N_SLOTS, dtype=torch.int64, device="cuda")})
    msg = str(ei.value)
    assert "decode_like" in msg and "bucket 2" in msg and ".item()" in msg
    assert ei.value.__cause__ is not None


def test_prepare_hook_sees_padded_view_and_exception_leaves_caller_untouched():
    seen = []
    fail = {"on": False}

    def prepare(x):
        seen.append(x.seq_lens.clone())
        if fail["on"]:
            raise RuntimeError("hook failed")

    cuda, ref, _, _ = pair(prepare=prepare)
    gen = torch.Generator().manual_seed(4)
    raw = raw_inputs(3, 2, "cuda", gen)
    before = {k: v.clone() for k, v in raw.items()}
    cuda(**raw)
    assert seen[-1].tolist() == raw["seq_lens"].tolist() + [1]        # bucket 4: one pad lane = 1
    fail["on"] = True
    with pytest.raises(RuntimeError):
        cuda(**raw)
    fail["on"] = False
    assert all(torch.equal(before[k], raw[k]) for k in raw)
    raw2 = raw_inputs(5, 7, "cuda", gen)
    assert_same(cuda(**raw2), ref(**raw2), "after exception")


def test_state_storage_change_is_an_error():
    cuda, _, cc, _ = pair()
    raw = raw_inputs(2, 2, "cuda", torch.Generator().manual_seed(5))
    cuda(**raw)
    cc.resize_(2 * N_SLOTS)
    with pytest.raises(pg.StateStorageError):
        cuda(**raw)


def test_outputs_are_views_until_next_call_unless_copied():
    cuda, _, _, _ = pair()
    copying, _, _, _ = pair(copy_outputs=True)
    gen = torch.Generator().manual_seed(6)
    r1, r2 = raw_inputs(4, 4, "cuda", gen), raw_inputs(4, 4, "cuda", gen)
    a = cuda(**r1).acc
    a_val = a.clone()
    cuda(**r2)
    with pytest.raises(pg.StaleOutputError):  # overwritten by the next replay: reading it raises
        torch.equal(a, a_val)
    c = copying(**r1).acc
    copying(**r2)
    assert torch.equal(c, a_val)


def test_overflow_error_mode():
    cuda, _, _, _ = pair(buckets=(1, 2, 4), overflow="error")
    raw = raw_inputs(5, 1, "cuda", torch.Generator().manual_seed(7))
    with pytest.raises(pg.BucketOverflowError):
        cuda(**raw)


def test_capturing_flag_and_report():
    flags = []

    def b(x):
        flags.append(pg.capturing())
        return body(x)

    cache = torch.zeros(N_SLOTS, dtype=torch.int64, device="cuda")
    r = pg.compile(decode_like((1, 2)), b, backend="cuda", state={"cache": cache}, progress=False)
    assert flags and all(flags) and not pg.capturing()
    assert "bucket" in r.capture_report() and r.pool_bytes() > 0
