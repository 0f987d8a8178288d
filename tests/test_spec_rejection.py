"""The exact "rejection" rule for deterministic proposals (`verify_tree_sampled` and
`verify_chain_sampled` with draft_probs None): the scalar form (a child is accepted iff
u * (mass left by its rejected siblings) < p(c), one draw a row at the end) emits, token for
token, what the previous implementation emitted, which renormalised the full [bs, V] residual
after every rejected child. That implementation is kept below as the reference. Inputs: random
trees and chains over small vocabularies (repeated sibling tokens, rows that accept nothing,
greedy one-hot rows), probabilities on a dyadic grid (every sum exact, so the two forms take
the same decisions) and plain softmax rows. The scalar form does no [bs, V] work per child."""
from __future__ import annotations

import pytest
import torch

import padgraph as pg
from padgraph.llm import Engine, SpecConfig
from padgraph.llm import sampling as S
from padgraph.llm.models.eagle_head import EagleHead
from padgraph.llm.models.llama import LlamaConfig, LlamaModel
from padgraph.llm.sampling import PURPOSE_ACCEPT, PURPOSE_RESIDUAL, uniform


# -------------------------------------------------- the previous implementation (the reference)

def _one_hot(c, V):
    return torch.nn.functional.one_hot(c, V).double()


def _residual(p, q):
    r = (p - q).clamp_min(0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def _draw(p, u):
    cum = p.double().cumsum(-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_max(p.shape[1] - 1)


def _at(t, idx):
    return t.gather(1, idx[:, None])[:, 0]


def reference_chain(target_probs, draft_tokens, seed, positions):
    bs, k = draft_tokens.shape
    alive = torch.ones(bs, dtype=torch.bool, device=draft_tokens.device)
    n_acc = torch.zeros(bs, dtype=torch.int32, device=draft_tokens.device)
    outs = []
    for i in range(k + 1):
        p = target_probs[:, i].double()
        u = uniform(seed, positions[:, i], PURPOSE_RESIDUAL)
        if i == k:
            outs.append(torch.where(alive, _draw(p, u), outs[-1]))
            break
        c = draft_tokens[:, i].long()
        q = _one_hot(c, p.shape[1])
        ok = uniform(seed, positions[:, i], PURPOSE_ACCEPT) * _at(q, c) < _at(p, c)
        tok = torch.where(ok, c, _draw(_residual(p, q), u))
        outs.append(torch.where(alive, tok, outs[-1]) if i else tok)
        n_acc += (alive & ok).int()
        alive = alive & ok
    return n_acc + 1, torch.stack(outs, 1)


def reference_tree(tokens, tree_mask, target_probs, seed, positions, steps):
    bs, k = tokens.shape
    parent = S._tree_parents(tree_mask)
    cur = torch.zeros(bs, dtype=torch.long, device=tokens.device)
    alive = torch.ones(bs, dtype=torch.bool, device=tokens.device)
    path, outs = [cur], []
    for depth in range(steps + 1):
        pos = positions[:, depth]
        p = target_probs.gather(1, cur[:, None, None].expand(-1, 1, target_probs.shape[2]))
        p = p[:, 0].double()
        found, nxt = torch.zeros_like(alive), cur
        if depth < steps:
            for j in range(1, k):
                child = (parent[:, j] == cur) & alive & ~found
                c = tokens[:, j].long()
                qj = _one_hot(c, p.shape[1])
                ok = child & (uniform(seed, pos, PURPOSE_ACCEPT, j) * _at(qj, c) < _at(p, c))
                found, nxt = found | ok, torch.where(ok, j, nxt)
                rej = child & ~ok
                r = _residual(p, qj)
                p = torch.where(rej[:, None], r / r.sum(-1, keepdim=True), p)
        tok = torch.where(found, _at(tokens, nxt), _draw(p, uniform(seed, pos, PURPOSE_RESIDUAL)))
        outs.append(torch.where(alive, tok, outs[-1]) if depth else tok)
        alive, cur = alive & found, nxt
        if depth < steps:
            path.append(cur)
    accept_index = torch.stack(path, 1)
    accept_len = 1 + torch.stack(path[1:], 1).ne(torch.stack(path[:-1], 1)).sum(1)
    return accept_len.int(), accept_index, torch.stack(outs, 1)


# ------------------------------------------------------------------------------- inputs

def dyadic_probs(shape, V, g, bits=12):
    """Rows of integer weights summing to 2**bits, divided by it: exact in fp32, and every sum
    of them exact in fp64. About a third of the entries are 0."""
    w = torch.randint(0, 40, (*shape, V), generator=g) * (torch.rand(*shape, V, generator=g)
                                                          > 0.35)
    w[..., 0] += 1                                            # no empty row
    scale = (2 ** bits) / w.sum(-1, keepdim=True)
    w = (w * scale).floor().long()
    top = w.argmax(-1, keepdim=True)
    w.scatter_add_(-1, top, 2 ** bits - w.sum(-1, keepdim=True))
    return (w.double() / 2 ** bits).float()


def softmax_probs(shape, V, g):
    return torch.softmax(torch.randn(*shape, V, generator=g) * 2, -1)


def greedy_rows(probs, g, share=0.3):
    """Makes about `share` of the requests greedy: one-hot at each row's argmax."""
    hot = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1]).float()
    pick = torch.rand(probs.shape[0], generator=g) < share
    return torch.where(pick.view(-1, *[1] * (probs.dim() - 1)), hot, probs)


def random_tree(bs, k, steps, g):
    """Random trees of k nodes, depth <= steps, parents before children."""
    mask = torch.eye(k, dtype=torch.bool).repeat(bs, 1, 1)
    depth = torch.zeros(bs, k, dtype=torch.long)
    for i in range(1, k):
        for b in range(bs):
            ok = (depth[b, :i] < steps).nonzero()[:, 0]
            par = ok[torch.randint(len(ok), (1,), generator=g)].item()
            depth[b, i] = depth[b, par] + 1
            mask[b, i] |= mask[b, par]
    return mask


def tree_tokens(probs, mask, g, vocab):
    """Children proposed like a draft's top-k of a perturbed target (so paths get accepted),
    mixed with random tokens (repeats among siblings, unlikely children)."""
    bs, k, _ = probs.shape
    parent = S._tree_parents(mask)
    noisy = probs.double().log() + torch.rand(bs, k, vocab, generator=g).double() * 3
    ranked = noisy.argsort(-1, descending=True)                      # [bs, k, V]
    rank = torch.zeros(bs, k, dtype=torch.long)
    for j in range(1, k):
        for i in range(j):
            rank[:, j] += (parent[:, i] == parent[:, j]).long()
    at_parent = ranked.gather(1, parent.clamp_min(0)[:, :, None].expand(-1, -1, vocab))
    top = at_parent.gather(2, rank.clamp_max(vocab - 1)[:, :, None])[..., 0]
    rand = torch.randint(vocab, (bs, k), generator=g)
    return torch.where(torch.rand(bs, k, generator=g) < 0.7, top, rand)


CASES = [(8, 3, 6, "dyadic"), (8, 3, 3, "dyadic"), (6, 2, 16, "softmax"), (12, 5, 5, "dyadic"),
         (4, 1, 9, "softmax")]


@pytest.mark.parametrize("k,steps,V,kind", CASES)
def test_tree_rule_equals_the_previous_implementation(k, steps, V, kind):
    g = torch.Generator().manual_seed(k * 100 + V)
    bs = 300
    mask = random_tree(bs, k, steps, g)
    probs = (dyadic_probs if kind == "dyadic" else softmax_probs)((bs, k), V, g)
    probs = greedy_rows(probs, g)
    tokens = tree_tokens(probs, mask, g, V)
    seed = torch.randint(0, 2 ** 62, (bs,), generator=g)
    positions = torch.randint(0, 1 << 20, (bs, 1)) + torch.arange(steps + 1)
    got = S.verify_tree_sampled(tokens, mask, probs, None, seed, positions, steps)
    want = reference_tree(tokens, mask, probs, seed, positions, steps)
    for name, a, b in zip(("accept_len", "accept_index", "out_tokens"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, (a != b).nonzero()[:5].tolist())
    acc = got[0]
    parent = S._tree_parents(mask)
    siblings = (parent[:, :, None] == parent[:, None, :]) & (parent[:, :, None] >= 0)
    repeats = siblings & (tokens[:, :, None] == tokens[:, None, :]) & ~torch.eye(k, dtype=bool)
    assert repeats.any(), "no repeated sibling token"
    assert (acc == 1).sum() > 10 and (acc > 1).sum() > 10
    assert acc.max() >= min(steps, 3) + 1                   # deep paths get accepted


@pytest.mark.parametrize("k,V,kind", [(3, 5, "dyadic"), (4, 12, "softmax"), (1, 3, "dyadic")])
def test_chain_rule_equals_the_previous_implementation(k, V, kind):
    g = torch.Generator().manual_seed(k + V)
    bs = 400
    probs = (dyadic_probs if kind == "dyadic" else softmax_probs)((bs, k + 1), V, g)
    probs = greedy_rows(probs, g)
    drafts = torch.where(torch.rand(bs, k, generator=g) < 0.6, probs[:, :k].argmax(-1),
                         torch.randint(V, (bs, k), generator=g))
    seed = torch.randint(0, 2 ** 62, (bs,), generator=g)
    positions = torch.randint(0, 1 << 20, (bs, 1)) + torch.arange(k + 1)
    got = S.verify_chain_sampled(probs, drafts, None, seed, positions)
    want = reference_chain(probs, drafts, seed, positions)
    for name, a, b in zip(("accept_len", "out_tokens"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, (a != b).nonzero()[:5].tolist())
    assert (got[0] == 1).sum() > 10 and (got[0] == k + 1).sum() > 10


def test_greedy_targets_accept_exactly_the_argmax_children():
    """Temperature 0 (one-hot targets): both rules give greedy verification's tokens, so the
    scalar form must accept a child iff it is its parent's argmax and draw the argmax."""
    g = torch.Generator().manual_seed(5)
    bs, k, steps, V = 200, 8, 3, 4
    mask = random_tree(bs, k, steps, g)
    hot = torch.nn.functional.one_hot(torch.randint(V, (bs, k), generator=g), V).float()
    tokens = torch.randint(V, (bs, k), generator=g)
    positions = torch.arange(steps + 1).expand(bs, -1)
    acc, path, out = S.verify_tree_sampled(tokens, mask, hot, None, torch.arange(bs), positions,
                                           steps)
    argmax = hot.argmax(-1)
    for b in range(bs):
        node = 0
        for d in range(steps + 1):
            kids = [j for j in range(1, k) if S._tree_parents(mask[b:b + 1])[0, j] == node]
            hit = [j for j in kids if tokens[b, j] == argmax[b, node]] if d < steps else []
            assert out[b, d] == argmax[b, node]
            if not hit:
                assert acc[b] == d + 1
                break
            node = hit[0]
            assert path[b, d + 1] == node


class _VocabOps(torch.overrides.TorchFunctionMode):
    """Counts the torch calls that return a tensor with a V-wide last dimension."""

    def __init__(self, V):
        super().__init__()
        self.V, self.count = V, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] == self.V:
            self.count += 1
        return out


@pytest.mark.parametrize("k,steps", [(8, 3), (16, 4)])
def test_no_vocabulary_wide_work_per_child(k, steps):
    """The V-wide ops of a round do not grow with the children tried: a tree of 16 nodes and
    one of 8 run the same number (the one draw at the end, a handful), and the chain likewise;
    the previous implementation ran several for every child."""
    g = torch.Generator().manual_seed(1)
    bs, V = 4, 1031
    counts = []
    for kk, ss in ((k, steps), (2 * k, steps)):
        mask = random_tree(bs, kk, ss, g)
        probs = softmax_probs((bs, kk), V, g)
        tokens = torch.randint(V, (bs, kk), generator=g)
        positions = torch.arange(ss + 1).expand(bs, -1)
        with _VocabOps(V) as mode:
            S.verify_tree_sampled(tokens, mask, probs, None, torch.arange(bs), positions, ss)
        counts.append(mode.count)
    with _VocabOps(V) as mode:
        reference_tree(tokens, mask, probs, torch.arange(bs), positions, steps)
    assert counts[0] == counts[1] <= 10 < mode.count, (counts, mode.count)
    chain = []
    for kk in (2, 6):
        probs = softmax_probs((bs, kk + 1), V, g)
        with _VocabOps(V) as mode:
            S.verify_chain_sampled(probs, torch.randint(V, (bs, kk), generator=g), None,
                                   torch.arange(bs), torch.arange(kk + 1).expand(bs, -1))
        chain.append(mode.count)
    assert chain[0] == chain[1] <= 10, chain


def test_both_rules_serve_greedy_tokens_at_temperature_zero():
    """An engine whose programs take sampling inputs, requests at temperature 0 with filters set:
    "rejection" and "draws" both emit the greedy-only engine's tokens, with drafts accepted."""
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    head = EagleHead.copy_of_target(target).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, target.cfg.vocab_size, (n,), generator=g).tolist()
               for n in (5, 9, 3)]
    news = [7, 4, 8]
    params = [S.SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3, seed=7)] * 3
    outs = {}
    for rule in ("rejection", "draws", None):
        w = Engine(target, head, SpecConfig(steps=3, topk=2, num_draft_tokens=5), max_bs=4,
                   max_context=64, buckets=pg.Buckets([1, 4]),
                   **({"sampling": False} if rule is None else {"spec_sampling": rule}))
        with torch.no_grad():
            reqs, stats = w.generate_spec(prompts, news,
                                          sampling=None if rule is None else params)
        outs[rule] = [r.output for r in reqs]
        assert stats.accept_len > 2, rule
    assert outs["rejection"] == outs["draws"] == outs[None]


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 16])
def test_tree_rule_equals_the_previous_implementation_on_gpu_at_llama3_vocabulary(bs):
    """A 128256-token vocabulary (dyadic rows: the GPU's sums are exact too), steps 3, topk 4,
    k 8 as EAGLE builds them (random trees here), greedy lanes mixed in."""
    V, k, steps = 128256, 8, 3
    g = torch.Generator().manual_seed(bs)
    mask = random_tree(bs, k, steps, g)
    probs = greedy_rows(dyadic_probs((bs, k), V, g, bits=24), g)
    parent = S._tree_parents(mask)
    top = probs.topk(4, -1).indices                                  # [bs, k, 4]
    slot = torch.randint(4, (bs, k), generator=g)
    tokens = top.gather(1, parent.clamp_min(0)[:, :, None].expand(-1, -1, 4))
    tokens = tokens.gather(2, slot[:, :, None])[..., 0]
    seed = torch.randint(0, 2 ** 62, (bs,), generator=g)
    positions = torch.randint(0, 1 << 20, (bs, 1)) + torch.arange(steps + 1)
    args = [t.cuda() for t in (tokens, mask, probs)]
    got = S.verify_tree_sampled(*args, None, seed.cuda(), positions.cuda(), steps)
    want = reference_tree(*args, seed.cuda(), positions.cuda(), steps)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_scalar_rule_traces_whole_under_torch_compile():
    """fullgraph: no graph break and no host sync in either verifier; the compiled call returns
    the eager tokens."""
    g = torch.Generator().manual_seed(3)
    bs, k, steps, V = 6, 8, 3, 11
    mask = random_tree(bs, k, steps, g)
    probs = softmax_probs((bs, k), V, g)
    tokens = torch.randint(V, (bs, k), generator=g)
    seed, positions = torch.arange(bs), torch.arange(steps + 1).expand(bs, -1)

    def both(tokens, mask, probs, seed, positions):
        tree = S.verify_tree_sampled(tokens, mask, probs, None, seed, positions, steps)
        chain = S.verify_chain_sampled(probs, tokens[:, 1:steps + 1], None, seed, positions)
        return (*tree, *chain)
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    args = (tokens, mask, probs, seed, positions)
    for got, want in zip(compiled(*args), both(*args)):
        assert torch.equal(got, want)


# ------------------------------------------- the rule from logits (no [bs * k, V] distribution)

def _logit_lanes(n, V, g):
    """bf16 logits and sampling lanes [n] mixing greedy, temperature-only, top-k, top-p and min-p
    rows, a NaN logit and a +inf one."""
    logits = (torch.randn(n, V, generator=g) * 4).to(torch.bfloat16)
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    temp = torch.rand(n, generator=g) + 0.3
    temp[::5] = 0.0
    top_k = torch.where(torch.rand(n, generator=g) < 0.5,
                        torch.randint(1, 30, (n,), generator=g), 0).int()
    top_p = torch.where(torch.rand(n, generator=g) < 0.5, 0.8, 1.0).float()
    min_p = torch.where(torch.rand(n, generator=g) < 0.3, 0.05, 0.0).float()
    return logits, temp, top_k, top_p, min_p


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_child_probs_are_the_distributions_entries_and_mass(impl):
    """`child_probs`: each pair's probability equals `sampling_probs`' entry bit for bit, and the
    row's mass its fp64 sum (the Triton form sums in another order: within 4 ulps of 1)."""
    g = torch.Generator().manual_seed(11)
    n, V = 20, 700
    lanes = _logit_lanes(n, V, g)
    probs = S.sampling_probs(*lanes, impl="torch")
    rows = torch.randint(0, n, (60,), generator=g)
    tokens = torch.randint(0, V, (60,), generator=g)
    tokens[:30] = probs[rows[:30]].argmax(-1)                        # pairs with mass
    p, total = S.child_probs(*lanes, rows, tokens, impl=impl)
    assert torch.equal(p, probs[rows, tokens].double())
    assert (p[:30] > 0).all()
    want = probs.sum(-1, dtype=torch.float64)[rows]
    assert (total - want).abs().max() <= 4 * 2 ** -52


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_tree_rule_from_logits_equals_the_rule_from_distributions(impl):
    """`verify_tree_logits` (each child's probability from its own logit, one row a request at
    the end) gives `verify_tree_sampled` on the full `sampling_probs` distributions, token for
    token, on random trees whose children follow their parents' distributions."""
    g = torch.Generator().manual_seed(12)
    bs, k, steps, V = 10, 6, 3, 300
    lanes = _logit_lanes(bs * k, V, g)
    probs = S.sampling_probs(*lanes, impl="torch").view(bs, k, V)
    mask = random_tree(bs, k, steps, g)
    tokens = tree_tokens(probs, mask, g, V)
    seed = torch.randint(0, 2 ** 62, (bs,), generator=g)
    positions = torch.randint(0, 1 << 20, (bs, 1)) + torch.arange(steps + 1)
    want = S.verify_tree_sampled(tokens, mask, probs, None, seed, positions, steps)
    got = S.verify_tree_logits(tokens, mask, *lanes, seed, positions, steps, impl=impl)
    for name, a, b in zip(("accept_len", "accept_index", "out_tokens"), got, want):
        assert torch.equal(a, b), (name, a.tolist(), b.tolist())
    assert (want[0] > 1).sum() >= 3 and (want[0] == 1).any(), want[0]


class _VocabElems(_VocabOps):
    """Sums the elements of the V-wide tensors torch calls return."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[-1] == self.V:
            self.count += out.numel()
        return out


def test_the_rule_from_logits_builds_one_distribution_row_a_request():
    """Where the kernels run, the V-wide tensors a round makes hold a few rows a request, not
    a row a node: 6 and 12 nodes make the same number of elements, and the rule from the
    distributions (their `sampling_probs` included) makes more than 3 times as many."""
    g = torch.Generator().manual_seed(13)
    bs, steps, V = 3, 3, 257
    counts = []
    for k in (6, 12):
        lanes = _logit_lanes(bs * k, V, g)
        mask = random_tree(bs, k, steps, g)
        tokens = torch.randint(V, (bs, k), generator=g)
        positions = torch.arange(steps + 1).expand(bs, -1)
        with _VocabElems(V) as mode:
            S.verify_tree_logits(tokens, mask, *lanes, torch.arange(bs), positions, steps,
                                 impl="triton")
        counts.append(mode.count)
    with _VocabElems(V) as mode:
        probs = S.sampling_probs(*lanes, impl="triton").view(bs, 12, V)
        S.verify_tree_sampled(tokens, mask, probs, None, torch.arange(bs), positions, steps)
    assert counts[0] == counts[1] and 3 * counts[1] < mode.count, (counts, mode.count)


@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 16])
def test_tree_rule_from_logits_on_gpu_at_llama3_vocabulary(bs):
    """`verify_tree_logits` on CUDA (the kernels' masses) against `verify_tree_sampled` on the
    full distributions, 128256 tokens, k 8, steps 3, lanes mixed as `_logit_lanes`; the
    children follow their parents' distributions."""
    V, k, steps = 128256, 8, 3
    g = torch.Generator().manual_seed(100 + bs)
    lanes = [t.cuda() for t in _logit_lanes(bs * k, V, g)]
    probs = S.sampling_probs(*lanes).view(bs, k, V)
    mask = random_tree(bs, k, steps, g).cuda()
    parent = S._tree_parents(mask)
    top = probs.topk(4, -1).indices                                  # [bs, k, 4]
    slot = torch.randint(4, (bs, k), generator=g).cuda()
    tokens = top.gather(1, parent.clamp_min(0)[:, :, None].expand(-1, -1, 4))
    tokens = tokens.gather(2, slot[:, :, None])[..., 0]
    seed = torch.randint(0, 2 ** 62, (bs,), generator=g).cuda()
    positions = (torch.randint(0, 1 << 20, (bs, 1)) + torch.arange(steps + 1)).cuda()
    want = S.verify_tree_sampled(tokens, mask, probs, None, seed, positions, steps)
    got = S.verify_tree_logits(tokens, mask, *lanes, seed, positions, steps)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
