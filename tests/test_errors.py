"""Bad input gets a clear error and changes nothing (reference backend), and
the errors of declaration, compile and the padded view name what must hold and what was given."""
import functools

import pytest
import torch

import padgraph as pg
from padgraph.spec import test_rule2_validation as V

compile_ref = functools.partial(pg.compile, backend="reference", device=torch.device("cpu"))
bs = pg.Axis("bs")


@pytest.mark.parametrize("case,edit,err,buffer,parts", V.BAD, ids=[b[0] for b in V.BAD])
def test_bad_input(case, edit, err, buffer, parts):
    """Error class; message names program, buffer, expected and given; nothing written; next call ok."""
    V.test_r2_bad_input(compile_ref, torch.device("cpu"), case, edit, err, buffer, parts)


def test_error_is_raised_before_the_body_runs():
    ran = []
    prog = pg.Program("p", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, outputs={"y": pg.Output((bs,), torch.int64)},
                      buckets=[2, 4])
    runner = compile_ref(prog, lambda x: ran.append(1) or {"y": x.a * 1}, prepare=lambda x: ran.append(0))
    with pytest.raises(pg.ContractTypeError):
        runner(a=torch.ones(2, dtype=torch.int32))
    assert ran == [] and not runner.stats.calls


@pytest.mark.parametrize("make,err,parts", [
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs,), torch.int64)}), pg.ContractValueError, ["'d'", "'a'", "pad="]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs, "x"), torch.int64, pad=0)}), pg.ContractTypeError, ["'d'", "'a'", "'x'"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input([bs], torch.int64, pad=0)}), pg.ContractTypeError, ["'d'", "'a'", "tuple"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs,), "int64", pad=0)}), pg.ContractTypeError, ["'d'", "'a'", "dtype"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, outputs={"a": pg.Output((bs,), torch.int64)}),
     pg.ContractValueError, ["'d'", "'a'", "unique"]),
    (lambda: pg.Program("d", inputs={"bucket": pg.Input((bs,), torch.int64, pad=0)}), pg.ContractValueError, ["'d'", "'bucket'"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, outputs={"y": pg.Output((pg.Axis("other"),), torch.int64)}),
     pg.ContractValueError, ["'d'", "'y'", "'other'"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs,), torch.int64, pad=0), "b": pg.Input((pg.Axis("bs2"),), torch.int64, pad=0)}),
     pg.ContractValueError, ["'d'", "bucketed", "bs2"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((4,), torch.int64)}), pg.ContractValueError, ["'d'", "padded axis"]),
    (lambda: pg.Program("d", inputs={}), pg.ContractValueError, ["'d'", "no inputs"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs, -1), torch.int64, pad=0)}), pg.ContractValueError, ["'d'", "'a'", "-1"]),
    (lambda: pg.Program("d", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, state={"kv": 0}), pg.ContractTypeError, ["'d'", "'kv'", "pg.State"]),
])
def test_declaration_errors_name_program_and_buffer(make, err, parts):
    with pytest.raises(err) as e:
        make()
    for part in parts:
        assert part in str(e.value), f"message={str(e.value)!r}, but should contain {part!r}"


def _prog():
    return pg.Program("c", inputs={"a": pg.Input((bs,), torch.int64, pad=0)}, outputs={"y": pg.Output((bs,), torch.int64)},
                      buckets=[1, 2])


@pytest.mark.parametrize("call,err,parts", [
    (lambda: pg.compile(_prog(), lambda x: x, backend="nope"), pg.ContractValueError, ["'nope'", "reference"]),
    (lambda: pg.compile("c", lambda x: x), pg.ContractValueError, ["pg.Program", "str"]),
    (lambda: pg.compile(_prog(), None), pg.ContractTypeError, ["'c'", "callable", "NoneType"]),
    (lambda: pg.compile(_prog(), lambda x: x, overflow="drop"), pg.ContractValueError, ["'c'", "'eager' or 'error'", "'drop'"]),
    (lambda: pg.compile(_prog(), lambda x: x, state={"kv": torch.zeros(1)}), pg.ContractValueError, ["'c'", "unknown ['kv']"]),
])
def test_compile_errors(call, err, parts):
    with pytest.raises(err) as e:
        call()
    for part in parts:
        assert part in str(e.value), f"message={str(e.value)!r}, but should contain {part!r}"


def test_view_and_outputs_name_what_exists():
    def body(x):
        with pytest.raises(pg.ContractAttributeError, match="'c'.*'nope'"):
            x.nope
        with pytest.raises(pg.ContractKeyError, match="'c'.*'tok'"):
            x.extent("tok")
        with pytest.raises(KeyError, match="'c'.*'tok'"):      # still a KeyError for callers
            x["tok"]
        return {"y": x.a * 1}

    out = compile_ref(_prog(), body)(a=torch.ones(2, dtype=torch.int64))
    with pytest.raises(AttributeError, match="'z'.*'y'"):
        out.z


def test_bucket_errors_say_what_was_given():
    for sizes, part in [([], "[]"), ([3, 1], "[3, 1]"), ([0], "0"), ([2, 2], "[2, 2]")]:
        with pytest.raises(ValueError, match=part.replace("[", r"\[").replace("]", r"\]")):
            pg.Buckets(sizes)
    with pytest.raises(ValueError, match=r"multiple of 8.*\[12\]"):
        pg.Buckets([8, 12, 16], multiple_of=8)
