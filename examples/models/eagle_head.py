"""EAGLE draft head: fc over [embedding(token), target hidden] → one decoder layer → target's lm_head.

The head shares the target's embedding and `lm_head` (not owned, not trained) and keeps its own
one-layer KV cache. Draft position p holds the pair (token p+1, target hidden at p), so the head's
output at p predicts token p+2 and its (normed) hidden stands in for the target hidden at p+1.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from .llama import (DecoderLayer, LlamaModel, RMSNorm, extend_batch, init_weights, tree_batch)


class EagleHead(nn.Module):
    def __init__(self, target: LlamaModel, seed: int = 1):
        super().__init__()
        cfg = target.cfg
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        init_weights(self, cfg.init_std, torch.Generator().manual_seed(seed))
        # Shared with the target, kept out of this module's parameters (and state_dict).
        object.__setattr__(self, "target", target)

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

    def _run(self, input_ids, hidden, positions, batch, kv):
        x = self.layer(self._inputs(input_ids, hidden), positions, self.target.rope, batch,
                       kv.k[0], kv.v[0])
        h = self.norm(x)                                             # [n, H]
        return self.target.logits(h), h

    def forward_extend(self, input_ids, hidden, positions, kv, req_to_token, req_pool_indices,
                       seq_lens, qo_indptr, out_cache_loc, impl="auto"):
        """Packed [n_tok] pairs → (logits [n_tok, V] fp32, hidden [n_tok, H])."""
        batch = extend_batch(req_to_token, req_pool_indices, seq_lens, qo_indptr, out_cache_loc,
                             impl)
        return self._run(input_ids, hidden, positions, batch, kv)

    def forward_tree(self, input_ids, hidden, positions, kv, req_to_token, req_pool_indices,
                     seq_lens, tree_mask, out_cache_loc, impl="auto"):
        """[bs*n] draft-tree nodes (seq_lens = prefix + n, tree_mask [bs,n,n]) → (logits, hidden)."""
        batch = tree_batch(req_to_token, req_pool_indices, seq_lens, tree_mask, out_cache_loc,
                           impl)
        return self._run(input_ids, hidden, positions, batch, kv)

    def forward_dense(self, input_ids: Tensor, hidden: Tensor):
        """Teacher-forced [B, T] pairs (token p+1, target hidden p) → (logits, hidden), no cache."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.layer.forward_dense(self._inputs(input_ids, hidden), positions, self.target.rope)
        h = self.norm(x)
        return self.target.logits(h), h
