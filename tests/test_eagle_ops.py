"""EAGLE device ops: Triton kernels (interpreted on CPU) against their torch references, and the
references against brute-force definitions, on awkward sizes."""
import pytest
import torch

from padgraph.backends.triton import eagle


def random_candidates(bs, topk, steps, gen, ties=False):
    """Run the EAGLE-2 expansion on random draft distributions; the flat candidate list."""
    vocab = 50
    def dist(n):
        p = torch.rand(n, topk, generator=gen)
        if ties:
            p = (p * 2).round() / 2 + 0.5    # few distinct values: exact score ties
        p, _ = p.sort(dim=1, descending=True)
        return p, torch.randint(0, vocab, (n, topk), generator=gen)
    H = 3
    p, idx = dist(bs)
    hidden = torch.randn(bs, H, generator=gen)
    scores_l, tokens_l, parents_l = [], [], []
    scores = None
    prev_global = None
    for step in range(steps):
        ids, hidden, scores, lv_s, lv_t, expanded, _ = eagle.select_top_k(
            step, p, idx, hidden, scores, topk)
        scores_l.append(lv_s)
        tokens_l.append(lv_t)
        parents_l.append(torch.full_like(lv_t, -1) if step == 0
                         else eagle.level_parents(prev_global, topk))
        prev_global = eagle.level_offset(step, topk) + expanded
        p, idx = dist(bs * topk)
    return torch.cat(scores_l, 1), torch.cat(tokens_l, 1), torch.cat(parents_l, 1)


def brute_tree(sel, cand_parents):
    """Ancestor mask by walking parents in Python."""
    bs, k1 = sel.shape
    k = k1 + 1
    mask = torch.zeros(bs, k, k, dtype=torch.bool)
    for r in range(bs):
        node_of = {int(c): i + 1 for i, c in enumerate(sel[r])}
        for i in range(k):
            mask[r, i, i] = True
            if i == 0:
                continue
            c = int(sel[r, i - 1])
            chain = []
            while True:  # up to the root, or to a missing parent (an orphaned branch)
                pc = int(cand_parents[r, c])
                if pc == -1:
                    chain.append(0)
                    break
                if pc not in node_of:
                    break
                chain.append(node_of[pc])
                c = pc
            mask[r, i, chain] = True
    return mask


@pytest.mark.parametrize("bs,topk,steps,k", [(3, 2, 3, 6), (5, 4, 4, 8), (1, 1, 5, 6),
                                             (7, 3, 2, 11)])
@pytest.mark.parametrize("ties", [False, True])
def test_build_tree(bs, topk, steps, k, ties):
    gen = torch.Generator().manual_seed(bs * 100 + k)
    s, t, par = random_candidates(bs, topk, steps, gen, ties)
    ref = eagle.build_tree(s, t, par, k, topk, steps, impl="torch")
    tri = eagle.build_tree(s, t, par, k, topk, steps, impl="triton")
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)
    sel = eagle.select_tree(s, k)
    assert torch.equal(ref[1], brute_tree(sel, par))
    # depth = number of strict ancestors for every reachable node
    parent = eagle.tree_parents(ref[1])
    assert torch.equal(parent.int(), ref[3])
    reach = ref[1][:, :, 0]
    assert torch.equal((ref[1].sum(2) - 1)[reach], ref[2][reach])


def random_tree_case(bs, k, steps, gen, vocab=6):
    """A random valid tree (parents precede children, depth <= steps) and target predictions."""
    parent = torch.full((bs, k), -1, dtype=torch.long)
    depth = torch.zeros(bs, k, dtype=torch.long)
    for r in range(bs):
        for i in range(1, k):
            while True:
                p = int(torch.randint(0, i, (), generator=gen))
                if depth[r, p] < steps:
                    break
            parent[r, i], depth[r, i] = p, depth[r, p] + 1
    mask = torch.eye(k, dtype=torch.bool).repeat(bs, 1, 1)
    for r in range(bs):
        for i in range(1, k):
            mask[r, i] |= mask[r, parent[r, i]]
    tokens = torch.randint(0, vocab, (bs, k), generator=gen)
    predict = torch.randint(0, vocab, (bs, k), generator=gen)
    # make sibling tokens distinct, as top-k children are
    for r in range(bs):
        for i in range(1, k):
            used = {int(tokens[r, j]) for j in range(1, i) if parent[r, j] == parent[r, i]}
            while int(tokens[r, i]) in used:
                tokens[r, i] = (tokens[r, i] + 1) % (vocab + k)
    return tokens, mask, predict, parent


def brute_accept(tokens, parent, predict, steps):
    path = [0]
    while len(path) <= steps:
        cur, tp = path[-1], int(predict[path[-1]])
        kids = [c for c in range(1, len(tokens)) if parent[c] == cur and int(tokens[c]) == tp]
        if not kids:
            break
        path.append(kids[0])
    return path, [int(predict[n]) for n in path]


@pytest.mark.parametrize("bs,k,steps", [(1, 4, 3), (5, 8, 4), (9, 13, 5), (3, 6, 2)])
def test_verify_greedy(bs, k, steps):
    gen = torch.Generator().manual_seed(k * 7 + bs)
    tokens, mask, predict, parent = random_tree_case(bs, k, steps, gen)
    n_rows, ctx = bs + 2, 40
    rt = torch.randperm(n_rows * ctx, generator=gen).int().view(n_rows, ctx) + 1
    rows = torch.randperm(n_rows - 1, generator=gen)[:bs].int() + 1
    seq_lens = torch.randint(0, ctx - k, (bs,), generator=gen).int()
    outs = []
    for impl in ("torch", "triton"):
        rt_i = rt.clone()
        res = eagle.verify_greedy(tokens, mask, predict, rt_i, rows, seq_lens, steps, impl=impl)
        outs.append((res, rt_i))
    (ref, rt_ref), (tri, rt_tri) = outs
    assert torch.equal(rt_ref, rt_tri)
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)
    acc_len, acc_idx, out_tok = ref
    for r in range(bs):
        path, emitted = brute_accept(tokens[r], parent[r], predict[r], steps)
        n = len(path)
        assert int(acc_len[r]) == n
        assert acc_idx[r, :n].tolist() == path
        assert out_tok[r, :n].tolist() == emitted
        row, L = int(rows[r]), int(seq_lens[r])
        old = rt[row, L:L + k].tolist()
        rejected = [old[i] for i in range(k) if i not in path]
        assert rt_ref[row, L:L + k].tolist() == [old[i] for i in path] + rejected
    # rows no request uses are untouched
    untouched = sorted(set(range(n_rows)) - set(rows.tolist()))
    assert torch.equal(rt_ref[untouched], rt[untouched])


def test_verify_greedy_all_accepted_chain():
    bs, k, steps = 2, 5, 4
    mask = torch.tril(torch.ones(k, k, dtype=torch.bool)).repeat(bs, 1, 1)
    tokens = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 7, 3, 4]])
    predict = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    rt = torch.arange(3 * 16).int().view(3, 16)
    for impl in ("torch", "triton"):
        acc_len, _, out = eagle.verify_greedy(tokens, mask, predict, rt.clone(),
                                              torch.tensor([1, 2]).int(),
                                              torch.tensor([3, 0]).int(), steps, impl=impl)
        assert acc_len.tolist() == [5, 2]
        assert out[0].tolist() == [1, 2, 3, 4, 5] and out[1, :2].tolist() == [1, 2]


@pytest.mark.parametrize("bs,n_path,k,H,n_valid", [(1, 4, 6, 5, 1), (6, 3, 4, 37, 4),
                                                    (9, 6, 8, 130, 9)])
def test_pack_draft_extend(bs, n_path, k, H, n_valid):
    gen = torch.Generator().manual_seed(bs + H)
    accept_len = torch.randint(1, n_path + 1, (bs,), generator=gen).int()
    accept_index = torch.randint(0, k, (bs, n_path), generator=gen)
    out_tokens = torch.randint(0, 1000, (bs, n_path), generator=gen)
    hidden = torch.randn(bs * k, H, generator=gen)
    rt = torch.randperm(20 * 32, generator=gen).int().view(20, 32)
    rows = torch.randperm(19, generator=gen)[:bs].int() + 1
    seq_lens = torch.randint(0, 32 - n_path, (bs,), generator=gen).int()
    nv = torch.tensor(n_valid)
    ref = eagle.pack_draft_extend(accept_len, accept_index, out_tokens, hidden, seq_lens, rt,
                                  rows, nv, impl="torch")
    tri = eagle.pack_draft_extend(accept_len, accept_index, out_tokens, hidden, seq_lens, rt,
                                  rows, nv, impl="triton")
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)
    ids, pos, loc, hid, qo, new_lens = ref
    lens = accept_len.tolist()[:n_valid] + [0] * (bs - n_valid)
    assert qo.tolist() == [sum(lens[:r]) for r in range(bs + 1)]
    assert new_lens.tolist() == (seq_lens + accept_len).tolist()
    for r in range(bs):
        for i in range(lens[r]):
            t = qo[r] + i
            assert ids[t] == out_tokens[r, i] and pos[t] == seq_lens[r] + i
            assert loc[t] == rt[rows[r], seq_lens[r] + i]
            assert torch.equal(hid[t], hidden[r * k + accept_index[r, i]])
    total = int(qo[-1])
    assert not ids[total:].any() and not pos[total:].any() and not hid[total:].any()


def test_assign_and_mask_helpers():
    rt = torch.arange(4 * 10).int().view(4, 10)
    loc = eagle.assign_cache_locs(rt, torch.tensor([2, 1]).int(), torch.tensor([3, 7]).int(), 3)
    assert loc.tolist() == [23, 24, 25, 17, 18, 19]
    topk, n = 2, 4
    mask = torch.eye(n, dtype=torch.bool)[None].clone()
    mask = eagle.expand_draft_mask(mask, 0, topk, None)
    mask = eagle.expand_draft_mask(mask, 1, topk, torch.tensor([[1, 1]]))
    assert mask[0, 2].tolist() == [False, True, True, False]
    assert mask[0, 3].tolist() == [False, True, False, True]


def test_pack_draft_extend_gives_int64_ids_from_int32_tokens_on_both_paths():
    """The reference's input_ids are int64 as the kernel's (and the docstring's), whatever the
    tokens' integer dtype."""
    from padgraph.backends.triton import eagle
    g = torch.Generator().manual_seed(5)
    bs, k, n_path, hid = 3, 4, 3, 5
    args = (torch.randint(1, n_path + 1, (bs,), generator=g).int(),
            torch.randint(0, k, (bs, n_path), generator=g),
            torch.randint(0, 100, (bs, n_path), generator=g).int(),
            torch.randn(bs * k, hid, generator=g), torch.randint(0, 8, (bs,), generator=g).int(),
            torch.randperm(4 * 16, generator=g).int().view(4, 16) + 1,
            torch.arange(1, bs + 1, dtype=torch.int32), torch.tensor(bs))
    ref = eagle.pack_draft_extend(*args, impl="torch")
    got = eagle.pack_draft_extend(*args, impl="triton")
    assert ref[0].dtype == got[0].dtype == torch.int64
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
