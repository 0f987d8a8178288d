"""padgraph.hf on CUDA graphs (GPU only): each architecture's tiny fp32 model decodes through
`Decoder(backend="cuda")` to HF generate's tokens, eager body and compiled, greedy and EAGLE."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import padgraph.hf as pghf  # noqa: E402
from test_hf_models import MAX_LEN, NEW, build, configs, prompts  # noqa: E402

pytestmark = pytest.mark.cuda


def generates_like_hf(model, dec, name: str):
    """dec.generate against HF's generate on the GPU at bs 1, 3, 5: asserts equal tokens, yields
    each size after its check (for the caller's per-size statistics)."""
    for n in (1, 3, 5):
        ids, mask = (t.cuda() for t in prompts(n, seed=n))
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW)
        ours = dec.generate(ids, attention_mask=mask, max_new_tokens=NEW)
        assert ours.tolist() == ref.tolist(), f"{name} bs {n}: tokens differ from HF's generate"
        yield n


@pytest.mark.parametrize("name", list(configs()))
@pytest.mark.parametrize("torch_compile", [False, True, "whole"], ids=["eager", "compiled", "whole"])
def test_cuda_tokens_equal_hf_generate(name, torch_compile):
    if torch_compile and name not in ("llama", "gemma2", "mixtral"):
        pytest.skip("compiled: one full-attention, one sliding + soft-cap, one MoE model")
    model = build(name).cuda()
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="cuda", torch_compile=torch_compile)
    for _ in generates_like_hf(model, dec, name):
        pass


@pytest.mark.parametrize("name", ["llama", "qwen3", "mixtral"])
@pytest.mark.parametrize("torch_compile", [False, True], ids=["eager", "compiled"])
def test_cuda_eagle_tokens_equal_hf_generate(name, torch_compile):
    """EAGLE on an HF target through padgraph.llm's programs on CUDA graphs (regional compile of
    HF's decoder layers with torch_compile): HF generate's tokens, drafts accepted."""
    model = build(name).cuda()
    dec = pghf.Decoder(model, max_batch=5, max_len=MAX_LEN, backend="cuda", torch_compile=torch_compile,
                       draft=pghf.Eagle(distill=dict(n_seq=16, prompt_len=8, gen_len=16, steps=30, lr=3e-3)))
    rounds = tokens = 0
    for _ in generates_like_hf(model, dec, name):
        rounds, tokens = rounds + dec.last_stats.request_rounds, tokens + dec.last_stats.accepted
    assert tokens > rounds, f"{name}: no draft token accepted"
