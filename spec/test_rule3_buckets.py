"""Rule 3: the bucket is the smallest ladder entry that holds every axis (SPEC.md §3)."""
import random

import warnings

import pytest

import padgraph as pg
from padgraph.spec import programs as P
from padgraph.spec import support as S


def _brute_bucket(ladder, n, n_tok):
    """Smallest b on the ladder with b >= n and 2b >= n_tok, or None (tok has capacity bs * 2)."""
    return next((b for b in ladder if b >= n and 2 * b >= n_tok), None)


def _cases(seed=3, n_random=12):
    rng = random.Random(seed)
    cases = [(1, 0), (1, 2), (1, 3), (2, 2), (2, 5), (3, 1), (4, 8), (4, 9), (5, 10), (8, 16), (1, 16)]
    cases += [(rng.randint(1, 8), rng.randint(0, 16)) for _ in range(n_random)]
    return cases


@pytest.mark.parametrize("n,n_tok", _cases(), ids=[f"bs={a},tok={b}" for a, b in _cases()])
def test_r3_1_smallest_bucket_holding_every_axis(compile, device, n, n_tok):
    program = P.pads_program()
    state = P.pads_state(program, device)
    runner = compile(program, P.probing_body, state=state)
    runner(**P.pads_raw(n, n_tok, device, seed=n_tok))
    want = _brute_bucket(S.LADDER, n, n_tok)
    case = f"ladder {list(S.LADDER)}, bs={n}, tok={n_tok}"
    S.assert_equal("x.bucket", int(state["p_bucket"][0]), want, case)
    S.assert_equal("padded shape of ids (tok)", int((state["p_ids"] != S.SENTINEL).sum()), 2 * want, case)
    S.assert_equal("padded shape of seq_lens (bs)", int((state["p_seq_lens"] != S.SENTINEL).sum()), want, case)


def test_r3_2_overflow_eager(compile, device):
    """Past the ladder: run at the exact fitting size, count it, warn once (pg.OverflowWarning,
    a Python warning that warning filters see), results still right."""
    program = P.pads_program()
    state = P.pads_state(program, device)
    runner = compile(program, P.probing_body, state=state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (n, n_tok) in enumerate([(9, 3), (8, 17), (10, 20)]):
            raw = P.pads_raw(n, n_tok, device, seed=i)
            out = runner(**raw)
            case = f"bs={n}, tok={n_tok} past ladder {list(S.LADDER)}"
            P.check_probes(program, state, raw, n, n_tok, case)
            S.assert_equal("y", out.y, raw["seq_lens"], case)
            S.assert_equal("stats.eager_fallbacks", runner.stats.eager_fallbacks, i + 1, case)
    warned = [w for w in caught if issubclass(w.category, pg.OverflowWarning)]
    S.assert_equal("overflow warnings", len(warned), 1, "three overflowing calls")
    assert "past the largest bucket" in str(warned[0].message), str(warned[0].message)
    out = runner(**P.pads_raw(3, 2, device, seed=9))       # and back on the ladder
    S.assert_equal("bucket after overflow", int(state["p_bucket"][0]), 4, "bs=3 after overflow")


def test_r3_2_overflow_error(compile, device):
    program = P.pads_program()
    runner = compile(program, P.probing_body, state=P.pads_state(program, device), overflow="error")
    with pytest.raises(pg.BucketOverflowError) as e:
        runner(**P.pads_raw(9, 0, device, seed=0))
    for part in ("'pads'", "bs", "8", "9"):
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", "bs=9")
    S.assert_equal("stats.eager_fallbacks", runner.stats.eager_fallbacks, 0, "overflow=error")


@pytest.mark.parametrize("sizes,kw", [([], {}), ([0, 1], {}), ([2, 1], {}), ([1, 1], {}), ([1, 2.0], {}),
                                      ([2, 3], {"multiple_of": 2}), ([-1], {})])
def test_r3_3_ladder_validation(sizes, kw):
    with pytest.raises(ValueError):
        pg.Buckets(sizes, **kw)


def test_r3_3_ladders():
    S.assert_equal("Buckets.pow2(40)", list(pg.Buckets.pow2(40)), [1, 2, 4, 8, 16, 32], "pow2")
    d = list(pg.Buckets.default(320))
    want = [1, 2, 4, 8, 12, 16, 24] + list(range(32, 257, 8)) + list(range(272, 321, 16))
    S.assert_equal("Buckets.default(320)", d, want, "default ladder")
    S.assert_equal("Buckets.default(300)[-1]", pg.Buckets.default(300)[-1], 300, "ends at its maximum")
    S.assert_equal("Buckets([2, 4], multiple_of=2)", list(pg.Buckets([2, 4], multiple_of=2)), [2, 4], "multiple_of")
