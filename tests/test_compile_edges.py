"""The torch.compile path behaves like the eager runner at its edges (rule 10, with 5.2 and 2.7):
a fullgraph body's exceptions (and `hasattr` on the view) reach the caller as eagerly, whole and
in regions; a module listed twice in `regions` compiles once; nested regions are a
ContractValueError; `torch_compile={}` compiles with the defaults; an unknown option is a
ContractValueError naming the program."""
import pytest
import torch

import padgraph as pg
from padgraph.compiled import CompiledBody

bs = pg.Axis("bs")


def prog(name="audit", state=True):
    return pg.Program(name, inputs={"h": pg.Input((bs, 4), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((bs, 4), torch.float32)},
                      state={"s": pg.State()} if state else {},
                      buckets=pg.Buckets([1, 2, 4, 8]))


def outcome(runner, n=3):
    try:
        return ("ok", runner(h=torch.ones(n, 4)).y.clone())
    except Exception as ex:           # noqa: BLE001
        return (type(ex), str(ex))


def _raise_value(x):
    raise ValueError("boom from the body")


BODIES = {
    "undeclared_attr": lambda x: {"y": x.nope},                       # 2.7: ContractAttributeError
    "undeclared_item": lambda x: {"y": x["nope"]},                    # 2.7: ContractKeyError
    "undeclared_extent": lambda x: {"y": x.h * x.extent("nope")},     # 2.7: ContractKeyError
    "body_raises": _raise_value,                                      # 5.2: type unchanged
    "hasattr": lambda x: {"y": x.h + (1 if hasattr(x, "nope") else 2)},   # 2.7: "hasattr works"
}


@pytest.mark.parametrize("case", sorted(BODIES))
def test_fullgraph_keeps_the_bodys_exception(case):
    """SPEC 5.2: "When the body, the hook or validation raises, the exception reaches the caller
    unchanged in type"; 2.7: an undeclared name raises ContractKeyError/ContractAttributeError,
    `hasattr` works; so under torch_compile={"fullgraph": True} too, where dynamo stops its trace
    at the raise ("Observed exception")."""
    body = BODIES[case]
    eager = outcome(pg.compile(prog(), body, state={"s": torch.zeros(3)}))
    comp = outcome(pg.compile(prog(), body, state={"s": torch.zeros(3)}, torch_compile={"fullgraph": True}))
    if eager[0] == "ok":
        assert comp[0] == "ok", f"eager ok, fullgraph raised {comp[0].__name__}: {comp[1][:200]}"
        torch.testing.assert_close(comp[1], eager[1])
    else:
        assert comp[0] is eager[0], f"eager raised {eager[0].__name__}, fullgraph raised {comp[0]}: {comp[1][:160]}"
        assert comp[1] == eager[1]


def test_fullgraph_region_keeps_the_exception():
    """Same (5.2) for regional compile with fullgraph: a region that raises."""
    class Bad(torch.nn.Module):
        def forward(self, h):
            raise ValueError("region refuses")

    m = Bad()
    eager = outcome(pg.compile(prog(state=False), lambda x: {"y": m(x.h)}))
    comp = outcome(pg.compile(prog(state=False), lambda x: {"y": m(x.h)},
                              torch_compile={"regions": [m], "fullgraph": True}))
    assert eager[0] is ValueError
    assert comp[0] is ValueError, f"got {comp[0]}: {comp[1][:160]}"


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, h):
        return torch.tanh(h @ self.w)


def test_regions_with_a_repeated_module():
    """A weight-tied stack (nn.ModuleList([layer] * 2): one module, iterated twice) is "a
    ModuleList" as `regions` accepts: it compiles once and runs as eagerly."""
    layer = _Layer()
    stack = torch.nn.ModuleList([layer, layer])

    def body(x):
        h = x.h
        for m in stack:
            h = m(h)
        return {"y": h}

    eager = outcome(pg.compile(prog(state=False), body))
    comp = outcome(pg.compile(prog(state=False), body, torch_compile={"regions": stack}))
    assert eager[0] == "ok"
    assert comp[0] == "ok", f"{comp[0].__name__}: {comp[1]}"
    torch.testing.assert_close(comp[1], eager[1])


def test_nested_regions():
    """regions=[outer, outer.inner] (e.g. a decoder layer and its attention) either works like
    eager or is refused at compile with a ContractValueError (it is refused: compile the outer)."""
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _Layer()

        def forward(self, h):
            return self.inner(h) + 1

    o = Outer()
    eager = outcome(pg.compile(prog(state=False), lambda x: {"y": o(x.h)}))
    try:
        r = pg.compile(prog(state=False), lambda x: {"y": o(x.h)}, torch_compile={"regions": [o, o.inner]})
    except pg.ContractValueError:
        return                         # refused at compile, naming regions: acceptable
    comp = outcome(r)
    assert comp[0] == "ok", f"{comp[0].__name__}: {comp[1][:200]}"
    torch.testing.assert_close(comp[1], eager[1])


def test_empty_options_dict_still_compiles():
    """registry.compile / Runner.__init__ test `if torch_compile:`, so torch_compile={} (options
    dict with every default) silently runs the body eagerly: no CompiledBody, stats.compiles 0.
    Docs: torch_compile = "True or torch.compile options"."""
    r = pg.compile(prog(state=False), lambda x: {"y": x.h * 2}, torch_compile={})
    r(h=torch.ones(3, 4))
    assert isinstance(r.body, CompiledBody), f"body is {type(r.body).__name__}: not compiled"
    assert r.stats.compiles >= 1


def test_unknown_option_is_a_contract_error_naming_the_program():
    """A misspelt option ({"fulgraph": True}) reaches torch.compile as a bare TypeError that names
    no program; the other option checks (mode, regions) raise ContractValueError naming the
    program and 'torch_compile' (SPEC 2.6: messages name the program)."""
    with pytest.raises(pg.ContractError, match="audit"):
        pg.compile(prog(state=False), lambda x: {"y": x.h}, torch_compile={"fulgraph": True})


def test_a_call_that_raises_changes_no_stats():
    """SPEC 10.6: a compiled body whose output has the wrong dtype raises ContractValueError (6.4)
    and leaves the compile counters as they were; its compiles count with the next call that
    returns (the graphs stay cached, so that call compiles nothing itself)."""
    state = {"bad": True}
    r = pg.compile(prog(state=False), lambda x: {"y": x.h.double() if state["bad"] else x.h * 2},
                   torch_compile=True)
    with pytest.raises(pg.ContractValueError):
        r(h=torch.ones(3, 4))
    assert (r.stats.compiles, r.stats.recompiles, r.stats.compile_seconds) == (0, 0, 0.0), r.stats.table()
    state["bad"] = False
    torch._dynamo.reset()
    assert torch.equal(r(h=torch.ones(3, 4)).y, torch.full((3, 4), 2.0))
    assert r.stats.compiles >= 2 and r.stats.compile_seconds > 0, r.stats.table()


def test_an_option_the_backend_lacks_is_a_contract_error_naming_its_options():
    """pg.compile's options are checked by name per backend: a misspelt one (or one of another
    backend's, like cuda's `warmup` on reference) fails before anything is built."""
    n = pg.Axis("bs")
    prog = pg.Program("opts", inputs={"a": pg.Input((n,), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((n,), torch.float32)}, buckets=pg.Buckets([2]))
    for bad in ({"copy_output": True}, {"warmup": 3}):
        with pytest.raises(pg.ContractTypeError, match="has no option") as err:
            pg.compile(prog, lambda x: {"y": x.a}, backend="reference", **bad)
        assert repr(next(iter(bad))) in str(err.value) and "copy_outputs" in str(err.value)
    with pytest.raises(pg.ContractValueError, match="overflow"):
        pg.compile(prog, lambda x: {"y": x.a}, backend="reference", overflow="ignore")
    runner = pg.compile(prog, lambda x: {"y": x.a}, backend="reference", torch_compile=False, copy_outputs=True)
    assert runner.options == pg.Options(copy_outputs=True) and not runner._compiled
    with pytest.raises(pg.ContractTypeError, match="copy_outputs must be a bool"):
        pg.compile(prog, lambda x: {"y": x.a}, backend="reference", copy_outputs=1)     # 1 is no bool
