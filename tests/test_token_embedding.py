"""`TokenEmbedding`, the token lookup of padgraph.llm's models: on the GPU an indexing gather
(`weight[ids]`) instead of `F.embedding`'s `index_select`. It must give F.embedding's rows bit
for bit, for every id dtype and shape a caller passes, eagerly, under torch.compile and inside
a captured graph (cuda-marked); on the CPU it is F.embedding, bounds check included (a negative
id is an error, not a row from the end); with `max_norm` it is nn.Embedding itself."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel
from padgraph.llm.models.hybrid import HybridConfig, HybridModel
from padgraph.llm.models.llama import LlamaConfig, LlamaModel, TokenEmbedding

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device(name)


@pytest.mark.cuda  # on the CPU the lookup is F.embedding itself: the gather runs on the GPU only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(), (1,), (16,), (17,), (3, 5)])
def test_gathered_rows_equal_f_embedding(dtype, id_dtype, shape):
    dev = _device("cuda")
    gen = torch.Generator().manual_seed(len(shape) * 7 + shape[0] if shape else 1)
    emb = TokenEmbedding(1000, 48).to(dev, dtype)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(1000, 48, generator=gen).to(dtype))
    ids = torch.randint(0, 1000, shape, generator=gen).to(dev, id_dtype)
    ids.view(-1)[:1] = 999                                        # the last row too
    got, want = emb(ids), F.embedding(ids.long(), emb.weight)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_and_captured_lookups_equal_f_embedding(device):
    """On the CPU: the module compiles whole (its device branch traced) to F.embedding's rows."""
    dev = _device(device)
    emb = TokenEmbedding(500, 32).to(dev, torch.bfloat16)
    ids = torch.tensor([3, 499, 0, 3, 250] * 3 + [7], device=dev)   # 16 ids, repeats
    want = F.embedding(ids, emb.weight)
    assert torch.equal(torch.compile(emb, fullgraph=True)(ids), want)
    if dev.type == "cuda":
        static = ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            emb(static)                                            # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = emb(static)
        static.copy_(ids.flip(0))
        graph.replay()
        assert torch.equal(out, F.embedding(ids.flip(0), emb.weight))


@pytest.mark.parametrize("bad", [-1, -1000, 1000])
def test_cpu_lookup_rejects_an_id_out_of_range(bad):
    emb = TokenEmbedding(1000, 8)
    with pytest.raises(IndexError):
        emb(torch.tensor([3, bad]))


def test_max_norm_is_nn_embedding():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(20, 8, generator=gen) * 5
    ours, theirs = TokenEmbedding(20, 8, max_norm=1.0), nn.Embedding(20, 8, max_norm=1.0)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ids = torch.tensor([1, 4, 4, 19])
    assert torch.equal(ours(ids), theirs(ids))
    assert torch.equal(ours.weight, theirs.weight)                # renormalized in place alike
    assert not torch.equal(ours.weight, weight)


@pytest.mark.parametrize("model", [(LlamaModel, LlamaConfig), (DeepSeekModel, DeepSeekConfig),
                                   (HybridModel, HybridConfig)], ids=lambda m: m[0].__name__)
def test_models_look_tokens_up_through_it(model):
    cls, config = model
    assert type(cls(config.tiny()).embed) is TokenEmbedding
