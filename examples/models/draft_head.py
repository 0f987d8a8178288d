"""What every draft head shares: EagleHead (Llama) and MTPHead (DeepSeek) are this plus a layer.

A draft head maps the pair (token p+1, target hidden at p) through an input projection, one
decoder layer of the target's kind and a norm to a hidden that stands in for the target's hidden
at p+1; its output at p predicts token p+2. Its logits are the target's `lm_head` (shared, not
owned, not trained) times a learned draft temperature, over the full vocabulary or a "hot"
subset. It keeps its own one-layer cache of the target's kind.

A subclass builds `layer` and `norm`, names its input projection (`in_proj`, whose first half
takes the token embedding) and says how its layer meets the cache: `_inputs`, `_layer`,
`_extend_batch`, `_tree_batch`, `_check_copyable`.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .llama import PagedBatch


def chunked_topk(x: Tensor, k: int, chunks: int | None):
    """`x.topk(k, dim=-1)` of a [n, V] tensor in two passes when `chunks` divides V: the top-k of
    each of `chunks` slices, then the top-k of those chunks * k candidates. Equal values, the same
    set of indices where values are distinct. On a GPU a short row is one thread block's sort,
    while a 128256-wide row takes torch's multi-block radix select (several kernels a call).
    Falls back to one pass when `chunks` is None or does not divide V into slices of >= k."""
    n, width = x.shape
    if not chunks or width % chunks or width // chunks < k:
        return x.topk(k, dim=-1)
    part = width // chunks
    v, i = x.reshape(n, chunks, part).topk(k, dim=-1)                    # [n, chunks, k]
    i = i + torch.arange(0, width, part, device=x.device)[None, :, None]
    v, j = v.reshape(n, chunks * k).topk(k, dim=-1)
    return v, i.reshape(n, chunks * k).gather(1, j)


class DraftHead(nn.Module):
    # Top-k over the vocabulary in two passes of this many slices (`chunked_topk`); None: one.
    topk_chunks: int | None = None

    def __init__(self, target: nn.Module):
        super().__init__()
        self.cfg = target.cfg
        # Draft temperature: the head borrows the target's lm_head, whose logits are as flat as
        # the target's (top-1 probability ~0.03 on a random 1B), while the head's top-1 is right
        # far more often than that. EAGLE-2's tree keeps the k-1 best nodes by the product of
        # these probabilities, so uncalibrated ones make it wide and shallow. Trained (distill).
        # Registered first: a 0-d parameter draws nothing from the init generator, so the
        # subclass's random weights are what they were before the head had one.
        self.log_scale = nn.Parameter(torch.zeros(()))
        # Shared with the target, kept out of this module's parameters (and state_dict).
        object.__setattr__(self, "target", target)
        self.register_buffer("hot_ids", None)      # [n_hot] draft vocabulary (None: all)
        self.register_buffer("hot_weight", None)   # [n_hot, H] the target lm_head's rows

    # ---- what a subclass provides ------------------------------------------------------
    @property
    def in_proj(self) -> nn.Linear:
        """The [H, 2H] projection of [embedding part, hidden part] into the layer."""
        raise NotImplementedError

    def _inputs(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        """(token ids [n], target hidden [n, H]) -> the layer's input [n, H]."""
        raise NotImplementedError

    def _layer(self, x: Tensor, positions: Tensor, batch: PagedBatch, kv) -> Tensor:
        """The decoder layer over its one-layer cache `kv` (the worker's bound view)."""
        raise NotImplementedError

    def _extend_batch(self, req_to_token, req_pool_indices, seq_lens, qo_indptr, out_cache_loc,
                      impl) -> PagedBatch:
        raise NotImplementedError

    def _tree_batch(self, req_to_token, req_pool_indices, seq_lens, tree_mask, out_cache_loc,
                    impl) -> PagedBatch:
        raise NotImplementedError

    @classmethod
    def _check_copyable(cls, cfg) -> None:
        """Raise unless the target is one layer of the head's own kind (`copy_of_target`)."""
        raise NotImplementedError

    # ---- initialisation ----------------------------------------------------------------
    def init_passthrough(self) -> None:
        """Start from the target's own bigram path: in_proj = [I, 0] passes the token embedding
        through, so before any training the head predicts lm_head(norm(embed(token))) — for a
        target whose residual stream is dominated by the token embedding, most of its next-token
        map. Training then only has to learn the context correction, and the head generalises to
        tokens it never saw in its (small) distillation corpus instead of memorising a table."""
        H = self.cfg.hidden_size
        with torch.no_grad():
            self.in_proj.weight.zero_()
            self.in_proj.weight[:, :H].copy_(torch.eye(H))
            self.norm.load_state_dict(self.target.norm.state_dict())

    @classmethod
    def copy_of_target(cls, target: nn.Module) -> "DraftHead":
        """For a one-layer target: a head that reproduces the target exactly (an oracle draft).

        The passthrough start plus the target's layer: draft position p computes what the target
        computes at p+1 (RoPE is relative).
        """
        cls._check_copyable(target.cfg)
        head = cls(target)
        head.init_passthrough()
        with torch.no_grad():
            head.layer.load_state_dict(target.layers[0].state_dict())
        return head

    # ---- draft distribution ------------------------------------------------------------
    def set_draft_vocab(self, token_ids: Tensor | None) -> None:
        """Draft over a subset of the vocabulary (EAGLE-3's "hot" tokens): the draft's lm_head is
        the target's rows for those ids, so a draft step reads n_hot rows instead of V."""
        if token_ids is None:
            self.hot_ids = self.hot_weight = None
            return
        ids = token_ids.to(self.target.lm_head.weight.device).long()
        self.hot_ids = ids
        self.hot_weight = self.target.lm_head.weight.detach()[ids].contiguous()

    def _temperature(self, logits: Tensor) -> Tensor:
        return logits * self.log_scale.float().exp()

    def logits(self, h: Tensor) -> Tensor:
        """Full-vocabulary draft logits [n, V] fp32, temperature applied (training, checks)."""
        return self._temperature(self.target.logits(h))

    def topk(self, h: Tensor, topk: int):
        """Draft distribution's top-k: (probs [n, topk] fp32, token ids [n, topk] int64).

        The top-k is taken on the target's logits as they come out (a positive temperature
        keeps their order), and only those k become probabilities:
        p = exp(t * l - logsumexp(t * l)). No [n, V] probability tensor is written, which saves
        the temperature and softmax passes over the full vocabulary per draft step. The full
        vocabulary goes through `target.logits`, since a tensor-parallel target gathers its
        vocabulary shards there."""
        logits = self.target.logits(h) if self.hot_ids is None else h @ self.hot_weight.t()
        top, i = chunked_topk(logits, topk, self.topk_chunks)
        lse = torch.logsumexp(self._temperature(logits.float()), dim=-1, keepdim=True)
        p = torch.exp(self._temperature(top.float()) - lse)
        return p, (i if self.hot_ids is None else self.hot_ids[i])

    # ---- forwards ----------------------------------------------------------------------
    def _run(self, input_ids, hidden, positions, batch: PagedBatch, kv) -> Tensor:
        x = self._layer(self._inputs(input_ids, hidden), positions, batch, kv)
        return self.norm(x)                                          # [n, H]

    def forward_extend(self, input_ids, hidden, positions, kv, req_to_token, req_pool_indices,
                       seq_lens, qo_indptr, out_cache_loc, impl="auto") -> Tensor:
        """Packed [n_tok] pairs → the head's hidden [n_tok, H] (logits: `topk`/`logits`)."""
        batch = self._extend_batch(req_to_token, req_pool_indices, seq_lens, qo_indptr,
                                   out_cache_loc, impl)
        return self._run(input_ids, hidden, positions, batch, kv)

    def forward_draft_step(self, step: int, input_ids, hidden, positions, kv, req_to_token,
                           req_pool_indices, seq_lens, tree_mask, out_cache_loc,
                           impl="auto") -> Tensor:
        """The `topk` nodes of draft step `step` per request ([bs*topk] tokens) → hidden.

        The draft tree's n nodes sit at positions seq_lens-n .. seq_lens-1 of each row (node
        step*topk + j is this step's j-th); tree_mask [bs, n, n] says which ancestors each sees.
        This step's queries go in their node rows of an otherwise-zero query block for the tree
        attention, whose other rows' outputs are dropped.
        """
        bs, n = tree_mask.shape[:2]
        topk = input_ids.shape[0] // bs
        lo = step * topk
        tree = self._tree_batch(req_to_token, req_pool_indices, seq_lens, tree_mask,
                                out_cache_loc, impl)

        def attend(q, *caches):                                      # q [bs*topk, n_heads, D]
            q_all = q.new_zeros(bs, n, *q.shape[1:])                 # [bs, n, n_heads, D]
            q_all[:, lo:lo + topk] = q.view(bs, topk, *q.shape[1:])
            o = tree.attend(q_all.view(bs * n, *q.shape[1:]), *caches)   # [bs*n, n_heads, Dv]
            return o.view(bs, n, *o.shape[1:])[:, lo:lo + topk].reshape(bs * topk, *o.shape[1:])

        return self._run(input_ids, hidden, positions, PagedBatch(out_cache_loc, attend), kv)

    def forward_dense(self, input_ids: Tensor, hidden: Tensor):
        """Teacher-forced [B, T] pairs (token p+1, target hidden p) → (logits, hidden), no cache."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.layer.forward_dense(self._inputs(input_ids, hidden), positions, self.target.rope)
        h = self.norm(x)
        return self.logits(h), h
