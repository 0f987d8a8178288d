"""Rule 2, continued: aliasing is decided byte by byte (2.4) and declarations are checked when built (2.7).

2.4 cases: an input shares memory with state exactly when some byte belongs to an element of both,
from their sizes and strides — a step-2 slice reaching into state is refused though its first
`numel` elements would stop short; an expanded (stride 0) or strided input beside state is accepted.
2.7 cases: every malformed declaration raises a ContractError naming program, buffer, expected, given.
"""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")


def alias_program(shape):
    return pg.Program("alias", inputs={"a": pg.Input(shape, torch.float32, pad=0)},
                      outputs={"y": pg.Output(shape, torch.float32)}, state={"kv": pg.State()},
                      buckets=pg.Buckets([4, 8, 16]))


def alias_body(x):
    return {"y": x.a * 2}


def _flat(device):
    return torch.arange(40, dtype=torch.float32, device=device)


def _grid(device):
    return torch.arange(128, dtype=torch.float32, device=device).view(8, 16)


# (id, base, state of base, input of base, input shape, shares a byte)
ALIASING = [
    ("step2-reaching-into-state", _flat, lambda b: b[10:20], lambda b: b[0:20:2], (bs,), True),
    ("step2-before-state", _flat, lambda b: b[10:20], lambda b: b[1:10:2], (bs,), False),
    ("expanded-beside-state", _flat, lambda b: b[10:20], lambda b: b[9:10].expand(8), (bs,), False),
    ("expanded-inside-state", _flat, lambda b: b[10:20], lambda b: b[10:11].expand(8), (bs,), True),
    ("columns-beside-state-columns", _grid, lambda b: b[:, :4], lambda b: b[:, 8:12], (bs, 4), False),
    ("one-column-beside", _grid, lambda b: b[:, :4], lambda b: b[:, 4], (bs,), False),
    ("a-row-through-state-columns", _grid, lambda b: b[:, :4], lambda b: b[2], (bs,), True),
]


@pytest.mark.parametrize("case,base,state,take,shape,hit", ALIASING, ids=[c[0] for c in ALIASING])
def test_r2_4_aliasing_is_decided_from_sizes_and_strides(compile, device, case, base, state, take, shape, hit):
    buf = base(device)
    kv = state(buf)
    runner = compile(alias_program(shape), alias_body, state={"kv": kv})
    a = take(buf)
    keep, kv_before, calls = buf.clone(), kv.clone(), sum(runner.stats.calls.values())
    if hit:
        with pytest.raises(pg.ContractValueError) as e:
            runner(a=a)
        for part in ("'alias'", "'a'", "'kv'"):
            assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", case)
        S.assert_equal("calls counted", sum(runner.stats.calls.values()), calls, case)
    else:
        out = runner(a=a)
        S.assert_close("y", out.y, a * 2, case)
    S.assert_equal("the caller's memory after the call", buf, keep, case)
    S.assert_equal("bound state after the call", kv, kv_before, case)


def _decl(inputs=None, **kw):
    return lambda: pg.Program("decl", inputs=inputs or {"a": pg.Input((bs,), torch.int32, pad=0)}, **kw)


def _input(dtype, pad):
    return {"a": pg.Input((bs,), dtype, pad=pad)}


# (id, declaration, error class, parts of the message: program and buffer first)
DECLARATIONS = [
    ("pad-300-on-uint8", _decl(_input(torch.uint8, 300)), pg.ContractValueError, ["'decl'", "'a'", "300", "[0, 255]"]),
    ("pad-nan-on-int32", _decl(_input(torch.int32, float("nan"))), pg.ContractValueError, ["'decl'", "'a'", "nan"]),
    ("pad-1.5-on-int64", _decl(_input(torch.int64, 1.5)), pg.ContractValueError, ["'decl'", "'a'", "1.5"]),
    ("pad-2**40-on-int32", _decl(_input(torch.int32, 2 ** 40)), pg.ContractValueError, ["'decl'", "'a'", str(2 ** 40)]),
    ("pad-2-on-bool", _decl(_input(torch.bool, 2)), pg.ContractValueError, ["'decl'", "'a'", "bool", "2"]),
    ("pad-70000-on-float16", _decl(_input(torch.float16, 70000.0)), pg.ContractValueError, ["'decl'", "'a'", "float16", "70000.0"]),
    ("pad-not-a-number", _decl(_input(torch.int32, pg.Fill("x"))), pg.ContractTypeError, ["'decl'", "'a'", "'x'", "number"]),
    ("edge-default-not-a-number", _decl(_input(torch.int32, pg.Edge(None))),
     pg.ContractTypeError, ["'decl'", "'a'", "None"]),
    ("edge-default-300-on-uint8", _decl(_input(torch.uint8, pg.Edge(300))),
     pg.ContractValueError, ["'decl'", "'a'", "300"]),
    ("complex-input", _decl(_input(torch.complex128, 0)),
     pg.ContractTypeError, ["'decl'", "'a'", "complex128", "cannot be packed"]),
    ("ladder-unsorted", _decl(buckets=[4, 2]), pg.ContractValueError, ["'decl'", "buckets", "[4, 2]"]),
    ("sink-negative", _decl(state={"kv": pg.State(sink=-1)}), pg.ContractValueError, ["'decl'", "'kv'", "sink", "-1"]),
    ("sink-not-an-int", _decl(state={"kv": pg.State(sink="0")}), pg.ContractTypeError, ["'decl'", "'kv'", "sink", "'0'"]),
    ("output-name-not-a-str", _decl(outputs={0: pg.Output((bs,), torch.int32)}),
     pg.ContractTypeError, ["'decl'", "output", "str", "0"]),
    ("output-named-items", _decl(outputs={"items": pg.Output((bs,), torch.int32)}),
     pg.ContractValueError, ["'decl'", "'items'", "Outputs"]),
    ("input-named-values", _decl({"values": pg.Input((bs,), torch.int32, pad=0)}),
     pg.ContractValueError, ["'decl'", "'values'", "Outputs"]),
    ("state-named-get", _decl(state={"get": pg.State()}), pg.ContractValueError, ["'decl'", "'get'", "Outputs"]),
    ("ladder-multiple_of-0", lambda: pg.Buckets([8, 16], multiple_of=0), pg.ContractValueError, ["multiple_of", "0"]),
    ("ladder-default-0", lambda: pg.Buckets.default(0), pg.ContractValueError, ["max_size", "0"]),
    ("ladder-pow2-2.5", lambda: pg.Buckets.pow2(2.5), pg.ContractValueError, ["max_size", "2.5"]),
    ("axis-name-not-an-identifier", lambda: pg.Axis("a b"), pg.ContractValueError, ["Axis", "'a b'"]),
    ("axis-capacity-not-an-expression", lambda: pg.Axis("t", capacity=4), pg.ContractTypeError, ["'t'", "capacity", "4"]),
    ("axis-scale-not-an-int", lambda: bs * 1.5, pg.ContractTypeError, ["'bs'", "1.5"]),
]


@pytest.mark.parametrize("case,make,err,parts", DECLARATIONS, ids=[c[0] for c in DECLARATIONS])
def test_r2_7_declarations_are_checked_when_built(case, make, err, parts):
    with pytest.raises(err) as e:
        make()
    assert isinstance(e.value, pg.ContractError), S.msg("error class", type(e.value).__mro__, "a pg.ContractError", case)
    for part in parts:
        assert part in str(e.value), S.msg("message", str(e.value), f"containing {part!r}", case)


def test_r2_7_policies_are_data_until_a_program_checks_them():
    for build in (lambda: pg.Fill("x"), lambda: pg.Edge(None), lambda: pg.Fill(float("nan")),
                  lambda: pg.Input((bs,), torch.uint8, pad=300), lambda: pg.State(sink=-1)):
        build()          # none of these raises: only pg.Program knows the dtype, program and buffer


def test_r2_7_view_lookups_raise_contract_key_and_attribute_errors(compile, device, pytestconfig):
    seen = {}

    def body(x):
        for what, get in (("extent", lambda: x.extent("nope")), ("attr", lambda: x.nope)):
            try:
                get()
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                seen[what] = e
        seen["hasattr"] = hasattr(x, "nope")
        seen["in"] = ("nope" in x, "a" in x)
        return {"y": x.a * 1}

    prog = pg.Program("view", inputs={"a": pg.Input((bs,), torch.int32, pad=0)},
                      outputs={"y": pg.Output((bs,), torch.int32)}, buckets=pg.Buckets([2]))
    compile(prog, body)(a=torch.ones(2, dtype=torch.int32, device=device))
    # 10.8: a compiled body that catches the view's missing-attribute error sees the builtin
    # AttributeError dynamo can trace (with it hasattr compiles); its message is the same
    compiled = bool(pytestconfig.getoption("--torch-compile"))
    attr = (AttributeError, AttributeError, Exception) if compiled else \
        (pg.ContractAttributeError, AttributeError, pg.ContractError)
    for what, cls, base, family in (("extent", pg.ContractKeyError, KeyError, pg.ContractError),
                                    ("attr", *attr)):
        e = seen.get(what)
        assert isinstance(e, cls) and isinstance(e, base) and isinstance(e, family), \
            S.msg(f"error of the view's {what} lookup", type(e).__mro__ if e else None, f"a {cls.__name__}", what)
        for part in ("'view'", "'nope'"):
            assert part in str(e), S.msg("message", str(e), f"containing {part!r}", what)
    S.assert_equal("hasattr(x, 'nope')", seen["hasattr"], False, "view")
    S.assert_equal("('nope' in x, 'a' in x)", seen["in"], (False, True), "view")
