"""The runner programs' bodies: what decode, verify, the EAGLE draft, draft-extend, prefill and
draft prefill compute on their padded view. Each passes the model one `Batch` built from the view
(`Batch.from_view`), so no body unpacks metadata tensor by tensor.

Sampling: where the program declares the sampling inputs (`programs.sampling_inputs`), decode and
verify draw each token with `padgraph.llm.sampling.sample`, keyed by the request's seed and the
absolute position of the token drawn (`PURPOSE_DECODE`), so a token depends only on its logits
and those keys: not on the lane's row, the bucket, graph or eager. Verify accepts draft tokens by
one of two exact rules (`WorkerOptions.spec_sampling`). "draws": one decode draw per tree node,
walked from the root while the draw equals a child's token; the path's draws are at distinct
positions, so the emitted tokens are exactly what plain sampling draws there, whatever the draft
proposed (a node's children are accepted with probability p(children), as rejection sampling of
one-hot proposals accepts them). "rejection": speculative sampling over the tree
(`verify_tree_sampled`; from the logits, `verify_tree_logits`). Either gives, per node, the
token the walk emits after it (`predict`), and `verify_greedy` walks those and commits the path,
as for greedy verification. Temperature 0 draws the argmax: greedy bit for bit."""
from __future__ import annotations

import torch

from padgraph.backends.triton import eagle as ops

from .batch import Batch
from .config import SpecConfig
from .paged import last_tokens
from .programs import SAMPLING_INPUTS
from .sampling import PURPOSE_DECODE, sample, verify_tree_logits


def samples(x) -> bool:
    """Whether runner view `x` carries sampling inputs (else its program picks the argmax)."""
    return all(n in x for n in SAMPLING_INPUTS)


def draw(logits, lanes: dict, positions):
    """Tokens [n] drawn from logits [n, V] with per-lane params `lanes` (name -> [n], the
    sampling inputs) for the tokens at absolute `positions` [n]."""
    return sample(logits, lanes["temperature"], lanes["top_k"], lanes["top_p"], lanes["min_p"],
                  lanes["seed"], positions, PURPOSE_DECODE)


def next_tokens(logits, x, positions, per: int = 1):
    """The tokens at `positions` [bs * per] from logits [bs * per, V]: drawn with view x's sampling
    lanes (each request's repeated `per` times) where it has them, else the argmax."""
    if not samples(x):
        return logits.argmax(-1)
    lanes = {n: x[n].repeat_interleave(per) if per > 1 else x[n] for n in SAMPLING_INPUTS}
    return draw(logits, lanes, positions)


def decode_body(target):
    """One token per request: drawn with the view's sampling lanes, or (a greedy-only program)
    the argmax, through the target's `forward_decode_greedy` where it has one (a fused tail
    takes the argmax in its lm_head kernel and writes no logits)."""
    greedy = getattr(target, "forward_decode_greedy", None)

    def body(x):
        if greedy is not None and not samples(x):
            ids, gap, _ = greedy(x.input_ids, x.positions, Batch.from_view(x))
            return {"next_token": ids, "top2_gap": gap}
        logits, _ = target.forward_decode(x.input_ids, x.positions, Batch.from_view(x))
        top2 = logits.topk(2, dim=-1).values                         # [bs, 2]
        # slices, not selects: inductor's select of a column guards on a batch of one (a graph
        # of its own for bucket 1 in a size-oblivious trace)
        return {"next_token": next_tokens(logits, x, x.positions + 1),
                "top2_gap": (top2[:, :1] - top2[:, 1:]).reshape(-1)}
    return body


def extend_body(target):
    """Prefill: the target over the packed prompts; every token's hidden (the draft's prefill
    reads them) and each request's last one (the caller applies the lm_head to the real rows)."""
    def body(x):
        hidden = target.forward_extend_hidden(x.input_ids, x.positions,
                                              Batch.from_view(x))    # [tokens, H]
        return {"hidden": hidden, "last_hidden": hidden[last_tokens(x.qo_indptr)]}
    return body


def verify_ids(target):
    """(input_ids, positions, batch) -> (hidden [bs*k, H], the target's argmax ids [bs*k]): through
    `forward_verify_hidden` and `greedy_ids` (default `logits(hidden).argmax(-1)`) where the
    target has them, with no fp32 [bs*k, V] logits; else `forward_verify`'s logits."""
    if not hasattr(target, "forward_verify_hidden"):
        def forward(*args):
            logits, hidden = target.forward_verify(*args)
            return hidden, logits.argmax(-1)
        return forward
    greedy_ids = getattr(target, "greedy_ids", None) or (lambda h: target.logits(h).argmax(-1))

    def forward(*args):
        hidden = target.forward_verify_hidden(*args)
        return hidden, greedy_ids(hidden)
    return forward


def verify_logits(target):
    """(input_ids, positions, batch) -> (hidden [bs*k, H], the target's logits [bs*k, V] fp32)."""
    def forward(*args):
        if not hasattr(target, "forward_verify_hidden"):
            logits, hidden = target.forward_verify(*args)
            return hidden, logits
        hidden = target.forward_verify_hidden(*args)
        return hidden, target.logits(hidden)
    return forward


def drawn_at_nodes(logits, x, spec: SpecConfig):
    """"draws": [bs, k] each tree node's decode draw (the token at the position after it)."""
    k = spec.num_draft_tokens
    return next_tokens(logits, x, x.positions + 1, per=k).view(x.bucket, k)


def accepted_by_rejection(logits, x, spec: SpecConfig):
    """"rejection": [bs, k] the token speculative sampling emits after each node of its path
    (-1 off it), so that walking these from the root retraces the path. A rejection's residual
    excludes every child it rejected (the draft's proposals are deterministic), so the walk
    stops where the rule stopped."""
    bs, k, steps = x.bucket, spec.num_draft_tokens, spec.steps
    lanes = {n: x[n].repeat_interleave(k) for n in SAMPLING_INPUTS}
    root = x.positions.view(bs, k)[:, 0]                               # the root's position
    emitted_at = root[:, None] + 1 + torch.arange(steps + 1, device=root.device)
    # each child's probability from its own logit and its parent's mass (`verify_tree_logits`),
    # not every node's [V] distribution
    _, path, out = verify_tree_logits(x.input_ids.view(bs, k), x.tree_mask, logits,
                                      lanes["temperature"], lanes["top_k"], lanes["top_p"],
                                      lanes["min_p"], x.seed, emitted_at, steps)
    return torch.full((bs, k), -1, dtype=torch.long, device=out.device).scatter(1, path, out)


SPEC_RULES = {"draws": drawn_at_nodes, "rejection": accepted_by_rejection}


def verify_body(target, spec: SpecConfig, rule: str = "draws"):
    """Verify: the target over the tree; the accepted path (greedy, or sampled by `rule`, one of
    `SPEC_RULES`), committed to the KV; draft-extend's inputs."""
    k, steps = spec.num_draft_tokens, spec.steps
    greedy, full, accept = verify_ids(target), verify_logits(target), SPEC_RULES[rule]
    # a hybrid target's recurrent layers leave each tree node's state; commit_tree keeps the
    # accepted path's last one as the request's
    commit_tree = getattr(target, "commit_tree", None)

    def body(x):
        bs = x.bucket
        batch = Batch.from_view(x, seq_lens=x.seq_lens + k)          # the tree is in the KV
        if samples(x):
            hidden, logits = full(x.input_ids, x.positions, batch)   # [bs*k, H], [bs*k, V]
            predict = accept(logits, x, spec)                        # [bs, k]
        else:
            hidden, ids = greedy(x.input_ids, x.positions, batch)    # [bs*k, H], [bs*k]
            predict = ids.view(bs, k)
        acc_len, acc_idx, out_tokens = ops.verify_greedy(
            x.input_ids.view(bs, k), x.tree_mask, predict, x.req_to_token,
            x.req_pool_indices, x.seq_lens, steps)
        if commit_tree is not None:      # the path's last node (acc_idx repeats it past acc_len)
            commit_tree(batch, acc_idx[:, -1])
        ids, pos, loc, hid, qo, new_lens = ops.pack_draft_extend(
            acc_len, acc_idx, out_tokens, hidden, x.seq_lens, x.req_to_token,
            x.req_pool_indices, x.extent("bs"))
        bonus = out_tokens.gather(1, (acc_len.long() - 1)[:, None])[:, 0]
        return {"accept_len": acc_len, "out_tokens": out_tokens, "bonus": bonus,
                "de_input_ids": ids, "de_positions": pos, "de_out_cache_loc": loc,
                "de_hidden": hid, "de_qo_indptr": qo, "de_seq_lens": new_lens}
    return body


def draft_body(head, spec: SpecConfig):
    steps, topk, k = spec.steps, spec.topk, spec.num_draft_tokens
    n = (steps - 1) * topk                                           # nodes run through the head

    def body(x):
        bs = x.bucket
        loc = x.out_cache_loc.view(bs, steps * topk)
        mask = torch.eye(max(n, 1), dtype=torch.bool, device=loc.device).expand(bs, -1, -1)
        p, idx, hid, scores, prev = x.topk_p, x.topk_index, x.hidden_states, None, None
        levels = []
        for step in range(steps):
            ids, hid, scores, lv_s, lv_t, expanded, parent_slot = ops.select_top_k(
                step, p, idx, hid, scores, topk)
            par = torch.full_like(lv_t, -1) if step == 0 else ops.level_parents(prev, topk)
            levels.append((lv_s, lv_t, par))
            prev = ops.level_offset(step, topk) + expanded
            if step == steps - 1:
                break
            mask = ops.expand_draft_mask(mask, step, topk, parent_slot)
            positions = (x.positions[:, None] + step).expand(bs, topk).reshape(-1)
            batch = Batch.from_view(x, seq_lens=x.seq_lens + n, tree_mask=mask,
                                    out_cache_loc=loc[:, step * topk:(step + 1) * topk].reshape(-1))
            hid = head.forward_draft_step(step, ids, hid, positions, batch)
            p, idx = head.topk(hid, topk)                            # [bs*topk, topk]
        s, t, par = (torch.cat(c, dim=1) for c in zip(*levels))
        draft_tokens, tree_mask, depth, _ = ops.build_tree(s, t, par, k, topk, steps)
        # verify's inputs, so nothing runs eagerly between the draft and verify replays
        ids, pos, loc = ops.verify_inputs(x.verified_id, draft_tokens, depth, x.seq_lens,
                                          x.req_to_token, x.req_pool_indices)   # [bs*k] each
        return {"draft_tokens": draft_tokens, "tree_mask": tree_mask, "depth": depth,
                "verify_input_ids": ids, "verify_positions": pos, "verify_out_cache_loc": loc}
    return body


def first_draft(head, h_last, req_to_token, req_pool_indices, seq_lens, spec: SpecConfig) -> dict:
    """What the next draft starts from, per request: the head's top-k at its last hidden
    h_last [bs, H] and the slots of its steps * topk draft nodes (after seq_lens)."""
    p, idx = head.topk(h_last, spec.topk)
    loc = ops.assign_cache_locs(req_to_token, req_pool_indices, seq_lens, spec.steps * spec.topk)
    return {"topk_p": p, "topk_index": idx, "next_hidden": h_last, "draft_out_cache_loc": loc}


def shifted_prompts(input_ids, qo_indptr, first):
    """The head's prefill tokens over packed prompts: token t becomes token t+1 of its prompt,
    or at each prompt's last position its request's first generated token `first` [reqs].
    Padded tokens (past qo_indptr[-1]) are never a prompt's last; padded requests own none."""
    n, bs = input_ids.shape[0], first.shape[0]
    ends = qo_indptr[1:].long()                                      # [reqs] one past the last
    t = torch.arange(n, device=ends.device)
    req = torch.searchsorted(ends, t, right=True).clamp(max=bs - 1)  # token -> request
    nxt = torch.cat([input_ids[1:], input_ids[:1]])
    return torch.where((t + 1) == ends[req], first[req], nxt)


def draft_extend_body(head, spec: SpecConfig):
    def body(x):
        h = head.forward_extend(x.input_ids, x.hidden_states, x.positions,
                                Batch.from_view(x))                  # [tokens, H]
        last = (x.qo_indptr[:-1] + x.accept_lens - 1).clamp(0, h.shape[0] - 1).long()
        return first_draft(head, h[last], x.req_to_token, x.req_pool_indices, x.seq_lens, spec)
    return body


def draft_prefill_body(head, spec: SpecConfig):
    """The head over the packed prompts the target has just prefilled (`shifted_prompts`, the
    target's hidden per token); each request's last token gives its first draft. The body of
    the draft-prefill program, and what `Worker.draft_prefill` runs eagerly."""
    def body(x):
        ids = shifted_prompts(x.input_ids, x.qo_indptr, x.verified_id)
        h = head.forward_extend(ids, x.hidden_states, x.positions,
                                Batch.from_view(x))                  # [tokens, H]
        last = (x.qo_indptr[1:].long() - 1).clamp(0, h.shape[0] - 1)
        return first_draft(head, h[last], x.req_to_token, x.req_pool_indices, x.seq_lens, spec)
    return body


def bodies(target, head, spec: SpecConfig, rule: str = "draws") -> dict:
    """The EAGLE runners' bodies by program name (`programs`); rule: how verify accepts for
    sampled requests (`SPEC_RULES`)."""
    return {"decode": decode_body(target), "verify": verify_body(target, spec, rule),
            "draft": draft_body(head, spec), "draft_extend": draft_extend_body(head, spec)}
