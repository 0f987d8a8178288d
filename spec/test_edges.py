"""Edge cases of rules 2, 6, 7 and 10 that a runner must hold like the common ones.

2.6 / 6.4  messages name the program; a body's non-string key is a ContractValueError;
2.7        numpy scalars are numbers as pads; a complex output with a real pad is legal; an
           undeclared `_name` on the view is a ContractAttributeError, compiled or not; the view
           is read-only (assignment, deletion: ContractAttributeError), compiled or not; a large
           strided input that touches no state byte is accepted (the exact test never assumes);
7.1        a `state=` that is not a mapping is a ContractError;
7.7        batch-ordered state in a dict subclass or a dataclass with an init=False field is cut
           to the bucket like any other;
5.1 / 6.2  an output passed back as the next call's input is read before it is overwritten;
10.5       outputs never require grad, even for requires-grad inputs, past the ladder, or when
           the body returns a Parameter state; the runner keeps no earlier input alive;
10.6       a call that raises changes neither the runner's device nor its stats.
"""
import dataclasses
from fractions import Fraction
import gc
import weakref

import numpy as np
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
LADDER = pg.Buckets([1, 2, 4])


def _program(name="edges", dtype=torch.float32, pad=0.0, **kw):
    return pg.Program(name, inputs={"a": pg.Input((bs, 2), dtype, pad=pad)},
                      outputs=kw.pop("outputs", {"y": pg.Output((bs, 2), torch.float32)}),
                      buckets=LADDER, **kw)


# ---- 10.5 -------------------------------------------------------------------------------------
def test_r10_5_outputs_of_requires_grad_inputs_do_not_require_grad(compile, device):
    runner = compile(_program(), lambda x: {"y": x.a})       # the padded input as it is
    for n in (3, 9):                                           # on the ladder, and past it
        out = runner(a=torch.randn(n, 2, device=device, requires_grad=True)).y
        S.assert_equal("out.requires_grad", out.requires_grad, False, f"10.5, {n} rows")
        S.assert_equal("out.grad_fn", out.grad_fn, None, f"10.5, {n} rows")


def test_r10_5_a_requires_grad_input_is_not_kept_alive(compile, device):
    runner = compile(_program(), lambda x: {"y": x.a * 2})
    a = torch.randn(3, 2, device=device, requires_grad=True)
    ref = weakref.ref(a)
    out = runner(a=a)
    del a, out
    gc.collect()
    S.assert_equal("input alive after the call", ref() is not None, False, "10.5")


@pytest.mark.parametrize("copy_outputs", [False, True])
def test_r10_5_a_parameter_state_returned_gives_a_plain_copy(compile, device, copy_outputs):
    p = _program("pstate", outputs={"w": pg.Output((3,), torch.float32)}, state={"wt": pg.State()})
    w = torch.nn.Parameter(torch.ones(3, device=device))
    runner = compile(p, lambda x: {"w": x.wt}, state={"wt": w}, copy_outputs=copy_outputs)
    out = runner(a=torch.zeros(2, 2, device=device)).w
    S.assert_equal("out.requires_grad", out.requires_grad, False, "10.5 with 6.3")
    S.assert_equal("out shares the Parameter's memory", out.data_ptr() == w.data_ptr(), False, "6.3")


def test_r10_5_a_body_writes_a_parameter_state_in_place(compile, device):
    p = _program("pwrite", outputs={"w": pg.Output((3,), torch.float32)}, state={"wt": pg.State()})
    w = torch.nn.Parameter(torch.ones(3, device=device))

    def body(x):
        x.wt.add_(1.0)                       # no_grad: legal on a leaf that requires grad
        return {"w": x.wt * 1}
    runner = compile(p, body, state={"wt": w})
    S.assert_equal("wt after compile (10.3)", w.detach(), torch.ones(3, device=device), "10.3")
    out = runner(a=torch.ones(1, 2, device=device)).w
    S.assert_equal("w", out, torch.full((3,), 2.0, device=device), "10.5")
    S.assert_equal("wt after one call", w.detach(), torch.full((3,), 2.0, device=device), "10.5")
    S.assert_equal("w.requires_grad", w.requires_grad, True, "10.5: the caller's Parameter as it was")


# ---- 10.6 -------------------------------------------------------------------------------------
def test_r10_6_a_rejected_call_pins_no_device(backend, device):
    runner = pg.compile(_program(), lambda x: {"y": x.a * 2}, backend=backend, overflow="error")
    before = runner.device
    with pytest.raises(pg.ContractError):          # past the ladder (3.2) or off-device (2.2)
        runner(a=torch.zeros(9, 2, device="meta"))
    S.assert_equal("runner.device", runner.device, before, "10.6")
    out = runner(a=torch.ones(2, 2, device=device)).y          # the next valid call runs (2.5)
    S.assert_equal("y", out, torch.full((2, 2), 2.0, device=device), "10.6, next call")


def test_r10_6_a_failing_call_past_the_ladder_counts_no_fallback(compile, device):
    class Boom(Exception):
        pass

    def body(x):
        if x.bucket > 4:
            raise Boom("body fails")
        return {"y": x.a + 1}
    runner = compile(_program(), body)
    with pytest.raises(Boom):
        runner(a=torch.zeros(9, 2, device=device))
    S.assert_equal("stats.eager_fallbacks", runner.stats.eager_fallbacks, 0, "10.6")
    p = _program("rows", state={"c": pg.State(rows=bs)})
    runner = compile(p, lambda x: {"y": x.a + x.c}, state={"c": torch.zeros(4, 2, device=device)})
    with pytest.raises(pg.ContractError):                      # 7.7: no rows past the ladder
        runner(a=torch.zeros(9, 2, device=device))
    S.assert_equal("stats.eager_fallbacks", runner.stats.eager_fallbacks, 0, "10.6, rows state")


# ---- 2.6 / 6.4 --------------------------------------------------------------------------------
def test_r6_4_a_non_string_key_is_a_contract_value_error(compile, device):
    with pytest.raises(pg.ContractValueError, match="'keys'"):   # graph backends: at compile
        compile(_program("keys"), lambda x: {"y": x.a, 0: x.a})(a=torch.ones(2, 2, device=device))


def test_r2_6_an_unknown_output_names_the_program(compile, device):
    out = compile(_program("named"), lambda x: {"y": x.a * 1})(a=torch.ones(2, 2, device=device))
    with pytest.raises(pg.ContractAttributeError, match="program 'named'"):
        out.nope


# ---- 5.1 / 6.2 --------------------------------------------------------------------------------
@pytest.mark.parametrize("copy_outputs", [False, True])
@pytest.mark.parametrize("n", [3, 4, 9], ids=["padded", "on-bucket", "past-ladder"])
def test_r5_1_an_output_passed_back_as_an_input_is_read_before_it_is_written(compile, device,
                                                                             copy_outputs, n):
    p = pg.Program("chain", inputs={"a": pg.Input((bs,), torch.int64, pad=0)},
                   outputs={"y": pg.Output((bs,), torch.int64)}, buckets=LADDER)
    runner = compile(p, lambda x: {"y": x.a * 2 + 1}, copy_outputs=copy_outputs)
    y = torch.arange(n, device=device)
    for _ in range(4):                      # the next step's input is this step's output
        prev = y.clone()
        out = runner(a=y).y
        S.assert_equal("y", out, prev * 2 + 1, "5.1 / 6.2: the input read before the output is written")
        if copy_outputs:
            S.assert_equal("the input (an earlier own output)", y, prev, "6.2: copy_outputs keeps it")
        y = out


# ---- 2.7 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad,dtype", [(np.int64(3), torch.int64), (np.float32(0.5), torch.float32),
                                       (np.bool_(True), torch.bool)], ids=["int64", "float32", "bool_"])
def test_r2_7_numpy_scalar_pads_are_numbers(compile, device, pad, dtype):
    p = pg.Program("np", inputs={"a": pg.Input((bs,), dtype, pad=pad)},
                   outputs={"y": pg.Output((bs,), dtype, pad=pad)}, buckets=LADDER)
    runner = compile(p, lambda x: {"y": x.a[-1:].expand(x.bucket).clone()})   # the last lane
    out = runner(a=torch.zeros(3, dtype=dtype, device=device)).y             # bucket 4: a pad
    S.assert_equal("y (the padded lane)", out, torch.full((3,), pad.item(), dtype=dtype,
                                                          device=device), "2.7")


def test_r2_7_a_complex_output_with_a_real_pad_is_legal(compile, device):
    p = _program("cplx", outputs={"y": pg.Output((bs, 2), torch.complex64)})
    out = compile(p, lambda x: {"y": torch.complex(x.a, -x.a)})(a=torch.ones(2, 2, device=device)).y
    S.assert_equal("y", out, torch.complex(torch.ones(2, 2), -torch.ones(2, 2)).to(device), "2.7")
    with pytest.raises(pg.ContractTypeError):
        pg.Program("cin", inputs={"a": pg.Input((bs,), torch.complex64, pad=0)}, outputs={},
                   buckets=LADDER)


@pytest.mark.parametrize("tc", [False, True], ids=["eager", "torch_compile"])
def test_r2_7_an_undeclared_underscore_name_is_a_contract_attribute_error(compile, device, tc):
    def body(x):
        x._scratch
        return {"y": x.a}
    with pytest.raises(pg.ContractAttributeError, match="_scratch"):
        compile(_program("under"), body, torch_compile=tc)(a=torch.ones(2, 2, device=device))


@pytest.mark.parametrize("tc", [False, True], ids=["eager", "torch_compile"])
@pytest.mark.parametrize("target", ["a", "extra", "bucket"])
def test_r2_7_the_view_is_read_only(compile, device, tc, target):
    def body(x):
        setattr(x, target, x.a * 2)
        return {"y": x.a}
    with pytest.raises(pg.ContractAttributeError, match=f"read-only.*x.{target}"):
        compile(_program("ro"), body, torch_compile=tc)(a=torch.ones(2, 2, device=device))

    def deleting(x):
        del x.a
        return {"y": x.a}
    with pytest.raises(pg.ContractAttributeError, match="read-only"):
        compile(_program("ro"), deleting, torch_compile=tc)(a=torch.ones(2, 2, device=device))


def test_r2_7_a_large_strided_input_beside_state_is_accepted(compile, device):
    n = (1 << 22) + 2                        # more runs than the overlap test lists at once
    p = pg.Program("interleaved", inputs={"a": pg.Input((bs, n), torch.float32, pad=0.0)},
                   outputs={"y": pg.Output((bs,), torch.float32)}, state={"s": pg.State()},
                   buckets=pg.Buckets([1, 2]))
    buf = torch.zeros(n, 2, device=device)
    runner = compile(p, lambda x: {"y": x.a[:, :4].sum(1)}, state={"s": buf[:, 1]})
    runner(a=buf[:, 0].unsqueeze(0))         # even columns: no byte of the odd ones
    with pytest.raises(pg.ContractValueError, match="share memory"):
        runner(a=buf[:, 1].unsqueeze(0))     # the state's own bytes


# ---- 7.1 / 7.7 --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["tensor", "list", "int"])
def test_r7_1_a_state_that_is_not_a_mapping_is_a_contract_error(compile, device, bad):
    value = {"tensor": torch.zeros(3, device=device), "list": [torch.zeros(3, device=device)],
             "int": 5}[bad]
    with pytest.raises(pg.ContractError, match="'st1'"):
        compile(_program("st1", state={"kv": pg.State()}), lambda x: {"y": x.a}, state=value)


class _MyDict(dict):
    pass


@dataclasses.dataclass
class _Late:
    k: torch.Tensor
    v: torch.Tensor = dataclasses.field(init=False, default=None)


def _rows_seen(compile, device, value, read):
    p = pg.Program("rows", inputs={"a": pg.Input((bs,), torch.float32, pad=0.0)},
                   outputs={"seen": pg.Output((bs,), torch.int64)}, state={"c": pg.State(rows=bs)},
                   buckets=LADDER)
    runner = compile(p, lambda x: {"seen": torch.zeros(x.bucket, dtype=torch.int64,
                                                       device=x.a.device) + read(x.c)},
                     state={"c": value})
    return runner(a=torch.zeros(1, device=device)).seen.tolist()


def test_r7_7_a_dict_subclass_is_cut_to_the_bucket(compile, device):
    seen = _rows_seen(compile, device, _MyDict(k=torch.zeros(4, 2, device=device)),
                      lambda c: c["k"].shape[0] + 10 * isinstance(c, _MyDict))
    S.assert_equal("rows seen (+10: the subclass kept)", seen, [11], "7.7")


def test_r7_7_a_dataclass_init_false_field_is_cut_to_the_bucket(compile, device):
    c = _Late(torch.zeros(4, 2, device=device))
    c.v = torch.zeros(4, 3, device=device)
    seen = _rows_seen(compile, device, c, lambda c: -1 if c.v is None else c.v.shape[0])
    S.assert_equal("rows of the init=False field seen", seen, [1], "7.7")




# ---- 2.1 / 2.2 / 2.7: what a call is given ---------------------------------------------------
def test_r2_1_unknown_names_of_mixed_types_are_a_contract_type_error(compile, device):
    runner = compile(_program("names"), lambda x: {"y": x.a})
    a = torch.ones(2, 2, device=device)
    with pytest.raises(pg.ContractTypeError, match=r"'names'.*unknown \['zz', 1\]"):
        runner.call({"a": a, 1: a, "zz": a})
    with pytest.raises(pg.ContractTypeError, match="'names'.*mapping"):
        runner.call([("a", a)])
    S.assert_equal("y", runner(a=a).y, a, "2.5: the next valid call")


def test_r2_2_device_cpu_0_is_the_cpu(backend, device):
    if device.type != "cpu":
        pytest.skip("a CPU device option")
    runner = pg.compile(_program("cpu0"), lambda x: {"y": x.a + 1}, backend=backend, device="cpu:0")
    out = runner(a=torch.ones(2, 2)).y
    S.assert_equal("y", out, torch.full((2, 2), 2.0), "2.2: device='cpu:0' is torch's cpu")


@pytest.mark.parametrize("pad,dtype,want", [(Fraction(1, 2), torch.float32, 0.5),
                                            (Fraction(3, 1), torch.int64, 3),
                                            (pg.Fill(Fraction(2 ** 62 + 1)), torch.int64, 2 ** 62 + 1)],
                         ids=["half", "three", "past-2**53"])
def test_r2_7_a_fraction_pad_is_the_number_it_holds(compile, device, pad, dtype, want):
    p = pg.Program("frac", inputs={"a": pg.Input((bs,), dtype, pad=pad)},
                   outputs={"y": pg.Output((bs,), dtype)}, buckets=LADDER)
    out = compile(p, lambda x: {"y": x.a[-1:].expand(x.bucket).clone()})(
        a=torch.zeros(3, dtype=dtype, device=device)).y                    # bucket 4: a pad
    S.assert_equal("y (the padded lane)", out, torch.full((3,), want, dtype=dtype, device=device), "2.7")


# ---- 6.4 / 6.2: what the body returns, what the caller keeps ---------------------------------
@pytest.mark.parametrize("bad", ["meta", "sparse"])
def test_r6_4_an_output_off_the_device_or_not_dense_is_a_contract_value_error(compile, device, bad):
    def body(x):
        y = x.a * 1
        return {"y": torch.empty_like(y, device="meta") if bad == "meta" else y.to_sparse()}
    with pytest.raises(pg.ContractValueError, match="output 'y'.*(device|layout)"):
        compile(_program("outdev"), body)(a=torch.ones(2, 2, device=device))


def test_r6_2_an_unknown_output_key_is_a_contract_key_error(compile, device):
    out = compile(_program("okey"), lambda x: {"y": x.a * 1})(a=torch.ones(2, 2, device=device))
    with pytest.raises(pg.ContractKeyError, match="program 'okey'.*'nope'"):
        out["nope"]
    S.assert_equal("out.get('nope')", out.get("nope"), None, "6.2: a dict")


def test_r2_7_a_numpy_int_sink_is_an_int():
    p = _program("npsink", state={"kv": pg.State(sink=np.int64(0))})
    S.assert_equal("sink rows", p.state["kv"].sink_rows, (0,), "2.7")


@pytest.mark.parametrize("tc", [False, True], ids=["eager", "torch_compile"])
def test_r7_7_batch_ordered_leaves_over_one_buffer(compile, device, tc):
    p = pg.Program("kvrows", inputs={"a": pg.Input((bs,), torch.float32, pad=0.0)},
                   outputs={"y": pg.Output((bs,), torch.float32)},
                   state={"c": pg.State(rows=bs)}, buckets=pg.Buckets([2, 4]))

    def body(x):
        x.c["k"].add_(x.a)                   # column 0 of the buffer that "all" is
        return {"y": x.c["all"][:, 0] * 1}
    big = torch.zeros(4, 2, device=device)
    runner = compile(p, body, state={"c": {"k": big[:, 0], "all": big}}, torch_compile=tc)
    out = runner(a=torch.tensor([1.0, 2.0, 3.0], device=device)).y
    S.assert_equal("y", out, torch.tensor([1.0, 2.0, 3.0], device=device), "7.7 with torch_compile")
