"""A DeepSeek-like target (MLA + MoE) over a paged latent cache, random init.

MLA (DeepSeek-V2/V3): queries through a low-rank bottleneck with RMSNorm (`q_lora_rank`); keys
and values compressed into one `kv_lora_rank` latent per token (RMSNorm'd) plus a decoupled rope
key `qk_rope_head_dim` shared by all heads. The cache holds only `[c_kv, k_rope]` per token; the
paged forwards run the absorbed form from `attention_mla` (q_nope folded through W_UK, MQA over
the latent rows, W_UV after); `forward_dense` runs the non-absorbed form (per-head K and V
up-projected, plain causal attention) on the same weights — the oracle and the training path.

MoE (DeepSeekMoE): routed experts with top-k routing (softmax or sigmoid scores, the top-k
weights optionally normalised, then scaled by `routed_scaling_factor`), one shared expert (width
`n_shared_experts * moe_ffn_size`), the first `n_dense_layers` layers dense. Dropless and
graph-safe two ways, chosen per call by `MoePolicy` (a field of the config) from the token count:
dense masked compute (every expert runs on every token and a [tokens, n_experts] combine matrix,
zero off the top-k, mixes them; n_experts / top_k times the routed FLOPs, every expert's weights
read) or, for decode-sized batches, the routed kernels (`backends/triton/moe_routed.py`: each
(token, slot) reads only the slice of the expert its router picked, ids read on the device, a
grid fixed by the token count). Neither has a data-dependent shape, and tokens never compete for
anything, so padded tokens cannot change real tokens' results (`pg.check` proves it;
`tests/test_deepseek.py` shows a capacity-limited grouping where they do).

Forward functions keep `LlamaModel`'s signatures (tokens, positions, one `Batch`) and return `(logits, hidden)`; `kv` is a
`LatentCache` (or the bound view `kv.latent[layer]` inside a runner program).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from padgraph.backends.triton.kv import IMPLS
from padgraph.backends.triton.moe_routed import routed_experts
from padgraph.errors import ContractValueError

from ..batch import Batch
from ..paged import AttnPlan, PagedForwards, dense_forward
from .llama import MLP, RMSNorm, Rotary, init_weights


@dataclass(frozen=True)
class MoePolicy:
    """Which path a MoE layer's routed experts take, decided per call from its token count T
    (T = bs for a decode, bs * tokens for a verify; a static size, so a captured graph holds one
    path). `routed(T, top_k, n_experts)`: T * top_k <= routed_max_ratio * n_experts.

    Why that rule: the routed kernels read T * top_k expert slices (fewer distinct ones where
    tokens share experts), the dense masked path all n_experts, with tensor-core GEMMs. At the
    default ratio 1.0 the routed path never requests more slices than dense reads; past it, the
    dense path reads fewer bytes. The `lite` preset's 16 experts, top-6: routed at bs 1 and 2
    (6 and 12 slices), dense from bs 3. routed_max_ratio 0: always dense; inf: always routed.
    impl: the routed kernels' ("auto": Triton on CUDA, the torch reference elsewhere; "triton",
    "torch")."""
    routed_max_ratio: float = 1.0
    impl: str = "auto"

    def __post_init__(self):
        if not self.routed_max_ratio >= 0:          # NaN too
            raise ContractValueError(f"MoePolicy.routed_max_ratio must be >= 0 (0: always dense, "
                                     f"inf: always routed), got {self.routed_max_ratio!r}")
        if self.impl not in IMPLS:
            raise ContractValueError(f"MoePolicy.impl must be one of {IMPLS}, got {self.impl!r}")

    def routed(self, n_tokens: int, top_k: int, n_experts: int) -> bool:
        """Whether T = n_tokens tokens take the routed path (class doc). Under torch.compile a
        dynamic token count becomes a guard: a graph per side of the bound."""
        return n_tokens * top_k <= self.routed_max_ratio * n_experts


@dataclass(frozen=True)
class DeepSeekConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn_size: int                   # dense layers' MLP width
    moe_ffn_size: int               # one routed expert's width
    n_routed_experts: int
    top_k: int
    n_shared_experts: int = 1       # the shared expert is one MLP n_shared * moe_ffn_size wide
    n_dense_layers: int = 1         # the first layers use a dense MLP (DeepSeek's first_k_dense)
    score_func: str = "sigmoid"     # "softmax" (V2) | "sigmoid" (V3)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_position: int = 4096
    init_std: float = 0.02
    moe_policy: MoePolicy = MoePolicy()     # routed or dense masked experts, per token count

    @classmethod
    def tiny(cls, **kw) -> "DeepSeekConfig":
        """CPU-test size; latent row 40 + 8 = 48 columns (not a power of two)."""
        base = dict(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, q_lora_rank=32,
                    kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    ffn_size=128, moe_ffn_size=32, n_routed_experts=8, top_k=2,
                    max_position=1024)
        return cls(**{**base, **kw})

    @classmethod
    def lite(cls, **kw) -> "DeepSeekConfig":
        """DeepSeek-V2-Lite's widths (MLA 512 + 64, 16 heads, expert width 1408, 2 shared,
        softmax top-6, unnormalised) with a V3-style q low-rank, 6 layers and 16 experts so a
        GPU run (distillation included) fits a few minutes; random weights."""
        base = dict(vocab_size=102400, hidden_size=2048, n_layers=6, n_heads=16,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, ffn_size=10944, moe_ffn_size=1408,
                    n_routed_experts=16, top_k=6, n_shared_experts=2, score_func="softmax",
                    norm_topk_prob=False, routed_scaling_factor=1.0, max_position=8192,
                    init_std=0.008)   # as LlamaConfig.llama_1b: 0.02 at 2048 wide is undraftable
        return cls(**{**base, **kw})

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        from padgraph.backends.triton.attention_mla import mla_sm_scale
        return mla_sm_scale(self.qk_nope_head_dim, self.qk_rope_head_dim)

    def replace(self, **kw) -> "DeepSeekConfig":
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------------------- latent cache

class LatentCache:
    """Per-layer latent rows `latent[layer] [n_slots, 1, kv_lora_rank + rope_dim]` and the
    request map `req_to_token [n_req_rows, max_context]`; slot 0 and row 0 are the sinks.
    Storage is fixed after construction (graphs bind it)."""

    def __init__(self, n_layers: int, n_slots: int, width: int, max_context: int,
                 n_req_rows: int, dtype: torch.dtype, device: torch.device | str):
        if n_slots < 2 or n_req_rows < 2:
            raise ValueError(f"n_slots and n_req_rows must be >= 2 (slot 0 and row 0 are "
                             f"sinks, 1 canaries); got n_slots={n_slots}, n_req_rows={n_req_rows}")
        self.n_layers, self.n_slots, self.width = n_layers, n_slots, width
        self.latent = [torch.zeros(n_slots, 1, width, dtype=dtype, device=device)
                       for _ in range(n_layers)]
        self.req_to_token = torch.zeros(n_req_rows, max_context, dtype=torch.int32,
                                        device=device)

    def state(self) -> dict:
        """The bound state a runner program declares for it (req_to_token aside)."""
        return {"latent_cache": self.latent}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent + [self.req_to_token])


# ------------------------------------------------------------------------ attention metadata

def _mla():
    from padgraph.backends.triton import attention_mla
    return attention_mla


def _store_latent(latent_cache, loc, c_kv, k_rope):
    _mla().store_latent(latent_cache, loc, c_kv, k_rope)


# Each batch's `attend(q_latent [n, H, r + rope], latent_cache) -> o_latent [n, H, r]`.

def mla_decode_batch(cfg, b: Batch) -> AttnPlan:
    fn = partial(_mla().mla_decode_attention, req_to_token=b.req_to_token,
                 req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
                 kv_lora_rank=cfg.kv_lora_rank, sm_scale=cfg.sm_scale, impl=b.impl)
    return AttnPlan(b.out_cache_loc, fn)


def mla_extend_batch(cfg, b: Batch) -> AttnPlan:
    fn = partial(_mla().mla_extend_attention, req_to_token=b.req_to_token,
                 req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
                 qo_indptr=b.qo_indptr, kv_lora_rank=cfg.kv_lora_rank, sm_scale=cfg.sm_scale,
                 impl=b.impl)
    return AttnPlan(b.out_cache_loc, fn)


def mla_tree_batch(cfg, b: Batch) -> AttnPlan:
    fn = partial(_mla().mla_tree_verify_attention, req_to_token=b.req_to_token,
                 req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens,
                 tree_mask=b.tree_mask, kv_lora_rank=cfg.kv_lora_rank, sm_scale=cfg.sm_scale,
                 impl=b.impl)
    return AttnPlan(b.out_cache_loc, fn)


# ------------------------------------------------------------------------------------- MLA

class MLAttention(nn.Module):
    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        self.cfg = cfg
        n_h, nope, rope = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.q_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps)
        self.q_b = nn.Linear(cfg.q_lora_rank, n_h * (nope + rope), bias=False)
        self.kv_a = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_eps)
        self.kv_b = nn.Linear(cfg.kv_lora_rank, n_h * (nope + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n_h * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def up_weights(self):
        """(W_UK [H, nope, r], W_UV [H, r, v]): views of kv_b's weight."""
        c = self.cfg
        w = self.kv_b.weight.view(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:].transpose(1, 2)

    def project(self, x: Tensor, positions: Tensor, rope: Rotary):
        """x [n, hidden] -> q_nope [n, H, nope], q_rope [n, H, rope], c_kv [n, r], k_rope [n, rope]."""
        c = self.cfg
        q = self.q_b(self.q_norm(self.q_a(x))).view(-1, c.n_heads, c.qk_nope_head_dim +
                                                     c.qk_rope_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv, k_rope = self.kv_a(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        k_rope = rope(k_rope[:, None], positions)[:, 0]               # one rope key, all heads
        return q_nope, rope(q_rope, positions), self.kv_norm(c_kv), k_rope

    def forward(self, x, positions, rope, batch: AttnPlan, latent_cache):
        """Absorbed: store [c_kv, k_rope], attend in the latent space, up-project after."""
        mla = _mla()
        q_nope, q_rope, c_kv, k_rope = self.project(x, positions, rope)
        _store_latent(latent_cache, batch.out_cache_loc, c_kv, k_rope)
        W_UK, W_UV = self.up_weights()
        o_latent = batch.attend(mla.absorb_query(q_nope, q_rope, W_UK), latent_cache)
        o = mla.project_output(o_latent, W_UV)                       # [n, H, v]
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward_dense(self, x, positions, rope, mask=None):
        """Non-absorbed causal attention over x [B, T, hidden], no cache: per-head
        K = [c_kv @ W_UK^T, k_rope], V = c_kv @ W_UV^T, softmax scale of MLA; `mask` [T, T]
        bool (True: attend) replaces the causal one."""
        B, T, _ = x.shape
        n_h = self.cfg.n_heads
        q_nope, q_rope, c_kv, k_rope = self.project(x.reshape(B * T, -1), positions.reshape(-1),
                                                    rope)
        W_UK, W_UV = self.up_weights()
        k_nope = torch.einsum("nc,hdc->nhd", c_kv, W_UK)              # [B*T, H, nope]
        v = torch.einsum("nc,hcv->nhv", c_kv, W_UV)                   # [B*T, H, v]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, n_h, -1)], dim=-1)
        q, k, v = (t.view(B, T, n_h, -1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=self.cfg.sm_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


# ------------------------------------------------------------------------------------- MoE

class MoE(nn.Module):
    """Routed experts (dense masked compute, or the routed kernels where `cfg.moe_policy` picks
    them) plus one shared expert."""

    def __init__(self, cfg: DeepSeekConfig):
        super().__init__()
        if cfg.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid'; got {cfg.score_func!r}")
        if not 0 < cfg.top_k <= cfg.n_routed_experts:
            raise ValueError(f"top_k must be in 1 .. n_routed_experts={cfg.n_routed_experts}; "
                             f"got {cfg.top_k}")
        E, H, Fe = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_ffn_size
        self.cfg = cfg
        self.gate = nn.Linear(H, E, bias=False)
        # V3's selection-only bias (auxiliary-loss-free balancing); zeros for a random model
        self.register_buffer("score_bias", torch.zeros(E))
        self.gate_up = nn.Parameter(torch.empty(E, H, 2 * Fe))         # [E, hidden, 2F]
        self.down = nn.Parameter(torch.empty(E, Fe, H))                # [E, F, hidden]
        self.shared = MLP(cfg.replace(ffn_size=cfg.n_shared_experts * Fe))

    def select(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [n, hidden] -> (expert ids [n, k] int64, their scaled weights [n, k] fp32)."""
        c = self.cfg
        logits = F.linear(x.float(), self.gate.weight.float())          # [n, E], router in fp32
        scores = logits.softmax(-1) if c.score_func == "softmax" else logits.sigmoid()
        idx = (scores + self.score_bias).topk(c.top_k, dim=-1).indices  # [n, k]
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        return idx, w * c.routed_scaling_factor

    def route(self, x: Tensor) -> Tensor:
        """x [n, hidden] -> combine weights [n, E] fp32: the scaled top-k weights, 0 elsewhere."""
        idx, w = self.select(x)
        return x.new_zeros(x.shape[0], self.cfg.n_routed_experts, dtype=w.dtype).scatter(1, idx, w)

    def routed(self, n_tokens: int) -> bool:
        """Whether n_tokens tokens run the routed kernels (`MoePolicy.routed`), else dense."""
        c = self.cfg
        return c.moe_policy.routed(n_tokens, c.top_k, c.n_routed_experts)

    def experts(self, x: Tensor, combine: Tensor) -> Tensor:
        """Every expert on every token, mixed by combine [n, E]: x [n, hidden] -> [n, hidden].

        Batched GEMMs over the experts with the weights as stored: x is broadcast over E (a
        stride-0 view), so the [E, hidden, 2F] weight is read in place. (An einsum
        "nd,edf->enf" has no batch dim in x, so it folds E into the output columns and copies the
        weight into [hidden, E * 2F] on every call: on the H200 that copy was 88 us a layer, 23%
        of the DeepSeek greedy step.)"""
        xe = x.unsqueeze(0).expand(self.gate_up.shape[0], *x.shape)             # [E, n, hidden]
        gate, up = torch.bmm(xe, self.gate_up).chunk(2, dim=-1)                 # [E, n, F]
        y = torch.bmm(F.silu(gate) * up, self.down)                             # [E, n, hidden]
        return torch.einsum("end,ne->nd", y, combine.to(y.dtype))

    def forward(self, x: Tensor) -> Tensor:
        """x [..., hidden] -> [..., hidden]; each token on its own (no token sees another)."""
        flat = x.reshape(-1, x.shape[-1])                                # [n, hidden]
        if self.routed(flat.shape[0]):
            idx, w = self.select(flat)                                   # [n, k] each
            y = routed_experts(flat, idx, w, self.gate_up, self.down,
                               impl=self.cfg.moe_policy.impl)
        else:
            y = self.experts(flat, self.route(flat))
        return (y + self.shared(flat)).view_as(x)


# ---------------------------------------------------------------------------------- layers

class DeepSeekLayer(nn.Module):
    def __init__(self, cfg: DeepSeekConfig, moe: bool):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = MLAttention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x, positions, rope, batch, latent_cache):
        x = x + self.attn(self.input_norm(x), positions, rope, batch, latent_cache)
        return x + self.mlp(self.post_norm(x))

    def forward_dense(self, x, positions, rope, mask=None):
        x = x + self.attn.forward_dense(self.input_norm(x), positions, rope, mask)
        return x + self.mlp(self.post_norm(x))


def init_deepseek(module: nn.Module, cfg: DeepSeekConfig, generator: torch.Generator,
                  n_layers: int):
    """`init_weights` (scaled residual projections), then the MoE parts it does not name: expert
    down-projections scaled like `down`, router weights std 1/sqrt(hidden) so that routing
    scores are spread (no near-ties between experts)."""
    init_weights(module, cfg.init_std, generator, n_layers)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, MoE):
                m.down.mul_((2 * n_layers) ** -0.5)
                m.gate.weight.copy_(torch.randn(m.gate.weight.shape, generator=generator)
                                    * cfg.hidden_size ** -0.5)


# ----------------------------------------------------------------------------------- model

class DeepSeekModel(PagedForwards, nn.Module):
    """The target. `kv.latent[layer]` are [n_slots, 1, kv_lora_rank + rope_dim] latent rows."""

    def __init__(self, cfg: DeepSeekConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepSeekLayer(cfg, moe=i >= cfg.n_dense_layers)
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = Rotary(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope_theta)
        gen = torch.Generator().manual_seed(seed)
        init_deepseek(self, cfg, gen, cfg.n_layers)
        with torch.no_grad():  # token-dependent residual stream; rows of unit RMS, so an
            e = torch.randn(self.embed.weight.shape, generator=gen)   # RMSNorm'd embedding
            self.embed.weight.copy_(e * e.pow(2).mean(-1, keepdim=True).rsqrt())  # is itself

    def set_moe_policy(self, policy: MoePolicy) -> None:
        """Every MoE layer's path choice from the next call on: `cfg` (the model's and each MoE
        layer's) replaced by one holding `policy`. Graphs captured before keep the path they hold."""
        self.cfg = self.cfg.replace(moe_policy=policy)
        for m in self.modules():
            if isinstance(m, MoE):
                m.cfg = m.cfg.replace(moe_policy=policy)

    def new_cache(self, n_layers: int, n_slots: int, max_context: int,
                  n_req_rows: int) -> LatentCache:
        """A latent cache of this model's width, dtype and device (the worker's protocol)."""
        w = self.lm_head.weight
        return LatentCache(n_layers, n_slots, self.cfg.latent_width, max_context, n_req_rows,
                           w.dtype, w.device)

    def _run(self, input_ids, positions, batch: AttnPlan, kv) -> Tensor:
        x = self.embed(input_ids)                                    # [n, hidden]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, batch, kv.latent[i])
        return self.norm(x)                                          # [n, hidden] final-normed

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def greedy_ids(self, hidden: Tensor) -> Tensor:
        """argmax of `logits(hidden)` on the lm_head's own output (`LlamaModel.greedy_ids`)."""
        return self.lm_head(hidden).argmax(-1)

    # the paged forwards are PagedForwards'; the metadata is MLA's (one latent head per slot)
    def _decode_batch(self, b: Batch) -> AttnPlan:
        return mla_decode_batch(self.cfg, b)

    def _extend_batch(self, b: Batch) -> AttnPlan:
        return mla_extend_batch(self.cfg, b)

    def _tree_batch(self, b: Batch) -> AttnPlan:
        return mla_tree_batch(self.cfg, b)

    def forward_dense(self, input_ids: Tensor, last_only: bool = False):
        """[B, T] → (logits [B, T, V] (or [B, V] with last_only), hidden [B, T, hidden]),
        non-absorbed MLA, no cache."""
        return dense_forward(self, input_ids, last_only)
