"""Rule 6: outputs are sliced to raw extents; their lifetime and ownership are explicit."""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2)


def program(name="outs"):
    return pg.Program(
        name,
        inputs={"a": pg.Input((bs,), torch.int64, pad=0), "ids": pg.Input((tok,), torch.int64, pad=0)},
        outputs={"y": pg.Output((bs,), torch.int64), "cu": pg.Output((bs + 1,), torch.int32),
                 "z": pg.Output((tok,), torch.int64), "h": pg.Output((bs, 3), torch.float16),
                 "k": pg.Output((4,), torch.int64), "st": pg.Output((bs,), torch.int64),
                 "same": pg.Output((bs,), torch.int64)},
        state={"kv": pg.State()},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body(x):
    b = x.bucket
    cu = torch.zeros(b + 1, dtype=torch.int32, device=x.a.device)
    cu[1:] = torch.cumsum(x.a, 0).to(torch.int32)
    x.kv[:b].copy_(x.a * 7)
    return {"y": x.a * 2, "cu": cu, "z": x.ids + 1,
            "h": (x.a.to(torch.float16) / 2).unsqueeze(1).expand(b, 3).contiguous(),
            "k": torch.arange(4, device=x.a.device) + x.kv[:4].sum() * 0,
            "st": x.kv[:b],              # a view of bound state, returned as is
            "same": x.a}                 # the padded input itself, returned as is


def expected(a, ids):
    a, ids = a.cpu(), ids.cpu()
    cu = torch.zeros(a.shape[0] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(a, 0).to(torch.int32)
    return {"y": a * 2, "cu": cu, "z": ids + 1, "h": (a.to(torch.float16) / 2).unsqueeze(1).expand(-1, 3),
            "k": torch.arange(4), "st": a * 7, "same": a}


def _raw(n, n_tok, device, seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randint(1, 50, (n,), generator=g).to(device),
            "ids": torch.randint(0, 50, (n_tok,), generator=g).to(device)}


def _overlaps(t: torch.Tensor, u: torch.Tensor) -> bool:
    if t.device != u.device or t.numel() == 0 or u.numel() == 0:
        return False
    a0 = t.untyped_storage().data_ptr()
    b0 = u.untyped_storage().data_ptr()
    return a0 < b0 + u.untyped_storage().nbytes() and b0 < a0 + t.untyped_storage().nbytes()


CASES = [(1, 0), (3, 6), (4, 8), (5, 1), (8, 16), (9, 3), (2, 11)]


@pytest.mark.parametrize("n,n_tok", CASES, ids=[f"bs={a},tok={b}" for a, b in CASES])
def test_r6_1_sliced_shapes_and_values(compile, device, n, n_tok):
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    raw = _raw(n, n_tok, device, seed=n)
    out = runner(**raw)
    case = f"bs={n}, tok={n_tok}"
    S.assert_equal("output names", sorted(out), sorted(program().outputs), case)
    for name, want in expected(**raw).items():
        S.assert_close(f"output {name!r}", out[name], want, case)
        S.assert_equal(f"device of {name!r}", out[name].device.type, torch.device(device).type, case)
    S.assert_equal("out.y is out['y']", out.y is out["y"], True, case)


@pytest.mark.parametrize("n", [3, 9], ids=["ladder", "past-ladder"])
def test_r6_3_outputs_never_alias_inputs_or_state(compile, device, n):
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    raw = _raw(n, 2, device, seed=0)
    out = runner(**raw)
    for name, t in out.items():
        for other, u in [("state 'kv'", kv)] + [(f"input {k!r}", v) for k, v in raw.items()]:
            assert not _overlaps(t, u), S.msg(f"output {name!r} shares memory with {other}", True, False, f"bs={n}")


@pytest.mark.parametrize("n_first,n_next", [(3, 3), (3, 7), (8, 2), (9, 3)])
def test_r6_2_copy_outputs_are_the_callers(compile, device, n_first, n_next):
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv}, copy_outputs=True)
    raw = _raw(n_first, 2, device, seed=1)
    first = runner(**raw)
    keep = {k: v.clone() for k, v in first.items()}
    for seed in range(3):
        runner(**_raw(n_next, 5, device, seed=10 + seed))
    case = f"copy_outputs=True, bs={n_first} then bs={n_next}"
    for k, v in keep.items():
        S.assert_equal(f"first call's {k!r} after later calls", first[k], v, case)


def test_r6_2_default_outputs_valid_until_next_call(compile, device):
    """Default lifetime: right until the next call; then any read raises StaleOutputError."""
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    previous = None
    for n in [3, 8, 1, 4, 4]:
        raw = _raw(n, n, device, seed=n)
        out = runner(**raw)
        for name, want in expected(**raw).items():
            S.assert_close(f"output {name!r}", out[name], want, f"bs={n}")
        if previous is not None:
            _assert_stale(previous, f"outputs of the call before bs={n}")
        previous = (out, out["y"][:1])       # an output and a view of one


def _assert_stale(previous, case: str) -> None:
    out, view = previous
    reads = {"print": lambda: repr(out["y"]), "arithmetic": lambda: out["h"] + 1, "item": lambda: out["k"][0].item(),
             "cpu": lambda: out["z"].cpu(), "a view": lambda: view.sum()}
    for what, read in reads.items():
        try:
            read()
        except pg.StaleOutputError as e:
            assert "copy_outputs=True" in str(e) and "'outs'" in str(e), S.msg("message", str(e), "naming the fix", case)
        else:
            raise AssertionError(S.msg(f"{what} of a stale output", "no error", "pg.StaleOutputError", case))


def test_r6_2_a_rejected_call_ends_no_lease(compile, device):
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    raw = _raw(3, 3, device, seed=1)
    out = runner(**raw)
    with pytest.raises(pg.ContractError):
        runner(**{**raw, "a": raw["a"].to(torch.int32)})
    S.assert_close("output 'y' after a rejected call", out["y"], expected(**raw)["y"], "bs=3")


BAD_RETURNS = [
    ("wrong-key", lambda x: {"w": x.a * 1}, "y"),
    ("extra-key", lambda x: {"y": x.a * 1, "w": x.a * 1}, "w"),
    ("wrong-shape", lambda x: {"y": x.a[:1] * 1}, "y"),
    ("wrong-dtype", lambda x: {"y": x.a.to(torch.int32)}, "y"),
    ("not-a-dict", lambda x: x.a * 1, "'y'"),
]


@pytest.mark.parametrize("case,bad,named", BAD_RETURNS, ids=[c[0] for c in BAD_RETURNS])
def test_r6_4_body_must_return_declared_outputs(compile, device, case, bad, named):
    prog = pg.Program("ret", inputs={"a": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int64)}, buckets=pg.Buckets([2, 4]))
    with pytest.raises(pg.ContractError) as e:
        runner = compile(prog, bad)
        runner(a=torch.ones(4, dtype=torch.int64, device=device))
    text = str(e.value) + "".join(f" <- {c}" for c in _chain(e.value))
    for part in ("'ret'", named):
        assert part in text, S.msg("error message", repr(text), f"containing {part!r}", case)


def _chain(err):
    while err.__cause__ is not None:
        err = err.__cause__
        yield err


ALIAS_ROUTES = {   # route -> the aliases of output 'h' ([bs, 3]) it hands back, in a tuple or list
    "unbind": lambda h: list(h.unbind()),
    "split": lambda h: list(torch.split(h, 1)),
    "chunk": lambda h: list(h.chunk(3, dim=1)),
    "for-row-in": lambda h: [row for row in h],
    "keyword": lambda h: [torch.narrow(h, dim=1, start=1, length=2)],
    "detach": lambda h: [h.detach()],
}


@pytest.mark.parametrize("route", sorted(ALIAS_ROUTES))
def test_r6_2_aliases_in_tuples_lists_and_keywords_stay_lent(compile, device, route):
    """Aliases of an output, wherever a torch function returns them, read its values until the
    next call and raise after it."""
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    raw = _raw(3, 3, device, seed=2)
    kept = ALIAS_ROUTES[route](runner(**raw)["h"])
    want = ALIAS_ROUTES[route](expected(**raw)["h"].contiguous())
    case = f"{route} of output 'h', bs=3"
    S.assert_equal("number of aliases", len(kept), len(want), case)
    for got, w in zip(kept, want):
        S.assert_close("an alias before the next call", got, w, case)
    runner(**_raw(3, 3, device, seed=3))
    for got in kept:
        with pytest.raises(pg.StaleOutputError):
            got.sum()


STALE_ARGUMENTS = {   # route -> a read that receives the stale output 'y' somewhere in its arguments
    "keyword": lambda y: torch.add(torch.zeros_like(y), other=y),
    "keyword-list": lambda y: torch.cat(tensors=[y, y]),
    "nested": lambda y: torch.stack([y, y]),
    "tolist": lambda y: y.tolist(),
    "len": lambda y: len(y),
    "iterate": lambda y: [int(v) for v in y],
}


@pytest.mark.parametrize("route", sorted(STALE_ARGUMENTS))
def test_r6_2_a_stale_output_anywhere_among_the_arguments_raises(compile, device, route):
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    y = runner(**_raw(3, 3, device, seed=2))["y"]
    runner(**_raw(3, 3, device, seed=3))
    with pytest.raises(pg.StaleOutputError, match="output 'y'"):
        STALE_ARGUMENTS[route](y)


def test_r6_2_results_in_their_own_memory_are_the_callers(compile, device):
    """No false alarm: results that do not alias an output (sorted values and indices, a sum, a
    split of a copy) keep their values after later calls."""
    kv = torch.zeros(4 * S.LADDER[-1], dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    raw = _raw(5, 3, device, seed=4)
    out = runner(**raw)
    kept = [*torch.sort(out["y"], descending=True), out["h"].sum(1), *(out["y"] + 0).split(2)]
    want_y = expected(**raw)["y"]
    want = [*torch.sort(want_y, descending=True), expected(**raw)["h"].sum(1), *(want_y + 0).split(2)]
    for seed in range(2):
        runner(**_raw(5, 3, device, seed=10 + seed))
    for i, (got, w) in enumerate(zip(kept, want)):
        S.assert_close(f"result {i} after later calls", got, w, "bs=5")
