"""One error family for declarations: every mistake in a declaration is a pg.ContractError subclass
whose message names the program (where one exists), the buffer, what was expected and what was given.

Hazards: a pad the dtype cannot hold is silently converted by the pack (300 -> 44 on uint8, nan -> 0
or garbage on int32, 70000 -> inf on float16); a name like "items" makes `out.items` the dict method.
"""
import pytest
import torch

import padgraph as pg
from padgraph.axes import Affine

bs = pg.Axis("bs")


def _prog(dtype=torch.int32, pad=0, **kw):
    return pg.Program("decl", inputs={"a": pg.Input((bs,), dtype, pad=pad)}, **kw)


def _raises(make, err, parts):
    with pytest.raises(err) as e:
        make()
    assert isinstance(e.value, pg.ContractError), type(e.value).__mro__
    for part in parts:
        assert part in str(e.value), f"message={str(e.value)!r}, but should contain {part!r}"
    return e.value


# ---- pads against the input dtype -------------------------------------------------------------------
BAD_PADS = [
    ("nan-int32", torch.int32, float("nan"), pg.ContractValueError, ["nan", "integer"]),
    ("inf-int64", torch.int64, float("inf"), pg.ContractValueError, ["inf", "integer"]),
    ("1.5-int32", torch.int32, 1.5, pg.ContractValueError, ["1.5", "[-2147483648, 2147483647]"]),
    ("300-uint8", torch.uint8, 300, pg.ContractValueError, ["300", "[0, 255]"]),
    ("-1-uint8", torch.uint8, -1, pg.ContractValueError, ["-1", "[0, 255]"]),
    ("2**40-int32", torch.int32, 2 ** 40, pg.ContractValueError, [str(2 ** 40), "int32"]),
    ("2-bool", torch.bool, 2, pg.ContractValueError, ["2", "bool"]),
    ("0.5-bool", torch.bool, 0.5, pg.ContractValueError, ["0.5", "bool"]),
    ("70000-float16", torch.float16, 70000.0, pg.ContractValueError, ["70000.0", "float16", "65504"]),
    ("1e39-float32", torch.float32, 1e39, pg.ContractValueError, ["1e+39", "float32"]),
    ("inf-float8e4m3fn", torch.float8_e4m3fn, float("inf"), pg.ContractValueError, ["inf", "float8_e4m3fn"]),
    ("Fill-str", torch.int32, pg.Fill("x"), pg.ContractTypeError, ["'x'", "number"]),
    ("Fill-None", torch.int32, pg.Fill(None), pg.ContractTypeError, ["None", "number"]),
    ("pad-str", torch.int32, "zero", pg.ContractTypeError, ["'zero'", "pg.Fill"]),
    ("Edge-str", torch.int32, pg.Edge("x"), pg.ContractTypeError, ["'x'", "number"]),
    ("Edge-None", torch.int32, pg.Edge(None), pg.ContractTypeError, ["None", "number"]),
    ("Edge-300-uint8", torch.uint8, pg.Edge(300), pg.ContractValueError, ["300", "[0, 255]"]),
    ("Edge-nan-int64", torch.int64, pg.Edge(float("nan")), pg.ContractValueError, ["nan"]),
]


@pytest.mark.parametrize("case,dtype,pad,err,parts", BAD_PADS, ids=[c[0] for c in BAD_PADS])
def test_pad_the_dtype_cannot_hold_is_refused_by_program(case, dtype, pad, err, parts):
    policy = pg.Fill(pad) if isinstance(pad, (int, float)) else pad      # building never raises
    pg.Input((bs,), dtype, pad=policy)
    _raises(lambda: _prog(dtype, policy), err, ["'decl'", "input 'a'", "pad"] + parts)


@pytest.mark.parametrize("dtype,pad", [
    (torch.float32, 0.1), (torch.float16, 65504.0), (torch.float16, 65519.0), (torch.bfloat16, 1e38),
    (torch.float32, float("nan")), (torch.float32, float("-inf")), (torch.float16, 3),
    (torch.int32, 2 ** 31 - 1), (torch.int64, -(2 ** 63)), (torch.uint8, 255), (torch.int8, -128),
    (torch.int32, 3.0), (torch.int32, True), (torch.bool, True), (torch.bool, 0), (torch.bool, 1.0),
    (torch.float8_e4m3fn, float("nan")), (torch.int32, pg.Edge()), (torch.float16, pg.Edge(float("-inf"))),
])
def test_pads_the_dtype_holds_are_accepted(dtype, pad):
    assert _prog(dtype, pad).inputs["a"].pad is not None


def test_an_unpadded_input_pad_is_checked_too():
    _raises(lambda: pg.Program("decl", inputs={"a": pg.Input((bs,), torch.int32, pad=0),
                                               "w": pg.Input((4,), torch.uint8, pad=-1)}),
            pg.ContractValueError, ["'decl'", "input 'w'", "-1"])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_inputs_are_refused_saying_why(dtype):
    _raises(lambda: pg.Program("decl", inputs={"a": pg.Input((bs,), torch.int32, pad=0),
                                               "z": pg.Input((bs,), dtype, pad=0)}),
            pg.ContractTypeError, ["'decl'", "input 'z'", str(dtype), "bit patterns", "complex128 cannot be packed"])


# ---- buckets ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,parts", [
    (lambda: pg.Buckets.default(0), ["Buckets.default", "max_size", ">= 1", "0"]),
    (lambda: pg.Buckets.default(2.5), ["Buckets.default", "2.5"]),
    (lambda: pg.Buckets.pow2(2.5), ["Buckets.pow2", "max_size", "2.5", "float"]),
    (lambda: pg.Buckets.pow2(0), ["Buckets.pow2", "0"]),
    (lambda: pg.Buckets([8, 16], multiple_of=0), ["multiple_of", ">= 1", "0"]),
    (lambda: pg.Buckets([8, 16], multiple_of=-8), ["multiple_of", "-8"]),
    (lambda: pg.Buckets([8, 16], multiple_of=8.0), ["multiple_of", "8.0", "float"]),
    (lambda: pg.Buckets([8, 16], multiple_of=True), ["multiple_of", "True", "bool"]),
    (lambda: pg.Buckets(5), ["iterable", "5"]),
    (lambda: pg.Buckets([1, "2"]), ["'2'", "[1, '2']"]),
    (lambda: pg.Buckets([]), ["[]"]),
    (lambda: pg.Buckets([4, 2]), ["sorted", "[4, 2]"]),
])
def test_bucket_errors(make, parts):
    e = _raises(make, pg.ContractValueError, parts)
    assert isinstance(e, ValueError)                     # SPEC 3.3: a malformed ladder is a ValueError


def test_a_bad_ladder_in_a_program_names_the_program():
    _raises(lambda: _prog(buckets=[4, 2]), pg.ContractValueError, ["'decl'", "buckets", "sorted", "[4, 2]"])
    _raises(lambda: _prog(buckets=[0]), pg.ContractValueError, ["'decl'", "buckets", "0"])


# ---- state sinks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sink,err,parts", [
    (-1, pg.ContractValueError, [">= 0", "-1"]),
    ((0, -2), pg.ContractValueError, [">= 0", "(0, -2)"]),
    ("0", pg.ContractTypeError, ["int", "'0'"]),
    (1.0, pg.ContractTypeError, ["int", "1.0"]),
    (True, pg.ContractTypeError, ["int", "True"]),
    ((0, None), pg.ContractTypeError, ["int", "None"]),
])
def test_sink_must_be_non_negative_ints(sink, err, parts):
    pg.State(sink=sink)                                  # plain data: Program checks it
    _raises(lambda: _prog(state={"kv": pg.State(sink=sink)}), err, ["'decl'", "state 'kv'", "sink"] + parts)


def test_sink_list_is_a_tuple_and_sinks_past_dim_0_are_refused_at_bind():
    assert pg.State(sink=[0, 1]).sink_rows == (0, 1)
    prog = _prog(state={"kv": pg.State(sink=(0, 16))})
    _raises(lambda: pg.compile(prog, lambda x: {}, state={"kv": torch.zeros(16)}, backend="reference"),
            pg.ContractValueError, ["'decl'", "state 'kv'", "sink rows", "< dim 0", "16", "[0, 16]"])


# ---- names ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["values", "items", "keys", "get", "copy", "pop", "update", "setdefault",
                                  "clear", "fromkeys", "popitem"])
@pytest.mark.parametrize("kind", ["input", "output", "state"])
def test_names_that_clash_with_outputs_methods_are_refused(name, kind):
    kw = {"inputs": {"a": pg.Input((bs,), torch.int32, pad=0)}}
    if kind == "input":
        kw["inputs"] = {name: pg.Input((bs,), torch.int32, pad=0)}
    elif kind == "output":
        kw["outputs"] = {name: pg.Output((bs,), torch.int32)}
    else:
        kw["state"] = {name: pg.State()}
    _raises(lambda: pg.Program("decl", **kw), pg.ContractValueError, ["'decl'", repr(name), "Outputs", f"out.{name}"])


@pytest.mark.parametrize("kind", ["inputs", "outputs", "state"])
def test_names_must_be_strings(kind):
    spec = {"inputs": pg.Input((bs,), torch.int32, pad=0), "outputs": pg.Output((bs,), torch.int32), "state": pg.State()}[kind]
    kw = {"inputs": {"a": pg.Input((bs,), torch.int32, pad=0)}}
    kw[kind] = {**kw.get(kind, {}), 1: spec}
    _raises(lambda: pg.Program("decl", **kw), pg.ContractTypeError, ["'decl'", "name", "str", "1 (int)"])


# ---- the padded view ----------------------------------------------------------------------------------
def test_view_errors_are_contract_key_and_attribute_errors():
    seen = {}

    def body(x):
        for what, get in (("extent", lambda: x.extent("nope")), ("attr", lambda: x.nope), ("item", lambda: x["nope"])):
            try:
                get()
            except Exception as e:   # noqa: BLE001 - recorded for the asserts below
                seen[what] = e
        seen["hasattr"] = hasattr(x, "nope")
        return {"y": x.a * 1}

    prog = _prog(outputs={"y": pg.Output((bs,), torch.int32)}, buckets=[2])
    pg.compile(prog, body, backend="reference")(a=torch.ones(2, dtype=torch.int32))
    assert isinstance(seen["extent"], pg.ContractKeyError) and isinstance(seen["extent"], KeyError)
    assert isinstance(seen["attr"], pg.ContractAttributeError) and isinstance(seen["attr"], AttributeError)
    assert isinstance(seen["item"], pg.ContractKeyError) and seen["hasattr"] is False
    for e in (seen["extent"], seen["attr"], seen["item"]):
        assert isinstance(e, pg.ContractError) and "'decl'" in str(e) and "'nope'" in str(e), str(e)
    assert "['bs']" in str(seen["extent"]) and "'a'" in str(seen["attr"])
    assert not str(seen["extent"]).startswith('"'), "a ContractKeyError reads as written, not as repr(message)"


def test_error_classes_refine_builtins():
    assert issubclass(pg.ContractKeyError, KeyError) and issubclass(pg.ContractKeyError, pg.ContractError)
    assert issubclass(pg.ContractAttributeError, AttributeError) and issubclass(pg.ContractAttributeError, pg.ContractError)


# ---- axes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,err,parts", [
    (lambda: pg.Axis(5), pg.ContractTypeError, ["Axis name", "str", "5"]),
    (lambda: pg.Axis("not an identifier"), pg.ContractValueError, ["identifier", "'not an identifier'"]),
    (lambda: pg.Axis("t", capacity=4), pg.ContractTypeError, ["'t'", "capacity", "4"]),
    (lambda: pg.Axis("t", capacity=pg.Axis("u", capacity=bs)), pg.ContractValueError, ["'t'", "'u'", "bucketed"]),
    (lambda: bs * 1.5, pg.ContractTypeError, ["'bs'", "scale", "1.5", "float"]),
    (lambda: bs + "1", pg.ContractTypeError, ["'bs'", "offset", "'1'", "str"]),
    (lambda: Affine(bs, scale=0), pg.ContractValueError, ["'bs'", "scale", ">= 1", "0"]),
    (lambda: Affine(bs, offset=0.5), pg.ContractTypeError, ["'bs'", "offset", "0.5"]),
    (lambda: Affine("bs"), pg.ContractTypeError, ["pg.Axis", "'bs'", "str"]),
])
def test_axis_errors(make, err, parts):
    _raises(make, err, parts)


# ---- axis arithmetic: the affine forms, and a ContractTypeError for anything else ------------------------------
def test_affine_forms_are_dimensions():
    assert (bs - 1).offset == -1 and (bs - 1) == bs + -1 and ((bs + 1) - 1) == Affine(bs)
    assert (2 * (bs + 1)) == Affine(bs, 2, 2) and (bs * 3 - 2) == Affine(bs, 3, -2)


@pytest.mark.parametrize("make,parts", [
    (lambda: 5 - bs, ["5 - bs", "'-'", "'bs'"]),
    (lambda: -bs, ["-(bs)", "'bs'"]),
    (lambda: -(bs + 1), ["-(bs+1)", "'bs'"]),
    (lambda: bs / 2, ["bs / 2", "'/'"]),
    (lambda: 2 / bs, ["2 / bs", "'/'"]),
    (lambda: bs // 2, ["bs // 2", "'//'"]),
    (lambda: (bs * 2) // 2, ["bs*2 // 2", "'//'"]),
    (lambda: bs % 2, ["bs % 2", "'%'"]),
    (lambda: bs ** 2, ["bs ** 2", "'**'"]),
    (lambda: bs < 3, ["bs < 3", "'<'"]),
    (lambda: 3 <= bs, ["bs >= 3", "'>='"]),
    (lambda: abs(bs), ["abs(bs)", "'abs'"]),
    (lambda: bs * bs, ["bs * bs", "'bs'", "scale must be an int", "Axis"]),
    (lambda: bs + bs, ["bs + bs", "'bs'", "offset must be an int", "Axis"]),
    (lambda: bs - 1.5, ["bs - 1.5", "offset must be an int", "float"]),
    (lambda: bs * True, ["bs * True", "scale must be an int", "bool"]),
    (lambda: (bs + 1) - "1", ["bs+1 - '1'", "offset", "str"]),
])
def test_other_axis_arithmetic_is_a_contract_type_error(make, parts):
    e = _raises(make, pg.ContractTypeError, parts + ["an axis takes", "bs + 1", "bs * 4"])
    assert isinstance(e, TypeError)


def test_a_dimension_negative_at_the_smallest_bucket_is_refused():
    _raises(lambda: pg.Program("decl", inputs={"a": pg.Input((bs,), torch.int32, pad=0),
                                               "b": pg.Input((bs - 3, 2), torch.int32, pad=0)}, buckets=[1, 2, 4]),
            pg.ContractValueError, ["'decl'", "input 'b'", "bs-3", ">= 0 at every bucket", "-2 at bucket 1"])
    ok = pg.Program("decl", inputs={"a": pg.Input((bs,), torch.int32, pad=0), "b": pg.Input((bs - 1,), torch.int32, pad=0)},
                    buckets=[1, 2])
    r = pg.compile(ok, lambda x: {}, backend="reference")
    r(a=torch.zeros(2, dtype=torch.int32), b=torch.zeros(1, dtype=torch.int32))


# ---- options of pg.compile: checked at compile, never at the first call -------------------------------------
_BODY = lambda x: {}     # noqa: E731

BAD_OPTIONS = [
    ("torch_compile-str", dict(torch_compile="bogus"), pg.ContractTypeError, ["torch_compile", "'bogus'", "True, False, None or a dict"]),
    ("torch_compile-int", dict(torch_compile=1), pg.ContractTypeError, ["torch_compile", "1 (int)"]),
    ("torch_compile-key", dict(torch_compile={1: 2}), pg.ContractTypeError, ["torch_compile", "str keys"]),
    ("torch_compile-mode", dict(torch_compile={"mode": "fast"}), pg.ContractValueError, ["torch_compile mode", "'fast'"]),
    ("torch_compile-fullgraph", dict(torch_compile={"fullgraph": "yes"}), pg.ContractValueError, ["'fullgraph'", "'yes'"]),
    ("torch_compile-size_oblivious", dict(torch_compile={"size_oblivious": 1}), pg.ContractValueError, ["'size_oblivious'", "1 (int)"]),
    ("torch_compile-options", dict(torch_compile={"options": 3}), pg.ContractValueError, ["'options'", "3"]),
    ("torch_compile-passes", dict(torch_compile={"passes": 3}), pg.ContractValueError, ["passes", "callable", "3"]),
    ("torch_compile-regions", dict(torch_compile={"regions": 3}), pg.ContractValueError, ["regions", "nn.Module"]),
    ("torch_compile-unknown", dict(torch_compile={"modee": "default"}), pg.ContractValueError, ["unknown ['modee']"]),
    ("copy_outputs-str", dict(copy_outputs="False"), pg.ContractTypeError, ["copy_outputs", "a bool", "'False' (str)"]),
    ("copy_outputs-int", dict(copy_outputs=0), pg.ContractTypeError, ["copy_outputs", "a bool", "0 (int)"]),
    ("copy_outputs-None", dict(copy_outputs=None), pg.ContractTypeError, ["copy_outputs", "a bool", "None"]),
    ("prepare-int", dict(prepare=42), pg.ContractTypeError, ["prepare", "a callable", "42 (int)"]),
    ("prepare-str", dict(prepare="hook"), pg.ContractTypeError, ["prepare", "a callable", "'hook'"]),
    ("overflow-value", dict(overflow="ignore"), pg.ContractValueError, ["overflow", "'eager' or 'error'", "'ignore'"]),
    ("overflow-type", dict(overflow=1), pg.ContractTypeError, ["overflow", "a str", "1 (int)"]),
    ("device", dict(device=42.5), pg.ContractValueError, ["device", "42.5"]),
    ("shadow", dict(shadow=3), pg.ContractTypeError, ["shadow", "pg.Shadow", "3"]),
    ("unknown", dict(warmup=2), pg.ContractTypeError, ["no option 'warmup'", "copy_outputs"]),
]


@pytest.mark.parametrize("case,options,err,parts", BAD_OPTIONS, ids=[c[0] for c in BAD_OPTIONS])
def test_bad_options_are_refused_at_compile(case, options, err, parts):
    _raises(lambda: pg.compile(_prog(), _BODY, backend="reference", **options), err, ["'decl'"] + parts)


@pytest.mark.parametrize("make,err,parts", [
    (lambda: pg.compile(3, _BODY), pg.ContractValueError, ["program must be a pg.Program", "3 (int)"]),
    (lambda: pg.compile(_prog(), 3), pg.ContractTypeError, ["'decl'", "body", "callable", "int"]),
    (lambda: pg.compile(_prog(), _BODY, backend=3), pg.ContractTypeError, ["backend", "a str", "3 (int)"]),
    (lambda: pg.compile(_prog(), _BODY, backend=["cuda"]), pg.ContractTypeError, ["backend", "['cuda']"]),
    (lambda: pg.compile(_prog(), _BODY, backend="nope"), pg.ContractValueError, ["backend", "'nope'", "reference"]),
    (lambda: pg.compile(_prog(), _BODY, backend="reference", state=3), pg.ContractTypeError, ["'decl'", "state", "int"]),
])
def test_compile_arguments_are_checked(make, err, parts):
    _raises(make, err, parts)


def test_options_typed_on_a_backend_subclass_are_checked_by_their_annotation():
    from dataclasses import dataclass

    from padgraph.reference import ReferenceRunner

    @dataclass(frozen=True)
    class MyOptions(pg.Options):
        steps: int = 2
        verbose: bool | None = None
        mode: str = "a"
        CHOICES = {**pg.Options.CHOICES, "mode": ("a", "b")}

    class Mine(ReferenceRunner):
        backend = "mine-options"
        Options = MyOptions

    for bad, parts in ((dict(steps=True), ["steps", "an int", "True (bool)"]), (dict(steps=2.0), ["steps", "2.0"]),
                       (dict(verbose="no"), ["verbose", "a bool", "or None", "'no'"]),
                       (dict(mode="c"), ["mode", "'a' or 'b'", "'c'"])):
        with pytest.raises(pg.ContractError) as e:
            Mine(_prog(), _BODY, **bad)
        assert all(p in str(e.value) for p in parts), str(e.value)
    assert Mine(_prog(), _BODY, steps=3, verbose=None, mode="b").options.steps == 3


# ---- register_backend --------------------------------------------------------------------------------------
class _NotARunner:
    pass


@pytest.mark.parametrize("name,cls,err,parts", [
    ("mine", _NotARunner, pg.ContractTypeError, ["'mine'", "pg.Runner subclass", "_NotARunner"]),
    ("mine", 3, pg.ContractTypeError, ["'mine'", "pg.Runner subclass", "3 (int)"]),
    ("mine", "no_colon", pg.ContractValueError, ["'mine'", "'package.module:RunnerClass'", "'no_colon'"]),
    ("mine", "pkg.mod:not ok", pg.ContractValueError, ["'pkg.mod:not ok'"]),
    (3, pg.Runner, pg.ContractTypeError, ["name", "str", "3 (int)"]),
    ("", pg.Runner, pg.ContractTypeError, ["name", "non-empty"]),
    ("reference", pg.Runner, pg.ContractValueError, ["built-in", "'reference'"]),
    ("cuda", pg.Runner, pg.ContractValueError, ["built-in", "'cuda'"]),
])
def test_register_backend_checks_name_and_class(name, cls, err, parts):
    _raises(lambda: pg.register_backend(name, cls), err, parts)
    assert name not in pg.backend_names() or name in ("reference", "cuda")


def test_a_registered_path_that_is_no_runner_fails_at_resolve_naming_it():
    pg.register_backend("decl-not-a-runner", "padgraph.errors:ContractError")
    _raises(lambda: pg.compile(_prog(), _BODY, backend="decl-not-a-runner"), pg.ContractTypeError,
            ["'decl-not-a-runner'", "pg.Runner subclass", "ContractError"])


# ---- Program, Input, Output, State: checked when the program is built, naming program and buffer ----------
@pytest.mark.parametrize("make,err,parts", [
    (lambda: pg.Program(3, inputs={"a": pg.Input((bs,), torch.int32, pad=0)}), pg.ContractTypeError, ["name", "str", "3 (int)"]),
    (lambda: pg.Program("", inputs={"a": pg.Input((bs,), torch.int32, pad=0)}), pg.ContractValueError, ["name", "non-empty"]),
    (lambda: pg.Program("decl", inputs=[("a", pg.Input((bs,), torch.int32, pad=0))]), pg.ContractTypeError, ["'decl'", "inputs", "mapping", "list"]),
    (lambda: pg.Program("decl", inputs=3), pg.ContractTypeError, ["'decl'", "inputs", "mapping", "3 (int)"]),
    (lambda: _prog(outputs=3), pg.ContractTypeError, ["'decl'", "outputs", "mapping"]),
    (lambda: _prog(state=["kv"]), pg.ContractTypeError, ["'decl'", "state", "mapping"]),
    (lambda: _prog(buckets=5), pg.ContractValueError, ["'decl'", "buckets", "5"]),
    (lambda: pg.Program("decl", inputs={"a": pg.Input((bs,), "int32", pad=0)}), pg.ContractTypeError, ["'decl'", "'a'", "torch.dtype", "'int32'"]),
    (lambda: pg.Program("decl", inputs={"a": pg.Input([bs], torch.int32, pad=0)}), pg.ContractTypeError, ["'decl'", "'a'", "tuple"]),
    (lambda: pg.Program("decl", inputs={"a": pg.Input((bs, 2.0), torch.int32, pad=0)}), pg.ContractTypeError, ["'decl'", "'a'", "2.0"]),
    (lambda: pg.Program("decl", inputs={"a": pg.Input((bs, True), torch.int32, pad=0)}), pg.ContractTypeError, ["'decl'", "'a'", "True"]),
    (lambda: _prog(outputs={"y": pg.Output((bs,), torch.int32, pad="x")}), pg.ContractTypeError, ["'decl'", "output 'y'", "'x'"]),
    (lambda: _prog(outputs={"y": pg.Output((bs,), "int32")}), pg.ContractTypeError, ["'decl'", "output 'y'", "torch.dtype"]),
    (lambda: _prog(state={"s": pg.State(flatten=3, unflatten=3)}), pg.ContractTypeError, ["'decl'", "state 's'", "callables"]),
    (lambda: _prog(state={"s": pg.State(flatten=lambda o: ([], None))}), pg.ContractTypeError, ["'decl'", "state 's'", "both"]),
    (lambda: _prog(state={"s": pg.State(rows=3)}), pg.ContractValueError, ["'decl'", "state 's'", "rows", "3"]),
    (lambda: _prog(state={"s": "kv"}), pg.ContractTypeError, ["'decl'", "state 's'", "pg.State"]),
    (lambda: pg.Axis("t", capacity=bs * 2, device_extent="yes"), pg.ContractTypeError, ["'t'", "device_extent", "bool", "'yes'"]),
    (lambda: pg.Axis("t", capacity=bs * 2, device_extent=1), pg.ContractTypeError, ["'t'", "device_extent", "1 (int)"]),
])
def test_declaration_arguments_are_checked(make, err, parts):
    _raises(make, err, parts)
