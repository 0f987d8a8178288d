"""A Llama-like target (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache, random init.

Forward functions take padded, static-shape tokens and positions and one `Batch` (the cache and
its metadata: `padgraph.llm.batch`) and return `(logits, hidden)`; none of them syncs with the host or produces a data-dependent shape, so each can run inside a captured graph.
`hidden` is the final-normed hidden state (the input of `lm_head`): what the EAGLE head consumes.

KV layout (as SGLang's): per layer `k_cache[slot, kv_head, head_dim]`, `req_to_token[row, pos]`
maps a request's position to its slot; slot 0 and row 0 are sinks for padded lanes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..batch import Batch
from ..paged import (AttendFn, AttnPlan, PagedForwards, decode_batch, dense_forward, extend_batch, last_tokens,  # noqa: F401
                     store_kv, tree_batch)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    max_position: int = 4096
    init_std: float = 0.02

    @classmethod
    def tiny(cls, **kw) -> "LlamaConfig":
        """CPU-test size: a few hundred kB of weights."""
        base = dict(vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, ffn_size=128, max_position=1024)
        return cls(**{**base, **kw})

    @classmethod
    def llama_1b(cls, **kw) -> "LlamaConfig":
        """Llama-3.2-1B's shape (random weights).

        init_std 0.008, not 0.02: what each layer adds to the residual stream grows like
        init_std**2 * hidden_size, so at 2048 wide 0.02 gives layers that swamp the token
        embedding and a chaotic generator — its greedy next token agrees with the embedding→
        lm_head map of the current token 8% of the time, n-gram lookup of its own history
        accepts nothing, and no one-layer draft can predict it (accept length 1.1 on the H200).
        At 0.008 (the small configs' regime, init_std**2 * H ~ 0.13) the token sets ~85-90% of
        the next token and the context the rest: predictable but not trivial, like text.
        """
        base = dict(vocab_size=128256, hidden_size=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                    head_dim=64, ffn_size=8192, max_position=8192, init_std=0.008)
        return cls(**{**base, **kw})

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------------------- attention metadata

# ---------------------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE from a precomputed [max_position, head_dim/2] table."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        # x [n, heads, D]; positions [n]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [n, 1, D/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, positions: Tensor, rope: Rotary):
        # heads unflattened before the split: a view of the contiguous projection, so torch
        # need not reason about the strides of a view of a column slice (which guards on the
        # batch being 1 or not, and gives bucket 1 a graph of its own under size-oblivious tracing)
        qkv = self.qkv_proj(x).view(x.shape[0], self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=1)
        return rope(q, positions), rope(k, positions), v               # [n, Hq | Hkv, D]

    def forward(self, x, positions, rope, batch: AttnPlan, k_cache, v_cache):
        q, k, v = self.qkv(x, positions, rope)
        store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        o = batch.attend(q, k_cache, v_cache)                         # [n, Hq, D]
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward_dense(self, x, positions, rope, mask=None):
        """Causal attention over x [B, T, H] without a cache (distillation, checks); `mask`
        [T, T] bool (True: attend) replaces the causal one."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x.reshape(B * T, -1), positions.reshape(-1), rope)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, batch, k_cache, v_cache):
        x = x + self.attn(self.input_norm(x), positions, rope, batch, k_cache, v_cache)
        return x + self.mlp(self.post_norm(x))

    def forward_dense(self, x, positions, rope, mask=None):
        x = x + self.attn.forward_dense(self.input_norm(x), positions, rope, mask)
        return x + self.mlp(self.post_norm(x))


def init_weights(module: nn.Module, std: float, generator: torch.Generator | None = None,
                 n_layers: int = 1):
    """Normal(0, std) for every matrix, std / sqrt(2 * n_layers) for the projections back into
    the residual stream (GPT-2's scaled init), ones for norms: a deterministic random model."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                s = std / (2 * n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down.weight")) \
                    else std
                p.copy_(torch.randn(p.shape, generator=generator) * s)


# ----------------------------------------------------------------------------------------- model

class LlamaModel(PagedForwards, nn.Module):
    """The target. `kv` is a KVCache with `.k[layer]`, `.v[layer]` of [n_slots, n_kv_heads, D]."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0, fused=None):
        """fused: a `padgraph.backends.triton.fused_decode.FusedDecodePolicy`: decode steps it
        takes (bf16 / fp16, up to its max_rows) run in the fused per-layer kernels and the fused
        norm + lm_head (`fused_tail`); so do the layers of EAGLE's tree verify of up to max_rows
        tokens (bs * k), attending through the tree kernel."""
        super().__init__()
        self.cfg, self.fused = cfg, fused
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        gen = torch.Generator().manual_seed(seed)
        init_weights(self, cfg.init_std, gen, cfg.n_layers)
        with torch.no_grad():  # a larger embedding keeps the residual stream token-dependent
            self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=gen))

    def _run(self, input_ids, positions, batch: AttnPlan, kv) -> Tensor:
        x = self.embed(input_ids)                                    # [n, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, batch, kv.k[i], kv.v[i])
        return self.norm(x)                                          # [n, H] final-normed

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def forward_decode(self, input_ids, positions, batch):
        """[bs] tokens → (logits [bs, V] fp32, hidden [bs, H]); with `fused` set, the steps the
        fused kernels take (`fused_decode.takes`) run in them, the others as before."""
        step = self._fused_step(input_ids, positions, batch, logits=True)
        if step is not None:
            return step.logits, step.hidden
        return super().forward_decode(input_ids, positions, batch)

    def forward_decode_greedy(self, input_ids, positions, batch):
        """[bs] tokens → (ids [bs] int64: `forward_decode`'s logits' argmax, gap [bs] fp32: their
        top-1 minus top-2, hidden [bs, H]): a greedy step. The fused step (with `fused` set)
        takes the argmax in its lm_head kernel and never writes the [bs, V] logits."""
        step = self._fused_step(input_ids, positions, batch, logits=False)
        if step is not None:
            return step.ids, step.gap, step.hidden
        logits, hidden = self.forward_decode(input_ids, positions, batch)
        top2 = logits.topk(2, dim=-1).values
        return logits.argmax(-1), top2[:, 0] - top2[:, 1], hidden

    def forward_verify_hidden(self, input_ids, positions, batch):
        """`forward_verify`'s hidden [bs*k, H] (greedy verification takes `greedy_ids` of it);
        with `fused` set, a verify of at most its max_rows tokens runs its layers in the fused
        kernels, attending through the tree kernel (`fused_decode.decode_hidden`: the rows are
        the tree's tokens, each at its own position and slot)."""
        hidden = self._fused_hidden(input_ids, positions, batch, self._tree_batch(batch))
        return hidden if hidden is not None else super().forward_verify_hidden(input_ids, positions, batch)

    def _fused_hidden(self, input_ids, positions, batch, plan):
        """`fused_decode.decode_hidden` with `plan`'s attention where `fused` is set and takes
        these rows, else None."""
        if self.fused is None:
            return None
        from padgraph.backends.triton import fused_decode
        if not fused_decode.takes(self, input_ids, batch.kv, self.fused):
            return None
        return fused_decode.decode_hidden(self, input_ids, positions, plan.out_cache_loc, batch.kv, plan.attend,
                                          policy=self.fused, impl=batch.impl)

    def _fused_step(self, input_ids, positions, batch, logits: bool):
        """`fused_tail.decode_step` where `fused` is set and takes the step, else None."""
        if self.fused is None:
            return None
        from padgraph.backends.triton import fused_decode, fused_tail
        if not fused_decode.takes(self, input_ids, batch.kv, self.fused):
            return None
        return fused_tail.decode_step(self, input_ids, positions, batch.out_cache_loc, batch.kv,
                                      self._decode_batch(batch).attend, logits=logits,
                                      policy=self.fused, impl=batch.impl)

    def greedy_ids(self, hidden: Tensor) -> Tensor:
        """argmax of `logits(hidden)`, taken on the lm_head's own output (bf16 on a GPU): the
        fp32 upcast in `logits` is exact and monotone, so the ids are the same (ties to the lower
        id either way), without writing [n, V] fp32 logits and reading twice the bytes back."""
        return self.lm_head(hidden).argmax(-1)

    def forward_dense(self, input_ids: Tensor, last_only: bool = False):
        """[B, T] → (logits [B, T, V], hidden [B, T, H]) with plain causal attention, no cache.

        last_only: logits of the last position only ([B, V]); the lm_head is most of a small
        model's FLOPs, so greedy generation without a cache should not pay it at every position.
        """
        return dense_forward(self, input_ids, last_only)
