"""Rule 7.7: batch-ordered state (`pg.State(rows=bs)`), e.g. a model's own per-request cache.

Raw lane i owns row i; the body sees every leaf cut to rows [0, bucket) and the structure rebuilt
around those views; rows past the bucket are never touched; pg.check verifies rows [0, n) and
allows padded lanes to write only their own rows [n, bucket).
"""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
ROWS = 12


class Cache:
    """A library's cache class torch's pytree does not know: given a flatten/unflatten pair."""

    def __init__(self, keys, values, step):
        self.keys, self.values, self.step = keys, values, step


def flatten(c):
    return [c.keys, c.values], c.step


def unflatten(leaves, step):
    return Cache(leaves[0], leaves[1], step)


def program(shift=0):
    return pg.Program(
        f"rows{shift}",
        inputs={"tok": pg.Input((bs,), torch.int64, pad=0), "pos": pg.Input((bs,), torch.int64, pad=0)},
        outputs={"y": pg.Output((bs,), torch.int64), "seen": pg.Output((2,), torch.int64)},
        state={"cache": pg.State(rows=bs, flatten=flatten, unflatten=unflatten),
               "kv": pg.State(rows=bs)},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body_of(shift):
    def body(x):
        n_rows = x.cache.keys.shape[0]                         # the bucket
        lanes = (torch.arange(n_rows, device=x.tok.device) + shift) % n_rows
        x.cache.keys[lanes, x.pos] = x.tok                     # lane i writes row (i + shift)
        x.cache.values[lanes] += 1
        x.kv["a"][lanes] = x.tok * 10
        y = x.cache.keys.sum(1) + x.kv["a"]
        seen = x.tok.new_full((2,), n_rows)
        seen[1:] = x.kv["a"].shape[0]                          # no host tensor: capturable
        return {"y": y, "seen": seen}
    return body


def _state(device):
    cache = Cache(torch.zeros(ROWS, 4, dtype=torch.int64, device=device),
                  torch.zeros(ROWS, dtype=torch.int64, device=device), step=3)
    return {"cache": cache, "kv": {"a": torch.full((ROWS,), -1, dtype=torch.int64, device=device)}}


@pytest.mark.parametrize("n", [1, 3, 5, 8], ids=lambda n: f"n{n}")
def test_r7_7_raw_rows_take_the_raw_lanes_and_rows_past_the_bucket_stay(compile, device, n):
    st = _state(device)
    runner = compile(program(), body_of(0), state=st)
    tok = S.ints((n,), 1, 9, torch.int64, device, n)
    pos = S.ints((n,), 0, 4, torch.int64, device, n + 1)
    out = runner(tok=tok, pos=pos)
    b = S.bucket_of(n)
    S.assert_equal("rows the body saw", out.seen.cpu().tolist(), [b, b], f"n={n}")
    keys = st["cache"].keys.cpu()
    want = torch.zeros(ROWS, 4, dtype=torch.int64)
    want[torch.arange(n), pos.cpu()] = tok.cpu()
    S.assert_equal("cache.keys raw rows", keys[:n], want[:n], f"n={n}")
    S.assert_equal("cache.keys rows past the bucket", keys[b:], want[b:], f"n={n} bucket={b}")
    S.assert_equal("kv['a'] rows past the bucket", st["kv"]["a"].cpu()[b:], torch.full((ROWS - b,), -1), f"n={n}")
    S.assert_equal("y", out.y.cpu(), tok.cpu() + tok.cpu() * 10, f"n={n}")


def test_r7_7_too_few_rows_is_refused_at_compile(compile, device):
    st = _state(device)
    st["kv"] = {"a": torch.zeros(S.LADDER[-1] - 1, dtype=torch.int64, device=device)}
    with pytest.raises(pg.ContractValueError, match="'rows0'.*kv"):
        compile(program(), body_of(0), state=st)


def test_r7_7_rows_must_be_the_bucketed_axis_and_exclude_sinks():
    tok = pg.Axis("tokens", capacity=bs * 2)
    with pytest.raises(pg.ContractValueError, match="rows"):
        pg.Program("bad", inputs={"t": pg.Input((tok,), torch.int64, pad=0), "b": pg.Input((bs,), torch.int64, pad=0)},
                   state={"c": pg.State(rows=tok)})
    with pytest.raises(pg.ContractValueError, match="sink"):
        pg.Program("bad", inputs={"b": pg.Input((bs,), torch.int64, pad=0)}, state={"c": pg.State(rows=bs, sink=0)})


def _sample(device):
    def sample(gen):
        n = int(torch.randint(1, S.LADDER[-1] + 1, (), generator=gen))
        return {"tok": torch.randint(1, 9, (n,), generator=gen).to(device),
                "pos": torch.randint(0, 4, (n,), generator=gen).to(device)}
    return sample


def _bucket_blind(shift):
    """The body without its `seen` output (which reports the bucket on purpose)."""
    inner = body_of(shift)

    def body(x):
        out = inner(x)
        return {"y": out["y"], "seen": torch.zeros_like(out["seen"])}
    return body


def test_r7_7_check_accepts_own_rows_and_finds_a_padded_lane_writing_a_real_row(device):
    ok = pg.check(program(), _bucket_blind(0), state=_state(device), sample=_sample(device), trials=6)
    assert ok.ok, str(ok)
    bad = pg.check(program(1), _bucket_blind(1), state=_state(device), sample=_sample(device), trials=6)
    kinds = {f.kind for f in bad.findings}
    assert "state-write" in kinds or "state-leakage" in kinds, str(bad)
