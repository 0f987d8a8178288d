"""EAGLE device ops: draft slot assignment, top-k expansion, tree construction, greedy
verification with KV commit, and draft-extend packing. Torch references beside the kernels.

All ops are graph-safe: fixed shapes from their arguments, no host syncs, per-request values read
on the device. Which is which:

- `assign_cache_locs`, `select_top_k`, `expand_draft_mask`, `verify_inputs`: torch only. Each is
  a handful of gathers/topk launches that are already graph-safe; a kernel would save little.
- `build_tree`, `verify_greedy`, `pack_draft_extend`: Triton kernels (one program per request)
  with torch references. In torch each is a loop of small ops per tree level or a cumsum/scatter
  chain (tens of launches per call); fused, each is one launch.

Tree conventions (EAGLE-2, as in SGLang). Draft candidates live in one flat list per request:
level 0 holds `topk` candidates, each later level `topk * topk` (the children of the `topk`
nodes expanded at the previous level), so `n_cand = topk + (steps - 1) * topk**2`.
`cand_parents[r, c]` is the flat index of c's parent candidate, -1 for level 0 (child of the
root). The verify tree has `k` nodes: node 0 is the root (the last verified token), nodes 1..k-1
the best `k - 1` candidates by cumulative score, in candidate order, so a parent always precedes
its children. `tree_mask[r, i, j]` is True iff node j is node i or one of its ancestors. A node
whose parent candidate was not selected (possible only on exact score ties) is an orphan: its
mask row holds itself (and its descendants' rows hold the orphaned branch) but never the root,
and verification, which only walks down from the root, can never reach it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv import resolve_impl


# ------------------------------------------------------------------------ torch-only small ops

def assign_cache_locs(req_to_token, req_pool_indices, seq_lens, n: int) -> torch.Tensor:
    """Slots of positions seq_lens .. seq_lens+n-1 per request: [bs * n] int64, request-major.

    Slots are assigned when a request is admitted (its req_to_token row covers its whole budget),
    so draft and verify tokens take the slots of the positions they occupy.
    """
    offs = torch.arange(n, device=seq_lens.device)
    cols = (seq_lens.long()[:, None] + offs[None, :]).clamp_max(req_to_token.shape[1] - 1)
    return req_to_token[req_pool_indices.long()[:, None], cols].long().reshape(-1)


def select_top_k(step: int, topk_p, topk_index, hidden, scores, topk: int):
    """One EAGLE-2 expansion step.

    step 0: topk_p/topk_index [bs, topk] are the level-0 candidates; all of them are expanded.
    step > 0: topk_p/topk_index [bs*topk, topk] are the children of the `topk` nodes expanded at
    the previous step (hidden [bs*topk, H], scores [bs, topk] their cumulative scores); the best
    `topk` children by cumulative score are expanded next.

    Returns (input_ids [bs*topk], hidden [bs*topk, H], scores [bs, topk], level scores
    [bs, n_level], level tokens [bs, n_level], expanded [bs, topk] = index of each expanded node
    within this level, parent_slot [bs, topk] = which node of the previous step it descends from).
    """
    if step == 0:
        bs = topk_p.shape[0]
        ids = topk_index.reshape(-1)
        hid = hidden.repeat_interleave(topk, dim=0)
        expanded = torch.arange(topk, device=topk_p.device).expand(bs, topk)
        return ids, hid, topk_p, topk_p, topk_index, expanded, expanded
    bs = scores.shape[0]
    level_scores = (scores[:, :, None] * topk_p.view(bs, topk, topk)).reshape(bs, topk * topk)
    level_tokens = topk_index.reshape(bs, topk * topk)
    new_scores, expanded = level_scores.topk(topk, dim=1)           # [bs, topk]
    parent_slot = torch.div(expanded, topk, rounding_mode="floor")  # [bs, topk]
    ids = level_tokens.gather(1, expanded).reshape(-1)
    rows = (parent_slot + torch.arange(bs, device=scores.device)[:, None] * topk).reshape(-1)
    return ids, hidden[rows], new_scores, level_scores, level_tokens, expanded, parent_slot


def expand_draft_mask(mask, step: int, topk: int, parent_slot):
    """Draft-tree attention mask after expanding step `step`'s nodes (rows step*topk + j).

    mask [bs, n, n] bool, n = (steps - 1) * topk; node (step, j) sees itself and its parent's
    row (node (step - 1, parent_slot[:, j])). Returns a new tensor (graph-safe, out of place).
    """
    bs, n, _ = mask.shape
    lo = step * topk
    eye = torch.eye(n, dtype=torch.bool, device=mask.device)[lo:lo + topk]  # [topk, n]
    rows = eye.expand(bs, topk, n)
    if step > 0:
        parent_rows = (step - 1) * topk + parent_slot                      # [bs, topk]
        rows = rows | mask.gather(1, parent_rows[:, :, None].expand(bs, topk, n))
    return torch.cat([mask[:, :lo], rows, mask[:, lo + topk:]], dim=1)


def verify_inputs(verified_id, draft_tokens, depth, seq_lens, req_to_token, req_pool_indices):
    """Verify-program inputs from a draft tree: (input_ids, positions, out_cache_loc) [bs * k]."""
    k = depth.shape[1]
    input_ids = torch.cat([verified_id[:, None], draft_tokens], dim=1).reshape(-1)
    positions = (seq_lens.long()[:, None] + depth).reshape(-1)
    out_cache_loc = assign_cache_locs(req_to_token, req_pool_indices, seq_lens, k)
    return input_ids, positions, out_cache_loc


def cand_levels(n_cand: int, topk: int, device) -> torch.Tensor:
    """Level (0-based) of each flat candidate index: [n_cand] int64."""
    c = torch.arange(n_cand, device=device)
    return torch.where(c < topk, 0, 1 + torch.div(c - topk, topk * topk, rounding_mode="floor"))


# ---------------------------------------------------------------------------- tree construction

def select_tree(cand_scores, k: int) -> torch.Tensor:
    """The k-1 best candidates by cumulative score, in candidate order: [bs, k-1] int64."""
    if not 1 <= k - 1 <= cand_scores.shape[1]:
        raise ValueError(f"build_tree: k - 1 must be in 1 .. n_cand = {cand_scores.shape[1]}; "
                         f"got k = {k}")
    return cand_scores.topk(k - 1, dim=1).indices.sort(dim=1).values


def build_tree_reference(sel, cand_parents, topk: int, steps: int):
    """Torch reference of `build_tree`'s structure: (tree_mask [bs,k,k], depth [bs,k] int64,
    parent [bs,k] int32)."""
    bs, k1 = sel.shape
    k, dev = k1 + 1, sel.device
    pc = cand_parents.gather(1, sel)                                   # [bs, k-1]
    hit = pc[:, :, None] == sel[:, None, :]                            # [bs, k-1, k-1]
    idx = torch.arange(1, k, device=dev)
    found = torch.where(hit, idx, -1).amax(dim=2)                      # node of the parent or -1
    parent = torch.cat([torch.full((bs, 1), -1, device=dev, dtype=torch.long),
                        torch.where(pc < 0, 0, found)], dim=1)         # [bs, k]
    mask = torch.eye(k, dtype=torch.bool, device=dev).expand(bs, k, k).clone()
    cur = parent
    for _ in range(steps):                                             # walk up to the root
        ok = cur >= 0
        mask |= torch.nn.functional.one_hot(cur.clamp_min(0), k).bool() & ok[:, :, None]
        cur = torch.where(ok, parent.gather(1, cur.clamp_min(0)), -1)
    levels = cand_levels(cand_parents.shape[1], topk, dev)
    depth = torch.cat([torch.zeros(bs, 1, dtype=torch.long, device=dev), levels[sel] + 1], 1)
    return mask, depth, parent.int()


@triton.jit
def _build_tree_kernel(Sel, CandParents, Mask, Depth, Parent, n_cand, k, topk,
                       STEPS: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per request; node i (1..k-1) is candidate Sel[r, i-1]
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    is_draft = (i >= 1) & (i < k)
    c = tl.load(Sel + r * (k - 1) + i - 1, mask=is_draft, other=-2)          # [K]
    pc = tl.load(CandParents + r * n_cand + c, mask=is_draft, other=-2)     # [K]
    hit = (pc[:, None] == c[None, :]) & is_draft[None, :]                    # [K, K]
    found = tl.max(tl.where(hit, i[None, :], -1), axis=1)
    parent = tl.where(pc == -1, 0, found)
    parent = tl.where(is_draft, parent, -1)
    # ancestors: follow parent pointers STEPS times (gather through a one-hot reduction)
    j = i[None, :]
    mask = i[:, None] == j
    cur = parent
    for _ in tl.static_range(STEPS):
        mask = mask | ((cur[:, None] == j) & (cur[:, None] >= 0))
        nxt = tl.sum(tl.where(cur[:, None] == j, parent[None, :] + 1, 0), axis=1) - 1
        cur = tl.where(cur >= 0, nxt, -1)
    level = tl.where(c < topk, 0, 1 + (c - topk) // (topk * topk))
    depth = tl.where(is_draft, level + 1, 0)
    valid = i < k
    tl.store(Depth + r * k + i, depth.to(tl.int64), mask=valid)
    tl.store(Parent + r * k + i, parent, mask=valid)
    mvalid = valid[:, None] & (j < k)
    tl.store(Mask + r * k * k + i[:, None] * k + j, mask, mask=mvalid)


def build_tree(cand_scores, cand_tokens, cand_parents, k: int, topk: int, steps: int,
               impl: str = "auto"):
    """EAGLE-2 tree from the flat candidate list: keep the best k-1 candidates (+ the root).

    Returns (draft_tokens [bs, k-1] int64, tree_mask [bs, k, k] bool, depth [bs, k] int64 — a
    node's position is seq_len + depth —, parent [bs, k] int32, -1 for the root and orphans).
    """
    sel = select_tree(cand_scores, k)
    draft_tokens = cand_tokens.gather(1, sel)
    if resolve_impl(impl, sel) == "torch":
        return (draft_tokens, *build_tree_reference(sel, cand_parents, topk, steps))
    bs, n_cand = cand_parents.shape
    dev = sel.device
    mask = torch.empty(bs, k, k, dtype=torch.bool, device=dev)
    depth = torch.empty(bs, k, dtype=torch.long, device=dev)
    parent = torch.empty(bs, k, dtype=torch.int32, device=dev)
    _build_tree_kernel[(bs,)](sel.contiguous(), cand_parents.long().contiguous(), mask, depth,
                              parent, n_cand, k, topk, STEPS=steps,
                              BLOCK_K=triton.next_power_of_2(k), num_warps=1)
    return draft_tokens, mask, depth, parent


# ------------------------------------------------------------------------ greedy verification

def tree_parents(tree_mask) -> torch.Tensor:
    """Parent node of each node from the mask: the deepest strict ancestor, -1 if none [bs,k]."""
    k = tree_mask.shape[1]
    idx = torch.arange(k, device=tree_mask.device)
    strict = tree_mask & (idx[None, :] < idx[:, None])
    return torch.where(strict, idx, -1).amax(dim=2)


def verify_greedy_reference(tokens, tree_mask, predict, req_to_token, req_pool_indices,
                            seq_lens, steps: int):
    """Torch reference of `verify_greedy` (same outputs, same req_to_token update)."""
    bs, k = tokens.shape
    dev = tokens.device
    parent = tree_parents(tree_mask)
    nodes = torch.arange(k, device=dev)
    cur = torch.zeros(bs, dtype=torch.long, device=dev)
    alive = torch.ones(bs, dtype=torch.bool, device=dev)
    path, out = [cur], []
    for _ in range(steps):
        tp = predict.gather(1, cur[:, None])                           # [bs, 1]
        out.append(tp[:, 0])
        match = (parent == cur[:, None]) & (tokens == tp) & (nodes >= 1) & alive[:, None]
        found = match.any(1)
        child = torch.where(match, nodes, k).amin(1)
        cur = torch.where(found, child, cur)
        alive = alive & found
        path.append(cur)
    out.append(predict.gather(1, cur[:, None])[:, 0])
    accept_index = torch.stack(path, 1)                                # [bs, steps+1]
    accept_len = 1 + torch.stack(path[1:], 1).ne(torch.stack(path[:-1], 1)).sum(1)
    _commit_reference(req_to_token, req_pool_indices, seq_lens, accept_index, accept_len, k)
    return accept_len.int(), accept_index, torch.stack(out, 1)


def _commit_reference(req_to_token, req_pool_indices, seq_lens, accept_index, accept_len, k):
    """Permute positions seq_len .. seq_len+k-1 so the accepted path comes first, in order."""
    bs, n_path = accept_index.shape
    dev = accept_index.device
    steps = torch.arange(n_path, device=dev)
    on = steps[None, :] < accept_len[:, None]                          # [bs, n_path]
    key = torch.arange(k, device=dev).expand(bs, k) + k                # rejected: after, in order
    key = torch.cat([key, key[:, :1]], dim=1)                          # column k: a dump
    key = key.scatter(1, torch.where(on, accept_index, k), steps.expand(bs, n_path))[:, :k]
    order = key.argsort(1)                                             # [bs, k] node per position
    rows = req_pool_indices.long()[:, None]
    cols = seq_lens.long()[:, None] + torch.arange(k, device=dev)
    old = req_to_token[rows, cols]
    req_to_token[rows, cols] = old.gather(1, order)


@triton.jit
def _verify_greedy_kernel(Tokens, TreeMask, Predict, ReqToToken, ReqPoolIdx, SeqLens,
                          AcceptLen, AcceptIndex, OutTokens, k, stride_rt,
                          STEPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_K)
    j = i[None, :]
    valid = i < k
    tokens = tl.load(Tokens + r * k + i, mask=valid, other=-1)
    predict = tl.load(Predict + r * k + i, mask=valid, other=-2)
    m = tl.load(TreeMask + r * k * k + i[:, None] * k + j,
                mask=valid[:, None] & (j < k), other=0).to(tl.int1)
    parent = tl.max(tl.where(m & (j < i[:, None]), j, -1), axis=1)       # deepest strict ancestor
    p = tl.arange(0, BLOCK_P)
    path = tl.zeros([BLOCK_P], dtype=tl.int64)
    outs = tl.zeros([BLOCK_P], dtype=tl.int64)
    cur = 0
    n_acc = 1
    alive = 1
    for d in tl.static_range(STEPS):
        tp = tl.sum(tl.where(i == cur, predict, 0))
        outs = tl.where(p == d, tp, outs)
        match = (parent == cur) & (tokens == tp) & (i >= 1) & valid & (alive == 1)
        child = tl.min(tl.where(match, i, BLOCK_K))
        found = child < BLOCK_K
        cur = tl.where(found, child, cur)
        n_acc += found.to(tl.int32)
        alive = tl.where(found, alive, 0)
        path = tl.where(p == d + 1, cur, path)
    outs = tl.where(p == STEPS, tl.sum(tl.where(i == cur, predict, 0)), outs)
    pm = p < STEPS + 1
    tl.store(AcceptLen + r, n_acc)
    tl.store(AcceptIndex + r * (STEPS + 1) + p, path, mask=pm)
    tl.store(OutTokens + r * (STEPS + 1) + p, outs, mask=pm)
    # commit: position of node i = its rank on the path, else n_acc + rank among rejected nodes
    on = tl.sum(((path[None, :] == i[:, None]) & (p[None, :] < n_acc)).to(tl.int32), axis=1) > 0
    rank = tl.sum(tl.where((path[None, :] == i[:, None]) & (p[None, :] < n_acc), p[None, :], 0),
                  axis=1)
    rejected_before = tl.sum(((~on)[None, :] & (j < i[:, None]) & (j < k)).to(tl.int32), axis=1)
    dest = tl.where(on, rank, n_acc + rejected_before)
    row = tl.load(ReqPoolIdx + r).to(tl.int64)
    base = ReqToToken + row * stride_rt + tl.load(SeqLens + r).to(tl.int64)
    slots = tl.load(base + i, mask=valid)
    tl.debug_barrier()  # every lane has read the old slots before any lane writes
    tl.store(base + dest, slots, mask=valid)


def verify_greedy(tokens, tree_mask, predict, req_to_token, req_pool_indices, seq_lens,
                  steps: int, impl: str = "auto"):
    """Greedy tree verification: the longest path whose draft tokens equal the target's argmax.

    tokens [bs, k] (node 0 = root), tree_mask [bs, k, k], predict [bs, k] = the target's argmax
    at each node. Returns (accept_len [bs] int32 = accepted drafts + 1, accept_index [bs, steps+1]
    node per path step (repeating the last node past accept_len), out_tokens [bs, steps+1] = the
    tokens emitted: accepted drafts then the bonus token). Also rewrites req_to_token positions
    seq_lens .. seq_lens+k-1 so the accepted nodes' slots come first in path order (a
    permutation of the request's own slots: KV is never copied, nothing is freed).
    """
    bs, k = tokens.shape
    if resolve_impl(impl, tokens, predict, req_to_token) == "torch":
        return verify_greedy_reference(tokens, tree_mask, predict, req_to_token,
                                       req_pool_indices, seq_lens, steps)
    dev = tokens.device
    if req_to_token.stride(-1) != 1:     # written in place: a dense copy would lose the commit
        raise ValueError(f"req_to_token must be contiguous in its last dim; strides "
                         f"{req_to_token.stride()}")
    req_pool_indices, seq_lens = req_pool_indices.contiguous(), seq_lens.contiguous()
    accept_len = torch.empty(bs, dtype=torch.int32, device=dev)
    accept_index = torch.empty(bs, steps + 1, dtype=torch.long, device=dev)
    out_tokens = torch.empty(bs, steps + 1, dtype=torch.long, device=dev)
    _verify_greedy_kernel[(bs,)](
        tokens.long().contiguous(), tree_mask.contiguous(), predict.long().contiguous(),
        req_to_token, req_pool_indices, seq_lens, accept_len, accept_index, out_tokens, k,
        req_to_token.stride(0), STEPS=steps, BLOCK_K=triton.next_power_of_2(k),
        BLOCK_P=triton.next_power_of_2(steps + 1), num_warps=1)
    return accept_len, accept_index, out_tokens


# ---------------------------------------------------------------------- draft-extend packing

def pack_draft_extend_reference(accept_len, accept_index, out_tokens, hidden, seq_lens,
                                req_to_token, req_pool_indices, n_valid):
    """Torch reference of `pack_draft_extend`."""
    bs, n_path = out_tokens.shape
    k = hidden.shape[0] // bs
    dev = out_tokens.device
    lens = torch.where(torch.arange(bs, device=dev) < n_valid, accept_len.long(), 0)
    qo_indptr = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    i = torch.arange(n_path, device=dev)
    keep = i[None, :] < lens[:, None]                                  # [bs, n_path]
    dest = torch.where(keep, qo_indptr[:-1, None] + i, bs * n_path)    # dump row past the end
    n_tok = bs * n_path

    def scatter(src, fill=0):
        out = src.new_full((n_tok + 1, *src.shape[2:]), fill)
        out[dest.reshape(-1)] = src.reshape(n_tok, *src.shape[2:])
        return out[:n_tok]

    pos = seq_lens.long()[:, None] + i
    loc = req_to_token[req_pool_indices.long()[:, None],
                       pos.clamp_max(req_to_token.shape[1] - 1)].long()
    rows = (torch.arange(bs, device=dev)[:, None] * k + accept_index).reshape(-1)
    hid = hidden[rows].view(bs, n_path, -1)
    new_seq_lens = (seq_lens.long() + accept_len.long()).int()
    return (scatter(out_tokens.long()), scatter(pos), scatter(loc), scatter(hid),
            qo_indptr.int(), new_seq_lens)


@triton.jit
def _pack_draft_extend_kernel(AcceptLen, AcceptIndex, OutTokens, Hidden, SeqLens, ReqToToken,
                              ReqPoolIdx, NValid, InputIds, Positions, Loc, HiddenOut,
                              QoIndptr, NewSeqLens, bs, k, H, stride_rt, stride_h, stride_ho,
                              N_PATH: tl.constexpr, BLOCK_BS: tl.constexpr,
                              BLOCK_H: tl.constexpr):
    # program (r, i): token i of request r goes to qo_indptr[r] + i when i < accept_len[r];
    # it also zero-fills position r * N_PATH + i when that lies past the last packed token.
    r = tl.program_id(0)
    i = tl.program_id(1)
    n_valid = tl.load(NValid)
    rr = tl.arange(0, BLOCK_BS)
    lens = tl.load(AcceptLen + rr, mask=(rr < bs) & (rr < n_valid), other=0)
    start = tl.sum(tl.where(rr < r, lens, 0))
    total = tl.sum(lens)
    n = tl.where(r < n_valid, tl.load(AcceptLen + r), 0)
    seq_len = tl.load(SeqLens + r).to(tl.int64)
    if i == 0:
        tl.store(QoIndptr + r, start)
        tl.store(NewSeqLens + r, (seq_len + tl.load(AcceptLen + r)).to(tl.int32))
        if r == bs - 1:
            tl.store(QoIndptr + bs, total)
    h = tl.arange(0, BLOCK_H)
    if i < n:
        t = (start + i).to(tl.int64)
        row = tl.load(ReqPoolIdx + r).to(tl.int64)
        tl.store(InputIds + t, tl.load(OutTokens + r * N_PATH + i))
        tl.store(Positions + t, seq_len + i)
        tl.store(Loc + t, tl.load(ReqToToken + row * stride_rt + seq_len + i).to(tl.int64))
        src = Hidden + (r * k + tl.load(AcceptIndex + r * N_PATH + i)).to(tl.int64) * stride_h
        for h0 in range(0, H, BLOCK_H):
            hm = h0 + h < H
            tl.store(HiddenOut + t * stride_ho + h0 + h, tl.load(src + h0 + h, mask=hm), mask=hm)
    t_own = (r * N_PATH + i).to(tl.int64)
    if t_own >= total:
        tl.store(InputIds + t_own, 0)
        tl.store(Positions + t_own, 0)
        tl.store(Loc + t_own, 0)
        for h0 in range(0, H, BLOCK_H):
            hm = h0 + h < H
            tl.store(HiddenOut + t_own * stride_ho + h0 + h,
                     tl.zeros([BLOCK_H], dtype=HiddenOut.dtype.element_ty), mask=hm)


def pack_draft_extend(accept_len, accept_index, out_tokens, hidden, seq_lens, req_to_token,
                      req_pool_indices, n_valid, impl: str = "auto"):
    """Draft-extend inputs after verify, packed along a token axis, with no host sync.

    accept_len [bs], accept_index/out_tokens [bs, n_path], hidden [bs*k, H] (verify's hidden per
    tree node), seq_lens [bs] = prefix lengths before verify (after the KV commit the accepted
    tokens sit at seq_lens + i), n_valid: 0-d int tensor, requests >= n_valid count as 0 tokens.
    Returns (input_ids, positions, out_cache_loc [bs*n_path] int64, hidden [bs*n_path, H],
    qo_indptr [bs+1] int32, new seq_lens [bs] int32); lanes past qo_indptr[bs] hold 0.
    """
    bs, n_path = out_tokens.shape
    n_valid = torch.as_tensor(n_valid, device=out_tokens.device).reshape(1)
    if resolve_impl(impl, out_tokens, hidden, req_to_token) == "torch":
        return pack_draft_extend_reference(accept_len, accept_index, out_tokens, hidden, seq_lens,
                                           req_to_token, req_pool_indices, n_valid[0])
    dev, n_tok = out_tokens.device, bs * n_path
    H = hidden.shape[1]
    if req_to_token.stride(-1) != 1:
        req_to_token = req_to_token.contiguous()     # read only here
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    accept_len, seq_lens = accept_len.contiguous(), seq_lens.contiguous()
    req_pool_indices = req_pool_indices.contiguous()
    input_ids = torch.empty(n_tok, dtype=torch.long, device=dev)
    positions = torch.empty(n_tok, dtype=torch.long, device=dev)
    loc = torch.empty(n_tok, dtype=torch.long, device=dev)
    hid = torch.empty(n_tok, H, dtype=hidden.dtype, device=dev)
    qo_indptr = torch.empty(bs + 1, dtype=torch.int32, device=dev)
    new_seq_lens = torch.empty(bs, dtype=torch.int32, device=dev)
    _pack_draft_extend_kernel[(bs, n_path)](
        accept_len, accept_index.contiguous(), out_tokens.contiguous(), hidden, seq_lens,
        req_to_token, req_pool_indices, n_valid.int(), input_ids, positions, loc, hid, qo_indptr,
        new_seq_lens, bs, hidden.shape[0] // bs, H, req_to_token.stride(0), hidden.stride(0),
        hid.stride(0), N_PATH=n_path, BLOCK_BS=triton.next_power_of_2(bs),
        BLOCK_H=min(1024, triton.next_power_of_2(H)), num_warps=4)
    return input_ids, positions, loc, hid, qo_indptr, new_seq_lens


# ------------------------------------------------------------------ candidate bookkeeping

def level_offset(level: int, topk: int) -> int:
    """Flat index of a level's first candidate."""
    return 0 if level == 0 else topk + (level - 1) * topk * topk


def level_parents(prev_expanded, topk: int) -> torch.Tensor:
    """Flat parent index of each of a level's topk*topk candidates: child (j, m) descends from
    the previous level's j-th expanded node, whose flat index is prev_expanded[:, j]."""
    return prev_expanded.repeat_interleave(topk, dim=1)
