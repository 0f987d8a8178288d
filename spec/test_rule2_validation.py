"""Rule 2: raw inputs are validated before anything is written (SPEC.md §2).

Each bad input is one case: the error class, a message naming the program, the buffer, what was
expected and what was given; nothing written (caller's tensors, state, stats); the next valid
call still correct.
"""
import pytest
import torch

import padgraph as pg
from padgraph.spec import support as S

bs = pg.Axis("bs")
tok = pg.Axis("tok", capacity=bs * 2)
LARGEST = S.LADDER[-1]


def program(name="validate"):
    return pg.Program(
        name,
        inputs={
            "ids": pg.Input((tok,), torch.int64, pad=0),
            "seq_lens": pg.Input((bs,), torch.int32, pad=1),
            "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge()),
            "h": pg.Input((bs, 4), torch.float32, pad=0),
            "topk": pg.Input((bs * 2,), torch.int64, pad=0),
        },
        outputs={"y": pg.Output((bs,), torch.int32), "z": pg.Output((tok,), torch.int64),
                 "w": pg.Output((bs, 4), torch.float32), "t": pg.Output((bs * 2,), torch.int64)},
        state={"kv": pg.State(sink=0)},
        buckets=pg.Buckets(list(S.LADDER)),
    )


def body(x):
    x.kv.add_(1)   # counts the calls that ran
    return {"y": x.seq_lens * 2 + x.cu[1:] - x.cu[:-1], "z": x.ids + 1, "w": x.h * 2, "t": x.topk * 3}


def raw_inputs(device, n=3, n_tok=5):
    g = torch.Generator().manual_seed(n * 10 + n_tok)
    return {
        "ids": torch.randint(0, 100, (n_tok,), generator=g).to(device),
        "seq_lens": torch.randint(1, 50, (n,), generator=g).int().to(device),
        "cu": torch.arange(n + 1, dtype=torch.int32).mul(3).to(device),
        "h": torch.randn(n, 4, generator=g).to(device),
        "topk": torch.randint(0, 100, (2 * n,), generator=g).to(device),
    }


def expected(raw):
    return {"y": raw["seq_lens"] * 2 + raw["cu"][1:] - raw["cu"][:-1], "z": raw["ids"] + 1,
            "w": raw["h"] * 2, "t": raw["topk"] * 3}


def _set(name, value_fn):
    def edit(raw, device, kv):
        raw = dict(raw)
        raw[name] = value_fn(raw, device, kv)
        return raw
    return edit


def _drop(name):
    return lambda raw, device, kv: {k: v for k, v in raw.items() if k != name}


def _shrink_all_to_zero(raw, device, kv):
    return raw_inputs(device, n=0, n_tok=0)


# (case id, edit of a valid raw dict, error class, buffer named, parts the message must hold)
BAD = [
    ("dtype", _set("seq_lens", lambda r, d, kv: r["seq_lens"].long()),
     pg.ContractTypeError, "seq_lens", ["int32", "int64"]),
    ("device", _set("seq_lens", lambda r, d, kv: torch.empty(3, dtype=torch.int32, device="meta")),
     pg.ContractValueError, "seq_lens", ["device", "meta"]),
    ("rank", _set("h", lambda r, d, kv: r["h"][:, 0].contiguous()),
     pg.ContractValueError, "h", ["rank", "2", "1"]),
    ("fixed-dim", _set("h", lambda r, d, kv: torch.zeros(3, 5, device=d)),
     pg.ContractValueError, "h", ["4", "(3, 5)"]),
    ("extents-disagree", _set("cu", lambda r, d, kv: torch.arange(6, dtype=torch.int32, device=d)),
     pg.ContractValueError, "cu", ["'seq_lens'", "bs=3", "bs=5"]),
    ("bs+1-empty", _set("cu", lambda r, d, kv: torch.zeros(0, dtype=torch.int32, device=d)),
     pg.ContractValueError, "cu", ["bs+1", "0"]),
    ("size-factor-not-whole", _set("topk", lambda r, d, kv: torch.zeros(5, dtype=torch.int64, device=d)),
     pg.ContractValueError, "topk", ["bs*2", "5"]),
    ("bucketed-axis-zero", _shrink_all_to_zero, pg.ContractValueError, "bs", [">= 1", "0"]),
    ("dependent-axis-past-capacity",
     _set("ids", lambda r, d, kv: torch.zeros(2 * LARGEST + 1, dtype=torch.int64, device=d)),
     pg.BucketOverflowError, "ids", ["tok", str(2 * LARGEST), str(2 * LARGEST + 1)]),
    ("bucketed-axis-past-ladder", lambda r, d, kv: raw_inputs(d, n=LARGEST + 1, n_tok=1),
     pg.BucketOverflowError, "bs", [str(LARGEST), str(LARGEST + 1)]),
    ("missing-name", _drop("h"), pg.ContractTypeError, "h", ["missing"]),
    ("unknown-name", lambda r, d, kv: dict(r, extra=r["h"]), pg.ContractTypeError, "extra", ["unknown"]),
    ("non-tensor", _set("seq_lens", lambda r, d, kv: [1, 2, 3]),
     pg.ContractTypeError, "seq_lens", ["torch.Tensor", "list"]),
    ("aliases-state", _set("ids", lambda r, d, kv: kv[:5]),
     pg.ContractValueError, "ids", ["'kv'"]),
]


@pytest.mark.parametrize("case,edit,err,buffer,parts", BAD, ids=[b[0] for b in BAD])
def test_r2_bad_input(compile, device, case, edit, err, buffer, parts):
    kv = torch.zeros(16, dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv}, overflow="error")
    good = raw_inputs(device)
    runner(**good)                                   # a valid call first: the runner is warm
    bad = edit(good, device, kv)
    before = {k: v.clone() for k, v in bad.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    kv_before, calls_before = kv.clone(), sum(runner.stats.calls.values())
    with pytest.raises(err) as e:
        runner(**bad)
    text = str(e.value)
    for part in ["'validate'", repr(buffer)] + parts:
        assert part in text, S.msg("error message", repr(text), f"a message containing {part!r}", case)
    assert isinstance(e.value, pg.ContractError), S.msg("error class", type(e.value).__mro__, "a pg.ContractError", case)
    for k, v in before.items():
        S.assert_equal(f"caller's {k!r} after the rejected call", bad[k], v, case)
    S.assert_equal("bound state after the rejected call", kv, kv_before, case)
    S.assert_equal("calls counted", sum(runner.stats.calls.values()), calls_before, case)
    nxt = raw_inputs(device, n=5, n_tok=7)
    out = runner(**nxt)
    for k, v in expected(nxt).items():
        S.assert_close(f"output {k!r} of the next valid call", out[k], v, case)
    S.assert_equal("bound state after the next valid call", kv, kv_before + 1, case)


def test_r2_3_extent_inference(compile, device):
    """Extents come from shapes: bs from seq_lens/cu/h/topk (k*n + c), tok from ids; tok may be 0."""
    kv = torch.zeros(16, dtype=torch.int64, device=device)
    runner = compile(program(), body, state={"kv": kv})
    for n, n_tok in [(1, 0), (3, 5), (4, 8), (2, 9), (8, 16)]:
        raw = raw_inputs(device, n=n, n_tok=n_tok)
        out = runner(**raw)
        case = f"bs={n}, tok={n_tok}"
        S.assert_equal("shape of y", tuple(out.y.shape), (n,), case)
        S.assert_equal("shape of z", tuple(out.z.shape), (n_tok,), case)
        S.assert_equal("shape of t", tuple(out.t.shape), (2 * n,), case)


def test_r2_4_same_tensor_for_two_inputs(compile, device):
    """Inputs may share memory with one another: both are read, neither written."""
    bs_ = pg.Axis("bs")
    prog = pg.Program("twice", inputs={"a": pg.Input((bs_,), torch.int64, pad=0),
                                       "b": pg.Input((bs_,), torch.int64, pad=5)},
                      outputs={"y": pg.Output((bs_,), torch.int64)}, buckets=pg.Buckets(list(S.LADDER)))

    def body2(x):
        y = x.a * 10 + x.b
        x.a.add_(1)                 # writes its own padded copy, never the caller's tensor
        return {"y": y}

    runner = compile(prog, body2)
    t = torch.arange(3, device=device, dtype=torch.int64)
    keep = t.clone()
    out = runner(a=t, b=t)
    S.assert_equal("y", out.y, keep * 11, "a and b the same tensor")
    S.assert_equal("the shared caller tensor", t, keep, "a and b the same tensor")
    out = runner(a=t[1:], b=t[:2])
    S.assert_equal("y", out.y, keep[1:] * 10 + keep[:2], "overlapping views")


def test_r2_6_error_classes_refine_builtins():
    pairs = [(pg.ContractValueError, ValueError), (pg.ContractTypeError, TypeError),
             (pg.ContractRuntimeError, RuntimeError), (pg.BucketOverflowError, pg.ContractValueError),
             (pg.StateStorageError, pg.ContractRuntimeError), (pg.CaptureError, pg.ContractRuntimeError)]
    for cls, base in pairs:
        assert issubclass(cls, base) and issubclass(cls, pg.ContractError), \
            S.msg(f"bases of {cls.__name__}", cls.__mro__, f"including {base.__name__} and ContractError", "r2.6")
