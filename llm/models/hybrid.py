"""A hybrid target: Llama attention layers and Mamba2 layers in one decoder, random init.

Each letter of `HybridConfig.pattern` is a layer: "A" a Llama decoder layer (RMSNorm, RoPE, GQA
over the paged K/V cache, SwiGLU), "M" a Mamba2 layer (RMSNorm, the mixer, RMSNorm, SwiGLU). The
mixer (Mamba2's): one in-projection to the gate z, the conv input xBC and the step dt; a causal
depthwise convolution (width `conv_kernel`, SiLU) over xBC whose last conv_kernel - 1 inputs are
kept as state; x, B, C split from its output; the selective state update per head

    h <- h * exp(dt' * A) + dt' * x B^T,   y = h C + D * x,   y <- y * silu(z)
    (dt' = softplus(dt + dt_bias), A = -exp(A_log); h [head_dim, d_state] per head)

then an RMSNorm over y (Mamba2's gated norm) and the out-projection. The kernels are
`padgraph.backends.triton.conv_state` and `.ssm` (their torch references off the GPU); inside
torch.compile'd layers they stay opaque ops (`padgraph.backends.triton.recurrent_ops`) unless
`opaque_recurrent=False`, which lets inductor compile their torch references instead.

Recurrent state (SPEC 7.9): per Mamba layer a convolution window pool `conv [n_rows,
conv_dim, conv_kernel - 1]` (the model's dtype) and an SSM state pool `ssm [n_rows, n_heads, head_dim,
d_state]` (fp32), indexed by the request's req_to_token row: a request owns its recurrent row
from admission to release, with its row. Row 0 is the sink (padded lanes carry row 0 in
`req_pool_indices` and read and write only it), row 1 the canary, as for the K/V cache; the
runner programs declare every pool `pg.State(sink=0, canary=1)`. No call clears a row: a
prefill starts each request from zeros by selection, never reading the row's old contents
(`has_initial_state` is false where the extend holds the request's whole sequence), so a
released row's leftovers (inf, nan) cannot reach the next request. Decode reads and rewrites
each lane's row.

Speculative verify and rollback: verify runs the tree's k nodes (EAGLE tree or MTP / top-1
chain; node 0 the root, every other node's parent an earlier node, `tree_parents` of the tree
mask) through each Mamba layer one node after another: node j starts from its parent's state (the
root from the request's row), takes its token and leaves its state in the per-node pools
`tree_conv [n_rows, k, conv_dim, conv_kernel - 1]` and `tree_ssm [n_rows, k, n_heads, head_dim,
d_state]` (row 0 the sink, too). The request's own row is not written during the forward. Once
verify has found the accepted path, `commit_tree` copies the state of the path's last node into
the request's row (an index the body computes on the device: no host sync), so a partially
accepted tree leaves the state that decoding the accepted tokens one at a time leaves (the same
recurrence over the same tokens).

What rollback costs:
  - memory: the per-node pools hold k states per request row and Mamba layer, k times the
    recurrent pools: k * (conv_dim * (conv_kernel - 1) * dtype bytes + n_heads * head_dim *
    d_state * 4) bytes (`HybridCache.tree_nbytes`; k = `SpecConfig.num_draft_tokens`; none for
    plain decoding), allocated once. The tiny config: 5,248 bytes a node and layer. Mamba2-2.7B's
    layer shapes (80 heads of 64 channels, d_state 128, conv_dim 5376 in bf16): 2.65 MB a node
    and layer, so 1.36 GB per request row at k = 8 over its 64 layers;
  - compute: no recomputation. Each Mamba layer runs the k nodes as k single-token steps, one
    after another, inside two launches (`conv_tree_update` for the convolution windows,
    `ssm_tree_update` for the SSM states): a program walks its lane's nodes, reading each
    node's parent state (the root: the request's row) and writing the node's state to its row
    of the per-node pools; the commit copies one state per request. State traffic per verify and
    layer: 2k + 2 state-sized reads and writes per request (each node reads its parent and
    writes itself, then the commit), where k decode steps move 2k.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from padgraph.backends.triton.recurrent_ops import (conv_state_prefill, conv_state_update, conv_tree_update,
                                                    ssm_chunked_scan, ssm_decode_update, ssm_tree_update)
from padgraph.backends.triton.eagle import tree_parents

from ..batch import Batch
from ..kv import KVCache
from ..paged import AttnPlan, PagedForwards, decode_batch, dense_forward, extend_batch, tree_batch
from .llama import MLP, DecoderLayer, RMSNorm, Rotary

LAYER_KINDS = ("A", "M")    # attention, Mamba2


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    pattern: str                 # one letter a layer: "A" attention, "M" Mamba2
    n_heads: int                 # attention (and an EAGLE head's layer): LlamaConfig's fields
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    ssm_heads: int               # the mixer: heads of ssm_head_dim channels, d_state each
    ssm_head_dim: int
    d_state: int
    n_groups: int = 1            # B and C groups (heads per group share them)
    conv_kernel: int = 4
    dt_min: float = 0.001        # the range dt' starts in (dt_bias's init)
    dt_max: float = 0.1
    d_skip: float = 1.0          # D's init (Mamba2's: 1)
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_position: int = 4096
    init_std: float = 0.02

    def __post_init__(self):
        bad = sorted(set(self.pattern) - set(LAYER_KINDS))
        if not self.pattern or bad or "M" not in self.pattern:
            raise ValueError(f"HybridConfig.pattern must be letters {LAYER_KINDS} (A attention, M Mamba2) "
                             f"with at least one M; got {self.pattern!r}")
        if self.ssm_heads % self.n_groups:
            raise ValueError(f"HybridConfig: n_groups={self.n_groups} must divide ssm_heads={self.ssm_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"HybridConfig: conv_kernel must be >= 2; got {self.conv_kernel}")

    @classmethod
    def tiny(cls, **kw) -> "HybridConfig":
        """CPU-test size: Mamba, attention, Mamba; about 0.6 MB of fp32 weights. Chosen so the
        tokens depend on the recurrent state, which the tests need: with D = 0 (no skip past the
        state) and init_std 0.1, dropping the SSM's memory (each step forgetting the previous
        state) changes about a third of the greedy next tokens of random sequences, and
        dropping all context (each token alone) more than half."""
        base = dict(vocab_size=256, hidden_size=64, pattern="MAM", n_heads=4, n_kv_heads=2,
                    head_dim=16, ffn_size=128, ssm_heads=4, ssm_head_dim=16, d_state=16,
                    dt_min=0.01, dt_max=0.5, d_skip=0.0, max_position=1024, init_std=0.1)
        return cls(**{**base, **kw})

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    @property
    def d_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    def replace(self, **kw) -> "HybridConfig":
        return dataclasses.replace(self, **kw)


# ------------------------------------------------------------------------------- cache

class HybridCache:
    """The attention layers' K/V pools (`KVCache`'s layout, one per "A" layer in order), the
    Mamba layers' recurrent pools (one per "M" layer in order: `conv`, `ssm`), a verify's
    per-node states (`tree_conv`, `tree_ssm`; none when `tree_nodes` is 0) and req_to_token.
    Every recurrent pool has one row per request row (dim 0): row 0 the sink, row 1 the canary.
    Storage is fixed after construction (graphs bind it)."""

    def __init__(self, cfg: HybridConfig, n_slots: int, max_context: int, n_req_rows: int,
                 tree_nodes: int, dtype: torch.dtype, device: torch.device | str):
        if tree_nodes < 0:
            raise ValueError(f"HybridCache: tree_nodes must be >= 0; got {tree_nodes}")
        kv = KVCache(cfg.pattern.count("A"), n_slots, cfg.n_kv_heads, cfg.head_dim, max_context,
                     n_req_rows, dtype, device)
        self.k, self.v, self.req_to_token = kv.k, kv.v, kv.req_to_token
        self.tree_nodes = tree_nodes
        window = (cfg.conv_dim, cfg.conv_kernel - 1)
        state = (cfg.ssm_heads, cfg.ssm_head_dim, cfg.d_state)
        n_m = cfg.pattern.count("M")

        def pools(shape, dt):
            return [torch.zeros(shape, dtype=dt, device=device) for _ in range(n_m)]
        self.conv = pools((n_req_rows, *window), dtype)                  # [n_rows, conv_dim, k - 1]
        self.ssm = pools((n_req_rows, *state), torch.float32)            # [n_rows, heads, head_dim, d_state]
        self.tree_conv = pools((n_req_rows, tree_nodes, *window), dtype) if tree_nodes else []
        self.tree_ssm = pools((n_req_rows, tree_nodes, *state), torch.float32) if tree_nodes else []

    def state(self) -> dict:
        """The bound state a runner program declares for it (req_to_token aside)."""
        named = {"k_cache": self.k, "v_cache": self.v, "conv_state": self.conv, "ssm_state": self.ssm,
                 "tree_conv": self.tree_conv, "tree_ssm": self.tree_ssm}
        return {name: pools for name, pools in named.items() if pools}

    def tree_nbytes(self) -> int:
        """Bytes of the per-node states a verify keeps to roll back (every request row)."""
        return _nbytes(self.tree_conv + self.tree_ssm)

    def nbytes(self) -> int:
        return _nbytes(self.k + self.v + self.conv + self.ssm + self.tree_conv + self.tree_ssm
                       + [self.req_to_token])


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------------- call plans

@dataclass(frozen=True)
class RecurrentPlan:
    """What the Mamba layers need for one call: each lane's recurrent row `slots` [bs] int64 (its
    request row; 0 for a padded lane) and, by the call's kind, the packed tokens of an extend
    (`cu_seqlens` [bs + 1] int32, `has_initial_state` [bs] bool) or a verify's tree (`parents`
    [bs, k] int64, -1 at the root); neither: a decode step. opaque: under torch.compile the
    recurrent updates run padgraph's kernels as opaque ops (`recurrent_ops`) rather than
    inductor's code for their references (`HybridModel.opaque_recurrent`)."""
    slots: Tensor
    cu_seqlens: Tensor | None = None
    has_initial_state: Tensor | None = None
    parents: Tensor | None = None
    impl: str = "auto"
    opaque: bool = False


@dataclass(frozen=True)
class HybridPlan(AttnPlan):
    """An attention plan (what the "A" layers read) with the Mamba layers' `recurrent` plan."""
    recurrent: RecurrentPlan


# ---------------------------------------------------------------------------------- layers

class Mamba2Mixer(nn.Module):
    """Mamba2's mixer over the recurrent pools (see the module docstring)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.d_state = cfg.ssm_heads, cfg.ssm_head_dim, cfg.d_state
        self.n_groups, self.kernel = cfg.n_groups, cfg.conv_kernel
        self.d_inner, self.conv_dim = cfg.d_inner, cfg.conv_dim
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.d_inner + cfg.conv_dim + cfg.ssm_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(cfg.conv_dim, cfg.conv_kernel))   # [channels, k]
        self.conv_bias = nn.Parameter(torch.empty(cfg.conv_dim))
        self.A_log = nn.Parameter(torch.empty(cfg.ssm_heads))
        self.D = nn.Parameter(torch.ones(cfg.ssm_heads))
        self.dt_bias = nn.Parameter(torch.empty(cfg.ssm_heads))
        self.norm = RMSNorm(cfg.d_inner, cfg.rms_eps)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.hidden_size, bias=False)

    def init_ssm(self, cfg: HybridConfig, gen: torch.Generator) -> None:
        """Mamba2's init: the in-projection at std 1 / sqrt(hidden) (x, B, C and dt of unit
        scale), the convolution as nn.Conv1d's, A in [-16, -1], dt' in [dt_min, dt_max]
        (log-uniform, through dt_bias = softplus^-1(dt')), D = `d_skip`."""
        bound = 1 / math.sqrt(cfg.conv_kernel)
        with torch.no_grad():
            w = self.in_proj.weight
            w.copy_(torch.randn(w.shape, generator=gen) / math.sqrt(cfg.hidden_size))
            self.conv_weight.copy_((torch.rand(self.conv_weight.shape, generator=gen) * 2 - 1) * bound)
            self.conv_bias.copy_((torch.rand(self.conv_bias.shape, generator=gen) * 2 - 1) * bound)
            self.A_log.copy_(torch.log(1 + 15 * torch.rand(self.n_heads, generator=gen)))
            lo, hi = math.log(cfg.dt_min), math.log(cfg.dt_max)
            dt = torch.exp(lo + (hi - lo) * torch.rand(self.n_heads, generator=gen))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))          # softplus^-1
            self.D.fill_(cfg.d_skip)

    @property
    def A(self) -> Tensor:
        return -torch.exp(self.A_log.float())                              # [n_heads] fp32

    def _project(self, h: Tensor):
        """h [n, H] -> z [n, n_heads, head_dim], xBC [n, conv_dim], dt [n, n_heads] (views)."""
        z, xbc, dt = self.in_proj(h).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        return z.view(-1, self.n_heads, self.head_dim), xbc, dt

    def _heads(self, u: Tensor):
        """The convolution's output u [n, conv_dim] -> x [n, n_heads, head_dim] and B, C
        [n, n_groups, d_state] (views)."""
        gn = self.n_groups * self.d_state
        x, B, C = u.split([self.d_inner, gn, gn], dim=-1)
        return (x.reshape(-1, self.n_heads, self.head_dim), B.reshape(-1, self.n_groups, self.d_state),
                C.reshape(-1, self.n_groups, self.d_state))

    def _out(self, y: Tensor) -> Tensor:
        """Gated y [n, n_heads, head_dim] -> [n, H]."""
        return self.out_proj(self.norm(y.reshape(y.shape[0], -1)))

    def _token(self, plan: RecurrentPlan, conv, ssm, xbc, dt, z) -> Tensor:
        """One token per lane on pool rows `plan.slots` [n], read and rewritten in place:
        y [n, n_heads, head_dim]."""
        u = conv_state_update(conv, plan.slots, xbc, self.conv_weight, self.conv_bias, "silu", impl=plan.impl,
                              opaque=plan.opaque)
        x, B, C = self._heads(u)
        return ssm_decode_update(ssm, plan.slots, x, dt, self.A, B, C, D=self.D, z=z, dt_bias=self.dt_bias,
                                 impl=plan.impl, opaque=plan.opaque)

    def forward(self, h: Tensor, plan: RecurrentPlan, conv: Tensor, ssm: Tensor,
                tree_conv: Tensor | None = None, tree_ssm: Tensor | None = None) -> Tensor:
        """h [n, H] (a token per lane, packed tokens or bs * k tree nodes, as `plan` says) -> [n, H]."""
        z, xbc, dt = self._project(h)
        if plan.parents is not None:
            y = self._tree(plan, conv, ssm, tree_conv, tree_ssm, xbc, dt, z)
        elif plan.cu_seqlens is not None:
            y = self._extend(plan, conv, ssm, xbc, dt, z)
        else:
            y = self._token(plan, conv, ssm, xbc, dt, z)
        return self._out(y)

    def _extend(self, plan: RecurrentPlan, conv, ssm, xbc, dt, z) -> Tensor:
        """Packed sequences: each from its row (continued) or from zeros (`has_initial_state`
        false), leaving its final state in the row."""
        args = (plan.slots, plan.cu_seqlens, plan.has_initial_state)
        u = conv_state_prefill(conv, *args, xbc, self.conv_weight, self.conv_bias, "silu", impl=plan.impl,
                               opaque=plan.opaque)
        x, B, C = self._heads(u)
        return ssm_chunked_scan(ssm, *args, x, dt, self.A, B, C, D=self.D, z=z, dt_bias=self.dt_bias,
                                impl=plan.impl, opaque=plan.opaque)

    def _tree(self, plan: RecurrentPlan, conv, ssm, tree_conv, tree_ssm, xbc, dt, z) -> Tensor:
        """A verify's tree, node after node: node j starts from its parent's state (the root
        from the request's row, which stays as it was) and leaves its own in the per-node pools,
        row r's node j at r * k + j of their flattened first two dims. One launch for the
        convolution windows of every node, one for the SSM states (`conv_tree_update`,
        `ssm_tree_update`)."""
        tc, ts = tree_conv.flatten(0, 1), tree_ssm.flatten(0, 1)     # [n_rows * k, ...] views
        u = conv_tree_update(conv, tc, plan.slots, plan.parents, xbc, self.conv_weight, self.conv_bias, "silu",
                             impl=plan.impl, opaque=plan.opaque)
        x, B, C = self._heads(u)
        return ssm_tree_update(ssm, ts, plan.slots, plan.parents, x, dt, self.A, B, C, D=self.D, z=z,
                               dt_bias=self.dt_bias, impl=plan.impl, opaque=plan.opaque)   # [bs * k, heads, head_dim]

    def forward_dense(self, h: Tensor) -> Tensor:
        """h [B, T, H] from zero state, no pools: the recurrence as written, token by token, in
        plain torch (the oracle of the paged paths)."""
        B, T, _ = h.shape
        z, xbc, dt = self.in_proj(h).split([self.d_inner, self.conv_dim, self.n_heads], dim=-1)
        window = F.pad(xbc.float().transpose(1, 2), (self.kernel - 1, 0))      # [B, conv_dim, k - 1 + T]
        u = F.conv1d(window, self.conv_weight.float()[:, None, :], self.conv_bias.float(),
                     groups=self.conv_dim)
        u = F.silu(u).transpose(1, 2).to(xbc.dtype)                            # [B, T, conv_dim]
        gn, rep = self.n_groups * self.d_state, self.n_heads // self.n_groups
        x, Bm, Cm = u.float().split([self.d_inner, gn, gn], dim=-1)
        x = x.reshape(B, T, self.n_heads, self.head_dim)
        # [B, T, n_heads, d_state]: each head its group's B and C
        Bm = Bm.reshape(B, T, self.n_groups, self.d_state).repeat_interleave(rep, dim=2)
        Cm = Cm.reshape(B, T, self.n_groups, self.d_state).repeat_interleave(rep, dim=2)
        step = F.softplus(dt.float() + self.dt_bias.float())                  # [B, T, heads]
        gate = F.silu(z.float().reshape(B, T, self.n_heads, self.head_dim))
        state = h.new_zeros(B, self.n_heads, self.head_dim, self.d_state, dtype=torch.float32)
        ys = []
        for t in range(T):
            decay = torch.exp(step[:, t] * self.A)[..., None, None]           # [B, heads, 1, 1]
            state = state * decay + (step[:, t, :, None] * x[:, t])[..., None] * Bm[:, t, :, None, :]
            y = (state * Cm[:, t, :, None, :]).sum(-1) + self.D.float()[:, None] * x[:, t]
            ys.append(y * gate[:, t])
        y = torch.stack(ys, 1).to(h.dtype)                                     # [B, T, heads, head_dim]
        return self.out_proj(self.norm(y.reshape(B, T, -1)))


class MambaLayer(nn.Module):
    """RMSNorm, the Mamba2 mixer, RMSNorm, SwiGLU; residual around each (a Llama layer with the
    attention swapped for the mixer)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mixer = Mamba2Mixer(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, plan: RecurrentPlan, conv, ssm, tree_conv=None, tree_ssm=None):
        x = x + self.mixer(self.input_norm(x), plan, conv, ssm, tree_conv, tree_ssm)
        return x + self.mlp(self.post_norm(x))

    def forward_dense(self, x, positions=None, rope=None):
        x = x + self.mixer.forward_dense(self.input_norm(x))
        return x + self.mlp(self.post_norm(x))


def init_hybrid(model: nn.Module, cfg: HybridConfig, gen: torch.Generator) -> None:
    """Normal(0, init_std) matrices, init_std / sqrt(2 * n_layers) for the projections back into
    the residual stream (o_proj, down, out_proj), norms at one, the mixers' own parameters as
    Mamba2 starts them (`Mamba2Mixer.init_ssm`), then a unit-scale embedding (as LlamaModel's:
    the residual stream stays token-dependent). Deterministic for a generator."""
    resid = ("o_proj.weight", "down.weight", "out_proj.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith("conv_weight"):
                std = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if name.endswith(resid) else cfg.init_std
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for layer in model.layers:
            if isinstance(layer, MambaLayer):
                layer.mixer.init_ssm(cfg, gen)
        model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=gen))


# ----------------------------------------------------------------------------------- model

class HybridModel(PagedForwards, nn.Module):
    """The target: the paged forwards of `PagedForwards` (decode, extend, verify over a `Batch`),
    whose attention plans carry the Mamba layers' `RecurrentPlan`; `commit_tree` after a verify;
    `forward_dense` the oracle. Served by `padgraph.llm.Engine` as any target (an `EagleHead`
    drafts for it: its layer is a Llama layer over K/V pools of its own)."""

    def __init__(self, cfg: HybridConfig, seed: int = 0, opaque_recurrent: bool = True):
        """opaque_recurrent: inside a torch.compile'd body (the engine's default on a GPU), the
        Mamba layers' conv and SSM updates run padgraph's Triton kernels as opaque custom ops
        (`padgraph.backends.triton.recurrent_ops`), the default: faster at every size measured
        (`python -m bench.bench_hybrid --recurrent-ops opaque,inductor`); False: inductor
        compiles their torch references with the code around them. The tokens are the same up
        to fp32 rounding."""
        super().__init__()
        self.cfg, self.opaque_recurrent = cfg, opaque_recurrent
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) if c == "A" else MambaLayer(cfg) for c in cfg.pattern)
        # layer i's pool: its index among the layers of its kind
        self.pool_index = [cfg.pattern[:i].count(c) for i, c in enumerate(cfg.pattern)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        init_hybrid(self, cfg, torch.Generator().manual_seed(seed))

    def new_hybrid_cache(self, n_slots: int, max_context: int, n_req_rows: int,
                         tree_nodes: int) -> HybridCache:
        """The worker's cache (`padgraph.llm.kv.new_cache`): K/V, recurrent and per-node pools."""
        p = self.lm_head.weight
        return HybridCache(self.cfg, n_slots, max_context, n_req_rows, tree_nodes, p.dtype, p.device)

    # ---- plans ------------------------------------------------------------------------
    def recurrent_slots(self, b: Batch) -> Tensor:
        """Each lane's recurrent row [bs] int64: its request row (row 0, the sink, for a padded
        lane)."""
        return b.req_pool_indices.long()

    def _decode_batch(self, b: Batch) -> HybridPlan:
        return _with(decode_batch(b), RecurrentPlan(self.recurrent_slots(b), impl=b.impl,
                                                    opaque=self.opaque_recurrent))

    def _extend_batch(self, b: Batch) -> HybridPlan:
        """A request continues from its row where the cache held tokens before this extend
        (seq_lens past its packed tokens); a request whose whole sequence this is starts from zeros."""
        n_new = b.qo_indptr[1:] - b.qo_indptr[:-1]
        rec = RecurrentPlan(self.recurrent_slots(b), b.qo_indptr, b.seq_lens > n_new, impl=b.impl,
                            opaque=self.opaque_recurrent)
        return _with(extend_batch(b), rec)

    def _tree_batch(self, b: Batch) -> HybridPlan:
        rec = RecurrentPlan(self.recurrent_slots(b), parents=tree_parents(b.tree_mask), impl=b.impl,
                            opaque=self.opaque_recurrent)
        return _with(tree_batch(b), rec)

    # ---- forwards ---------------------------------------------------------------------
    def _run(self, input_ids, positions, plan: HybridPlan, kv) -> Tensor:
        x = self.embed(input_ids)                                    # [n, H]
        for layer, i in zip(self.layers, self.pool_index):
            if isinstance(layer, MambaLayer):
                tree = (kv.tree_conv[i], kv.tree_ssm[i]) if plan.recurrent.parents is not None else ()
                x = layer(x, plan.recurrent, kv.conv[i], kv.ssm[i], *tree)
            else:
                x = layer(x, positions, self.rope, plan, kv.k[i], kv.v[i])
        return self.norm(x)                                          # [n, H] final-normed

    def commit_tree(self, batch: Batch, last_node: Tensor) -> None:
        """After a verify: each request's row takes the state of its accepted path's last node
        (`last_node` [bs] int64), so the row holds the state after the accepted tokens."""
        kv, rows = batch.kv, self.recurrent_slots(batch)
        for conv, ssm, tc, ts in zip(kv.conv, kv.ssm, kv.tree_conv, kv.tree_ssm):
            node = rows * tc.shape[1] + last_node.long()
            conv.index_copy_(0, rows, tc.flatten(0, 1)[node])
            ssm.index_copy_(0, rows, ts.flatten(0, 1)[node])

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def forward_dense(self, input_ids: Tensor, last_only: bool = False):
        """[B, T] -> (logits [B, T, V] fp32, hidden [B, T, H]) from zero state: plain causal
        attention and the recurrence token by token, no cache. last_only: logits [B, V] of the
        last position."""
        return dense_forward(self, input_ids, last_only)


def _with(attn: AttnPlan, recurrent: RecurrentPlan) -> HybridPlan:
    return HybridPlan(attn.out_cache_loc, attn.attend, recurrent)
