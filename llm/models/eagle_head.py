"""EAGLE draft head: fc over [embedding(token), target hidden] → one decoder layer → target's lm_head.

A `DraftHead` (temperature, draft vocabulary, passthrough start, forwards) with a Llama decoder
layer over its own one-layer K/V cache. Draft position p holds the pair (token p+1, target hidden
at p), so the head's output at p predicts token p+2 and its (normed) hidden stands in for the
target hidden at p+1.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..batch import Batch
from .draft_head import DraftHead
from ..paged import AttnPlan, extend_batch, tree_batch
from .llama import DecoderLayer, LlamaConfig, LlamaModel, RMSNorm, init_weights


class EagleHead(DraftHead):
    def __init__(self, target: LlamaModel, seed: int = 1):
        super().__init__(target)
        cfg = target.cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        init_weights(self, cfg.init_std, torch.Generator().manual_seed(seed))

    @property
    def in_proj(self) -> nn.Linear:
        return self.fc

    @classmethod
    def _check_copyable(cls, cfg: LlamaConfig) -> None:
        if cfg.n_layers != 1:
            raise ValueError(f"copy_of_target needs a 1-layer target; got n_layers={cfg.n_layers}")

    def _inputs(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        emb = self.target.embed(input_ids)                            # [n, H]
        return self.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))

    def _layer(self, x, positions, batch: AttnPlan, kv) -> Tensor:
        return self.layer(x, positions, self.target.rope, batch, kv.k[0], kv.v[0])

    def _extend_batch(self, b: Batch) -> AttnPlan:
        return extend_batch(b)

    def _tree_batch(self, b: Batch) -> AttnPlan:
        return tree_batch(b)
