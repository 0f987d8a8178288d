"""Rule 8: results equal the reference backend; raw-lane outputs do not depend on the bucket.

On the reference backend itself the expectation is computed by hand from SPEC.md's padded view.
"""

import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2)
SLOTS, D = 40, 6


def program(ladder=S.LADDER):
    return pg.Program(
        "mix",
        inputs={"a": pg.Input((bs,), torch.int64, pad=0), "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
                "loc": pg.Input((bs,), torch.int64, pad=0), "h": pg.Input((bs, D), torch.float32, pad=0),
                "ids": pg.Input((tok,), torch.int64, pad=0)},
        outputs={"y": pg.Output((bs,), torch.int64), "f": pg.Output((bs, D), torch.float32),
                 "s": pg.Output((bs,), torch.int64), "lens": pg.Output((bs,), torch.int32),
                 "e": pg.Output((tok, D), torch.float32)},
        state={"w": pg.State(), "kv": pg.State(sink=0), "emb": pg.State()},
        buckets=pg.Buckets(list(ladder)),
    )


def body(x):
    """Row-independent: no raw lane of an output reads a padded lane (cumsum reads a prefix)."""
    f = torch.tanh(x.h @ x.w)                                    # [bs, D]
    x.kv.index_copy_(0, x.loc, f)                                 # padded lanes write sink row 0
    return {"y": x.a * 3 + 1, "f": f, "s": torch.cumsum(x.a, 0), "lens": x.cu[1:] - x.cu[:-1],
            "e": x.emb.index_select(0, x.ids) + x.kv[1:2]}


def by_hand(raw, st):
    """What rule 8.1 requires of the reference, written without padgraph."""
    a, cu, loc, h, ids = (raw[k].cpu() for k in ("a", "cu", "loc", "h", "ids"))
    w, kv, emb = (st[k].cpu().clone() for k in ("w", "kv", "emb"))
    f = torch.tanh(h @ w)
    kv[loc] = f
    out = {"y": a * 3 + 1, "f": f, "s": torch.cumsum(a, 0), "lens": cu[1:] - cu[:-1],
           "e": emb[ids] + kv[1:2]}
    return out, kv


def state(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(D, D, generator=g).to(device), "kv": torch.zeros(SLOTS, D).to(device),
            "emb": torch.randn(50, D, generator=g).to(device)}


def raw_inputs(n, n_tok, device, seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(-50, 50, (n,), generator=g).to(device),
            "cu": torch.cumsum(torch.randint(0, 9, (n + 1,), generator=g), 0).int().to(device),
            "loc": (torch.randperm(SLOTS - 1, generator=g)[:n] + 1).to(device),
            "h": torch.randn(n, D, generator=g).to(device),
            "ids": torch.randint(0, 50, (n_tok,), generator=g).to(device)}


def _cases():
    out = []
    for label, n in S.extents(n_random=4, seed=8):
        out.append((label, n, min(2 * n, 5)))
    return out + [("tok-decides", 1, 7), ("tok=0", 4, 0)]


CASES = _cases()


@pytest.mark.parametrize("label,n,n_tok", CASES, ids=[c[0] for c in CASES])
def test_r8_1_equals_reference(compile, reference, backend, device, label, n, n_tok):
    raw = raw_inputs(n, n_tok, device, seed=n * 31 + n_tok)
    st = state(device)
    runner = compile(program(), body, state=st)
    if backend == "reference":
        want, want_kv = by_hand(raw, state(device))
    else:
        ref_state = state(device)
        ref_out = reference(program(), body, state=ref_state)(**raw)
        want, want_kv = {k: v.clone() for k, v in ref_out.items()}, ref_state["kv"]
    out = runner(**raw)
    for name, t in want.items():
        S.assert_close(f"output {name!r}", out[name], t, label)
    S.assert_close("state 'kv' (sink row 0 excluded)", st["kv"][1:], want_kv[1:], label)


@pytest.mark.parametrize("ladder", [(8,), (1, 8), (3, 5, 8), (2, 4, 6, 8)], ids=str)
def test_r8_2_pad_invariance(compile, device, ladder):
    """The same raw inputs on a different ladder (so a different bucket) give the same outputs."""
    base = compile(program(), body, state=state(device))
    other = compile(program(ladder), body, state=state(device))
    for n, n_tok in [(1, 0), (1, 2), (2, 3), (3, 6), (5, 1), (7, 14), (8, 16)]:
        raw = raw_inputs(n, n_tok, device, seed=n)
        want = {k: v.clone() for k, v in base(**raw).items()}
        got = other(**raw)
        for name, t in want.items():
            S.assert_close(f"output {name!r}", got[name], t, f"ladder {list(ladder)}, bs={n}, tok={n_tok}")


def _check_sample(device):
    def sample(gen):
        n = int(torch.randint(1, S.LADDER[-1] + 1, (), generator=gen))
        n_tok = int(torch.randint(0, 2 * n + 1, (), generator=gen))
        return raw_inputs(n, n_tok, device, seed=int(torch.randint(0, 1 << 30, (), generator=gen)))
    return sample


def test_r8_2_check_clean_leaky_and_nondeterministic(device):
    clean = pg.check(program(), body, state=state(device), sample=_check_sample(device), trials=6)
    assert clean.ok, S.msg("pg.check findings of a row-independent body", str(clean), "none", "r8.2")

    def leaky(x):                                      # every lane reads every lane, pads included
        out = body(x)
        out["y"] = out["y"] + x.a.sum() + x.a.shape[0]
        return out

    found = pg.check(program(), leaky, state=state(device), sample=_check_sample(device), trials=6)
    kinds = {f.kind for f in found.findings}
    assert "pad-leakage" in kinds, S.msg("pg.check finding kinds of a leaky body", sorted(kinds), "with 'pad-leakage'", "r8.2")

    calls = {"n": 0}

    def flaky(x):
        calls["n"] += 1
        out = body(x)
        out["y"] = out["y"] + calls["n"]
        return out

    found = pg.check(program(), flaky, state=state(device), sample=_check_sample(device), trials=3)
    kinds = {f.kind for f in found.findings}
    assert "nondeterminism" in kinds, S.msg("pg.check finding kinds of a flaky body", sorted(kinds), "with 'nondeterminism'", "r8.2")
