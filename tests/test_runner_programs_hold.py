"""The runner programs at edge extents (every request at capacity, 0 requests, the last bucket)
give no pad leakage or non-sink writes; pg.check catches the classic buggy bodies on them; device
extents (rule 11) clamp, pad and never show stale lanes, eager and with torch_compile=True."""
import pytest
import torch

import padgraph as pg
from padgraph.llm.programs import decode_program, draft_extend_program, extend_program, verify_program
from padgraph.llm.kv import FIRST

H, S = 4, 3
B = pg.Buckets([1, 2, 4, 8])
EMB = torch.randn(64, H, generator=torch.Generator().manual_seed(0))


def kv_state():
    return {"k_cache": torch.zeros(400, H), "v_cache": torch.zeros(400, H), "req_to_token": torch.zeros(9, 64, dtype=torch.int32)}


def body_tokens(x):      # writes KV at out_cache_loc, req_to_token at (row, seq_len-1); per-request last hidden
    k = EMB[x.input_ids] + x.positions[:, None]
    x.k_cache.index_copy_(0, x.out_cache_loc, k)
    x.req_to_token[x.req_pool_indices.long(), (x.seq_lens.long() - 1).clamp(0, 63)] = x.seq_lens
    last = (x.qo_indptr[1:] - 1).clamp(0, k.shape[0] - 1).long() if "qo_indptr" in x else None
    out = {"h": k * 2}
    if last is not None:
        out["last"] = k[last] + x.seq_lens[:, None]
    return out


def _packed(gen, lens, rows):
    qo = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    t = int(qo[-1])
    return qo, t, dict(input_ids=torch.randint(1, 60, (t,), generator=gen), positions=torch.arange(t),
                       out_cache_loc=torch.randperm(399, generator=gen)[:t] + 1)


@pytest.mark.parametrize("mode", ["all_at_capacity", "all_one", "mixed", "largest_bucket"])
def test_draft_extend_declaration_edges(mode):
    prog = draft_extend_program(S, H, torch.float32, lambda a: {"h": pg.Output((a.tokens, H), torch.float32),
                                                                 "last": pg.Output((a.bs, H), torch.float32)}, buckets=B)

    def sample(gen):
        n = 8 if mode == "largest_bucket" else int(torch.randint(1, 8, (), generator=gen))
        lens = {"all_at_capacity": torch.full((n,), S + 1), "all_one": torch.ones(n)}.get(
            mode, torch.randint(1, S + 2, (n,), generator=gen)).int()
        qo, t, d = _packed(gen, lens, None)
        return dict(d, hidden_states=torch.randn(t, H, generator=gen), seq_lens=lens + 5,
                    req_pool_indices=(torch.randperm(8, generator=gen)[:n] + 1).int(), accept_lens=lens, qo_indptr=qo)
    res = pg.check(prog, body_tokens, state=kv_state(), sample=sample, trials=6)
    assert res.ok, str(res)


@pytest.mark.parametrize("mode", ["zero_requests", "one_token_each", "mixed", "last_bucket"])
def test_extend_declaration_edges(mode):
    prog = extend_program(lambda a: {"h": pg.Output((a.tokens, H), torch.float32), "last": pg.Output((a.bs, H), torch.float32)},
                          buckets=pg.Buckets([16, 24, 32, 48]))

    def sample(gen):
        if mode == "zero_requests":
            lens = torch.zeros(0, dtype=torch.int32)
        elif mode == "one_token_each":
            lens = torch.ones(int(torch.randint(1, 9, (), generator=gen)), dtype=torch.int32)
        elif mode == "last_bucket":
            lens = torch.full((8,), 6, dtype=torch.int32)
        else:
            lens = torch.randint(1, 7, (int(torch.randint(1, 8, (), generator=gen)),), generator=gen).int()
        n = lens.shape[0]
        qo, t, d = _packed(gen, lens, None)
        if t == 0:                                  # the bucketed axis needs >= 1 token
            d = dict(input_ids=torch.tensor([3]), positions=torch.tensor([0]), out_cache_loc=torch.tensor([7]))
        return dict(d, seq_lens=lens.clamp_min(1), req_pool_indices=(torch.randperm(8, generator=gen)[:n] + 1).int(), qo_indptr=qo)
    res = pg.check(prog, body_tokens, state=kv_state(), sample=sample, trials=6)
    assert res.ok, str(res)


def test_verify_and_decode_declarations_at_the_largest_bucket():
    k = 5
    v = verify_program(k, lambda a: {"h": pg.Output((a.bs * k, H), torch.float32)}, buckets=B)
    d = decode_program(lambda a: {"h": pg.Output((a.bs, H), torch.float32)}, buckets=B)

    def sample(per):
        def s(gen):
            n = int(torch.randint(1, 9, (), generator=gen))
            raw = dict(input_ids=torch.randint(1, 60, (n * per,), generator=gen), positions=torch.randint(0, 30, (n * per,), generator=gen),
                       out_cache_loc=torch.randperm(399, generator=gen)[:n * per] + 1, seq_lens=torch.randint(1, 40, (n,), generator=gen).int(),
                       req_pool_indices=(torch.randperm(8, generator=gen)[:n] + 1).int())
            if per > 1:
                raw["tree_mask"] = torch.randint(0, 2, (n, per, per), generator=gen).bool()
            return raw
        return s
    for prog, per in [(v, k), (d, 1)]:
        res = pg.check(prog, body_tokens, state=kv_state(), sample=sample(per), trials=6)
        assert res.ok, str(res)


def test_check_reports_classic_buggy_bodies():
    prog = decode_program(lambda a: {"y": pg.Output((a.bs,), torch.float32)}, buckets=B)

    def sample(gen):
        n = int(torch.randint(1, 8, (), generator=gen))
        return dict(input_ids=torch.randint(1, 50, (n,), generator=gen), positions=torch.randint(0, 30, (n,), generator=gen),
                    seq_lens=torch.randint(1, 30, (n,), generator=gen).int(),
                    req_pool_indices=(torch.randperm(8, generator=gen)[:n] + 1).int(), out_cache_loc=torch.randperm(63, generator=gen)[:n] + 1)

    def non_sink(x):
        x.k_cache.index_copy_(0, x.out_cache_loc + (x.out_cache_loc == 0).long() * 5, EMB[x.input_ids])
        return {"y": EMB[x.input_ids].sum(1)}

    def leak(x):
        return {"y": EMB[x.input_ids].sum(1) + x.seq_lens.sum()}

    def leak_roll(x):
        return {"y": EMB[x.input_ids.roll(-1)].sum(1)}

    def rnd(x):
        return {"y": EMB[x.input_ids].sum(1) + torch.rand(x.input_ids.shape)}

    def good(x):
        x.k_cache.index_copy_(0, x.out_cache_loc, EMB[x.input_ids])
        return {"y": EMB[x.input_ids].sum(1)}
    want = {non_sink: "state-write", leak: "pad-leakage", leak_roll: "pad-leakage", rnd: "nondeterminism"}
    for b, kind in want.items():
        res = pg.check(prog, b, state=kv_state(), sample=sample, trials=8)
        assert kind in {f.kind for f in res.findings}, (b.__name__, str(res))
    assert pg.check(prog, good, state=kv_state(), sample=sample, trials=8).ok


@pytest.mark.parametrize("tc", [None, True])
def test_device_extents_repeated_calls(tc):
    prog = draft_extend_program(S, H, torch.float32, lambda a: {
        "y": pg.Output((a.tokens,), torch.int64, pad=-7), "g": pg.Output((a.tokens, H), torch.float32, pad=float("nan")),
        "c": pg.Output((a.bs,), torch.int64)}, buckets=pg.Buckets([1, 2, 4]))
    st = kv_state()

    def body(x):
        x.k_cache.index_copy_(0, x.out_cache_loc, x.hidden_states)
        live = torch.arange(x.input_ids.shape[0]) < x.extent("tokens")
        return {"y": x.input_ids * 10 + 1, "g": x.hidden_states * 2,
                "c": x.seq_lens.long() * 0 + live.sum() + x.input_ids.sum()}
    r = pg.compile(prog, body, "reference", state=st, torch_compile=tc)
    cases = [(3, 12), (3, 7), (3, 2), (3, 0), (3, -5), (3, 100), (4, 3), (4, 16)] + ([] if tc else [(1, 4), (1, 0)])
    for n, e in cases:   # compiled: bucket 4 only (one graph; keeps the test short)
        m = n * (S + 1)
        st["k_cache"][FIRST:].zero_()              # slot 0 the sink, 1 the canary: not the test's
        raw = dict(input_ids=torch.arange(m) + 1, positions=torch.arange(m), out_cache_loc=torch.arange(m) + FIRST,
                   hidden_states=torch.randn(m, H), seq_lens=torch.full((n,), 5, dtype=torch.int32),
                   req_pool_indices=torch.arange(n, dtype=torch.int32) + FIRST, accept_lens=torch.ones(n, dtype=torch.int32),
                   qo_indptr=torch.arange(n + 1, dtype=torch.int32))
        out = r.call(raw, extents={"tokens": torch.tensor(e, dtype=torch.int32)})
        f = min(max(e, 0), m)
        want_y = torch.full((m,), -7)
        want_y[:f] = raw["input_ids"][:f] * 10 + 1
        assert torch.equal(out.y, want_y), (n, e)
        assert torch.equal(out.g[:f], raw["hidden_states"][:f] * 2) and out.g[f:].isnan().all(), (n, e)
        assert torch.equal(out.c, torch.full((n,), f + int((torch.arange(f) + 1).sum()))), (n, e)
        want_kv = torch.zeros(400, H)
        want_kv[raw["out_cache_loc"][:f]] = raw["hidden_states"][:f]
        assert torch.equal(st["k_cache"][FIRST:], want_kv[FIRST:]), (n, e)


def test_device_extent_bad_values_rejected_before_anything_runs():
    prog = draft_extend_program(S, H, torch.float32, lambda a: {"y": pg.Output((a.tokens,), torch.int64)}, buckets=pg.Buckets([1, 2, 4]))
    calls = []
    r = pg.compile(prog, lambda x: calls.append(1) or {"y": x.input_ids}, "reference", state=kv_state())
    m = 8
    raw = dict(input_ids=torch.arange(m), positions=torch.arange(m), out_cache_loc=torch.arange(m), hidden_states=torch.randn(m, H),
               seq_lens=torch.ones(2, dtype=torch.int32), req_pool_indices=torch.ones(2, dtype=torch.int32),
               accept_lens=torch.ones(2, dtype=torch.int32), qo_indptr=torch.arange(3, dtype=torch.int32))
    for bad in [torch.tensor(3), torch.tensor(3, dtype=torch.int32, device="meta"), torch.tensor([3], dtype=torch.int32),
                torch.tensor(3.0), torch.tensor(True), 3]:
        with pytest.raises(pg.ContractError):
            r.call(raw, extents={"tokens": bad})
    with pytest.raises(pg.ContractError):
        r.call(raw, extents={"bs": torch.tensor(1, dtype=torch.int32)})
    assert not calls and dict(r.stats.calls) == {}
