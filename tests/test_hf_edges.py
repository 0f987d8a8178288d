"""padgraph.hf's refusals and edges: models it cannot serve raise at `Decoder(...)` naming the
layer; a bad request raises before anything runs; the user's model is left as it was; HF's
end-of-sequence stopping is honoured."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph as pg  # noqa: E402
import padgraph.hf as pghf  # noqa: E402
from test_hf_models import build, prompts  # noqa: E402

SSM = {   # class name -> config name, tiny config kwargs
    "MambaForCausalLM": ("MambaConfig", dict(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2)),
    "Mamba2ForCausalLM": ("Mamba2Config", dict(vocab_size=64, hidden_size=16, state_size=4, num_heads=4,
                                               head_dim=8, n_groups=1, num_hidden_layers=2)),
    "BambaForCausalLM": ("BambaConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                                             mamba_d_head=16, mamba_n_groups=1, mamba_d_state=4,
                                             attn_layer_indices=[1])),
    "JambaForCausalLM": ("JambaConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                             attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                             num_experts=2, mamba_d_state=4, use_mamba_kernels=False)),
}


@pytest.mark.parametrize("cls_name", list(SSM))
def test_ssm_model_raises_at_decoder_with_a_draft(cls_name):
    """Served without a draft (tests/test_hf_hybrid.py); a draft head's engine keeps no recurrent state."""
    cfg_name, kwargs = SSM[cls_name]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"{cls_name} is not in transformers {transformers.__version__}")
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**kwargs)).eval()
    with pytest.raises(pghf.UnsupportedModelError, match="Mixer") as err:
        pghf.Decoder(model, max_batch=2, max_len=16, backend="reference", draft=pghf.Eagle())
    assert isinstance(err.value, pg.ContractError) and cls_name in str(err.value)


def test_model_left_as_it_was():
    model = build("llama")
    before = model.config._attn_implementation
    ids, mask = prompts(2, seed=7)
    dec = pghf.Decoder(model, max_batch=2, max_len=32, backend="reference")
    dec.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert model.config._attn_implementation == before
    with torch.no_grad():   # HF's own path still works and agrees
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=4).tolist() == ref.tolist()


@pytest.mark.parametrize("bad, match", [
    (dict(n=3), "number of prompts"),
    (dict(max_new_tokens=40), "max_len"),
    (dict(right_padded=True), "left-padded"),
])
def test_bad_request_raises_before_running(bad, match):
    model = build("llama")
    dec = pghf.Decoder(model, max_batch=2, max_len=32, backend="reference")
    ids, mask = prompts(bad.get("n", 2), seed=3)
    if bad.get("right_padded"):
        ids, mask = ids.flip(1), mask.flip(1)
        mask[:, 0] = 1
    with pytest.raises(pg.ContractValueError, match=match):
        dec.generate(ids, attention_mask=mask, max_new_tokens=bad.get("max_new_tokens", 4))


def test_eos_stops_like_hf():
    model = build("qwen2")
    ids, mask = prompts(3, seed=5)
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    model.generation_config.eos_token_id = int(free[0, -5])     # a token row 0 emits mid-way
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
    dec = pghf.Decoder(model, max_batch=3, max_len=32, backend="reference")
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=8).tolist() == ref.tolist()


def test_attention_outside_a_decoder_call_raises():
    model = build("llama")
    pghf.Decoder(model, max_batch=1, max_len=16, backend="reference")
    model.config._attn_implementation = "padgraph"
    with pytest.raises(pghf.NotBoundError, match="padgraph_batch"):
        model(torch.ones(1, 3, dtype=torch.int64))


def test_check_catches_padded_lanes_on_a_real_row():
    """The hazard the sink pads prevent: padded lanes pointed at a request's slot (out_cache_loc
    padded with slot FIRST, not the sink 0) write a live row of the cache; `pg.check` on the
    engine's decode body over the Decoder's own cache reports state writes outside raw targets
    and sinks."""
    from padgraph.llm import checks
    from padgraph.llm.kv import FIRST
    dec = pghf.Decoder(build("llama"), max_batch=5, max_len=16, backend="reference")
    w = dec.worker
    good = w.programs["decode"]
    bs = good.inputs["positions"].shape[0]
    inputs = dict(good.inputs, out_cache_loc=pg.Input((bs,), torch.int64, pad=FIRST))
    bad = pg.Program("hf_decode_bad_pad", inputs=inputs, outputs=dict(good.outputs), state=dict(good.state),
                     buckets=good.buckets)
    saved = w.kv.req_to_token.clone()
    try:
        checks.own_slots(w)
        with dec.serving(), torch.no_grad():
            result = pg.check(bad, w.bodies["decode"], state=w.state("decode"), sample=checks.sampler(w, "decode"),
                              trials=4)
    finally:
        w.kv.req_to_token.copy_(saved)
    assert {f.kind for f in result.findings} == {"state-write"}, result
    assert all(r.ok for r in dec.check(trials=2).values())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_experts_run_graph_safe_while_serving_and_are_restored(name, monkeypatch):
    """On a GPU the Decoder swaps HF's MoE experts (eager / grouped_mm: host syncs) for
    batched_mm while it serves; the tokens stay HF's and the user's setting comes back."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if "batched_mm" not in ALL_EXPERTS_FUNCTIONS:
        pytest.skip("this transformers has no batched_mm experts")
    from padgraph.hf import target
    monkeypatch.setattr(target, "graph_safe_experts", lambda device: "batched_mm")
    model = build(name)
    before = model.config._experts_implementation
    seen = []
    forward = ALL_EXPERTS_FUNCTIONS["batched_mm"]
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "batched_mm",
                        lambda *a, **k: seen.append(1) or forward(*a, **k))
    dec = pghf.Decoder(model, max_batch=3, max_len=40, backend="reference")
    ids, mask = prompts(3, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=6).tolist() == ref.tolist()
    assert seen, "the served forward did not run batched_mm"
    assert model.config._experts_implementation == before


def test_torch_compile_whole_traces_the_ladder_once():
    """torch_compile="whole": one size-oblivious trace of the forward for the ladder (bucket 1
    included where the model's ops do not specialise on a batch of one)."""
    from test_hf_models import MAX_LEN, NEW
    torch._dynamo.reset()       # the count starts from no traces: dynamo keeps per-code state (the
    model = build("qwen3")      # body's code is every model's) from earlier tests in this process
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference", torch_compile="whole")
    for n in (1, 4, 2):
        ids, mask = prompts(n, seed=n)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist()
    # transformers 5.25's rotary traces without a size-1 guard: one graph. 5.17's rotary matmul
    # decomposes with a guard on a batch of one even size-obliviously: bucket 1 compiles its own
    from packaging.version import Version
    most = 1 if Version(transformers.__version__) >= Version("5.25") else 2
    assert dec.worker.runner("decode").stats.compiles <= most, dec.worker.runner("decode").stats


def _layers_decoder(name: str, n_layers: int):
    from test_hf_models import MAX_LEN, configs
    cls, cfg = configs()[name]
    d = {**cfg.to_dict(), "num_hidden_layers": n_layers}
    if d.get("layer_types"):                                            # one type per layer
        d["layer_types"] = [d["layer_types"][i % len(d["layer_types"])] for i in range(n_layers)]
    cfg = type(cfg).from_dict(d)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    return model, pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference", torch_compile=True)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_torch_compile_layers_shares_one_graph_among_the_layers(name):
    """torch_compile=True (regional, "layers"): HF's tokens, and as many graphs for 4 layers as for 2 (the attention
    function reads its cache from the module, bound per call, not through layer_idx, which dynamo
    would specialise a graph on); nothing stays bound on the model after a call."""
    from test_hf_models import NEW
    compiles = []
    for n_layers in (2, 4):
        model, dec = _layers_decoder(name, n_layers)
        for n in (3, 1):
            ids, mask = prompts(n, seed=n)
            with torch.no_grad():
                ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
            assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist()
        compiles.append(dec.worker.runner("decode").stats.compiles)
        assert not [m for m in model.modules() if hasattr(m, pghf.attention.BOUND_KV)]
    assert compiles[0] == compiles[1], f"graphs for 2 and 4 layers: {compiles}"


def test_torch_compile_rejects_an_unknown_mode():
    with pytest.raises(pg.ContractValueError, match="torch_compile"):
        pghf.Decoder(build("llama"), max_batch=2, max_len=16, backend="reference", torch_compile="everything")


def test_torch_compile_true_without_one_layer_list_compiles_the_whole_forward():
    """A decoder whose layers are not one ModuleList: True warns and traces the whole forward
    (still HF's tokens); "layers" refuses."""
    from test_hf_models import MAX_LEN, NEW
    model = build("llama")
    model.model.extra = torch.nn.ModuleList([torch.nn.Identity()])        # a second ModuleList
    with pytest.raises(pg.ContractValueError, match="ModuleList"):
        pghf.Decoder(model, max_batch=2, max_len=MAX_LEN, backend="reference", torch_compile="layers")
    with pytest.warns(RuntimeWarning, match="whole forward"):
        dec = pghf.Decoder(model, max_batch=2, max_len=MAX_LEN, backend="reference", torch_compile=True)
    ids, mask = prompts(2, seed=3)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist()


@pytest.mark.parametrize("name,groups", [("llama", 2), ("qwen2", 2), ("mixtral", 1)])
def test_torch_compile_groups_the_sibling_projections(name, groups, monkeypatch):
    """torch_compile=True runs the group_linears pass: each layer graph calls q / k / v (Qwen2:
    with their biases) and gate / up (not Mixtral's experts) as grouped linears, and the tokens
    stay HF's."""
    from padgraph.backends.triton import grouped_linear as gl
    from test_hf_models import NEW
    made, real = [], gl.group_linears
    monkeypatch.setattr(gl, "group_linears", lambda gm, ex: made.append(real(gm, ex)))
    model, dec = _layers_decoder(name, 2)
    ids, mask = prompts(3, seed=5)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist()
    assert max(made) == groups, made                   # the layer graph (the rotary and final norm: 0)


@pytest.mark.parametrize("chunk", [9, 16, 33])
def test_the_chunk_rule_compiles_to_its_eager_values(chunk):
    """`attention.in_window`'s chunk rule under torch.compile equals HF's q // c == k // c for
    keys at or before the query (the form inductor miscompiles is not used)."""
    from padgraph.hf.attention import Layer, in_window
    q = torch.tensor([0, 5, 8, 13, 16, 17, 39])[:, None]
    k = torch.arange(40)[None, :]
    layer = Layer(1.0, None, None, chunk=chunk)
    torch._dynamo.reset()
    got = torch.compile(lambda a, b: in_window(a, b, layer))(q, k)
    want = (torch.div(q, chunk, rounding_mode="floor") == torch.div(k, chunk, rounding_mode="floor"))
    causal = k <= q
    assert torch.equal(got & causal, want & causal)


@pytest.mark.parametrize("prompt_len, max_position", [(8, None), (22, None), (8, 13)])
def test_no_length_set_gives_hfs_default_new_tokens(prompt_len, max_position):
    """With max_length and max_new_tokens set nowhere (the call, a generation_config, the model's),
    HF decodes 20 tokens past the prompt, capped at max_position_embeddings; a prompt of 20 or
    more tokens is served."""
    model = build("llama")
    assert model.generation_config.max_length is None
    if max_position is not None:
        model.config.max_position_embeddings = max_position
    ids = torch.randint(1, 64, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    with torch.no_grad(), pytest.warns(UserWarning, match="max_length"):
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)
    dec = pghf.Decoder(model, max_batch=1, max_len=48, backend="reference")
    out = dec.generate(ids, attention_mask=torch.ones_like(ids))
    assert out.shape[1] == min(prompt_len + 20, max_position or 10**9)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("pad_is_end", [False, True])
def test_no_mask_given_is_inferred_from_the_pad_token_as_hf_does(pad_is_end):
    """attention_mask=None: HF masks the pad token's positions where the pad occurs in the prompts
    and is no end token (else it attends to every position); so does padgraph.hf."""
    model = build("llama")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 0 if pad_is_end else 2
    ids, _ = prompts(2, seed=11)          # left-padded with token 0
    assert bool((ids == 0).any())
    with torch.no_grad():
        ref = model.generate(ids, do_sample=False, max_new_tokens=6)
    dec = pghf.Decoder(model, max_batch=2, max_len=32, backend="reference")
    assert dec.generate(ids, max_new_tokens=6).tolist() == ref.tolist()
