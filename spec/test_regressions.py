"""Named regression cases: holes the generated suite (or a user) found, each kept as it was shrunk.

Each case names the rule it breaks and what a backend did wrong. They run on every backend like
the rest of the suite; several only ever failed on `cuda` (the pack kernel, the per-call staging).
"""
from __future__ import annotations

import threading

import pytest
import torch

import padgraph as pg
from padgraph.spec import generated as G
from padgraph.spec.cases import run_case
from padgraph.spec import support as S

bs = pg.Axis("bs")


def test_r1_strided_inputs_never_read_another_inputs_copy(compile, device):
    """Two non-contiguous raw inputs: the cuda pack read both from one freed temporary (the second
    input's dense copy reused the first's block before the pack ran): o was x.b*3 + 100."""
    program = pg.Program("strided2", inputs={"a": pg.Input((bs, 3), torch.float32, pad=0),
                                              "b": pg.Input((bs, 3), torch.float32, pad=0)},
                         outputs={"o": pg.Output((bs, 3), torch.float32)}, buckets=pg.Buckets([4]))
    runner = compile(program, lambda x: {"o": (x.a + 100) + x.b * 2})
    base = torch.arange(15.).view(3, 5).to(device)
    a, b = base[:, 1:4], base.t().contiguous().t()[:, :3]
    for _ in range(3):
        S.assert_equal("o", runner(a=a, b=b).o.cpu(), (a + 100 + b * 2).cpu(), "strided a and b")


@pytest.mark.parametrize("shape", ["2xtok", "bsxtok", "two_device_axes"])
def test_r11_device_extent_on_2d_layouts_reads_the_right_rows(shape, options, backend, device):
    """A device extent below the host bound on a (2, tok) / (bs, tok) input: the pack read row 1
    onward with the device extent's row stride instead of the raw tensor's (another row's values)."""
    dims = {"2xtok": (2, ("t1", 1, 0)), "bsxtok": (("bs", 1, 0), ("t1", 1, 0)),
            "two_device_axes": (("t1", 1, 0), ("t2", 1, 0))}[shape]
    recipe = G.Recipe(axes=(("t1", 2, 0, True), ("t2", 1, 1, True)), ladder=(2, 4),
                      inputs=(("a", dims, torch.int32, ("fill", -1)), ("c", (("bs", 1, 0),), torch.int8, ("fill", 0)),
                              ("d", (("t2", 1, 0),), torch.int8, ("fill", 0))),
                      echo=(("a", "clone", -7),))
    calls = [G.Call(ext=(("bs", 3), ("t1", 5), ("t2", 4)), dev=(("t1", 2), ("t2", 1)), seed=s) for s in range(3)]
    run_case(recipe, calls, backend=backend, device=device, **options)


@pytest.mark.parametrize("dtype,pad", [(torch.float32, -3.4028235e38), (torch.float16, 65519.0),
                                       (torch.bfloat16, 3.39e38), (torch.float8_e4m3fn, 449.0),
                                       (torch.float8_e5m2, -57344.0)])
def test_r1_pads_at_a_dtype_limit_are_written_as_the_dtype_holds_them(dtype, pad, options, backend, device):
    """Program() accepted these (they round to the dtype's largest value), then every padded call
    raised torch's 'value cannot be converted ... without overflow'."""
    recipe = G.Recipe(ladder=(4,), inputs=(("m", (("bs", 1, 0), 3), dtype, ("fill", pad)),),
                      echo=(("m", "clone", pad),), digest=("m",))
    run_case(recipe, [G.Call(ext=(("bs", 1),)), G.Call(ext=(("bs", 3),), seed=1)],
               backend=backend, device=device, **options)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.float8_e5m2])
def test_r1_edge_pads_of_every_dtype(dtype, options, backend, device):
    """Edge on a (fixed, tok) input of a dtype torch has no index_select kernel for (reference)."""
    recipe = G.Recipe(axes=(("t1", 1, 1, False),), ladder=(2, 5),
                      inputs=(("e", (3, ("t1", 1, 0)), dtype, ("edge", 0)), ("c", (("bs", 1, 0),), torch.int8, ("fill", 0))),
                      echo=(("e", "clone", 0),))
    run_case(recipe, [G.Call(ext=(("bs", 2), ("t1", 2)), seed=4), G.Call(ext=(("bs", 1), ("t1", 0)))],
               backend=backend, device=device, **options)


@pytest.mark.parametrize("form", ["unkeyed", "keyed", "custom", "dataclass"])
def test_r7_state_classes_registered_without_key_functions(form, options, backend, device):
    """A class registered with torch's pytree without flatten_with_keys_fn failed at pg.compile
    with torch's ValueError."""
    recipe = G.Recipe(ladder=(2, 4), inputs=(("h", (("bs", 1, 0),), torch.int32, ("fill", 0)),
                                             ("slot", (("bs", 1, 0),), torch.int64, ("fill", 0))),
                      state="sink", state_form=form)
    run_case(recipe, [G.Call(ext=(("bs", 3),), seed=2)], backend=backend, device=device, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_r7_9_a_released_slots_nan_stays_bit_for_bit(dtype, options, backend, device):
    """Rule 7.9.3 with a released slot holding nan: a 2-byte pool written back with torch's CPU
    scatter_ had the nan of rows no lane wrote rewritten (0x7fc0 -> 0xffff); a body that writes
    with index_copy_ / index_put_ keeps them, and so must every backend around it."""
    inputs = (("r_slot", (("bs", 1, 0),), torch.int64, ("fill", 0)),
              ("r_fresh", (("bs", 1, 0),), torch.bool, ("fill", True)),
              ("r_x", (("bs", 1, 0), 3), dtype, ("fill", float("nan"))))
    for how in ("index_copy", "index_put"):
        recipe = G.Recipe(ladder=(1, 4), inputs=inputs, recurrent="pool", rec_form="dict", rec_dtype=dtype,
                          rec_write=how)
        calls = [G.Call(ext=(("bs", 2),), lanes=((1, True), (4, True))),
                 G.Call(ext=(("bs", 1),), lanes=((1, False),), seed=1),
                 G.Call(ext=(("bs", 3),), lanes=((2, True), (4, False), (3, True)), poison=(1,), seed=2),
                 G.Call(ext=(("bs", 1),), lanes=((1, True),), seed=3)]
        run_case(recipe, calls, backend=backend, device=device, **options)


def _threads_program():
    return pg.Program("threads", inputs={"a": pg.Input((bs,), torch.int64, pad=0)},
                      outputs={"o": pg.Output((bs,), torch.int64)}, buckets=pg.Buckets([8]))


def test_r4_a_reentrant_call_raises(compile, device, options):
    """A runner called from its own prepare hook overwrote the outer call's staged inputs."""
    if options.get("pack") == "in-graph":
        pytest.skip("a prepare hook needs the eager pack (it reads the packed view before the replay)")
    program = _threads_program()
    inner = {}

    def hook(x):
        if inner.get("on"):
            inner["on"] = False
            with pytest.raises(pg.ContractRuntimeError, match="inside its own call"):
                runner(a=torch.zeros(2, dtype=torch.int64, device=device))
            inner["raised"] = True

    runner = compile(program, lambda x: {"o": x.a * 3}, prepare=hook, copy_outputs=True)
    inner["on"] = True
    out = runner(a=torch.arange(5, device=device))
    assert inner.get("raised"), "the hook's inner call did not run"
    S.assert_equal("o", out.o.cpu(), torch.arange(5) * 3, "outer call after a rejected re-entrant call")


def test_r4_calls_from_several_threads_run_one_at_a_time(compile, device):
    """Calls from several threads (copy_outputs=True) returned another thread's outputs."""
    runner = compile(_threads_program(), lambda x: {"o": x.a * 3}, copy_outputs=True)
    results, errors = {}, []

    def worker(k):
        try:
            for i in range(20):
                a = torch.full((1 + (k + i) % 8,), 100 * k + i, dtype=torch.int64, device=device)
                results[(k, i)] = (runner(a=a).o, a * 3)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for key, (got, want) in results.items():
        S.assert_equal("o", got.cpu(), want.cpu(), f"thread {key[0]} call {key[1]}")
