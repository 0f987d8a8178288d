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

from ..batch import Batch
from ..paged import AttnPlan

# Rows up to which "fp8-fused" runs the fused lm_head + top-k kernel. At V 128256 x H 2048 it
# beat the fp8 GEMM + top-k kernel at 16 and 64 rows and lost at 256, where its tiles re-read
# the weight once per 64-row block (results/topk.md); between 64 and 256 it was not measured.
FUSED_MAX_ROWS = 64


FP8_MAX = 448.0   # largest finite float8_e4m3fn


def fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """[m, K] -> (e4m3 [m, K], fp32 scales [m, 1]): each row scaled so its absmax is FP8_MAX
    (a zero row stays zero)."""
    x = x.float()
    s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x / s).to(torch.float8_e4m3fn), s


def fp8_logits(h: Tensor, w8: Tensor, w_scale: Tensor) -> Tensor:
    """[n, H] hidden x the e4m3 lm_head [V, H] (row scales [1, V]) -> bf16 logits [n, V]; the
    hidden is quantized per row (`fp8_rows`)."""
    x8, s = fp8_rows(h)                                                    # [n, H], [n, 1]
    return torch._scaled_mm(x8, w8.t(), scale_a=s, scale_b=w_scale, out_dtype=torch.bfloat16)


class DraftHead(nn.Module):
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
        # fp8 copy of the draft's lm_head rows (`set_draft_lm_head`): [V or n_hot, H] e4m3 and
        # its per-row scale [1, V or n_hot] fp32. None: the draft reads the bf16 lm_head.
        self.register_buffer("fp8_weight", None, persistent=False)
        self.register_buffer("fp8_scale", None, persistent=False)
        self.fp8_fused = False                      # the fp8 copy read by the fused kernel

    # ---- what a subclass provides ------------------------------------------------------
    @property
    def in_proj(self) -> nn.Linear:
        """The [H, 2H] projection of [embedding part, hidden part] into the layer."""
        raise NotImplementedError

    def _inputs(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        """(token ids [n], target hidden [n, H]) -> the layer's input [n, H]."""
        raise NotImplementedError

    def _layer(self, x: Tensor, positions: Tensor, batch: AttnPlan, kv) -> Tensor:
        """The decoder layer over its one-layer cache `kv` (the worker's bound view)."""
        raise NotImplementedError

    def _extend_batch(self, b: Batch) -> AttnPlan:
        """The layer's attention plan over packed tokens (`qo_indptr`)."""
        raise NotImplementedError

    def _tree_batch(self, b: Batch) -> AttnPlan:
        """The layer's attention plan over a tree (`tree_mask`)."""
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
            # the target's final norm weight where it has one of this shape (a LayerNorm's bias
            # and mean aside, and none at all for a norm without parameters: a start that the
            # training corrects; the verified tokens never depend on it)
            weight = getattr(getattr(self.target, "norm", None), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.shape == self.norm.weight.shape:
                self.norm.weight.copy_(weight)

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
        else:
            ids = token_ids.to(self.target.lm_head.weight.device).long()
            self.hot_ids = ids
            self.hot_weight = self.target.lm_head.weight.detach()[ids].contiguous()
        if self.fp8_weight is not None:            # re-quantize the rows now drafted over
            mode = "fp8-fused" if self.fp8_fused else "fp8"
            self.fp8_weight = self.fp8_scale = None    # (bf16 if that fails: never stale rows)
            self.set_draft_lm_head(mode)

    def set_draft_lm_head(self, dtype: str) -> None:
        """"bf16": the draft reads the target's lm_head (or its hot rows) as they are. "fp8": it
        reads an e4m3 copy with one fp32 scale per vocabulary row, and quantizes its hidden per
        row the same way (`torch._scaled_mm`, bf16 logits out), which halves the bytes of the
        draft's largest read: on a 1B Llama the lm_head is a fifth of the weights and runs once
        per draft step. Only the draft changes: verify scores every token with the target's own
        lm_head, so outputs stay exact; a draft logit off by the quantization can only change
        which tokens are proposed (accept length). The copy costs V * H bytes of memory.
        Needs the whole vocabulary on this device: a tensor-parallel target gathers its shards
        in `target.logits`, which the fp8 path would bypass. "fp8-fused": the same copy, read by
        one kernel that takes the top-k in the GEMM's epilogue (`fp8_lm_head_topk`: the [n, V]
        logits are never written; they stay fp32 there, bf16 unfused) for up to FUSED_MAX_ROWS
        rows, the unfused fp8 path past them (the row count is a bucket's: fixed per graph)."""
        if dtype not in ("bf16", "fp8", "fp8-fused"):
            raise ValueError(f"draft lm_head dtype must be 'bf16', 'fp8' or 'fp8-fused'; "
                             f"got {dtype!r}")
        self.fp8_fused = dtype == "fp8-fused"
        if dtype == "bf16":
            self.fp8_weight = self.fp8_scale = None
            return
        if hasattr(self.target, "local_logits"):
            raise ValueError("an fp8 draft lm_head needs the full vocabulary on each rank; "
                             "this target shards it (tensor parallel)")
        w = self.target.lm_head.weight if self.hot_weight is None else self.hot_weight
        if w.shape[0] % 16 or w.shape[1] % 16:
            raise ValueError(f"an fp8 draft lm_head needs rows and hidden size divisible by 16 "
                             f"(torch._scaled_mm); got {tuple(w.shape)}")
        with torch.no_grad():                      # in slices: bounded fp32 temporaries
            w8, scale = zip(*(fp8_rows(part) for part in w.detach().split(16384)))
        self.fp8_weight = torch.cat(w8)                          # [V, H] e4m3
        self.fp8_scale = torch.cat(scale).t().contiguous()       # [1, V] fp32

    def _scale(self) -> Tensor:
        """The draft temperature's multiplier t = exp(log_scale), a 0-d fp32 tensor."""
        return self.log_scale.float().exp()

    def _temperature(self, logits: Tensor) -> Tensor:
        return logits * self._scale()

    def logits(self, h: Tensor) -> Tensor:
        """Full-vocabulary draft logits [n, V] fp32, temperature applied (training, checks)."""
        return self._temperature(self.target.logits(h))

    def topk(self, h: Tensor, topk: int):
        """Draft distribution's top-k: (probs [n, topk] fp32, token ids [n, topk] int64).

        The top-k is taken on the target's logits as they come out (a positive temperature
        keeps their order), and only those k become probabilities:
        p = exp(t * l - logsumexp(t * l)). Top-k and log-sum-exp come from one read of the
        logits (`topk_logsumexp`: one Triton pass on a GPU, where torch's radix top-k plus a
        logsumexp read the [n, V] logits twice in five kernels), or, with "fp8-fused", from the
        GEMM's epilogue; no [n, V] probability tensor is written. The full vocabulary goes through `target.logits`, since a tensor-parallel
        target gathers its vocabulary shards there."""
        from padgraph.backends.triton.lm_head_topk import fp8_lm_head_topk
        from padgraph.backends.triton.topk import topk_logsumexp
        t = self._scale()
        if self.fp8_weight is not None and self.fp8_fused and h.shape[0] <= FUSED_MAX_ROWS:
            x8, sx = fp8_rows(h)                                         # [n, H], [n, 1]
            top, i, lse = fp8_lm_head_topk(x8, sx, self.fp8_weight, self.fp8_scale, topk, t)
        else:
            top, i, lse = topk_logsumexp(self._draft_logits(h), topk, t)
        p = torch.exp(t * top - lse[:, None])
        return p, (i if self.hot_ids is None else self.hot_ids[i])

    def _draft_logits(self, h: Tensor) -> Tensor:
        """[n, H] -> the logits the draft ranks [n, V or n_hot]: the fp8 copy's (bf16), the
        target's (through `target.logits`), or the hot rows'."""
        if self.fp8_weight is not None:
            return fp8_logits(h, self.fp8_weight, self.fp8_scale)
        if self.hot_ids is None:
            return self.target.logits(h)
        return h @ self.hot_weight.t()

    # ---- forwards ----------------------------------------------------------------------
    def _run(self, input_ids, hidden, positions, batch: AttnPlan, kv) -> Tensor:
        x = self._layer(self._inputs(input_ids, hidden), positions, batch, kv)
        return self.norm(x)                                          # [n, H]

    def forward_extend(self, input_ids, hidden, positions, batch: Batch) -> Tensor:
        """Packed [n_tok] pairs → the head's hidden [n_tok, H] (logits: `topk`/`logits`)."""
        return self._run(input_ids, hidden, positions, self._extend_batch(batch), batch.kv)

    def forward_draft_step(self, step: int, input_ids, hidden, positions, batch: Batch) -> Tensor:
        """The `topk` nodes of draft step `step` per request ([bs*topk] tokens) → hidden.

        The draft tree's n nodes sit at positions seq_lens-n .. seq_lens-1 of each row (node
        step*topk + j is this step's j-th); `batch.tree_mask` [bs, n, n] says which ancestors
        each sees, `batch.out_cache_loc` [bs*topk] where this step's K/V go.
        This step's queries go in their node rows of an otherwise-zero query block for the tree
        attention, whose other rows' outputs are dropped.
        """
        bs, n = batch.tree_mask.shape[:2]
        topk = input_ids.shape[0] // bs
        lo = step * topk
        tree = self._tree_batch(batch)

        def attend(q, *caches):                                      # q [bs*topk, n_heads, D]
            q_all = q.new_zeros(bs, n, *q.shape[1:])                 # [bs, n, n_heads, D]
            q_all[:, lo:lo + topk] = q.view(bs, topk, *q.shape[1:])
            o = tree.attend(q_all.view(bs * n, *q.shape[1:]), *caches)   # [bs*n, n_heads, Dv]
            return o.view(bs, n, *o.shape[1:])[:, lo:lo + topk].reshape(bs * topk, *o.shape[1:])

        return self._run(input_ids, hidden, positions, AttnPlan(batch.out_cache_loc, attend),
                         batch.kv)

    def forward_dense(self, input_ids: Tensor, hidden: Tensor):
        """Teacher-forced [B, T] pairs (token p+1, target hidden p) → (logits, hidden), no cache."""
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.layer.forward_dense(self._inputs(input_ids, hidden), positions, self.target.rope)
        h = self.norm(x)
        return self.logits(h), h

    def forward_unrolled(self, input_ids: Tensor, hidden: Tensor, depth: int) -> list[Tensor]:
        """The head as the draft runs it, `depth` steps deep, over [B, T] teacher-forced pairs
        (token p+1, target hidden p): [h_0, ..., h_{depth-1}], each [B, T, H].

        h_0 is `forward_dense`'s hidden. Row i of depth d > 0 is the pair (token i+1,
        h_{d-1}[i-1]): the head's own hidden where a draft step has no target hidden, as draft
        step d-1 feeds it (row 0 keeps the target's). It attends to what that node sees in the
        draft: the teacher-forced rows up to i-d (the cache that draft-extend wrote from target
        hiddens), then its chain of ancestors, row i-d+e of depth e for e = 1..d
        (`unrolled_mask`). Each depth recomputes the ones below it (one layer: cheap)."""
        B, T = input_ids.shape
        rope = self.target.rope
        xs, hs = [self._inputs(input_ids, hidden)], []
        for d in range(depth):
            positions = torch.arange(T, device=input_ids.device).repeat(d + 1).expand(B, -1)
            mask = None if d == 0 else unrolled_mask(T, d + 1, input_ids.device)  # 0: causal
            x = self.layer.forward_dense(torch.cat(xs, dim=1), positions, rope, mask)
            hs.append(self.norm(x[:, d * T:]))                       # depth d's rows
            if d + 1 < depth:
                fed = torch.cat([hidden[:, :1].to(hs[-1].dtype), hs[-1][:, :-1]], dim=1)
                xs.append(self._inputs(input_ids, fed))
        return hs


def unrolled_mask(T: int, depth: int, device=None) -> Tensor:
    """[depth*T, depth*T] bool, True = attend, rows and columns (depth d, position i) d-major:
    (d, i) sees (0, j) for j <= i - d and (e, i - d + e) for e = 1..d. Depth 0 is causal; every
    row sees itself."""
    d = torch.arange(depth, device=device).repeat_interleave(T)
    i = torch.arange(T, device=device).repeat(depth)
    rd, ri, ce, cj = d[:, None], i[:, None], d[None, :], i[None, :]
    teacher = (ce == 0) & (cj <= ri - rd)
    chain = (ce >= 1) & (ce <= rd) & (cj == ri - rd + ce)
    return teacher | chain
