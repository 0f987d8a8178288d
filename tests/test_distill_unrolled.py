"""The unrolled draft head used by distillation (`DraftHead.forward_unrolled`): each depth's row
is what the draft computes for that node, checked against a plain causal pass over the node's
own context (the teacher-forced prefix the draft-extend cache holds, then the node's chain of
ancestors), for the Llama EAGLE head and the DeepSeek MTP head; and the held-out chain check."""

import pytest
import torch


from padgraph.llm.distill import chain_accept, train_head
from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel
from padgraph.llm.models.draft_head import unrolled_mask
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.models.mtp_head import MTPHead


def test_unrolled_mask_rows():
    m = unrolled_mask(4, 3)
    assert m.shape == (12, 12) and m.diagonal().all()
    assert torch.equal(m[:4, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not m[:4, 4:].any()                    # teacher-forced rows see only themselves' kind
    # depth 2, position 3: teacher rows 0..1, depth-1 row 2, itself
    row = m[2 * 4 + 3].view(3, 4)
    assert row.tolist() == [[True, True, False, False], [False, False, True, False],
                            [False, False, False, True]]
    # depth 1, position 0: no teacher row before it, only itself
    assert m[4].nonzero().flatten().tolist() == [4]


def _family(kind):
    torch.manual_seed(0)
    if kind == "llama":
        target = LlamaModel(LlamaConfig.tiny(vocab_size=96)).eval()
        return target, EagleHead(target)
    target = DeepSeekModel(DeepSeekConfig.tiny(vocab_size=96)).eval()
    return target, MTPHead(target)


@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_unrolled_rows_are_the_draft_nodes(kind):
    target, head = _family(kind)
    B, T, depth = 2, 7, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (B, T), generator=g)
    hidden = torch.randn(B, T, target.cfg.hidden_size, generator=g)
    with torch.no_grad():
        hs = head.forward_unrolled(ids, hidden, depth)
        assert torch.allclose(hs[0], head.forward_dense(ids, hidden)[1], atol=1e-5)
        for d in range(1, depth):
            for i in range(d, T):
                # the node's context: teacher rows 0 .. i-d, then ancestors at depth 1 .. d
                xs = [head._inputs(ids[:, :i - d + 1], hidden[:, :i - d + 1])]
                for e in range(1, d + 1):
                    j = i - d + e
                    xs.append(head._inputs(ids[:, j:j + 1], hs[e - 1][:, j - 1:j]))
                x = torch.cat(xs, dim=1)
                pos = torch.arange(x.shape[1]).expand(B, -1)
                want = head.norm(head.layer.forward_dense(x, pos, target.rope))[:, -1]
                assert torch.allclose(hs[d][:, i], want, atol=1e-4), (d, i)


def test_unrolled_training_and_chain_check():
    """Training unrolled 3 deep runs and lowers the deeper depths' loss; chain_accept counts
    accepted tokens up to the first miss (an oracle draft accepts every one)."""
    target, head = _family("llama")
    for p in target.parameters():
        p.requires_grad_(False)
    from padgraph.llm.distill import greedy_corpus
    tokens, hidden, labels = greedy_corpus(target, 8, 6, 10, 8)
    before = chain_accept(head, tokens, hidden, labels, depth=3)
    head.init_passthrough()
    train_head(head, tokens, hidden, labels, steps=30, batch=8, lr=3e-3, depth=3,
               log=lambda *a: None)
    after = chain_accept(head, tokens, hidden, labels, depth=3)
    assert 1.0 <= before["accept"] <= 4.0 and len(after["top1"]) == 3
    assert after["accept"] > before["accept"]
    # chain arithmetic: a perfect head accepts depth + 1 (labels from the head itself)
    with torch.no_grad():
        hs = head.forward_unrolled(tokens[:, 1:], hidden[:, :-1], 1)
        own = head.logits(hs[0]).argmax(-1)
    fake = labels.clone()
    fake[:, 1:] = own
    one = chain_accept(head, tokens, hidden, fake, depth=1)
    assert one["top1"] == [1.0] and one["accept"] == 2.0


def test_early_stopping_keeps_the_best_held_out_weights_and_calibrates():
    """train_head(select=...) restores the checkpoint with the best held-out chain accept (the
    returned check is what the restored head gives), and calibrate_temperature lands on the
    likelihood's optimum (nudging the temperature either way raises the held-out CE)."""
    import torch.nn.functional as F

    from padgraph.llm.distill import calibrate_temperature, greedy_corpus
    target, head = _family("llama")
    for p in target.parameters():
        p.requires_grad_(False)
    tokens, hidden, labels = greedy_corpus(target, 8, 6, 10, 8)
    held = greedy_corpus(target, 4, 6, 10, 8, seed=99)
    head.init_passthrough()
    seen = []
    step, best = train_head(head, tokens, hidden, labels, steps=24, batch=8, lr=3e-3,
                            select=held, n_evals=6, log=seen.append)
    checks = [line for line in seen if "held-out check" in line]
    # every 4th step, and 1, 2, 3 before the first of those
    at = [int(c.split("step")[1].split(":")[0]) for c in checks]
    assert at == [0, 1, 2, 3, 4, 8, 12, 16, 20, 24] and step in at
    assert best == chain_accept(head, *held, depth=3)
    assert all(float(c.split("chain accept ")[1].split(",")[0]) <= best["accept"] for c in checks)
    # a third of the labels replaced: no temperature fits them all, the optimum is interior
    g = torch.Generator().manual_seed(5)
    noisy = held[2].clone()
    flip = torch.rand(noisy.shape, generator=g) < 0.33
    noisy[flip] = torch.randint(1, 96, (int(flip.sum()),), generator=g)
    held = (held[0], held[1], noisy)
    ce = calibrate_temperature(head, *held, log=lambda *a: None)
    ids, h_in, y = held[0][:, 1:], held[1][:, :-1], held[2][:, 1:]
    with torch.no_grad():
        raw = target.logits(head.forward_dense(ids, h_in)[1]).float().flatten(0, 1)
    t = head.log_scale.exp().item()
    nll = lambda s: F.cross_entropy(raw * s, y.reshape(-1)).item()   # noqa: E731
    assert 1.0 < t < 140 and abs(nll(t) - ce) < 1e-4
    assert nll(t) <= nll(t * 1.2) and nll(t) <= nll(t / 1.2)
