"""`greedy_ids(hidden)`: the verify program's argmax on the lm_head's own output equals the
argmax of the fp32 logits, ties to the lower id, for every target kind."""

import pytest
import torch

from padgraph.llm import Batch
from padgraph.llm.kv import KVCache

from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.models.llama_tp import LlamaTP, TPGroup


def _with_ties(model, dtype):
    """The model in `dtype` with vocab rows 7 and 3 (and 200, 201) identical, so their logits
    tie exactly whatever the hidden: argmax must pick the lower id."""
    model = model.to(dtype).eval()
    with torch.no_grad():
        w = model.lm_head.weight
        w[7] = w[3]
        w[201] = w[200]
        w[3] *= 4  # row 3 (and 7) win for most hidden states
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "deepseek", "tp"])
def test_greedy_ids_is_the_argmax_of_the_fp32_logits(kind, dtype):
    if kind == "deepseek":
        model = _with_ties(DeepSeekModel(DeepSeekConfig.tiny(), seed=0), dtype)
        hidden_size = model.cfg.hidden_size
    else:
        model = _with_ties(LlamaModel(LlamaConfig.tiny(), seed=0), dtype)
        hidden_size = model.cfg.hidden_size
        if kind == "tp":
            model = LlamaTP.shard(model, TPGroup())
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, hidden_size, generator=gen).to(dtype)
    hidden[:8] = 0  # all-zero rows: every logit is 0, the whole vocabulary ties -> id 0
    with torch.no_grad():
        want = model.logits(hidden).argmax(-1)
        got = model.greedy_ids(hidden)
    assert got.dtype == torch.int64
    assert torch.equal(got, want), f"{(got != want).sum()} ids differ, but should be 0"
    assert torch.equal(got[:8], torch.zeros(8, dtype=torch.int64))
    assert (got != 7).all() and (got != 201).all(), "a tie went to the higher id"
    assert (got == 3).any(), "the tied pair never won: the case does not test ties"


def test_verify_hidden_and_greedy_ids_equal_forward_verify():
    """The verify body's path (hidden, then greedy_ids) against forward_verify's logits."""
    cfg = LlamaConfig.tiny()
    model = LlamaModel(cfg, seed=0).eval()
    n_slots, k = 32, 4
    kv = KVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, 16, 2, torch.float32,
                 torch.device("cpu"))
    kv.req_to_token[0, :8] = torch.arange(8, dtype=torch.int32)
    kv.req_to_token[1, :8] = torch.arange(8, 16, dtype=torch.int32)
    ids = torch.tensor([5, 9, 11, 2, 100, 3, 4, 17])
    pos = torch.tensor([2, 3, 3, 4, 4, 5, 5, 6])
    rows = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([3 + k, 4 + k], dtype=torch.int32)
    tree = torch.tril(torch.ones(k, k, dtype=torch.bool)).expand(2, k, k).contiguous()
    loc = torch.tensor([3, 4, 5, 6, 12, 13, 14, 15])
    with torch.no_grad():
        batch = Batch(kv, kv.req_to_token, rows, lens, loc, tree_mask=tree)
        logits, hidden = model.forward_verify(ids, pos, batch)
        hidden2 = model.forward_verify_hidden(ids, pos, batch)
    assert torch.equal(hidden, hidden2)
    assert torch.equal(model.greedy_ids(hidden2), logits.argmax(-1))


def test_a_target_with_hidden_verify_but_no_greedy_ids_verifies_by_its_logits():
    """The verify body's fallback: forward_verify_hidden without greedy_ids takes the argmax of
    logits(hidden); a target with neither uses forward_verify's logits. Same tokens as the
    full model (the reference backend, the tiny Llama, an oracle draft)."""
    from padgraph.llm.models.eagle_head import EagleHead
    from padgraph.llm import Engine, SpecConfig
    import padgraph as pg

    class NoGreedyIds(LlamaModel):
        greedy_ids = property(lambda self: (_ for _ in ()).throw(AttributeError("greedy_ids")))

    class OnlyLogits(LlamaModel):
        forward_verify_hidden = property(
            lambda self: (_ for _ in ()).throw(AttributeError("forward_verify_hidden")))

        def forward_verify(self, input_ids, positions, batch):
            hidden = self._run(input_ids, positions, self._tree_batch(batch), batch.kv)
            return self.logits(hidden), hidden

    outs = []
    for cls in (LlamaModel, NoGreedyIds, OnlyLogits):
        torch.manual_seed(0)
        target = cls(LlamaConfig.tiny(n_layers=1)).eval()
        assert hasattr(target, "greedy_ids") == (cls is not NoGreedyIds)
        assert hasattr(target, "forward_verify_hidden") == (cls is not OnlyLogits)
        head = EagleHead.copy_of_target(target).eval()
        w = Engine(target, head, SpecConfig(steps=3, topk=2, num_draft_tokens=5), max_bs=2,
                   max_context=64, buckets=pg.Buckets([1, 2]))
        with torch.no_grad():
            reqs, _ = w.generate_spec([[5, 6, 7], [9, 3]], [7, 5])
            greedy, _ = w.generate_greedy([[5, 6, 7], [9, 3]], [7, 5])
        assert [r.output for r in reqs] == [r.output for r in greedy]
        outs.append([r.output for r in reqs])
    assert outs[0] == outs[1] == outs[2]
