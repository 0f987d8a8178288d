"""Exact speculative sampling (`verify_chain_sampled`, `verify_tree_sampled`): on a tiny
synthetic model (logits tables indexed by the last two tokens, V = 8) the joint distribution of
the first three tokens emitted by MTP-chain and EAGLE-tree rounds equals plain sampling's
(chi-square over the 512 triples), while deliberately wrong acceptance rules fail the same
test; greedy targets reproduce greedy verification bit for bit."""
from __future__ import annotations

import pytest
import torch
from sampling_stats import P_MIN, chi_square, counts_of, one_thread  # noqa: F401 (fixture)

from padgraph.backends.triton import eagle
from padgraph.llm import sampling as S
from padgraph.llm.sampling import PURPOSE_DECODE, PURPOSE_DRAFT, sample, sampling_probs

V, N, PROMPT = 8, 40000, (3, 5)
_g = torch.Generator().manual_seed(11)
TARGET = torch.randn(V, V, V, generator=_g) * 1.5                  # logits[prev2, prev1]
DRAFT = TARGET + torch.randn(V, V, V, generator=_g) * 1.2           # a draft that mostly agrees
TARGET_PARAMS = dict(temperature=0.9, top_k=6, top_p=0.95, min_p=0.02)
DRAFT_PARAMS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def params(n, p):
    return dict(temperature=torch.full((n,), p["temperature"]),
                top_k=torch.full((n,), p["top_k"], dtype=torch.int32),
                top_p=torch.full((n,), p["top_p"]), min_p=torch.full((n,), p["min_p"]))


def probs(table, prev2, prev1, p=TARGET_PARAMS):
    """The sampling distribution after (prev2, prev1): [..., V] fp32."""
    shape = prev2.shape
    logits = table[prev2.reshape(-1), prev1.reshape(-1)]
    return sampling_probs(logits, **params(logits.shape[0], p)).view(*shape, V)


def exact_joint() -> torch.Tensor:
    """P(t1, t2, t3) of plain sampling after the prompt: [V**3]."""
    a, b = (torch.tensor(t) for t in PROMPT)
    p1 = probs(TARGET, a[None], b[None])[0]                           # [V]
    t = torch.arange(V)
    p2 = probs(TARGET, b.expand(V), t)                                # [t1, V]
    p3 = probs(TARGET, t[:, None].expand(V, V), t[None, :].expand(V, V))   # [t1, t2, V]
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1).double()


class Lanes:
    """N requests with the same prompt and their own seeds, emitting tokens round by round."""

    def __init__(self, seed0=0):
        self.hist = torch.tensor(PROMPT).repeat(N, 1)
        self.hist = torch.cat([self.hist, torch.zeros(N, 3, dtype=torch.long)], 1)
        self.count = torch.zeros(N, dtype=torch.long)
        self.seed = torch.arange(N) + seed0 * N
        self.rounds = 0
        self.accepted = 0

    def last_two(self):
        return (self.hist.gather(1, self.count[:, None])[:, 0],
                self.hist.gather(1, (self.count + 1)[:, None])[:, 0])

    def next_position(self):
        return len(PROMPT) + self.count

    def emit(self, accept_len, out_tokens):
        for j in range(out_tokens.shape[1]):
            on = (j < accept_len) & (self.count < 3)
            col = (self.count + len(PROMPT)).clamp_max(self.hist.shape[1] - 1)[:, None]
            old = self.hist.gather(1, col)[:, 0]
            self.hist.scatter_(1, col, torch.where(on, out_tokens[:, j], old)[:, None])
            self.count += on.long()
        self.rounds += 1
        self.accepted += float((accept_len - 1).double().mean())

    def triples(self):
        t = self.hist[:, len(PROMPT):]
        return (t[:, 0] * V + t[:, 1]) * V + t[:, 2]

    def run(self, round_fn):
        while bool((self.count < 3).any()):
            round_fn(self)
        return self.triples()


def fit(triples) -> float:
    return chi_square(counts_of(triples, V ** 3), exact_joint())[2]


def plain_round(lanes: Lanes):
    prev2, prev1 = lanes.last_two()
    logits = TARGET[prev2, prev1]
    tok = sample(logits, **params(N, TARGET_PARAMS), seed=lanes.seed,
                 position=lanes.next_position(), purpose=PURPOSE_DECODE)
    lanes.emit(torch.ones(N, dtype=torch.long), tok[:, None])


def chain_round(lanes: Lanes, k=2, sampled_draft=True, verify=S.verify_chain_sampled):
    """MTP: the draft proposes k tokens one after the other (drawn from its distribution, or
    its argmax), the target scores the k + 1 positions, `verify` accepts."""
    prev2, prev1 = lanes.last_two()
    pos0 = lanes.next_position()
    drafts, qs, ps = [], [], []
    for i in range(k + 1):
        ps.append(probs(TARGET, prev2, prev1))
        if i == k:
            break
        q = probs(DRAFT, prev2, prev1, DRAFT_PARAMS)
        if sampled_draft:
            c = sample(DRAFT[prev2, prev1], **params(N, DRAFT_PARAMS), seed=lanes.seed,
                       position=pos0 + i, purpose=PURPOSE_DRAFT)
        else:
            c = q.argmax(-1)
        drafts.append(c)
        qs.append(q)
        prev2, prev1 = prev1, c
    positions = pos0[:, None] + torch.arange(k + 1)
    acc, out = verify(torch.stack(ps, 1), torch.stack(drafts, 1),
                      torch.stack(qs, 1) if sampled_draft else None, lanes.seed, positions)
    lanes.emit(acc.long(), out)


# A depth-2 EAGLE tree, two children a node: 0 the root; 1, 2 its children; 3, 4 node 1's;
# 5, 6 node 2's. Node i's context is (its parent's token, its token).
TREE_PARENT = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
TREE_K, TREE_STEPS = 7, 2


def tree_mask() -> torch.Tensor:
    mask = torch.eye(TREE_K, dtype=torch.bool)
    for i in range(1, TREE_K):
        mask[i] |= mask[TREE_PARENT[i]]
    return mask.expand(N, TREE_K, TREE_K)


def tree_round(lanes: Lanes, sampled_children=False, pass_draft_probs=None, key_by_node=False):
    """EAGLE: each expanded node's two children are the draft's top-2 (deterministic) or two
    draws without replacement from its distribution (Gumbel top-2 on the stream)."""
    prev2, prev1 = lanes.last_two()
    pos0 = lanes.next_position()
    tokens = torch.zeros(N, TREE_K, dtype=torch.long)
    ctx = torch.zeros(N, TREE_K, 2, dtype=torch.long)
    tokens[:, 0], ctx[:, 0] = prev1, torch.stack([prev2, prev1], 1)
    qs = torch.zeros(N, TREE_K, V)
    for node in (0, 1, 2):
        q = probs(DRAFT, ctx[:, node, 0], ctx[:, node, 1], DRAFT_PARAMS)
        qs[:, node] = q
        if sampled_children:         # keyed by the children's position and the node: a
            # decision never reuses noise another decision (this round's or the next's) saw
            depth = 0 if node == 0 else 1
            at, index = (node, 0) if key_by_node else (depth, node * V)
            u = S.uniform(lanes.seed[:, None], (pos0 + at)[:, None], PURPOSE_DRAFT,
                          index + torch.arange(V))
            gumbel = q.double().log() - (-u.log()).log()
            kids = gumbel.topk(2, -1).indices
        else:
            kids = q.topk(2, -1).indices
        children = (TREE_PARENT == node).nonzero()[:, 0]
        tokens[:, children] = kids
        ctx[:, children] = torch.stack([tokens[:, node:node + 1].expand(N, 2), kids], -1)
    target = probs(TARGET, ctx[..., 0], ctx[..., 1])                  # [N, k, V]
    use_q = sampled_children if pass_draft_probs is None else pass_draft_probs
    positions = pos0[:, None] + torch.arange(TREE_STEPS + 1)
    acc, _, out = S.verify_tree_sampled(tokens, tree_mask(), target, qs if use_q else None,
                                        lanes.seed, positions, TREE_STEPS)
    lanes.emit(acc.long(), out)


# ------------------------------------------------------------------ joint distributions

def test_plain_sampling_fits_the_exact_joint():
    assert fit(Lanes().run(plain_round)) >= P_MIN


@pytest.mark.parametrize("sampled_draft", [True, False], ids=["sampled-draft", "argmax-draft"])
def test_mtp_chain_emits_the_targets_joint_distribution(sampled_draft):
    lanes = Lanes(seed0=1)
    triples = lanes.run(lambda ls: chain_round(ls, k=2, sampled_draft=sampled_draft))
    assert lanes.accepted / lanes.rounds > 0.2                # the drafts do get accepted
    assert fit(triples) >= P_MIN


@pytest.mark.parametrize("sampled_children", [False, True],
                         ids=["top2-children", "sampled-children"])
def test_eagle_tree_emits_the_targets_joint_distribution(sampled_children):
    lanes = Lanes(seed0=2)
    triples = lanes.run(lambda ls: tree_round(ls, sampled_children))
    assert lanes.accepted / lanes.rounds > 0.5
    assert fit(triples) >= P_MIN


def test_eagle_tree_with_a_draft_sharper_than_its_children(monkeypatch):
    """A sharp draft (temperature 0.2, top-p 0.5) often has fewer tokens with mass than a node
    has children: the later children cannot be draws from q, and are tried as deterministic
    proposals (before, u * q(c) = 0 < p(c) accepted them whenever the target gave them mass)."""
    import sys
    monkeypatch.setattr(sys.modules[__name__], "DRAFT_PARAMS",
                        dict(temperature=0.2, top_k=0, top_p=0.5, min_p=0.0))
    monkeypatch.setattr(sys.modules[__name__], "TARGET_PARAMS",
                        dict(temperature=1.3, top_k=0, top_p=1.0, min_p=0.1))
    assert fit(Lanes(seed0=8).run(lambda ls: tree_round(ls, sampled_children=True))) >= P_MIN


def test_a_child_outside_the_drafts_mass_is_a_deterministic_proposal():
    """One node, q one-hot at token 0, children 0 and 1: the first token follows p exactly (as
    with `draft_probs=None`), not 0 / 1 with p(0) / 1 - p(0)."""
    n, v = 40_000, 4
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    target = p.expand(n, 3, v).contiguous()
    q = torch.zeros(n, 3, v, dtype=torch.float64)
    q[..., 0] = 1.0
    tokens = torch.tensor([[9 % v, 0, 1]]).expand(n, 3)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(n, 3, 3)
    seeds = torch.arange(n, dtype=torch.int64)
    positions = torch.zeros(n, 2, dtype=torch.int64)
    first = [S.verify_tree_sampled(tokens, mask, target, d, seeds, positions, 1)[2][:, 0]
             for d in (q, None)]
    for out in first:
        freq = torch.bincount(out, minlength=v).double() / n
        assert (freq - p).abs().max() < 0.01, freq


def test_a_chain_rule_whose_residual_ignores_the_draft_fails(monkeypatch):
    """Accept with min(1, p/q) but redraw from p itself on rejection: biased, and caught."""
    monkeypatch.setattr(S, "_residual", lambda p, q: p)
    lanes = Lanes(seed0=3)
    assert fit(lanes.run(lambda ls: chain_round(ls, k=2, sampled_draft=True))) < P_MIN


def test_a_chain_rule_that_ignores_the_draft_probability_in_the_test_fails():
    """Accept iff u < p(c), as if q were one-hot, yet correct with norm(max(p - q, 0)): caught."""
    def wrong(target_probs, drafts, draft_probs, seed, positions):
        bs, k = drafts.shape
        alive, n_acc, outs = torch.ones(bs, dtype=torch.bool), torch.zeros(bs, dtype=torch.long), []
        for i in range(k + 1):
            p = target_probs[:, i].double()
            u = S.uniform(seed, positions[:, i], S.PURPOSE_RESIDUAL)
            if i == k:
                outs.append(torch.where(alive, S._draw_probs(p, u), outs[-1]))
                break
            c = drafts[:, i]
            ok = S.uniform(seed, positions[:, i], S.PURPOSE_ACCEPT) < S._at(p, c)
            tok = torch.where(ok, c, S._draw_probs(S._residual(p, draft_probs[:, i].double()), u))
            outs.append(torch.where(alive, tok, outs[-1]) if i else tok)
            n_acc += (alive & ok).long()
            alive &= ok
        return n_acc + 1, torch.stack(outs, 1)
    lanes = Lanes(seed0=4)
    assert fit(lanes.run(lambda ls: chain_round(ls, k=2, verify=wrong))) < P_MIN


def test_a_tree_verified_with_q_for_deterministic_top_k_children_fails():
    """Top-2 children are not draws from q: verifying them with min(1, p/q) (q the draft's
    distribution) is biased, and caught; `draft_probs=None` is the exact rule for them."""
    lanes = Lanes(seed0=5)
    assert fit(lanes.run(lambda ls: tree_round(ls, False, pass_draft_probs=True))) < P_MIN


def test_reusing_noise_across_rounds_biases_the_output():
    """The hazard the keys avoid: a draft keying its noise by (round start + node) reads, in
    the next round, bits that one of this round's decisions already read; the output is then
    biased, and caught. Keyed by the proposed token's position and the node, it fits (above)."""
    lanes = Lanes(seed0=6)
    assert fit(lanes.run(lambda ls: tree_round(ls, True, key_by_node=True))) < P_MIN


# ----------------------------------------------------------------------- greedy targets

def random_tree(bs, k, steps, g):
    """Random trees of k nodes and depth <= steps: parents precede children."""
    parent = torch.full((bs, k), -1, dtype=torch.long)
    depth = torch.zeros(bs, k, dtype=torch.long)
    mask = torch.eye(k, dtype=torch.bool).repeat(bs, 1, 1)
    for i in range(1, k):
        for b in range(bs):
            ok = (depth[b, :i] < steps).nonzero()[:, 0]
            par = ok[torch.randint(len(ok), (1,), generator=g)].item()
            parent[b, i], depth[b, i] = par, depth[b, par] + 1
            mask[b, i] |= mask[b, par]
    return mask


@pytest.mark.parametrize("k,steps", [(8, 4), (6, 2), (12, 5)])
def test_greedy_target_gives_verify_greedys_result_bit_for_bit(k, steps):
    g = torch.Generator().manual_seed(k)
    bs, vocab = 64, 3                                        # a small vocabulary: many matches
    mask = random_tree(bs, k, steps, g)
    tokens = torch.randint(vocab, (bs, k), generator=g)
    predict = torch.randint(vocab, (bs, k), generator=g)
    onehot = torch.nn.functional.one_hot(predict, vocab).float()
    positions = torch.arange(steps + 1).expand(bs, steps + 1) + 100
    got = S.verify_tree_sampled(tokens, mask, onehot, None, torch.arange(bs), positions, steps)
    rt = torch.zeros(bs, 64, dtype=torch.int32)
    want = eagle.verify_greedy_reference(tokens, mask, predict, rt, torch.arange(bs),
                                         torch.zeros(bs, dtype=torch.int32), steps)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[0].float().mean() > 1.2                      # paths do get accepted


def test_greedy_target_chain_accepts_exactly_the_argmax_prefix():
    g = torch.Generator().manual_seed(3)
    bs, k, vocab = 256, 4, 3
    argmax = torch.randint(vocab, (bs, k + 1), generator=g)
    drafts = torch.where(torch.rand(bs, k, generator=g) < 0.7, argmax[:, :k],
                         torch.randint(vocab, (bs, k), generator=g))
    onehot = torch.nn.functional.one_hot(argmax, vocab).float()
    for q in (None, torch.softmax(torch.randn(bs, k, vocab, generator=g), -1)):
        acc, out = S.verify_chain_sampled(onehot, drafts, q, torch.arange(bs),
                                          torch.arange(k + 1).expand(bs, k + 1))
        match = (drafts == argmax[:, :k]).long().cumprod(1)
        assert torch.equal(acc.long(), 1 + match.sum(1))
        emitted = torch.arange(k + 1) < acc[:, None]
        assert torch.equal(out[emitted], argmax[emitted])


def test_verification_depends_only_on_each_requests_keys():
    g = torch.Generator().manual_seed(9)
    bs, k = 32, 3
    tp = torch.softmax(torch.randn(bs, k + 1, V, generator=g), -1)
    q = torch.softmax(torch.randn(bs, k, V, generator=g), -1)
    drafts = torch.randint(V, (bs, k), generator=g)
    seed, pos = torch.randint(0, 2 ** 40, (bs,), generator=g), torch.arange(k + 1).expand(bs, -1)
    acc, out = S.verify_chain_sampled(tp, drafts, q, seed, pos)
    perm = torch.randperm(bs, generator=g)
    acc2, out2 = S.verify_chain_sampled(tp[perm], drafts[perm], q[perm], seed[perm], pos[perm])
    assert torch.equal(acc2, acc[perm]) and torch.equal(out2, out[perm])
    acc3, out3 = S.verify_chain_sampled(tp[:3], drafts[:3], q[:3], seed[:3], pos[:3])
    assert torch.equal(acc3, acc[:3]) and torch.equal(out3, out[:3])
