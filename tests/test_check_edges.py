"""pg.check on the runner programs: what it must see and what it must not report.

- padded lanes taking KV slots from a slot table an earlier call left (odd trials start from a
  previous call's state);
- a padded lane overwriting a raw lane's write to a sink row;
- an exact run that indexes out of bounds (raw lanes reading padded ones);
- raw lanes reading a sink slot that padded lanes of an earlier call filled (each call alone
  matches the exact run; the next call with the same raw inputs does not);
- no finding for a correct body that reads its inputs densely while the caller's raw tensors
  are not row-major (the exact run gets row-major copies, as rule 10.1 promises).
"""
import torch

import padgraph as pg
from padgraph.llm.programs import decode_program, draft_extend_program

H = 4
B = pg.Buckets([1, 2, 4, 8])
EMB = torch.randn(64, H, generator=torch.Generator().manual_seed(0))


def _kv_state(extra=None):
    st = {"k_cache": torch.zeros(64, H), "v_cache": torch.zeros(64, H), "req_to_token": torch.zeros(9, 32, dtype=torch.int32)}
    st.update(extra or {})
    return st


def _decode_sample(first_slot=None):
    def sample(gen):
        n = int(torch.randint(1, 8, (), generator=gen))
        loc = torch.randperm(63, generator=gen)[:n] + 1
        if first_slot is not None:
            loc[0] = first_slot
        return dict(input_ids=torch.randint(1, 50, (n,), generator=gen), positions=torch.randint(0, 30, (n,), generator=gen),
                    seq_lens=torch.randint(1, 30, (n,), generator=gen).int(),
                    req_pool_indices=(torch.randperm(8, generator=gen)[:n] + 1).int(), out_cache_loc=loc)
    return sample


# ---- stale metadata: padded lanes take their KV slot from metadata state built from the raw lanes only --------
def _stale_meta_program():
    state = {"k_cache": pg.State(sink=0), "v_cache": pg.State(sink=0), "req_to_token": pg.State(sink=0),
             "slot_of_lane": pg.State(sink=0)}
    return decode_program(lambda a: {"y": pg.Output((a.bs,), torch.float32)}, buckets=B, state=state)


def stale_meta_body(x):
    b = x.input_ids.shape[0]
    meta = x.slot_of_lane[:b]
    # the bug under test: the slot table is rebuilt for raw lanes only; padded lanes keep the
    # previous call's slots
    meta.copy_(torch.where(torch.arange(b) < x.extent("bs"), x.out_cache_loc, meta))
    k = EMB[x.input_ids]
    x.k_cache.index_copy_(0, meta, k)
    return {"y": k.sum(1)}


def test_fn_stale_metadata_padded_lanes_write_old_requests_slots():
    # the harm, on the reference backend: call 2 (3 raw lanes, bucket 4) overwrites a slot of call 1
    st = _kv_state({"slot_of_lane": torch.zeros(8, dtype=torch.int64)})
    r = pg.compile(_stale_meta_program(), stale_meta_body, "reference", state=st)
    raw8 = dict(input_ids=torch.arange(8) + 1, positions=torch.arange(8), seq_lens=torch.full((8,), 9, dtype=torch.int32),
                req_pool_indices=torch.arange(8, dtype=torch.int32) + 1, out_cache_loc=torch.arange(8) + 10)
    r(**raw8)
    before = st["k_cache"].clone()
    raw3 = dict(input_ids=torch.arange(3) + 1, positions=torch.arange(3), seq_lens=torch.full((3,), 9, dtype=torch.int32),
                req_pool_indices=torch.arange(3, dtype=torch.int32) + 1, out_cache_loc=torch.tensor([40, 41, 42]))
    r(**raw3)
    changed = set((st["k_cache"] != before).any(1).nonzero().flatten().tolist())
    assert 13 in changed - {40, 41, 42, 0}, changed      # padded lane 3 wrote call 1's slot 13
    # pg.check on the same program and body
    res = pg.check(_stale_meta_program(), stale_meta_body, sample=_decode_sample(), trials=16,
                   state=_kv_state({"slot_of_lane": torch.zeros(8, dtype=torch.int64)}))
    assert not res.ok, ("pg.check found nothing, but padded lanes write non-sink KV rows taken from a previous "
                        "call (state is restored between every run and no call sequence is ever tried)\n" + str(res))


# ---- a raw write to a sink: a padded lane overwrites a raw lane's write to a sink row -------------------------------
def kv_body(x):
    k = EMB[x.input_ids]
    x.k_cache.index_copy_(0, x.out_cache_loc, k)        # raw lanes first, padded lanes (slot 0) after
    return {"y": k.sum(1)}


def test_fn_padded_lane_clobbers_a_raw_write_to_the_sink():
    prog = decode_program(lambda a: {"y": pg.Output((a.bs,), torch.float32)}, buckets=B)
    # raw request 0 is (wrongly) given slot 0, the sink: at any padded size its KV is replaced by a
    # padded lane's, so the state differs from the exact run
    res = pg.check(prog, kv_body, state=_kv_state(), sample=_decode_sample(first_slot=0), trials=8)
    assert not res.ok, "a padded lane overwrote a raw lane's KV (at the sink row) and pg.check reported nothing\n" + str(res)


# ---- out-of-bounds exact run: reading a padded token into a raw output makes the exact run fail -> silently tolerated --
def _de_program():
    return draft_extend_program(3, H, torch.float32, lambda a: {"last": pg.Output((a.bs, H), torch.float32)}, buckets=B)


def _de_sample(gen):
    n = int(torch.randint(1, 8, (), generator=gen))
    acc = torch.randint(1, 5, (n,), generator=gen).int()
    qo = torch.cat([torch.zeros(1, dtype=torch.int32), acc.cumsum(0).int()])
    t = int(qo[-1])
    return dict(input_ids=torch.randint(1, 50, (t,), generator=gen), positions=torch.arange(t),
                out_cache_loc=torch.randperm(63, generator=gen)[:t] + 1, hidden_states=torch.randn(t, H, generator=gen),
                seq_lens=acc + 5, req_pool_indices=(torch.randperm(8, generator=gen)[:n] + 1).int(), accept_lens=acc, qo_indptr=qo)


def test_fn_padded_token_read_into_raw_output():
    def off_by_one(x):      # the bug: qo[i+1], not qo[i+1]-1: the last raw request reads padded token qo[n]
        return {"last": x.hidden_states[x.qo_indptr[1:].long()]}
    res = pg.check(_de_program(), off_by_one, state=_kv_state(), sample=_de_sample, trials=8)
    assert not res.ok, ("the last raw request's output is a padded token's hidden (pad 0) at every size; the exact "
                        "run raised IndexError for exactly that read, and the fallback baseline counted the padded "
                        "token as raw, so res.ok is True\n" + str(res))


# ---- no false positive: the exact run hands the body the caller's (non-dense) layout --------------------------------
def test_fp_dense_reading_body_on_transposed_raw_inputs():
    bs = pg.Axis("bs")
    prog = pg.Program("dense", inputs={"h": pg.Input((bs, 3), torch.float32, pad=0)},
                      outputs={"y": pg.Output((bs, 3), torch.float32)}, buckets=B)

    def body(x):      # reads the buffer densely, as a kernel on data_ptr does (allowed by SPEC 10.1)
        return {"y": torch.as_strided(x.h, (x.h.numel(),), (1,)).view(x.h.shape) * 2}

    def sample(gen):  # e.g. a matmul result in column-major layout
        return {"h": torch.randn(3, int(torch.randint(1, 9, (), generator=gen)), generator=gen).t()}

    r = pg.compile(prog, body, "reference")
    h = torch.randn(3, 5).t()
    assert torch.equal(r(h=h).y, h * 2)                     # correct on the backend
    res = pg.check(prog, body, sample=sample, trials=4)
    assert res.ok, ("a correct body reported: the exact run must hand it row-major inputs (10.1)\n"
                    + str(res))


# ---- a sink read before the padded lanes write it: only the next call shows it ---------------------------------
def _sink_reader(x):
    y = x.input_ids.float() + x.k_cache[0].sum()          # BUG: raw lanes read the sink slot
    x.k_cache.index_copy_(0, x.out_cache_loc, EMB[x.input_ids] + 1.0)   # padded lanes fill slot 0
    return {"y": y}


def _sink_writer(x):                                      # correct: the sink is written, never read
    x.k_cache.index_copy_(0, x.out_cache_loc, EMB[x.input_ids] + 1.0)
    return {"y": x.input_ids.float() + x.k_cache[x.out_cache_loc].sum(1)}


def _y_program():
    return decode_program(lambda a: {"y": pg.Output((a.bs,), torch.float32)}, buckets=B)


def test_check_sees_raw_lanes_read_what_padded_lanes_of_an_earlier_call_left():
    res = pg.check(_y_program(), _sink_reader, state=_kv_state(), sample=_decode_sample(), trials=8)
    assert any(f.kind == "pad-leakage" and "next call" in f.detail for f in res.findings), str(res)
    r = pg.compile(_y_program(), _sink_reader, backend="reference", state=_kv_state())
    raw = dict(input_ids=torch.tensor([5, 6, 7]), positions=torch.tensor([3, 4, 5]),
               seq_lens=torch.tensor([4, 5, 6], dtype=torch.int32),
               req_pool_indices=torch.tensor([1, 2, 3], dtype=torch.int32),
               out_cache_loc=torch.tensor([10, 11, 12]))   # 3 lanes: bucket 4, one padded lane
    first = r(**raw).y.clone()                              # its padded lane fills slot 0
    assert not torch.equal(r(**raw).y, first)               # what check reports: the same call differs


def test_check_reports_nothing_for_a_body_that_only_writes_the_sink():
    res = pg.check(_y_program(), _sink_writer, state=_kv_state(), sample=_decode_sample(), trials=8)
    assert res.ok, str(res)


def test_state_of_unsigned_dtypes_is_checked_not_crashed():
    """uint16 / uint32 / uint64 state (no index_put kernel on the CPU): pg.check compares it by
    bit pattern, with no finding on a correct batch-ordered body."""
    bs = pg.Axis("bs")
    for dtype in (torch.uint16, torch.uint32, torch.uint64):
        prog = pg.Program("unsigned", inputs={"v": pg.Input((bs,), torch.int32, pad=0)},
                          outputs={"y": pg.Output((bs,), torch.int32)},
                          state={"kv": pg.State(rows=bs)}, buckets=pg.Buckets([2, 4]))

        def body(x, dtype=dtype):
            x.kv.copy_(x.v.abs().to(dtype))          # lane i writes row i
            return {"y": x.v + 1}

        found = pg.check(prog, body, state={"kv": torch.zeros(8, dtype=dtype)}, trials=2)
        assert found.findings == [], found
