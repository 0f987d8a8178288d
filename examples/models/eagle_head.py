"""EAGLE draft head: fc over [embedding(token), target hidden] → one decoder layer → target's lm_head.

The head shares the target's embedding and `lm_head` (not owned, not trained) and keeps its own
one-layer KV cache. Draft position p holds the pair (token p+1, target hidden at p), so the head's
output at p predicts token p+2 and its (normed) hidden stands in for the target hidden at p+1.
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from .llama import (DecoderLayer, LlamaModel, PagedBatch, RMSNorm, extend_batch, init_weights)


def _temperature(head: nn.Module, logits: Tensor) -> Tensor:
    s = getattr(head, "log_scale", None)        # heads borrowing EagleHead's methods may have none
    return logits if s is None else logits * s.float().exp()


class EagleHead(nn.Module):
    def __init__(self, target: LlamaModel, seed: int = 1):
        super().__init__()
        cfg = target.cfg
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        init_weights(self, cfg.init_std, torch.Generator().manual_seed(seed))
        # Draft temperature: the head borrows the target's lm_head, whose logits are as flat as
        # the target's (top-1 probability ~0.03 on a random 1B), while the head's top-1 is right
        # far more often than that. EAGLE-2's tree keeps the k-1 best nodes by the product of
        # these probabilities, so uncalibrated ones make it wide and shallow. Trained (distill).
        self.log_scale = nn.Parameter(torch.zeros(()))
        # Shared with the target, kept out of this module's parameters (and state_dict).
        object.__setattr__(self, "target", target)
        self.register_buffer("hot_ids", None)      # [n_hot] draft vocabulary (None: all)
        self.register_buffer("hot_weight", None)   # [n_hot, H] the target lm_head's rows

    def set_draft_vocab(self, token_ids: Tensor | None) -> None:
        """Draft over a subset of the vocabulary (EAGLE-3's "hot" tokens): the draft's lm_head is
        the target's rows for those ids, so a draft step reads n_hot rows instead of V."""
        if token_ids is None:
            self.hot_ids = self.hot_weight = None
            return
        ids = token_ids.to(self.target.lm_head.weight.device).long()
        self.hot_ids = ids
        self.hot_weight = self.target.lm_head.weight.detach()[ids].contiguous()

    def init_passthrough(self) -> None:
        """Start from the target's own bigram path: fc = [I, 0] passes the token embedding
        through, so before any training the head predicts lm_head(norm(embed(token))) — for a
        target whose residual stream is dominated by the token embedding, most of its next-token
        map. Training then only has to learn the context correction, and the head generalises to
        tokens it never saw in its (small) distillation corpus instead of memorising a table."""
        H = self.cfg.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :H].copy_(torch.eye(H))
            self.norm.load_state_dict(self.target.norm.state_dict())

    def logits(self, h: Tensor) -> Tensor:
        """Full-vocabulary draft logits [n, V] fp32, temperature applied (training, checks)."""
        return _temperature(self, self.target.logits(h))

    def topk(self, h: Tensor, topk: int):
        """Draft distribution's top-k: (probs [n, topk] fp32, token ids [n, topk] int64)."""
        if self.hot_ids is None:
            probs = torch.softmax(self.logits(h), dim=-1)
            return probs.topk(topk, dim=-1)
        logits = _temperature(self, (h @ self.hot_weight.t()).float())
        probs = torch.softmax(logits, dim=-1)                              # [n, n_hot]
        p, i = probs.topk(topk, dim=-1)
        return p, self.hot_ids[i]

    @classmethod
    def copy_of_target(cls, target: LlamaModel) -> "EagleHead":
        """For a 1-layer target: a head that reproduces the target exactly (an oracle draft).

        fc = [I, 0] passes the token embedding through, the layer and norm are the target's, so
        draft position p computes what the target computes at p+1 (RoPE is relative).
        """
        assert target.cfg.n_layers == 1, "copy_of_target needs a 1-layer target"
        head = cls(target)
        H = target.cfg.hidden_size
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, :H].copy_(torch.eye(H))
            head.layer.load_state_dict(target.layers[0].state_dict())
            head.norm.load_state_dict(target.norm.state_dict())
        return head

    def _inputs(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        emb = self.target.embed(input_ids)                            # [n, H]
        return self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))

    def _run(self, input_ids, hidden, positions, batch: PagedBatch, kv) -> Tensor:
        x = self.layer(self._inputs(input_ids, hidden), positions, self.target.rope, batch,
                       kv.k[0], kv.v[0])
        return self.norm(x)                                          # [n, H]

    def forward_extend(self, input_ids, hidden, positions, kv, req_to_token, req_pool_indices,
                       seq_lens, qo_indptr, out_cache_loc, impl="auto") -> Tensor:
        """Packed [n_tok] pairs → the head's hidden [n_tok, H] (logits: `topk`/`logits`)."""
        batch = extend_batch(req_to_token, req_pool_indices, seq_lens, qo_indptr, out_cache_loc,
                             impl)
        return self._run(input_ids, hidden, positions, batch, kv)

    def forward_draft_step(self, step: int, input_ids, hidden, positions, kv, req_to_token,
                           req_pool_indices, seq_lens, tree_mask, out_cache_loc,
                           impl="auto") -> Tensor:
        """The `topk` nodes of draft step `step` per request ([bs*topk] tokens) → hidden.

        The draft tree's n nodes sit at positions seq_lens-n .. seq_lens-1 of each row (node
        step*topk + j is this step's j-th); tree_mask [bs, n, n] says which ancestors each sees.
        Queries of the other steps' nodes are zeros whose outputs are dropped.
        """
        from padgraph.backends.triton.attention import tree_verify_attention
        bs, n = tree_mask.shape[:2]
        topk = input_ids.shape[0] // bs
        lo = step * topk

        def attend(q, k_cache, v_cache):                             # q [bs*topk, Hq, D]
            q_all = q.new_zeros(bs, n, *q.shape[1:])
            q_all[:, lo:lo + topk] = q.view(bs, topk, *q.shape[1:])
            o = tree_verify_attention(q_all.view(bs * n, *q.shape[1:]), k_cache, v_cache,
                                      req_to_token, req_pool_indices, seq_lens, tree_mask,
                                      impl=impl)
            return o.view(bs, n, *o.shape[1:])[:, lo:lo + topk].reshape(bs * topk, *o.shape[1:])

        return self._run(input_ids, hidden, positions, PagedBatch(out_cache_loc, attend), kv)

    def forward_dense(self, input_ids: Tensor, hidden: Tensor):
        """Teacher-forced [B, T] pairs (token p+1, target hidden p) → (logits, hidden), no cache."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.layer.forward_dense(self._inputs(input_ids, hidden), positions, self.target.rope)
        h = self.norm(x)
        return self.logits(h), h
