"""Rule 7.9: recurrent state, read-modify-written per request (a hybrid layer's conv window or SSM
state), in a slot-indexed pool with a sink or batch-ordered.

The body is the recurrence h <- 0.5 * h + x on each request's row (started from zeros on the
request's first call, flagged by the `fresh` input). The oracle is that recurrence on the CPU,
lane by lane, over the rows the requests own: 0.5 * h is exact, so every backend (and a compiled
body that fuses the multiply-add) must equal it bit for bit on the raw rows (y, a sum, within the
dtype's tolerance: rule 8.1). Released slots are
filled with nan before they are handed out again, the worst leftovers a reused slot can hold.
"""
import random
import warnings

import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
SLOTS, WIDTH, SINK = 12, 3, 0


def program(kind="pool"):
    """pool: slot-indexed with sink 0 (pad 0). clamped: pad -1 with the sink at the last row.
    rows: batch-ordered (`rows=bs`), no slot input."""
    inputs = {"x": pg.Input((bs, WIDTH), torch.float32, pad=0), "fresh": pg.Input((bs,), torch.bool, pad=True)}
    if kind == "rows":
        state = {"h": pg.State(rows=bs)}
    else:
        sink, pad = (SLOTS - 1, -1) if kind == "clamped" else (SINK, SINK)
        inputs["slot"] = pg.Input((bs,), torch.int64, pad=pad)
        state = {"h": pg.State(sink=sink)}
    return pg.Program(f"recurrent_{kind}", inputs=inputs, outputs={"y": pg.Output((bs,), torch.float32)},
                      state=state, buckets=pg.Buckets(list(S.LADDER)))


def _update(old, x, fresh):
    # select, never multiply: a reused slot may hold nan, and nan * 0 is nan
    return 0.5 * torch.where(fresh[:, None], torch.zeros_like(old), old) + x


def body(x):
    slot = x.slot
    new = _update(x.h.index_select(0, slot), x.x, x.fresh)
    x.h.index_copy_(0, slot, new)
    return {"y": new.sum(1)}


def clamped_body(x):
    """The reported bug: padded lanes marked -1 are clamped onto slot 0, a live request's row."""
    slot = x.slot.clamp(min=0)
    new = _update(x.h.index_select(0, slot), x.x, x.fresh)
    x.h.index_copy_(0, slot, new)
    return {"y": new.sum(1)}


def rows_body(x):
    new = _update(x.h, x.x, x.fresh)                       # rows [0, bucket): lane i owns row i
    x.h.copy_(new)
    return {"y": new.sum(1)}


class Pool:
    """The caller's side: admission hands out free slots (lowest first, so freed slots are reused),
    release poisons the slot with nan; `model` is the oracle's copy of every live row."""

    def __init__(self, device, seed, first=1, last=SLOTS - 1):
        self.device, self.rng = device, random.Random(seed)
        self.free = list(range(first, last + 1))
        self.live: dict[int, bool] = {}                    # slot -> has it had its first call
        self.model = torch.full((SLOTS, WIDTH), float("nan"))
        self.gen = torch.Generator().manual_seed(seed)
        self.released, self.reused = set(), 0

    def admit(self, k):
        for _ in range(min(k, len(self.free))):
            slot = self.free.pop(0)
            self.reused += slot in self.released
            self.live[slot] = False

    def release(self, state, k):
        for slot in self.rng.sample(sorted(self.live), min(k, len(self.live))):
            del self.live[slot]
            self.free.insert(0, slot)
            self.released.add(slot)
            state["h"][slot] = float("nan")               # leftovers a new occupant must never read

    def call(self, n):
        """Raw inputs for n live requests, chosen at random (others stay live, not in the call)."""
        slots = self.rng.sample(sorted(self.live), min(n, len(self.live)))
        fresh = [not self.live[s] for s in slots]
        for s in slots:
            self.live[s] = True
        x = torch.randn(len(slots), WIDTH, generator=self.gen)
        return {"slot": torch.tensor(slots).to(self.device), "x": x.to(self.device),
                "fresh": torch.tensor(fresh).to(self.device)}

    def expect(self, raw):
        """The oracle: the recurrence lane by lane on the CPU; returns the raw lanes' y."""
        ys = []
        for s, x, f in zip(raw["slot"].tolist(), raw["x"].cpu(), raw["fresh"].tolist()):
            self.model[s] = _update(self.model[s][None], x[None], torch.tensor([f]))[0]
            ys.append(self.model[s].sum())
        return torch.stack(ys)


def _check_rows(state, pool, before, raw, case):
    """Rows of started requests equal the oracle; every other non-sink row is bitwise what it was
    before (compared as bits: released rows hold nan)."""
    h = state["h"].detach().cpu()
    started = sorted(s for s, ran in pool.live.items() if ran)
    S.assert_equal("rows of live requests", h[started], pool.model[started], case)
    called = set(raw["slot"].tolist())
    untouched = [r for r in range(SLOTS) if r != SINK and r not in called]
    S.assert_equal("rows no lane of the call owns (bits)", h[untouched].view(torch.int32),
                   before[untouched].view(torch.int32), case)


def _run(runner, state, pool, raw, case):
    before = state["h"].detach().cpu().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pg.OverflowWarning)   # past the ladder: rule 3.2's eager run
        out = runner(**raw)
    S.assert_close("y", out.y.cpu(), pool.expect(raw), case)         # a sum: compiled bodies may reorder it
    _check_rows(state, pool, before, raw, case)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 9], ids=lambda n: f"raw={n}")
def test_r7_9_raw_rows_equal_the_exact_run_and_other_rows_stay(compile, device, n):
    state = {"h": torch.randn(SLOTS, WIDTH, generator=torch.Generator().manual_seed(n)).to(device)}
    pool = Pool(device, seed=n)
    pool.admit(SLOTS)
    pool.model[1:] = state["h"][1:].cpu()                  # every request continues (not fresh) ...
    for s in pool.live:
        pool.live[s] = True
    pool.live[3] = False                                   # ... but one, started in this call
    runner = compile(program(), body, state=state)
    raw = pool.call(n)
    _run(runner, state, pool, raw, f"raw={n} bucket={S.bucket_of(n)} slots={raw['slot'].tolist()}")


def test_r7_9_a_request_pool_over_calls_at_every_bucket_with_slot_reuse(compile, device):
    state = {"h": torch.zeros(SLOTS, WIDTH, device=device)}
    runner = compile(program(), body, state=state)
    pool = Pool(device, seed=7)
    for step, n in enumerate([8, 3, 1, 6, 2, 9, 4, 5, 7, 1, 8, 3]):
        if step % 3 == 2:
            pool.release(state, 3)
        pool.admit(2 if step else 9)
        raw = pool.call(n)
        _run(runner, state, pool, raw, f"step {step}: slots={raw['slot'].tolist()} fresh={raw['fresh'].tolist()}")
    assert pool.reused >= 4, S.msg("slots handed out again", pool.reused, ">= 4", "admission with releases")


def test_r7_9_a_reused_slot_starts_from_the_initial_state(compile, device):
    """The program initialises a new request's row: the old occupant's nan and inf never reach it."""
    state = {"h": torch.zeros(SLOTS, WIDTH, device=device)}
    state["h"][4] = float("nan")
    state["h"][5] = float("inf")
    runner = compile(program(), body, state=state)
    x = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]], device=device)
    out = runner(slot=torch.tensor([4, 5], device=device), x=x, fresh=torch.tensor([True, True], device=device))
    S.assert_equal("reused rows after the first call", state["h"][4:6].cpu(), 0.5 * 0 + x.cpu(), "nan / inf leftovers")
    S.assert_equal("y", out.y.cpu(), x.cpu().sum(1), "nan / inf leftovers")


@pytest.mark.parametrize("n", [1, 3, 5, 8], ids=lambda n: f"raw={n}")
def test_r7_9_batch_ordered_recurrent_state(compile, device, n):
    rows = S.LADDER[-1] + 2
    state = {"h": torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(n)).to(device)}
    before = state["h"].cpu().clone()
    runner = compile(program("rows"), rows_body, state=state)
    g = torch.Generator().manual_seed(100 + n)
    x, fresh = torch.randn(n, WIDTH, generator=g), torch.rand(n, generator=g) < 0.5
    out = runner(x=x.to(device), fresh=fresh.to(device))
    want = _update(before[:n], x, fresh)
    b, case = S.bucket_of(n), f"raw={n} bucket={S.bucket_of(n)}"
    S.assert_equal("raw rows", state["h"][:n].cpu(), want, case)
    S.assert_equal("rows past the bucket", state["h"][b:].cpu(), before[b:], case)
    S.assert_close("y", out.y.cpu(), want.sum(1), case)


def _sample(device, first, last):
    def sample(gen):
        n = int(torch.randint(1, S.LADDER[-1] + 1, (), generator=gen))
        slots = torch.randperm(last - first + 1, generator=gen)[:n] + first
        return {"slot": slots.to(device), "x": torch.randn(n, WIDTH, generator=gen).to(device),
                "fresh": (torch.rand(n, generator=gen) < 0.3).to(device)}
    return sample


def test_r7_9_check_passes_the_body_and_reports_a_clamped_pad(device):
    def state():
        return {"h": torch.randn(SLOTS, WIDTH, generator=torch.Generator().manual_seed(0)).to(device)}
    ok = pg.check(program(), body, state=state(), sample=_sample(device, 1, SLOTS - 1), trials=6)
    assert ok.ok, S.msg("pg.check findings (pad = sink slot 0)", str(ok), "none", "r7.9")
    bad = pg.check(program("clamped"), clamped_body, state=state(), sample=_sample(device, 0, SLOTS - 2), trials=6)
    kinds = {f.kind for f in bad.findings if f.buffer == "state 'h'"}
    assert "state-write" in kinds, S.msg("pg.check finding kinds (pad -1 clamped onto live slot 0)", sorted(kinds),
                                         "with 'state-write'", "r7.9")


def test_r7_9_shadow_passes_the_body_and_reports_a_clamped_pad(compile, device):
    state = {"h": torch.zeros(SLOTS, WIDTH, device=device)}
    runner = compile(program(), body, state=state, shadow=pg.Shadow(every=1))
    pool = Pool(device, seed=3)
    pool.admit(SLOTS)
    for step, n in enumerate([8, 3, 5, 1, 6]):
        _run(runner, state, pool, pool.call(n), f"shadowed step {step}")
    state = {"h": torch.randn(SLOTS, WIDTH, generator=torch.Generator().manual_seed(5)).to(device)}  # row 0: live
    runner = compile(program("clamped"), clamped_body, state=state, shadow=pg.Shadow(every=1))
    pool = Pool(device, seed=4, first=0, last=SLOTS - 2)
    pool.admit(SLOTS)
    pool.live.pop(0)                                      # slot 0 live, its request not in this call
    with pytest.raises(pg.ShadowMismatch) as e:
        runner(**pool.call(3))
    text = str(e.value)
    assert "'h'" in text and "row 0" in text, S.msg("mismatch", text, "naming state 'h', row 0", "r7.9")
