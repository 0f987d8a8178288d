"""DeepSeek MTP-style draft head: eh_proj([RMSNorm(embedding(token)), RMSNorm(target hidden)])
→ one MLA + MoE layer → RMSNorm → the target's lm_head.

It plays the EAGLE head's part (same methods, same runner programs, same distillation): draft
position p holds (token p+1, target hidden p); the head's output at p predicts token p+2 and its
normed hidden stands in for the target hidden at p+1. It shares the target's embedding, rope and
`lm_head` (not owned, not trained) and keeps a one-layer latent cache of the target's width.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .deepseek import (DeepSeekLayer, DeepSeekModel, PagedBatch, RMSNorm, init_deepseek,
                       mla_extend_batch)
from .eagle_head import EagleHead


class MTPHead(nn.Module):
    def __init__(self, target: DeepSeekModel, seed: int = 1):
        super().__init__()
        cfg = target.cfg
        self.cfg = cfg
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DeepSeekLayer(cfg, moe=True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        init_deepseek(self, cfg, torch.Generator().manual_seed(seed), n_layers=1)
        object.__setattr__(self, "target", target)   # shared, not a parameter
        self.register_buffer("hot_ids", None)        # [n_hot] draft vocabulary (None: all)
        self.register_buffer("hot_weight", None)     # [n_hot, hidden] the lm_head's rows

    # The draft vocabulary and the draft distribution are the EAGLE head's (they only use
    # `target`, `hot_ids` and `hot_weight`).
    set_draft_vocab = EagleHead.set_draft_vocab
    logits = EagleHead.logits
    topk = EagleHead.topk

    @classmethod
    def copy_of_target(cls, target: DeepSeekModel) -> "MTPHead":
        """For a 1-layer MoE target (n_dense_layers=0): a head that reproduces the target (an
        oracle draft). The target's embedding rows have unit RMS, so enorm(embedding) is the
        embedding; eh_proj = [I, 0] passes it on; layer and norm are the target's."""
        cfg = target.cfg
        if cfg.n_layers != 1 or cfg.n_dense_layers != 0:
            raise ValueError(f"copy_of_target needs a 1-layer MoE target (n_layers=1, "
                             f"n_dense_layers=0); got n_layers={cfg.n_layers}, "
                             f"n_dense_layers={cfg.n_dense_layers}")
        head = cls(target)
        H = cfg.hidden_size
        with torch.no_grad():
            head.eh_proj.weight.zero_()
            head.eh_proj.weight[:, :H].copy_(torch.eye(H))
            head.layer.load_state_dict(target.layers[0].state_dict())
            head.norm.load_state_dict(target.norm.state_dict())
        return head

    def _inputs(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        emb = self.target.embed(input_ids)                            # [n, hidden]
        both = torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1)
        return self.eh_proj(both)                                     # [n, hidden]

    def _run(self, input_ids, hidden, positions, batch: PagedBatch, kv) -> Tensor:
        x = self.layer(self._inputs(input_ids, hidden), positions, self.target.rope, batch,
                       kv.latent[0])
        return self.norm(x)

    def forward_extend(self, input_ids, hidden, positions, kv, req_to_token, req_pool_indices,
                       seq_lens, qo_indptr, out_cache_loc, impl="auto") -> Tensor:
        """Packed [n_tok] pairs → the head's hidden [n_tok, hidden] (logits: `topk`/`logits`)."""
        batch = mla_extend_batch(self.cfg, req_to_token, req_pool_indices, seq_lens, qo_indptr,
                                 out_cache_loc, impl)
        return self._run(input_ids, hidden, positions, batch, kv)

    def forward_draft_step(self, step: int, input_ids, hidden, positions, kv, req_to_token,
                           req_pool_indices, seq_lens, tree_mask, out_cache_loc,
                           impl="auto") -> Tensor:
        """The `topk` nodes of draft step `step` per request ([bs*topk] tokens) → hidden.

        As `EagleHead.forward_draft_step`: the n tree nodes sit at positions seq_lens-n ..
        seq_lens-1, tree_mask [bs, n, n]; this step's queries go in their node rows of an
        otherwise-zero query block whose other outputs are dropped (absorbed MLA tree verify).
        """
        from padgraph.backends.triton.attention_mla import mla_tree_verify_attention
        cfg = self.cfg
        bs, n = tree_mask.shape[:2]
        topk = input_ids.shape[0] // bs
        lo = step * topk

        def attend(q, latent_cache):                                  # q [bs*topk, H, r+rope]
            q_all = q.new_zeros(bs, n, *q.shape[1:])
            q_all[:, lo:lo + topk] = q.view(bs, topk, *q.shape[1:])
            o = mla_tree_verify_attention(q_all.view(bs * n, *q.shape[1:]), latent_cache,
                                          req_to_token, req_pool_indices, seq_lens, tree_mask,
                                          cfg.kv_lora_rank, cfg.sm_scale, impl=impl)
            return o.view(bs, n, *o.shape[1:])[:, lo:lo + topk].reshape(bs * topk, *o.shape[1:])

        return self._run(input_ids, hidden, positions, PagedBatch(out_cache_loc, attend), kv)

    def forward_dense(self, input_ids: Tensor, hidden: Tensor):
        """Teacher-forced [B, T] pairs (token p+1, target hidden p) → (logits, hidden), no cache."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.layer.forward_dense(self._inputs(input_ids, hidden), positions, self.target.rope)
        h = self.norm(x)
        return self.logits(h), h
