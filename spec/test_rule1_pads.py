"""Rule 1: every padded lane holds its declared pad value, on every call (SPEC.md §1)."""
import random

import pytest
import torch

import padgraph as pg
from padgraph.spec import programs as P
from padgraph.spec import support as S

CASES = P.extent_cases()


def test_r1_1_pad_must_be_declared():
    bs = pg.Axis("bs")
    with pytest.raises(pg.ContractValueError) as e:
        pg.Program("nopad", inputs={"seq_lens": pg.Input((bs,), torch.int32)})
    for part in ("'nopad'", "'seq_lens'", "pad="):
        assert part in str(e.value), S.msg("message", str(e.value), f"naming {part}", "r1.1")


@pytest.mark.parametrize("label,n,n_tok", CASES, ids=S.ids(CASES))
def test_r1_2_padded_view(compile, device, label, n, n_tok):
    program = P.pads_program()
    state = P.pads_state(program, device)
    runner = compile(program, P.probing_body, state=state)
    raw = P.pads_raw(n, n_tok, device, seed=n * 100 + n_tok)
    out = runner(**raw)
    P.check_probes(program, state, raw, n, n_tok, label)
    S.assert_equal("y", out.y, raw["seq_lens"], label)


@pytest.mark.parametrize("seed", [0, 1])
def test_r1_3_no_stale_tails(compile, device, seed):
    """Calls of shrinking and growing extents, a body that scribbles over its padded inputs in
    place, and a hook that does so on odd calls: each call still sees exactly its padded view."""
    program = P.pads_program()
    state = P.pads_state(program, device)
    calls = {"n": 0}

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        calls["n"] += 1
        if calls["n"] % 2 == 1:
            return
        x.topk.fill_(-5)          # the body of this call reads -5 everywhere (rule 4.2) ...
        x.ids.fill_(-6)           # ... and no later call may see it (rule 1.3)

    runner = compile(program, lambda x: P.probing_body(x, mutate=True), state=state, prepare=prepare)
    rng = random.Random(seed)
    seq = [8, 5, 8, 3, 4, 1, 7, 2, 6] + [rng.randint(1, 8) for _ in range(4)]
    for i, n in enumerate(seq):
        n_tok = rng.randint(0, 2 * S.fit(program, {"bs": n, "tok": 0}))
        raw = P.pads_raw(n, n_tok, device, seed=1000 * seed + i)
        runner(**raw)
        case = f"call {i}: bs={n}, tok={n_tok}"
        if (i + 1) % 2 == 0:   # the hook wrote this call's view: the body must have read that
            size = S.fit(program, {"bs": n, "tok": n_tok})
            S.assert_equal("topk as written by the hook", S.read_probe(state["p_topk"], (4 * size,)),
                           torch.full((4 * size,), -5, dtype=torch.int64), case)
            raw = dict(raw, topk=torch.full((4 * n,), -5, dtype=torch.int64),
                       ids=torch.full((n_tok,), -6, dtype=torch.int64))
            # pads of topk/ids are then -5/-6 too: the hook overwrote whole tensors
            raw_pads = {"topk": pg.Fill(-5), "ids": pg.Fill(-6)}
            _check_with_pads(program, state, raw, n, n_tok, case, raw_pads)
        else:
            P.check_probes(program, state, raw, n, n_tok, case)


def _check_with_pads(program, state, raw, n, n_tok, case, overrides):
    size = S.fit(program, {"bs": n, "tok": n_tok})
    for name, spec in P.PAD_INPUTS.items():
        shape = S.padded_shape(program, name, size)
        pad = overrides.get(name, spec.pad)
        want = S.expected_padded(raw[name], shape, pad, S.dims_of(program, name))
        S.assert_equal(f"padded view of {name!r}", S.read_probe(state[f"p_{name}"], shape), want, case)
