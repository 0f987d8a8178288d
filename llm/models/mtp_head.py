"""DeepSeek MTP-style draft head: eh_proj([RMSNorm(embedding(token)), RMSNorm(target hidden)])
→ one MLA + MoE layer → RMSNorm → the target's lm_head.

A `DraftHead` like the EAGLE head (same methods, runner programs, distillation, passthrough
start, draft temperature): draft position p holds (token p+1, target hidden p); the head's output
at p predicts token p+2 and its normed hidden stands in for the target hidden at p+1. It keeps a
one-layer latent cache of the target's width.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..batch import Batch
from ..paged import AttnPlan
from .deepseek import (DeepSeekConfig, DeepSeekLayer, DeepSeekModel, RMSNorm, init_deepseek,
                       mla_extend_batch, mla_tree_batch)
from .draft_head import DraftHead


class MTPHead(DraftHead):
    def __init__(self, target: DeepSeekModel, seed: int = 1):
        super().__init__(target)
        cfg = target.cfg
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DeepSeekLayer(cfg, moe=True)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        init_deepseek(self, cfg, torch.Generator().manual_seed(seed), n_layers=1)

    @property
    def in_proj(self) -> nn.Linear:
        """The target's embedding rows have unit RMS, so enorm(embedding) is the embedding and
        eh_proj = [I, 0] passes it on (`init_passthrough`, `copy_of_target`)."""
        return self.eh_proj

    @classmethod
    def _check_copyable(cls, cfg: DeepSeekConfig) -> None:
        if cfg.n_layers != 1 or cfg.n_dense_layers != 0:
            raise ValueError(f"copy_of_target needs a 1-layer MoE target (n_layers=1, "
                             f"n_dense_layers=0); got n_layers={cfg.n_layers}, "
                             f"n_dense_layers={cfg.n_dense_layers}")

    def _inputs(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        emb = self.target.embed(input_ids)                            # [n, hidden]
        both = torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1)
        return self.eh_proj(both)                                     # [n, hidden]

    def _layer(self, x, positions, batch: AttnPlan, kv) -> Tensor:
        return self.layer(x, positions, self.target.rope, batch, kv.latent[0])

    def _extend_batch(self, b: Batch) -> AttnPlan:
        return mla_extend_batch(self.cfg, b)

    def _tree_batch(self, b: Batch) -> AttnPlan:
        """Absorbed MLA tree verify over the latent rows."""
        return mla_tree_batch(self.cfg, b)
