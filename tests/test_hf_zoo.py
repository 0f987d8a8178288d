"""Every decoder-only causal LM this transformers ships, as a tiny random model (`hf_zoo`): padgraph.hf
decodes it to `model.generate(do_sample=False)`'s very tokens (bs 1, 3 and 5, left-padded prompts,
prompts plus new tokens longer than its sliding windows, attention chunks and convolution kernels),
or refuses it at `Decoder(...)` with a message naming a real cause. Never wrong tokens, never a raw
error.

docs/hf_models.md lists each architecture's outcome; it is generated from this sweep
(`python tests/test_hf_zoo.py --write`), and each test checks its architecture against it, so a
served model that becomes refused (or the reverse) fails here.

By default a representative subset runs: one architecture per mechanism served or refused (under
20 s on 2 cores). PADGRAPH_HF_SWEEP=all runs every architecture (about a minute on 2 cores; a cold
first run took about 3).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402

import hf_zoo  # noqa: E402
from test_hf_models import prompts  # noqa: E402

DOC = Path(__file__).parents[1] / "docs" / "hf_models.md"
NEW, MAX_LEN, ROWS = 10, 32, (1, 3, 5)
REPRESENTATIVE = [      # one per mechanism: plain, sinks, two calls a layer, MLA, per-layer widths, fused
    "llama", "gpt_oss", "diffllama", "deepseek_v3", "gemma4_text", "gpt2",     # q/k/v; chunked and dynamic masks,
    "llama4_text", "doge", "lfm2", "nemotron", "mamba", "qwen3_next",          # short convs, kwargs not passed on,
    "bamba", "minimax", "dory", "gemma3n_text", "zamba"]                         # SSMs, gated delta nets, an SSM
#          beside attention, state kept outside HF's cache API (refused); a layer run in loops, each pass with
#          its own keys; layers that reuse another layer's keys; an attention module shared by layers (refused)
CAUSES = {   # a refusal's short cause -> the words of padgraph's message that say it
    "state kept across tokens": "keeps state across tokens",
    "model's own mask": "HF's attention mask",
    "attention keyword not applied": "to the attention function; padgraph",
    "keywords not passed to attention": "without the keyword arguments",
    "no attention interface": "_supports_attention_backend",
    "no attention call": "no layer called",
    "logits differ on the probe": "padgraph's logits differ",
    "needs what HF builds for its own attention": "fails with padgraph's attention function",
    "probe fails through padgraph's path": "fails through padgraph's path",
    "attention without a layer index": "no layer_idx to key its cache by",
}


@dataclass(frozen=True)
class Outcome:
    model_type: str
    status: str          # served / refused / not built (the tiny config this sweep gives is invalid)
    cause: str = ""
    message: str = ""

    def row(self) -> str:
        msg = re.sub(r"\d+\.\d+(e-?\d+)?", "…", self.message).replace("|", "/")
        return f"| `{self.model_type}` | {self.status} | {self.cause} | {msg} |"


def first_line(e: BaseException, width: int) -> str:
    """The innermost cause of `e` (a config validator's own error, not its wrapper's header), as
    `Type: first line`, at most `width` characters of it."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {(str(e) or '?').strip().splitlines()[0][:width]}"


def cause_of(message: str) -> str:
    """The first cause whose words the message holds (a mask or state cause over the probe's)."""
    return next((c for c, words in CAUSES.items() if words in message), "")


def tiny_model(model_type: str):
    """hf_zoo's model, one whose own generate runs: as many KV heads as heads where 2 fail (MLA)."""
    ids, mask = prompts(3, seed=3)
    for overrides in ({}, {"num_key_value_heads": 4}):
        try:
            model = hf_zoo.build_type(model_type, **overrides)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=2)
            return model
        except Exception:
            if overrides:
                raise


def outcome(model_type: str) -> Outcome:
    """Decoder(...) and generate at bs 1 / 3 / 5 against HF's; raw errors propagate."""
    try:                            # the sweep's tiny config, not padgraph: recorded, not judged
        model = tiny_model(model_type)
    except Exception as e:
        return Outcome(model_type, "not built", "", first_line(e, 160))
    try:
        dec = pghf.Decoder(model, max_batch=max(ROWS), max_len=MAX_LEN, backend="reference")
    except pghf.UnsupportedModelError as e:
        return Outcome(model_type, "refused", cause_of(str(e)), str(e).split(": ", 1)[-1][:400])
    for n in ROWS:
        ids, mask = prompts(n, seed=n)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        ours = dec.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        if ours.tolist() != ref.tolist():
            return Outcome(model_type, "WRONG TOKENS", "", f"bs {n}")
    return Outcome(model_type, "served")


def outcome_or_error(model_type: str) -> Outcome:
    """`outcome`, a raw error recorded as one (for the doc; the test fails on it)."""
    try:
        return outcome(model_type)
    except Exception as e:
        return Outcome(model_type, "RAW ERROR", "", f"{type(e).__name__}: {(str(e) or '?').splitlines()[0][:160]}")


def documented() -> dict[str, tuple[str, str]]:
    """model_type -> (status, cause) as docs/hf_models.md lists them, where it was generated with
    this transformers (another version's architectures may differ: then nothing to compare)."""
    text = DOC.read_text() if DOC.exists() else ""
    if f"(transformers {transformers.__version__})" not in text:
        return {}
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| ([^|]*) \|", text, re.M)
    return {t: (s.strip(), c.strip()) for t, s, c in rows}


def selected() -> list[str]:
    everything = hf_zoo.architectures()
    if os.environ.get("PADGRAPH_HF_SWEEP") == "all":
        return everything
    return [t for t in REPRESENTATIVE if t in everything]


@pytest.mark.parametrize("model_type", selected())
def test_served_exactly_or_refused_with_a_cause(model_type):
    got = outcome(model_type)
    if got.status == "not built":
        pytest.skip(f"{model_type}: the sweep's tiny config does not build here ({got.message})")
    assert got.status != "WRONG TOKENS", f"{model_type}: tokens differ from HF's generate at {got.message}"
    if got.status == "refused":
        assert got.cause, f"{model_type}: refused without a cause this sweep knows: {got.message}"
    doc = documented()
    if model_type in doc:
        assert doc[model_type] == (got.status, got.cause), (
            f"{model_type}: docs/hf_models.md says {doc[model_type]}, the sweep gives {(got.status, got.cause)}; "
            f"regenerate with `python tests/test_hf_zoo.py --write` if the change is meant")


def write_doc() -> None:
    """docs/hf_models.md from a sweep of every architecture."""
    outcomes = [outcome_or_error(t) for t in hf_zoo.architectures()]
    served = [o for o in outcomes if o.status == "served"]
    refused = [o for o in outcomes if o.status == "refused"]
    lines = [
        "# Hugging Face architectures and padgraph.hf",
        "",
        f"Generated by `python tests/test_hf_zoo.py --write` (transformers {transformers.__version__}); "
        "`tests/test_hf_zoo.py` checks each row. Each architecture is a tiny random model built from its config "
        f"(`tests/hf_zoo.py`): **served** means `padgraph.hf.Decoder` gives `model.generate(do_sample=False)`'s "
        f"tokens at batch sizes 1, 3 and 5 with left padding, {NEW} new tokens past prompts of 3 to 12, beyond "
        "sliding windows, attention chunks and convolution kernels of 3 and 4 (a hybrid's recurrent mixers, "
        "SSMs, short convolutions and gated delta nets, keep their state in the Decoder's pool of one row per "
        "request); **refused** means `Decoder(...)` raised `UnsupportedModelError` with the cause shown; "
        "**not built** means this sweep's tiny config is not valid for the architecture (not judged).",
        "",
        "Whatever the architecture, some configurations are refused only where `max_len` (with the engine's "
        "margins) reaches them: rotary embeddings whose frequencies HF picks from the longest position of each "
        "forward (`longrope` past `original_max_position_embeddings`, `dynamic` types past "
        "`max_position_embeddings`: HF's result then depends on the rows of its batch, and Phi-3's generate "
        "re-encodes the sequence at the switch), and Llama 4's attention temperature tuning from `floor_scale` "
        "on. Below those lengths they are served.",
        "",
        f"{len(served)} served, {len(refused)} refused, {len(outcomes) - len(served) - len(refused)} not built "
        f"of {len(outcomes)}.",
        "",
        "| model type | outcome | cause | message |",
        "|---|---|---|---|",
        *[o.row() for o in outcomes],
        "",
    ]
    DOC.write_text("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_hf_zoo.py --write")
    write_doc()


@pytest.mark.parametrize("model_type", ["diffllama", pytest.param("gpt_oss", marks=pytest.mark.skipif(
    os.environ.get("PADGRAPH_HF_SWEEP") != "all", reason="a full sweep's (PADGRAPH_HF_SWEEP=all): ~2 min on 2 cores"))])
def test_compiled_regions_serve_two_calls_a_layer_and_sinks(model_type):
    """torch_compile=True (decoder layers as compiled regions): a layer calling attention twice
    keeps its two cache sites apart, and sink logits stay applied."""
    model = tiny_model(model_type)
    dec = pghf.Decoder(model, max_batch=3, max_len=MAX_LEN, backend="reference", torch_compile=True)
    for n in (3, 1):
        ids, mask = prompts(n, seed=n + 30)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist(), model_type


def test_cache_sites_follow_what_the_layers_hand_attention():
    """The cache is sized from the calls, not the config's head_dim: MLA's keys wider than its
    values, Gemma 4's full layers wider than its sliding ones, two sites for a layer that calls
    attention twice."""
    mla = pghf.Decoder(tiny_model("deepseek_v3"), max_batch=2, max_len=16, backend="reference", probe=False)
    assert {(s.k_dim, s.v_dim) for s in mla.target.shape.sites} == {(24, 16)}
    gemma4 = pghf.Decoder(tiny_model("gemma4_text"), max_batch=2, max_len=16, backend="reference", probe=False)
    assert len({s.k_dim for s in gemma4.target.shape.sites}) == 2, gemma4.target.shape
    diff = pghf.Decoder(tiny_model("diffllama"), max_batch=2, max_len=16, backend="reference", probe=False)
    assert [s.layer_idx for s in diff.target.shape.sites] == [0, 0, 1, 1]


@pytest.mark.parametrize("model_type", ["gemma4_text", "diffllama", "gpt_oss"])
def test_triton_decode_kernel_path_on_the_variants(model_type):
    """The GPU path's attention (the Triton paged decode kernel, interpreted on the CPU): per-layer
    head widths and two sites a layer through the kernel; sink logits, which the kernel does not
    apply, through the torch path. HF generate's tokens."""
    import functools
    from padgraph.backends.triton import attention_decode
    model = tiny_model(model_type)
    dec = pghf.Decoder(model, max_batch=3, max_len=MAX_LEN, backend="reference")
    dec.target.kernel = functools.partial(attention_decode.decode_attention, impl="triton")   # as on a GPU
    ids, mask = prompts(3, seed=11)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=6).tolist() == ref.tolist()


def test_a_layer_reading_another_pass_cache_is_refused():
    """Dory's looped layer with `recurrent_kv_cache_mode="last_loop"`: under HF's generate its first
    pass attends over the keys the last pass cached, not its own, so generate is not the model's
    cacheless forward (which padgraph's one site per pass reproduces). The probe compares with
    generate too: refused at `Decoder(...)`, naming generate, the decode step, the layer and the
    disagreement; the default `per_loop` (a cache per pass) is served."""
    if "dory" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"no Dory in transformers {transformers.__version__}")
    model = hf_zoo.build_type("dory", recurrent_kv_cache_mode="last_loop")
    with pytest.raises(pghf.UnsupportedModelError, match=r"own generate at decode step 1.*model\.layers\.1 is") as err:
        pghf.Decoder(model, max_batch=3, max_len=MAX_LEN, backend="reference")
    assert "generate and forward disagree" in str(err.value), str(err.value)
    pghf.Decoder(hf_zoo.build_type("dory"), max_batch=3, max_len=MAX_LEN, backend="reference")


def test_a_cache_read_beyond_the_state_interface_is_named():
    """Qwen4-Exp's gated delta nets keep their state through HF's conv / recurrent interface, but
    its forward also reads the cache's own layers (its indexer's keys): the recording forward
    fails, and the refusal names that failure, not only the mixer."""
    if "qwen4_exp_text" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"no Qwen4-Exp in transformers {transformers.__version__}")
    with pytest.raises(pghf.UnsupportedModelError, match=r"linear_attn.*recurrent cache .* fails \(AttributeError"):
        pghf.Decoder(hf_zoo.build_type("qwen4_exp_text"), max_batch=3, max_len=MAX_LEN, backend="reference")


@pytest.mark.parametrize("model_type, field", [("llama4_text", "attention_chunk_size"), ("phimoe", "sliding_window")])
def test_a_mask_rule_longer_than_the_probe_is_served_from_the_mask_factory(model_type, field, monkeypatch):
    """Llama 4's chunks and PhiMoE's window are rules of HF's mask alone (the layers pass no
    `sliding_window`), here 16 tokens: longer than the probe's sequences, so the probe's values
    cannot see them. The survey reads them from the mask factories HF calls; the tokens equal
    generate's past the boundary. Served without those rules (the census's answer dropped), the
    same prompts decode other tokens: the check can fail."""
    model = hf_zoo.build_type(model_type, **{field: 16})
    ids, mask = prompts(5, seed=7)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    dec = pghf.Decoder(model, max_batch=5, max_len=40, backend="reference")
    rules = {(h.window, h.chunk) for h in dec.target.horizons.values()}
    assert ((None, 16) if field == "attention_chunk_size" else (16, None)) in rules, rules
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=24).tolist() == ref.tolist()
    from padgraph.hf import target as target_mod
    monkeypatch.setattr(target_mod, "mask_horizons", lambda *a: {})
    blind = pghf.Decoder(model, max_batch=5, max_len=40, backend="reference")   # the probe passes: too short
    assert blind.generate(ids, attention_mask=mask, max_new_tokens=24).tolist() != ref.tolist()


def test_a_layer_window_its_mask_does_not_apply_is_refused():
    """A layer that passes sliding_window=4 to attention while HF builds it a plain causal mask
    (Gemma 2's full layer given a window): SDPA and eager follow the mask, flash attention the
    keyword; refused at Decoder(...), naming the layer, both rules and why."""
    model = tiny_model("gemma2")
    model.model.layers[1].self_attn.sliding_window = 4
    with pytest.raises(pghf.UnsupportedModelError, match=r"layers\.1\.self_attn.*sliding_window=4.*no window"):
        pghf.Decoder(model, max_batch=2, max_len=MAX_LEN, backend="reference")


def test_the_census_wraps_every_namespace_that_holds_a_factory():
    """Inside `masks.census` both masking_utils and the model's modeling module hold the wrapped
    factories (whatever order the modules are visited in), and both get their own back after."""
    import sys
    import transformers.masking_utils as mu
    from padgraph.hf import masks
    model = tiny_model("llama4_text")
    ml = sys.modules[type(model.model).__module__]
    before = ml.create_chunked_causal_mask, mu.create_chunked_causal_mask
    with masks.census(model):
        assert ml.create_chunked_causal_mask is not before[0] and mu.create_chunked_causal_mask is not before[1]
    assert (ml.create_chunked_causal_mask, mu.create_chunked_causal_mask) == before


def test_a_chunked_mask_is_served_under_torch_compile():
    """Llama 4's 16-token chunks through the compiled decode (inductor miscompiles an equality of
    two floor divisions by 16; padgraph's rule is the chunk's first position): generate's tokens."""
    model = hf_zoo.build_type("llama4_text", attention_chunk_size=16)
    ids, mask = prompts(3, seed=33)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    dec = pghf.Decoder(model, max_batch=3, max_len=40, backend="reference", torch_compile=True)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=24).tolist() == ref.tolist()


def test_positions_read_from_hfs_cache_are_refused_past_where_they_matter():
    """Llama 4's temperature tuning counts positions from HF's cache length, which padgraph's
    forwards do not have: served while every position stays below floor_scale, refused (naming
    the fields) where a request could reach it."""
    pghf.Decoder(hf_zoo.build_type("llama4_text", floor_scale=4096), max_batch=2, max_len=32,
                 backend="reference", probe=False)
    with pytest.raises(pghf.UnsupportedModelError, match="floor_scale=16"):
        pghf.Decoder(hf_zoo.build_type("llama4_text", floor_scale=16), max_batch=2, max_len=32,
                     backend="reference", probe=False)
