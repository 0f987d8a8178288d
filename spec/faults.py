"""The fault catalogue: the padding bugs engines shipped, each injected into a small program or runner.

Each `Fault` builds a `Case` twice: with the bug and without it. `spec/inject.py` runs the
safety net on both and reports, per detector, the first call (or generated program) that caught
the bug; the clean case must be caught by none (a detector that flags a correct program is a
false alarm). Backend faults are runners (subclasses of the reference backend) that pack, cut or
stage inputs wrongly; program faults are bodies and hooks with the bug; usage faults are callers
misusing a correct runner.

The programs are a decode step over a paged KV pool and a slot-indexed recurrent pool (both with
sink row 0 and canary row 1; live rows from 2), and a draft-extend-like program whose token axis
takes its raw extent from the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

import padgraph as pg
from padgraph.eager import run_padded
from padgraph.reference import ReferenceRunner

N_KV, N_REC, H = 40, 20, 4
LIVE = 2                       # rows 0 (sink) and 1 (canary) are no request's
SIZES = (3, 8, 2, 5, 1, 7, 4, 6)


@dataclass
class Case:
    """One program, its body and calls; `runner`: a faulty Runner class (None: the backend under test)."""

    program: pg.Program
    make_body: Callable[[], Callable]            # a fresh body (the oracle runs a fresh one per call)
    make_state: Callable[[torch.device], dict]
    calls: list                                  # (raw inputs on the CPU, device extents or None)
    sample: Callable | None = None               # pg.check's sampler
    prepare: Callable | None = None
    runner: type | None = None
    misuse: Callable | None = None               # usage faults: fn(runner, state, i, out) after call i
    before_call: Callable | None = None          # fn(raw): what the caller's objects hold for the call
    graph_only: bool = False                     # the bug exists only under a capture


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str                                    # "backend", "program" or "usage"
    bug: str
    seen: str
    build: Callable[[bool], Case] = field(repr=False)   # build(faulty) -> Case


# ---- the decode program ------------------------------------------------------------------------
def decode_program(name: str = "decode") -> pg.Program:
    bs = pg.Axis("bs")
    return pg.Program(
        name,
        inputs={"loc": pg.Input((bs,), torch.int64, pad=0), "idx": pg.Input((bs,), torch.int64, pad=0),
                "x": pg.Input((bs, H), torch.float32, pad=0), "temp": pg.Input((bs,), torch.float32, pad=1.0)},
        outputs={"y": pg.Output((bs, H), torch.float32)},
        state={"kv": pg.State(sink=0, canary=1), "rec": pg.State(sink=0, canary=1)},
        buckets=pg.Buckets([1, 2, 4, 8]),
    )


def decode_state(device) -> dict:
    g = torch.Generator().manual_seed(11)
    return {"kv": torch.randn(N_KV, H, generator=g).to(device), "rec": torch.randn(N_REC, H, generator=g).to(device)}


def decode_raw(n: int, g: torch.Generator) -> dict:
    return {"loc": torch.randperm(N_KV - LIVE, generator=g)[:n] + LIVE,
            "idx": torch.randperm(N_REC - LIVE, generator=g)[:n] + LIVE,
            "x": torch.randn(n, H, generator=g), "temp": torch.rand(n, generator=g) + 0.5}


def decode_calls(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(decode_raw(n, g), None) for n in SIZES]


def decode_sample(gen: torch.Generator) -> dict:
    return decode_raw(int(torch.randint(1, 9, (1,), generator=gen)), gen)


def decode_step(x, loc, idx, temp):
    """The body's work with its routing given: KV append at loc, recurrent update at idx."""
    x.kv.index_copy_(0, loc, x.x * temp[:, None])
    h = x.rec.index_select(0, idx) * 0.5 + x.x                          # [bs, H]
    x.rec.index_copy_(0, idx, h)
    return {"y": x.kv.index_select(0, x.loc) + h}


def clean_body():
    return lambda x: decode_step(x, x.loc, x.idx, x.temp)


def decode_case(faulty: bool, bad_body: Callable, **kw) -> Case:
    return Case(decode_program(), bad_body if faulty else clean_body, decode_state, decode_calls(),
                sample=decode_sample, **kw)


# ---- backend faults: runners that stage, pad or cut inputs wrongly ------------------------------
class FreedStagingRunner(ReferenceRunner):
    """The pack reads a staged copy of the first input after it was freed: the allocator handed the
    block to the next staging, so the lanes it shares with the previous call's copy hold those."""

    backend = "inject-freed-staging"

    def _run(self, bucket, raw, ext):
        name = next(iter(self.program.inputs))
        prev, cur = getattr(self, "_staged", None), raw[name].contiguous().clone()
        self._staged = cur.clone()
        if prev is not None and prev.dtype == cur.dtype and prev.dim() == cur.dim() and cur.dim():
            k = min(prev.shape[0], cur.shape[0])
            region = tuple(slice(0, min(a, b)) for a, b in zip(prev.shape, cur.shape))
            if k:
                cur[region] = prev[region]
        return super()._run(bucket, {**raw, name: cur}, ext)


class StaleTailRunner(ReferenceRunner):
    """Pads written once, at "capture": each input's padded lanes keep what an earlier call or the body
    left there. `only`: the inputs this holds for (None: every input; draft-extend's bug was one)."""

    backend = "inject-stale-tail"
    only: tuple | None = None

    def _run(self, bucket, raw, ext):
        self._static = getattr(self, "_static", {})
        body = self.body

        def stale(x):
            for name in self.program.inputs:
                if self.only is not None and name not in self.only:
                    continue
                t, keep = x[name], self._static.get((name, bucket))
                n = raw[name].shape[0] if raw[name].dim() else 0
                if keep is not None and t.dim() and n < t.shape[0]:
                    t[n:] = keep[n:]                     # the tail as the last call left it
            outs = body(x)
            for name in self.program.inputs:
                self._static[(name, bucket)] = x[name].clone()   # after the body: its scribbles too
            return outs
        return self._into_arena(run_padded(self, bucket, raw, ext, self.device, body=stale), bucket)


class OneStaleInputRunner(StaleTailRunner):
    """Only the first declared input keeps a stale tail (draft-extend's `accept_length`, padded by
    hand in every other runner but this one)."""

    backend = "inject-one-stale-input"

    @property
    def only(self):
        return (next(iter(self.program.inputs)),)


class RowStrideRunner(ReferenceRunner):
    """Device extents applied with the host bound's row stride: a 2-d input along a device-extent axis
    is read as if its rows were `bound` elements apart (its columns' layout), not `cols`."""

    backend = "inject-row-stride"

    def _cut(self, raw, ext, dev):
        cut_ext, cut = super()._cut(raw, ext, dev)
        for name, dims in self._in_device_dims.items():
            t = raw[name]
            if t.dim() == 2 and dims and dims[0][0] == 0:
                n, bound = cut[name].shape[0], t.shape[0]
                flat = t.contiguous().reshape(-1)
                cut[name] = flat.as_strided((n, t.shape[1]), (1, bound)).clone()   # (i, j) at j*bound + i
        return cut_ext, cut


def extend_program() -> pg.Program:
    bs = pg.Axis("bs")
    tok = pg.Axis("tokens", capacity=bs * 4, device_extent=True)
    return pg.Program("draft_extend", inputs={"hidden": pg.Input((tok, 3), torch.float32, pad=0),
                                              "seq_lens": pg.Input((bs,), torch.int32, pad=1)},
                      outputs={"h": pg.Output((tok, 3), torch.float32)}, buckets=pg.Buckets([1, 2, 4]))


def extend_calls() -> list:
    g = torch.Generator().manual_seed(3)
    calls = []
    for n, valid in ((2, 5), (4, 9), (1, 2), (3, 7)):
        raw = {"hidden": torch.randn(4 * n, 3, generator=g), "seq_lens": torch.randint(1, 9, (n,), generator=g).int()}
        calls.append((raw, {"tokens": valid}))
    return calls


def extend_case(faulty: bool) -> Case:
    body = lambda: (lambda x: {"h": x.hidden * 2 + 1})       # noqa: E731
    return Case(extend_program(), body, lambda d: {}, extend_calls(), runner=RowStrideRunner if faulty else None)


# ---- program faults -----------------------------------------------------------------------------
def clamped_kv_body():
    """Padded lanes' slot clamped to the first non-sink slot (an index fixed up "to be safe")."""
    return lambda x: decode_step(x, x.loc.clamp(min=1), x.idx, x.temp)


def stale_recurrent_body():
    """Padded lanes update the recurrent row of the request in the first lane (a stale pool index)."""
    def body(x):
        idx = torch.where(x.idx == 0, x.idx[:1].expand_as(x.idx), x.idx)
        return decode_step(x, x.loc, idx, x.temp)
    return body


class RawHolder:
    """What the caller's batch object holds: the raw `loc` of the call in flight."""
    raw: torch.Tensor | None = None


def raw_metadata_case(faulty: bool) -> Case:
    """A hook builds the write slots (state `slots`) from the caller's raw `loc` instead of the view:
    lanes past the raw batch keep the slots an earlier, larger call left (SGLang #25529's shape)."""
    holder = RawHolder()
    base = decode_program()
    prog = pg.Program("decode_hook", inputs=base.inputs, outputs=base.outputs,
                      state={**base.state, "slots": pg.State()}, buckets=base.buckets)

    def hook(x):
        src = holder.raw if faulty and holder.raw is not None else x.loc
        x.slots[: src.shape[0]].copy_(src)
        if not faulty:
            x.slots[src.shape[0]:].zero_()

    def make_state(device):
        return {**decode_state(device), "slots": torch.zeros(8, dtype=torch.int64, device=device)}

    def body():
        return lambda x: decode_step(x, x.slots[: x.bucket], x.idx, x.temp)

    def before_call(raw):
        holder.raw = raw["loc"]

    return Case(prog, body, make_state, decode_calls(), sample=decode_sample, prepare=hook, before_call=before_call)


def baked_scalar_body():
    """A Python number read from the caller's object at every call: a graph keeps the capture's."""
    step = {"n": 0}

    def body(x):
        step["n"] += 1
        return decode_step(x, x.loc, x.idx, x.temp * float(step["n"] % 7 + 1))
    return body


def cached_params_body():
    """Per-request parameters kept from the body's first run (a warm-up's dummies) for every later
    call, instead of read from the call's inputs (TensorRT-LLM's leak of capture-time params)."""
    kept = {}

    def body(x):
        if x.bucket not in kept:
            kept[x.bucket] = x.temp.clone()
        return decode_step(x, x.loc, x.idx, kept[x.bucket])
    return body


def missing_factor_case(faulty: bool) -> Case:
    """A dependent axis declared without its factor: `topk` ids per request sized (bs,), not (bs * 4,)."""
    bs = pg.Axis("bs")
    width = bs if faulty else bs * 4
    prog = pg.Program("draft", inputs={"topk_ids": pg.Input((width,), torch.int64, pad=0),
                                       "scores": pg.Input((bs, 4), torch.float32, pad=0)},
                      outputs={"best": pg.Output((bs,), torch.int64)}, buckets=pg.Buckets([1, 2, 4, 8]))
    g = torch.Generator().manual_seed(5)
    calls = [({"topk_ids": torch.randint(1, 100, (4 * n,), generator=g), "scores": torch.randn(n, 4, generator=g)},
              None) for n in (2, 1, 3)]

    def body():
        def run(x):
            ids = x.topk_ids.view(-1, 4) if not faulty else x.topk_ids.view(-1, 1).expand(-1, 4)
            return {"best": ids.gather(1, x.scores.argmax(1, keepdim=True)).squeeze(1)}
        return run
    return Case(prog, body, lambda d: {}, calls)


# ---- usage faults --------------------------------------------------------------------------------
def keep_output(runner, state, i, out, kept={}):
    """Keeps call 0's output view and reads it after later calls (no copy_outputs, no clone)."""
    if i == 0:
        kept[id(runner)] = out.y
    elif id(runner) in kept:
        kept[id(runner)].sum()


def rebind_state(runner, state, i, out):
    """After call 1 the caller swaps the KV pool's storage for a fresh one (a re-allocated cache)."""
    if i == 1:
        kv = state["kv"]
        kv.set_(kv.clone())


# ---- the catalogue -------------------------------------------------------------------------------
def _usage(misuse):
    return lambda faulty: decode_case(False, clean_body, misuse=misuse if faulty else None)


FAULTS = (
    Fault("freed-staging", "backend", "a staged temporary freed before the pack reads it",
          "graph runners staging through a temporary (padgraph's own pack, before enforced lifetimes)",
          lambda f: decode_case(False, clean_body, runner=FreedStagingRunner if f else None)),
    Fault("row-stride", "backend", "device extents read with the host bound's row stride",
          "padgraph's device-extent path on 2-d inputs", extend_case),
    Fault("stale-tail", "backend", "pads not re-applied after a body scribbles over its inputs",
          "SGLang positions / req_pool_indices / topk_index",
          lambda f: decode_case(False, _scribbling_body, runner=StaleTailRunner if f else None)),
    Fault("raw-metadata", "program", "a hook building metadata from the raw buffer", "SGLang #25529",
          raw_metadata_case),
    Fault("live-kv-row", "program", "a padded lane writing a live KV row (index clamped)",
          "SGLang / vLLM padded out_cache_loc", lambda f: decode_case(f, clamped_kv_body)),
    Fault("live-recurrent-row", "program", "a padded lane writing a live recurrent row (stale pool index)",
          "SGLang #32555 and the tokenspeed engine", lambda f: decode_case(f, stale_recurrent_body)),
    Fault("unpadded-input", "backend", "a draft-extend input left unpadded", "SGLang #6987",
          lambda f: decode_case(False, clean_body, runner=OneStaleInputRunner if f else None)),
    Fault("output-past-call", "usage", "an output view read after the next call", "every graph runner",
          _usage(keep_output)),
    Fault("baked-scalar", "program", "a Python scalar baked in at capture", "CUDA-graph runners",
          lambda f: replace(decode_case(f, baked_scalar_body), graph_only=True)),
    Fault("state-rebound", "usage", "bound state re-allocated after capture", "KV cache resized after capture",
          _usage(rebind_state)),
    Fault("capture-params", "program", "parameters captured at warm-up reaching live calls", "TRTLLM-14874",
          lambda f: decode_case(f, cached_params_body)),
    Fault("missing-factor", "program", "a missing capacity factor on a dependent axis", "SGLang #27338",
          missing_factor_case),
)


def _scribbling_body():
    """The clean decode body, which then scribbles over its inputs (allowed: pads are re-applied)."""
    def body(x):
        outs = decode_step(x, x.loc, x.idx, x.temp)
        x.loc.fill_(LIVE)
        x.idx.fill_(LIVE)
        return outs
    return body


def by_name(name: str) -> Fault:
    for f in FAULTS:
        if f.name == name:
            return f
    raise KeyError(f"no fault {name!r}; the catalogue: {', '.join(f.name for f in FAULTS)}")
