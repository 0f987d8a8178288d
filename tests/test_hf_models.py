"""padgraph.hf on the CPU: for each architecture, a tiny random model (2 layers, fp32, seeded)
decodes through `Decoder` (reference backend) to the very tokens of HF's own
`generate(do_sample=False)` on the same left-padded prompts, at bs 1, 3 and 5; and `pg.check`
finds nothing on the decode body."""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402

VOCAB, NEW, MAX_LEN = 128, 10, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)


def configs() -> dict:
    """name -> (model class, config); sliding windows (4) shorter than the prompts plus new tokens."""
    t = transformers
    gemma = dict(COMMON, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, final_logit_softcapping=30.0)
    # Gemma2's reference is HF's eager attention, which applies the layer's attn_logit_softcapping:
    # transformers 5.17 marks Gemma2 `_supports_sdpa = True` and builds it with SDPA by default,
    # whose `sdpa_attention_forward` has no `softcap` parameter (it lands in **kwargs, unused), so
    # the soft-cap is silently dropped from HF's generate and forward alike; 5.25 sets
    # `_supports_sdpa = False` ("sdpa does not support softcapping") and defaults to eager.
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**COMMON)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**COMMON, head_dim=8)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=4)),
        "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(**gemma, attn_logit_softcapping=2.0, initializer_range=0.3,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       attn_implementation="eager")),
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(**gemma, sliding_window_pattern=2,
                                                           layer_types=["sliding_attention", "full_attention"])),
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(**COMMON, **MOE)),
        "qwen2_moe": (t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32,
                                                              shared_expert_intermediate_size=32)),
    }


def build(name: str):
    cls, cfg = configs()[name]
    torch.manual_seed(0)
    return cls(cfg).eval()


def prompts(n: int, seed: int):
    """n left-padded prompts of lengths 3..12: (input_ids [n, P], attention_mask [n, P])."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 13, (n,), generator=g).tolist()
    width = max(lens)
    ids = torch.zeros(n, width, dtype=torch.int64)
    mask = torch.zeros(n, width, dtype=torch.int64)
    for i, k in enumerate(lens):
        ids[i, width - k:] = torch.randint(1, VOCAB, (k,), generator=g)
        mask[i, width - k:] = 1
    return ids, mask


@pytest.mark.parametrize("name", list(configs()))
def test_tokens_equal_hf_generate(name):
    model = build(name)
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference")
    for n in (1, 3, 5):
        ids, mask = prompts(n, seed=n)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        ours = dec.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        assert ours.tolist() == ref.tolist(), f"{name} bs {n}: tokens differ from HF's generate"
    assert all(r.ok for r in dec.check(trials=2).values()), dec.check(trials=2)


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_triton_decode_kernel_path(name):
    """The GPU path's attention: full layers through the Triton paged decode kernel (interpreted
    on the CPU), layers whose window is shorter than the row through the torch path."""
    from padgraph.backends.triton import attention_decode
    kernel = functools.partial(attention_decode.decode_attention, impl="triton")
    model = build(name)
    dec = pghf.Decoder(model, max_batch=3, max_len=MAX_LEN, backend="reference")
    dec.target.kernel = kernel                       # what backend="cuda" picks on a GPU
    ids, mask = prompts(3, seed=11)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    assert dec.generate(ids, attention_mask=mask, max_new_tokens=6).tolist() == ref.tolist()


def test_compiled_body_one_graph():
    """torch_compile: HF's forward and padgraph's attention trace as one graph (fullgraph) that
    serves the ladder, to HF's tokens."""
    model = build("gemma3")
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference", torch_compile={"fullgraph": True})
    for n in (3, 5):
        ids, mask = prompts(n, seed=n)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
        assert dec.generate(ids, attention_mask=mask, max_new_tokens=6).tolist() == ref.tolist()
    assert dec.worker.runner("decode").stats.compiles >= 1 and dec.worker.runner("decode").stats.recompiles <= 1, dec.worker.runner("decode").stats


@pytest.mark.parametrize("name", list(configs()))
def test_default_compiled_decoder_gives_hf_tokens(name):
    """torch_compile=True (the decoder layers compiled as regions, the rest eager) on every
    architecture: HF generate's tokens at bs 3 and 1."""
    model = build(name)
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="reference", torch_compile=True)
    for n in (3, 1):
        ids, mask = prompts(n, seed=n + 20)
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        assert dec.generate(ids, attention_mask=mask, max_new_tokens=NEW).tolist() == ref.tolist(), name
    assert dec.worker.runner("decode").stats.compiles >= 1, dec.worker.runner("decode").stats
