"""padgraph.hf on hybrid models: recurrent mixers (Mamba2-style SSMs, Mamba1, short convolutions,
gated delta nets) beside attention, or alone, decode through `Decoder` to the very tokens of HF's
own `generate(do_sample=False)`: tiny random fp32 models (`hf_zoo`), bs 1, 3 and 5, left-padded
prompts of 3 to 12 tokens and 10 new ones (past every convolution kernel).

Their states live in the Target's recurrent pools, one row per request row of padgraph.llm's
engine (row 0 the sink):
  - a padded lane writes only the sink row, found by `pg.check` (`state-write`) when it does not;
  - a row no request of a call owns is left bitwise unchanged; a reused row's old state (even
    nan) is never read by the next request's prefill;
  - a mixer whose state the pool does not keep is refused by the probe, naming the decode step;
  - a mixer that keeps state outside HF's cache API stays refused, naming the layer.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402
from padgraph.hf import recurrent, support  # noqa: E402
from padgraph.llm.kv import FIRST  # noqa: E402

import hf_zoo  # noqa: E402
from test_hf_models import MAX_LEN, NEW, prompts  # noqa: E402

# most used first: Mamba2-style SSMs (alone, beside attention, in parallel with it, with MoE),
# short convolutions, gated delta nets, Mamba1
needs_api = pytest.mark.skipif(not support.linear_cache_api(), reason=(
    f"transformers {transformers.__version__}'s Cache has no linear-attention interface: hybrids are refused"))

SERVED = ["mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "lfm2", "qwen3_next",
          "qwen3_5_text", "jamba", "mamba"]
CHECKED = {"bamba", "lfm2", "qwen3_next"}       # pg.check of the decode body too (one per mixer kind)


def model_of(model_type: str):
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    return hf_zoo.build_type(model_type)


def assert_generates_like_hf(model, dec, sizes, seed: int = 0, device="cpu"):
    for n in sizes:
        ids, mask = (t.to(device) for t in prompts(n, seed=seed + n))
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        ours = dec.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        assert ours.tolist() == ref.tolist(), f"{type(model).__name__} bs {n}: tokens differ from HF's generate"


@pytest.mark.parametrize("model_type", SERVED)
@needs_api
def test_tokens_equal_hf_generate(model_type):
    model = model_of(model_type)
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference")
    assert dec.target.shape.states, f"{model_type}: served without recurrent state"
    assert_generates_like_hf(model, dec, (1, 3, 5))
    if model_type in CHECKED:
        assert all(r.ok for r in dec.check(trials=2).values()), dec.check(trials=2)


@pytest.mark.parametrize("model_type", ["bamba", "qwen3_next"])
@needs_api
def test_compiled_layers_read_and_write_the_recurrent_pool_in_place(model_type):
    """torch_compile=True on the CPU (the decoder layers as compiled regions): HF generate's tokens;
    a continuing forward reads each recurrent state from the pool inside the compiled layer and
    writes it straight back into the lanes' slots (no batch-ordered copy is made or scattered
    for it), while the convolution windows go through batch-ordered rows."""
    from padgraph.hf.recurrent import CONV, Step
    model = model_of(model_type)
    dec = pghf.Decoder(model, max_batch=3, max_len=MAX_LEN, backend="reference", torch_compile=True)
    assert_generates_like_hf(model, dec, (1, 3))
    specs = dec.target.shape.states
    pool = [torch.randn(4, *s.shape).to(s.dtype) for s in specs]
    before = [t.clone() for t in pool]
    step = Step.gathered(specs, pool, torch.tensor([2, 3]))
    assert [r is not None for r in step.rows] == [s.kind == CONV for s in specs]
    i, spec = next((i, s) for i, s in enumerate(specs) if s.kind != CONV)
    got = step.get_recurrent_state(spec.layer_idx, spec.state_idx)
    assert torch.equal(got, before[i][2:4])
    new = torch.randn(got.shape).to(got.dtype)
    step.update_recurrent_state(new, spec.layer_idx, spec.state_idx)
    assert torch.equal(pool[i][2:4], new) and torch.equal(pool[i][:2], before[i][:2])
    step.scatter(pool, torch.tensor([2, 3]))                 # the windows only: the state stays
    assert torch.equal(pool[i][2:4], new)


@needs_api
def test_kinds_and_shapes_of_the_states():
    """The pool holds what HF's own cache holds, per request: LFM2's conv window [hidden, L_cache]
    on its conv layer only; Bamba's conv window and SSM state on its Mamba layer only."""
    lfm2 = pghf.Decoder(model_of("lfm2"), max_batch=2, max_len=16, backend="reference", probe=False)
    cfg = lfm2.model.config
    assert [(s.layer_idx, s.kind, s.shape) for s in lfm2.target.shape.states] == [
        (0, "conv", (cfg.hidden_size, cfg.conv_L_cache))]
    bamba = pghf.Decoder(model_of("bamba"), max_batch=2, max_len=16, backend="reference", probe=False)
    assert [(s.layer_idx, s.kind) for s in bamba.target.shape.states] == [(0, "conv"), (0, "recurrent")]
    assert [t.shape[0] for t in bamba.worker.kv.recurrent] == [FIRST + 2] * 2   # sink, canary, two request rows
    assert set(bamba.worker.state("decode")) == {"k_cache", "v_cache", "conv_state", "ssm_state", "req_to_token"}


def assert_rows_reused(model, dec, device="cpu"):
    """Three generate calls on one Decoder, each request row reused: before the second and third,
    every request row of the pools is poisoned with nan. Each call gives HF's tokens (its prefill
    reads no old state); the rows its requests took are finite after it, and the others still
    hold the poison bitwise (no lane of the call wrote them)."""
    assert_generates_like_hf(model, dec, (5,), seed=40, device=device)
    pools = dec.worker.kv.recurrent
    for n, seed in ((3, 50), (1, 60)):
        for t in pools:
            t[FIRST:] = float("nan")                                   # a released row may hold anything
        assert_generates_like_hf(model, dec, (n,), seed=seed, device=device)
        taken = [int(r) for r in range(FIRST, pools[0].shape[0]) if bool(torch.isfinite(pools[0][r]).all())]
        assert len(taken) == n, f"rows written by a call of {n} requests: {taken}"
        for t in pools:
            rest = [r for r in range(FIRST, t.shape[0]) if r not in taken]
            assert bool(torch.isnan(t[rest]).all()), "a row no request of the call owns was written"
            assert bool(torch.isfinite(t[taken]).all()), "a reused row still holds its old state"


@needs_api
def test_slot_reuse_reads_no_old_state_and_leaves_other_rows():
    model = model_of("bamba")
    assert_rows_reused(model, pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference"))


@needs_api
def test_padded_lanes_write_only_the_sink_row():
    """Decode steps of 3 requests in a bucket of 4: the padded lane's writes land in row 0 only
    (the rows of no request, and the canary row 1, keep their contents); `pg.check` reports a
    write moved off the sink row as a state-write."""
    model = model_of("lfm2")
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, buckets=(1, 2, 4, 5), backend="reference")
    pools = dec.worker.kv.recurrent
    before = [t.clone() for t in pools]
    assert_generates_like_hf(model, dec, (3,), seed=7)
    taken = [r for r in range(pools[0].shape[0]) if not torch.equal(pools[0][r], before[0][r])]
    assert set(taken) <= {0, FIRST, FIRST + 1, FIRST + 2} and len(set(taken) - {0}) == 3, taken

    real = recurrent.Step.scatter
    try:
        recurrent.Step.scatter = lambda self, pool, slots: real(self, pool, slots.clamp(min=FIRST))
        result = dec.check(trials=2)["decode"]
    finally:
        recurrent.Step.scatter = real
    assert not result.ok and "state-write" in str(result), str(result)


@needs_api
def test_probe_refuses_a_recurrent_state_the_pool_drops(monkeypatch):
    """A gated delta net whose state is not kept (the pool's write dropped): the prefill agrees,
    the first decode step does not, and the probe names the layer."""
    monkeypatch.setattr(recurrent.Step, "update_recurrent_state",
                        lambda self, states, layer_idx, state_idx=0, **kw: states)
    with pytest.raises(pghf.UnsupportedModelError, match=r"decode step 1.*model\.layers\.0 is the first"):
        pghf.Decoder(model_of("qwen3_next"), max_batch=3, max_len=MAX_LEN, backend="reference")


@pytest.mark.parametrize("model_type, layer", [("minimax", "model.layers.0.self_attn"),
                                               ("recurrent_gemma", "model.layers.0.temporal_block")])
def test_state_kept_outside_the_cache_is_refused_naming_the_layer(model_type, layer):
    """Lightning attention (its own cache methods) and RecurrentGemma's recurrent block (state it
    keeps itself) keep no state through HF's conv / recurrent cache API: refused, named."""
    with pytest.raises(pghf.UnsupportedModelError, match="keeps state across tokens") as err:
        pghf.Decoder(model_of(model_type), max_batch=2, max_len=MAX_LEN, backend="reference")
    assert repr(layer) in str(err.value), str(err.value)


# ---- CUDA graphs (GPU only) ---------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("model_type", SERVED)
@pytest.mark.parametrize("torch_compile", [False, True], ids=["eager", "compiled"])
@needs_api
def test_cuda_tokens_equal_hf_generate(model_type, torch_compile):
    """backend="cuda": the decode step (pool gather, HF's mixers, write-back) captured in CUDA
    graphs, eager or with the decoder layers compiled as regions: HF generate's tokens."""
    model = model_of(model_type).cuda()
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="cuda", torch_compile=torch_compile)
    assert_generates_like_hf(model, dec, (1, 3, 5), device="cuda")


@pytest.mark.cuda
@needs_api
def test_cuda_slot_reuse():
    """On CUDA graphs: a second and third call reuse request rows (every request row poisoned
    with nan first) and leave the rows they do not own as they were."""
    model = model_of("qwen3_next").cuda()
    assert_rows_reused(model, pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="cuda"), device="cuda")
