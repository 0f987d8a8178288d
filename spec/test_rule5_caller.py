"""Rule 5: the caller's tensors are never written, whether the call succeeds or raises."""
import pytest

import padgraph as pg

from padgraph.spec import programs as P
from padgraph.spec import support as S


class HookFailed(Exception):
    """A user error raised by a prepare hook; must reach the caller as is."""


def _clones(raw):
    return {k: v.clone() for k, v in raw.items()}


def _unchanged(raw, before, case):
    for k, v in before.items():
        S.assert_equal(f"caller's {k!r}", raw[k], v, case)


@pytest.mark.parametrize("n,n_tok", [(1, 0), (3, 5), (8, 16), (9, 4)], ids=["bs1", "bs3", "bs8", "past-ladder"])
def test_r5_1_body_and_hook_write_their_view_not_the_caller(compile, device, n, n_tok):
    program = P.pads_program()
    state = P.pads_state(program, device)

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        x.fixed.fill_(-3)                    # an unpadded input: padded view or not, never the caller's
        x.cu.add_(1)

    runner = compile(program, lambda x: P.probing_body(x, mutate=True), state=state, prepare=prepare)
    raw = P.pads_raw(n, n_tok, device, seed=n)
    before = _clones(raw)
    runner(**raw)
    runner(**raw)
    _unchanged(raw, before, f"bs={n}, tok={n_tok}")


def test_r5_1_non_contiguous_caller_views(compile, device):
    program = P.pads_program()
    runner = compile(program, lambda x: P.probing_body(x, mutate=True), state=P.pads_state(program, device))
    base = P.pads_raw(6, 8, device, seed=1)
    raw = dict(base, seq_lens=base["seq_lens"][::2],       # strided views of the caller's tensors
               cu=base["cu"][::2], topk=base["topk"][::2], hidden=base["hidden"][::2],
               mask=base["mask"][::2], edge2=base["edge2"][:, ::2])
    before = _clones(base)
    runner(**raw)
    _unchanged(base, before, "strided views")


@pytest.mark.parametrize("fail_at", [0, 2], ids=["first-call", "warm"])
def test_r5_2_hook_raises(compile, device, fail_at):
    """The hook scribbles over the view, then raises: the caller's tensors are untouched, the
    exception is the hook's own, and the next call sees a clean padded view."""
    program = P.pads_program()
    state = P.pads_state(program, device)
    calls = {"n": 0}

    def prepare(x):

        if pg.capturing():  # warm-up/capture of a graph backend: not a call

            return
        calls["n"] += 1
        if calls["n"] - 1 == fail_at:
            x.seq_lens.fill_(-1)
            x.ids.fill_(-1)
            x.cu.fill_(-1)
            raise HookFailed("boom")

    runner = compile(program, lambda x: P.probing_body(x, mutate=True), state=state, prepare=prepare)
    for i in range(fail_at):
        runner(**P.pads_raw(8, 16, device, seed=i))
    raw = P.pads_raw(8, 16, device, seed=99)
    before = _clones(raw)
    with pytest.raises(HookFailed):
        runner(**raw)
    _unchanged(raw, before, f"hook raised on call {fail_at}")
    for n, n_tok in [(5, 3), (8, 16)]:
        raw = P.pads_raw(n, n_tok, device, seed=n)
        runner(**raw)
        P.check_probes(program, state, raw, n, n_tok, f"call after the hook raised, bs={n}")
