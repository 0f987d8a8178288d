"""Shadow verification (pg.Shadow) on the reference backend: silent on correct programs, and it
catches the hazards a reference run can show (a padded lane writing a non-sink row, metadata a
hook built from a raw buffer, raw lanes reading lanes past an extent) at the first sampled call
that exhibits them. The graph-only hazards (a Python scalar baked in at capture, a temporary
freed before the pack reads it) are tested on the GPU in test_cuda_shadow.py.

Hazards, sorted:
  false alarm — padded lanes writing anything (an affine layer's bias, noise) at a sink row or at
    the padded rows of batch-ordered state; an output fed back as the next call's input (a decode
    loop), whose memory the replay rewrites before the eager runs read it.
  silent change — a verification that raises after the run has rewritten the previous call's
    outputs: those must read as stale, not show the raising call's values.
  still caught — a padded lane writing a live row or a raw lane's batch-ordered row, a live row
    that differs between the replay and the eager run (named by row)."""
import logging

import pytest
import torch

import padgraph as pg

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2, device_extent=True)


def _kv_program():
    return pg.Program("kv", inputs={"slot": pg.Input((bs,), torch.int64, pad=0), "v": pg.Input((bs,), torch.float32, pad=0)},
                      outputs={"o": pg.Output((bs,), torch.float32)}, state={"kv": pg.State(sink=0)},
                      buckets=pg.Buckets([4, 8]))


def _good(x):
    x.kv.index_copy_(0, x.slot, x.v)
    return {"o": x.v * 2}


def test_correct_program_verified_on_every_call_finds_nothing():
    r = pg.compile(_kv_program(), _good, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1))
    for n in (3, 7, 1, 8, 2):
        v = torch.randn(n)
        out = r(slot=torch.arange(n) + 8, v=v)
        torch.testing.assert_close(out.o, v * 2)
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (5, 0)


def test_sampling_first_per_bucket_then_every_nth():
    r = pg.compile(_kv_program(), _good, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=4, first=2))
    for n in (3, 3, 3, 3, 7, 7, 7, 7):
        r(slot=torch.arange(n) + 8, v=torch.randn(n))
    # bucket 4: calls 1, 2 (first) and 4 (every 4th); bucket 8: calls 5, 6 (first) and 8
    assert r.stats.shadow_calls == 6


def test_padded_lane_writing_a_non_sink_row_raises():
    def bad(x):
        x.kv.index_copy_(0, torch.where(x.slot == 0, torch.ones_like(x.slot), x.slot), x.v + 1)
        return {"o": x.v * 2}

    r = pg.compile(_kv_program(), bad, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1000))
    with pytest.raises(pg.ShadowMismatch, match=r"'kv'.*bucket 4.*\{'bs': 3\}.*state 'kv', row 1.*non-sink"):
        r(slot=torch.arange(3) + 8, v=torch.randn(3))


def test_metadata_from_a_raw_buffer_in_the_hook_raises_on_the_first_call_it_matters():
    program = pg.Program("meta", inputs={"v": pg.Input((bs,), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)},
                         state={"kv": pg.State(sink=0), "loc": pg.State()}, buckets=pg.Buckets([4, 8]))
    batch = {}

    def hook(x):                 # SGLang #25529: metadata from the raw out_cache_loc, tail left stale
        n = batch["loc"].shape[0]
        x.loc[:n].copy_(batch["loc"])

    def body(x):
        x.kv.index_copy_(0, x.loc[: x.bucket], x.v)
        return {"o": x.v + 0}

    state = {"kv": torch.zeros(64), "loc": torch.zeros(8, dtype=torch.int64)}
    r = pg.compile(program, body, state=state, prepare=hook, shadow=pg.Shadow(every=1000, first=1))
    batch["loc"] = torch.arange(6) + 10
    r(v=torch.randn(6))                      # bucket 8: every lane real, nothing stale yet
    batch["loc"] = torch.arange(3) + 40
    with pytest.raises(pg.ShadowMismatch, match="row 1[345].*non-sink"):
        r(v=torch.randn(3))                  # bucket 4: lane 3 reads the last call's slot 13


def test_raw_lanes_reading_lanes_past_a_device_extent_raise():
    program = pg.Program("ext", inputs={"c": pg.Input((bs,), torch.int8, pad=0), "t": pg.Input((tok,), torch.float32, pad=0.5)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([2, 4]))
    r = pg.compile(program, lambda x: {"o": x.c.float() + x.t.sum()}, shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match="output 'o'.*exact run"):
        r.call({"c": torch.zeros(2, dtype=torch.int8), "t": torch.ones(3)}, extents={"tok": torch.tensor(1, dtype=torch.int32)})


def test_on_mismatch_log_and_callable(caplog):
    def bad(x):
        x.kv.index_copy_(0, torch.where(x.slot == 0, torch.ones_like(x.slot), x.slot), x.v + 1)
        return {"o": x.v * 2}
    seen = []
    r = pg.compile(_kv_program(), bad, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1, on_mismatch=seen.append))
    out = r(slot=torch.arange(3) + 8, v=torch.ones(3))
    assert out.o.tolist() == [2.0, 2.0, 2.0] and len(seen) == 1 and isinstance(seen[0], pg.ShadowMismatch)
    r = pg.compile(_kv_program(), bad, state={"kv": torch.zeros(32)}, shadow=pg.Shadow(every=1, on_mismatch="log"))
    with caplog.at_level(logging.ERROR, logger="padgraph"):
        r(slot=torch.arange(3) + 8, v=torch.ones(3))
    assert any("non-sink" in m for m in caplog.messages) and r.stats.shadow_mismatches == 1


@pytest.mark.parametrize("kw", [{"every": 0}, {"first": -1}, {"on_mismatch": "warn"}, {"every": True}])
def test_shadow_options_are_checked(kw):
    with pytest.raises(pg.ContractError):
        pg.Shadow(**kw)


# ---- no false alarm where padded lanes may write anything (rules 7.4, 7.7) --------------------------
def _sink_program(name="sink"):
    return pg.Program(name, inputs={"loc": pg.Input((bs,), torch.int64, pad=0), "v": pg.Input((bs, 2), torch.float32, pad=0)},
                      outputs={"o": pg.Output((bs,), torch.float32)},
                      state={"rows": pg.State(sink=0), "own": pg.State(rows=bs)}, buckets=pg.Buckets([4, 8]))


def _sink_state(device="cpu"):
    return {"rows": torch.zeros(32, 2, device=device), "own": torch.zeros(8, 2, device=device)}


def _pad_lanes(x) -> torch.Tensor:
    return (torch.arange(x.bucket, device=x.v.device) >= x.extent("bs"))[:, None]    # [bucket, 1]


def _affine_at_sink(x):
    """What a linear layer with a bias does: padded lanes (v = 0) write 0.5 at the sink, not 0."""
    x.rows.index_copy_(0, x.loc, x.v * 2 + 0.5)
    x.own.copy_(x.v * 3 + 0.25)                      # padded rows [n, bucket) get 0.25
    return {"o": x.rows.index_select(0, x.loc).sum(1)}


def _noise_at_sink(x):
    """Padded lanes write fresh noise at the sink and at their own rows: a value no two runs share."""
    x.rows.index_copy_(0, x.loc, torch.where(_pad_lanes(x), torch.rand_like(x.v), x.v))
    x.own.copy_(torch.where(_pad_lanes(x), torch.rand_like(x.v), x.v + 1))
    return {"o": x.v.sum(1)}


@pytest.mark.parametrize("body,tc", [(_affine_at_sink, None), (_noise_at_sink, None), (_affine_at_sink, True)],
                         ids=["affine", "noise", "affine-compiled"])
def test_padded_lanes_writing_anything_at_sinks_and_own_rows_are_no_mismatch(body, tc):
    st = _sink_state()
    r = pg.compile(_sink_program(), body, state=st, torch_compile=tc, shadow=pg.Shadow(every=1))
    for n in (3, 5, 2, 8, 3):
        loc, v = torch.randperm(31)[:n] + 1, torch.randn(n, 2)
        r(loc=loc, v=v)
        want = v * 2 + 0.5 if body is _affine_at_sink else v
        torch.testing.assert_close(st["rows"][loc], want)          # live rows: exactly what raw lanes wrote
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (5, 0)


def test_live_rows_are_still_compared_strictly_and_named_by_row():
    """A state row raw lanes own that differs between the replay and the eager run (here a Python
    counter the body reads) is a mismatch, reported as the row, not a lane."""
    calls = [0]

    def body(x):
        calls[0] += 1
        x.rows.index_copy_(0, x.loc, torch.rand_like(x.v))          # noise at the sink: allowed
        x.rows[5, 1] = float(calls[0])                               # row 5: no sink, not padded lanes'
        return {"o": x.v.sum(1)}
    r = pg.compile(_sink_program(), body, state=_sink_state(), shadow=pg.Shadow(every=1))
    want = r"state 'rows', row 5, column 1: the replay left 1.0, the eager padded path leaves 2.0"
    with pytest.raises(pg.ShadowMismatch, match=want):
        r(loc=torch.arange(3) + 8, v=torch.randn(3, 2))


def test_a_0d_state_and_a_3d_row_are_named_as_such():
    program = pg.Program("shapes", inputs={"v": pg.Input((bs,), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs,), torch.float32)}, state={"count": pg.State(), "cube": pg.State(sink=0)}, buckets=pg.Buckets([4]))
    runs = [0]

    def body(x, field):
        runs[0] += 1
        target = x.count if field == "count" else x.cube[2, 1, 0]     # never a sink, never a padded row
        target.fill_(runs[0])                                      # replay and eager run differ
        return {"o": x.v + 0}
    for field, where in (("count", "state 'count', its value"), ("cube", r"state 'cube', row 2, element \(1, 0\) of it")):
        state = {"count": torch.zeros(()), "cube": torch.zeros(4, 2, 2)}
        r = pg.compile(program, lambda x: body(x, field), state=state, shadow=pg.Shadow(every=1))
        with pytest.raises(pg.ShadowMismatch, match=where + ": the replay left"):
            r(v=torch.ones(3))


def test_padded_lanes_of_batch_ordered_state_writing_a_raw_row_are_caught():
    """Lane i writes row (i + 1) mod bucket: the last padded lane lands on raw row 0."""
    def body(x):
        x.own[(torch.arange(x.bucket) + 1) % x.bucket] = x.v
        return {"o": x.v.sum(1)}
    r = pg.compile(_sink_program(), body, state=_sink_state(), shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match=r"state 'own', row 0, column 0: the padded run left 0.0, the exact run"):
        r(loc=torch.arange(3) + 8, v=torch.randn(3, 2) + 5)


# ---- an output fed back; a verification that raises ----------------------------------------------
def _loop_program():
    return pg.Program("loop", inputs={"h": pg.Input((bs, 3), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs, 3), torch.float32)}, buckets=pg.Buckets([4, 8]))


@pytest.mark.parametrize("copy", [False, True], ids=["lent", "copied"])
def test_an_output_fed_back_as_the_next_input_is_no_mismatch(copy):
    """The decode-loop pattern: the eager runs read the input as the call found it, not the
    output memory the replay has just rewritten."""
    r = pg.compile(_loop_program(), lambda x: {"y": x.h * 2 + 1}, shadow=pg.Shadow(every=1), copy_outputs=copy)
    h = torch.randn(3, 3)
    out = r(h=h)
    for _ in range(4):
        want = out.y.clone() * 2 + 1
        out = r(h=out.y)
        torch.testing.assert_close(out.y, want)
    assert (r.stats.shadow_calls, r.stats.shadow_mismatches) == (5, 0)


def test_a_shadowed_call_that_raises_leaves_earlier_outputs_stale_not_changed():
    runs = [0]

    def body(x):                 # the second run (call 2's replay) differs from every other run
        runs[0] += 1
        return {"y": x.h + (100.0 if runs[0] == 2 else 0.0)}
    r = pg.compile(_loop_program(), body, shadow=pg.Shadow(every=2, first=0))
    first = r(h=torch.zeros(3, 3))                     # not sampled
    assert first.y.tolist() == [[0.0] * 3] * 3
    with pytest.raises(pg.ShadowMismatch, match="output 'y'.*the replay gave 101.0, the eager padded path gives 1.0"):
        r(h=torch.ones(3, 3))                          # sampled: its run rewrote the output memory
    with pytest.raises(pg.StaleOutputError, match="call 1"):
        first.y.sum()
    assert r(h=torch.ones(3, 3) * 2).y.tolist() == [[2.0] * 3] * 3      # not sampled: still usable


def test_float_tolerance_is_relative_to_the_rows_scale():
    """A GEMM picked by row count rounds an element that cancels to near zero by many of its own
    ulps (bf16 K rows on a GPU, 15 rows against 16): within the row's scale, no finding. A row a
    padded lane overwrote differs by the row's scale: a finding, naming that row."""
    from padgraph.shadow import Shadow, _first_difference
    b = torch.tensor([[0.5, -0.25, 0.002, 0.125], [0.3, 0.1, -0.2, 0.05]], dtype=torch.bfloat16)
    a = b.clone()
    a[0, 2] = 0.0027                                   # ~90 of its own ulps, 0.1 % of the row's max
    assert _first_difference(a, b, Shadow()) is None
    a[1] = torch.tensor([0.31, -0.4, 0.7, 0.05], dtype=torch.bfloat16)   # a row rewritten
    assert _first_difference(a, b, Shadow())[0] == 1
    v = torch.tensor([0.002, 0.5], dtype=torch.bfloat16)                  # 1-d: each element's own scale
    assert _first_difference(v + torch.tensor([0.0007, 0.0], dtype=torch.bfloat16), v, Shadow()) == (0,)


# ---- rounding that depends on the row count, complex values, bool state ---------------------

def _rows_round(y):
    """A GEMM picked by row count: with more than one row every element moves by 5e-7 of its
    row's largest value (CPU BLAS does so at 1 row against 2; cuBLAS at 15 against 16), far
    beyond the own ulps of an element that cancels to near zero. (On top of the real GEMM's own
    row-count rounding, up to about 3e-7 of the row here: the sum stays within fp32's rtol.)"""
    return y + (y.shape[0] > 1) * 5e-7 * y.abs().amax(-1, keepdim=True)


def _gemm_program(dtype):
    return pg.Program("gemm", inputs={"h": pg.Input((bs, 64), torch.float32, pad=3.0)},
                      outputs={"y": pg.Output((bs, 32), dtype)}, buckets=pg.Buckets([2, 4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_row_count_rounding_is_no_finding(dtype):
    """pg.check and the shadow scale the tolerance by the row's magnitude, complex values too."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(dtype) * 30

    def good(x):
        return {"y": _rows_round(x.h.to(dtype) @ w)}

    one = lambda gen: {"h": torch.randn(1, 64, generator=gen)}  # noqa: E731 - exact run: 1 row
    assert pg.check(_gemm_program(dtype), good, sample=one, trials=3).ok
    r = pg.compile(_gemm_program(dtype), good, shadow=pg.Shadow(every=1))
    gen = torch.Generator().manual_seed(2)
    for n in (1, 3, 1):
        r(h=torch.randn(n, 64, generator=gen))
    assert r.stats.shadow_mismatches == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_a_raw_lane_reading_a_padded_one_is_caught_whatever_the_dtype(dtype):
    def leak(x):                                   # the last row is padded when n < the bucket
        return {"y": x.h[:, :32].to(dtype) + x.h[-1, :32]}

    r = pg.compile(_gemm_program(dtype), leak, shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match=r"output 'y', lane \(0, 0\)"):
        r(h=torch.randn(1, 64))


def test_a_raw_lane_rewriting_its_row_within_rounding_is_no_padded_write():
    """A request's row written again with the value it holds: the exact run (1 row) leaves it
    bit-identical, the padded run (2 rows) moves it by rounding; not a padded lane's write."""
    tok2 = pg.Axis("tok", capacity=bs * 2)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    prog = pg.Program("rewrite", inputs={"slot": pg.Input((bs,), torch.int64, pad=0),
                                         "h": pg.Input((bs, 64), torch.float32, pad=0),
                                         "ids": pg.Input((tok2,), torch.int64, pad=0)},
                      outputs={"o": pg.Output((tok2,), torch.int64)},
                      state={"kv": pg.State(sink=0)}, buckets=pg.Buckets([1, 2, 4]))

    def body(x):
        x.kv.index_copy_(0, x.slot, _rows_round(x.h @ w))
        return {"o": x.ids + 1}

    r = pg.compile(prog, body, state={"kv": torch.zeros(16, 32)}, shadow=pg.Shadow(every=1))
    slot, h = torch.tensor([5]), torch.randn(1, 64)
    r(slot=slot, h=h, ids=torch.tensor([7]))                 # bucket 1: writes row 5
    r(slot=slot, h=h, ids=torch.tensor([7, 8, 9]))           # bucket 2: the same write again
    assert r.stats.shadow_mismatches == 0


def test_shadow_restores_a_bool_states_canary_byte_for_byte():
    """The shadow's snapshot and restore copy bool state by its bytes: a copy of a bool tensor
    turns the canary's sentinel byte into 1, which the next check would report as a write."""
    prog = pg.Program("flags", inputs={"slot": pg.Input((bs,), torch.int64, pad=0),
                                       "m": pg.Input((bs,), torch.bool, pad=False)},
                      outputs={"o": pg.Output((bs,), torch.bool)},
                      state={"flags": pg.State(sink=0, canary=1)}, buckets=pg.Buckets([2, 4]))

    def body(x):
        x.flags.index_copy_(0, x.slot, x.m)
        return {"o": ~x.m}

    flags = torch.zeros(8, dtype=torch.bool)
    r = pg.compile(prog, body, state={"flags": flags}, canary=True, shadow=pg.Shadow(every=1))
    sentinel = flags.view(torch.uint8)[1].item()
    for slots in ([2, 3], [4, 5, 6], [2]):
        r(slot=torch.tensor(slots), m=torch.ones(len(slots), dtype=torch.bool))
    r.canary_check()
    assert flags.view(torch.uint8)[1].item() == sentinel != 1


def test_a_read_past_the_extent_that_fails_unpadded_is_a_mismatch():
    """An off-by-one last-token gather: padded it reads a pad lane, unpadded it indexes out of
    bounds. The shadow reports it (as pg.check does) instead of skipping the exact comparison."""
    tok4 = pg.Axis("tok", capacity=bs * 4)
    prog = pg.Program("last_tok", inputs={"hidden": pg.Input((tok4, 4), torch.float32, pad=0),
                                          "seq_lens": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"h_last": pg.Output((bs, 4), torch.float32)},
                      buckets=pg.Buckets([1, 2, 4, 8]))

    def good(x):
        return {"h_last": x.hidden[x.seq_lens.cumsum(0) - 1]}

    def bad(x):
        idx = x.seq_lens.cumsum(0) - 1
        return {"h_last": x.hidden[torch.where(torch.arange(idx.shape[0]) == x.extent("bs") - 1,
                                               idx + 1, idx)]}

    lens = torch.tensor([2, 1, 3, 2, 1])
    raw = {"hidden": torch.randn(int(lens.sum()), 4), "seq_lens": lens}
    ok = pg.compile(prog, good, shadow=pg.Shadow(every=1))
    ok(**raw)
    assert ok.stats.shadow_mismatches == 0 and ok.stats.shadow_exact_skipped == 0
    with pytest.raises(pg.ShadowMismatch, match="indexed out of bounds"):
        pg.compile(prog, bad, shadow=pg.Shadow(every=1))(**raw)


def test_a_device_extent_output_returned_from_state_keeps_its_pad_out_of_the_state():
    """A body returning (a view of) state along a device-extent axis: the output's pad goes in the
    caller's copy, and the shadow's eager run must mask a copy too, not the state it compares."""
    toks = pg.Axis("tok", capacity=bs * 2, device_extent=True)
    prog = pg.Program("state_rows_out", inputs={"h": pg.Input((toks,), torch.float32, pad=0.0),
                                                "r": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"g": pg.Output((toks,), torch.float32, pad=-1.0)},
                      state={"buf": pg.State()}, buckets=pg.Buckets([2, 4]))

    def body(x):        # raw lanes add to their own rows of buf; padded lanes leave theirs
        rows = x.buf[:x.h.shape[0]]
        rows.copy_(torch.where(torch.arange(rows.shape[0]) < x.extent("tok"), rows + x.h, rows))
        return {"g": rows}

    for shadow in (None, pg.Shadow(every=1)):
        buf = torch.full((8,), 10.0)
        runner = pg.compile(prog, body, backend="reference", state={"buf": buf}, shadow=shadow)
        out = runner.call({"h": torch.ones(4), "r": torch.zeros(2, dtype=torch.int64)},
                          extents={"tok": torch.tensor(2, dtype=torch.int32)})
        assert out.g.tolist() == [11.0, 11.0, -1.0, -1.0]
        assert buf.tolist() == [11.0, 11.0] + [10.0] * 6


def test_a_device_extent_fed_back_from_the_runner_is_verified_not_stale():
    """A loop passing the previous call's output as the next call's device extent (its own
    valid length): the shadow reads the extent as the call found it."""
    toks = pg.Axis("tok", capacity=bs * 4, device_extent=True)
    prog = pg.Program("chain", inputs={"h": pg.Input((toks,), torch.float32, pad=0.0),
                                       "r": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((toks,), torch.float32), "n": pg.Output((), torch.int32)},
                      buckets=pg.Buckets([2, 4]))

    def body(x):
        return {"y": x.h * 2, "n": (x.extent("tok") - 1).clamp(min=0).to(torch.int32)}

    def loop(runner):
        n, sums = torch.tensor(6, dtype=torch.int32), []
        for _ in range(3):
            out = runner.call({"h": torch.ones(8), "r": torch.zeros(2, dtype=torch.int64)},
                              extents={"tok": n})
            sums.append(out.y.sum().item())
            n = out.n
        return sums

    shadowed = pg.compile(prog, body, backend="reference", shadow=pg.Shadow(every=1))
    assert loop(shadowed) == loop(pg.compile(prog, body, backend="reference")) == [12.0, 10.0, 8.0]
    assert shadowed.stats.shadow_calls == 3 and shadowed.stats.shadow_mismatches == 0


def test_a_read_past_the_extent_through_narrow_is_caught():
    """narrow / unfold past a tensor's end raise their own messages in the exact run: those are
    out-of-bounds reads as an index's are, a mismatch, not a skipped exact run."""
    toks = pg.Axis("tok", capacity=bs * 2)
    prog = pg.Program("window", inputs={"h": pg.Input((toks,), torch.float32, pad=100.0),
                                        "start": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.float32)}, buckets=pg.Buckets([4, 8]))

    def narrowed(x):    # each request's window of 2 tokens: the last one's runs past the extent
        return {"y": torch.stack([x.h.narrow(0, int(s), 2).sum() for s in x.start])}

    def unfolded(x):
        return {"y": torch.stack([x.h[int(s):].unfold(0, 2, 1)[0].sum() for s in x.start])}

    raw = {"h": torch.arange(5, dtype=torch.float32), "start": torch.tensor([0, 2, 4])}
    runner = pg.compile(prog, narrowed, backend="reference", shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match="out of bounds"):
        runner(**raw)
    found = pg.check(prog, narrowed, trials=2, sample=lambda g: raw)
    assert any(f.kind == "pad-leakage" for f in found.findings), found
    runner = pg.compile(prog, unfolded, backend="reference", shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match="out of bounds"):
        runner(**raw)


@pytest.mark.parametrize("layout", ["bs_first", "bs_last", "bs_middle"])
def test_the_tolerance_scale_is_each_requests_own_in_every_layout(layout):
    """The row scale is taken over an output's lane of its padded dims: a GEMM's row-count
    rounding is no finding in (D, bs) or (L, bs, D) either, and one request's large value
    does not hide a leak of 5 % into another request's lane."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 30
    shape = {"bs_first": (bs, 32), "bs_last": (32, bs), "bs_middle": (2, bs, 32)}[layout]
    prog = pg.Program("laid", inputs={"h": pg.Input((bs, 64), torch.float32, pad=3.0)},
                      outputs={"y": pg.Output(shape, torch.float32)}, buckets=pg.Buckets([2, 4]))

    def lay(y):                                   # y [bs, 32] into the layout
        return {"bs_first": y, "bs_last": y.T, "bs_middle": torch.stack([y, 2 * y])}[layout]

    def good(x):                                  # CPU BLAS rounds 1 row and 2 differently
        return {"y": lay(x.h @ w)}

    def leak(x):                                  # every raw lane moves by 5 % of request 1's value
        padded = (torch.arange(x.bucket) >= x.extent("bs")).any()
        return {"y": lay(x.h @ w + 0.05 * padded * (x.h @ w)[1:2].abs())}

    one = lambda gen: {"h": torch.randn(1, 64, generator=gen)}  # noqa: E731 - exact run: 1 row
    assert pg.check(prog, good, sample=one, trials=3).ok
    r = pg.compile(prog, good, shadow=pg.Shadow(every=1))
    gen = torch.Generator().manual_seed(2)
    for n in (1, 3, 1):
        r(h=torch.randn(n, 64, generator=gen))
    assert r.stats.shadow_mismatches == 0

    big = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    big[0] *= 1e5                                 # request 0's values dwarf request 1's
    assert not pg.check(prog, leak, sample=lambda gen: {"h": big}, trials=1).ok
    r = pg.compile(prog, leak, shadow=pg.Shadow(every=1))
    with pytest.raises(pg.ShadowMismatch, match="output 'y'"):
        r(h=big)
