"""The Llama-like target of `llama.py`, tensor-parallel over `world` ranks (Megatron layout).

Per layer, the fused qkv and gate_up projections are column-parallel (each rank holds its heads'
rows: `n_heads / world` query heads, `n_kv_heads / world` KV heads, `ffn_size / world` of the
MLP), o_proj and down are row-parallel (each rank's partial sum, then one all-reduce). The
embedding and lm_head are vocab-parallel: rank r holds vocab rows [r*V/W, (r+1)*V/W). The KV
cache is sharded by KV heads: each rank's `KVCache` holds its own `n_kv_heads / world` heads, and
every rank's `req_to_token` is the same map (the driver sends the same batch to every rank).

A rank's layer is `llama.py`'s `Attention` and `MLP` built at the shard's width (the local
config has `n_heads / W` heads and `ffn_size / W`), so the shapes and the attention kernels are
the single-GPU ones; only the two all-reduces per layer are new. Collectives go through a
`TPGroup` (torch.distributed on the given group: gloo on the CPU, NCCL on GPUs, where they are
captured into each bucket's graph like any kernel), and nothing here syncs with the host.

Logits, two ways: `forward_*` all-gather the vocab shards into full [n, V] logits (so
`padgraph.llm.bodies` run unchanged), and `decode_top2` is a distributed top-2: each rank's
local top-2, one all-gather of [n, 4] floats, the same combine on every rank (ties go to the
lower vocab index, as `argmax` on the full logits does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import rearrange
from torch import Tensor, nn

from ..batch import Batch
from ..kv import KVCache
from ..paged import AttnPlan, PagedForwards, decode_batch
from .llama import MLP, Attention, LlamaConfig, LlamaModel, RMSNorm, Rotary


# ------------------------------------------------------------------------------ collectives

@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group, and the two collectives the model uses.

    group: a torch.distributed process group (None = the default one); world 1 makes both
    collectives no-ops, so a TP model of one rank is the single-GPU model.
    """
    rank: int = 0
    world: int = 1
    group: object = None

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place (x is a fresh contiguous activation)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: Tensor) -> Tensor:
        """[n, ...] on every rank → [world * n, ...], rank-major."""
        if self.world == 1:
            return x
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=self.group)
        return out


# torch >= 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """The per-rank widths: heads, KV heads and ffn split `world` ways (each must divide)."""
    for name in ("n_heads", "n_kv_heads", "ffn_size", "vocab_size"):
        if getattr(cfg, name) % world:
            raise ValueError(f"tensor parallel over {world} ranks: {name} must be a multiple of "
                             f"{world}, got {getattr(cfg, name)} (KV heads are split, never "
                             f"replicated)")
    return cfg.replace(n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                       ffn_size=cfg.ffn_size // world, vocab_size=cfg.vocab_size // world)


# ---------------------------------------------------------------------------------- layers

class TPDecoderLayer(nn.Module):
    """`llama.DecoderLayer` with its attention and MLP at shard width and an all-reduce after
    each (o_proj and down are row-parallel: each rank returns a partial sum)."""

    def __init__(self, cfg: LlamaConfig, local: LlamaConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(local)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(local)

    def forward(self, x, positions, rope, batch: AttnPlan, k_cache, v_cache):
        # x [n, H] replicated; k_cache [n_slots, n_kv_heads / W, D] this rank's heads
        x = x + self.tp.all_reduce(self.attn(self.input_norm(x), positions, rope, batch,
                                             k_cache, v_cache))
        return x + self.tp.all_reduce(self.mlp(self.post_norm(x)))


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, lo + V/W) of the embedding; other ids give 0 here and their row elsewhere."""

    def __init__(self, local: LlamaConfig, tp: TPGroup):
        super().__init__()
        self.tp, self.lo, self.n = tp, tp.rank * local.vocab_size, local.vocab_size
        self.weight = nn.Parameter(torch.empty(local.vocab_size, local.hidden_size))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.lo                                        # [n]
        mine = (local >= 0) & (local < self.n)
        x = self.weight[local.clamp(0, self.n - 1)]                  # [n, H]
        return self.tp.all_reduce(x.masked_fill(~mine[:, None], 0))  # one shard is nonzero: exact


# ----------------------------------------------------------------------------------- model

class LlamaTP(PagedForwards, nn.Module):
    """One rank of the tensor-parallel target; `shard(full, tp)` builds it from a LlamaModel.

    Same protocol as LlamaModel (`forward_decode / forward_extend / forward_verify` return
    `(logits [n, V] fp32, hidden [n, H])`, `kv.k[i]` / `kv.v[i]` per layer), plus `new_cache`
    (this rank's KV heads) and `decode_top2`.
    """

    def __init__(self, cfg: LlamaConfig, tp: TPGroup):
        super().__init__()
        self.cfg, self.tp, self.local = cfg, tp, shard_config(cfg, tp.world)
        self.embed = VocabParallelEmbedding(self.local, tp)
        self.layers = nn.ModuleList(TPDecoderLayer(cfg, self.local, tp)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, self.local.vocab_size, bias=False)
        self.rope = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta)

    @classmethod
    def shard(cls, full: LlamaModel, tp: TPGroup) -> "LlamaTP":
        """This rank's slices of a single-GPU model's weights (same device and dtype)."""
        w = full.lm_head.weight
        model = cls(full.cfg, tp).to(w.device, w.dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(shard_tensor(name, full.get_parameter(name), full.cfg, tp))
        return model.eval()

    def new_cache(self, n_layers: int, n_slots: int, max_context: int, n_req_rows: int):
        """This rank's KV pools ([n_slots, n_kv_heads / W, D] per layer) and its req_to_token."""
        w = self.lm_head.weight
        return KVCache(n_layers, n_slots, self.local.n_kv_heads, self.cfg.head_dim, max_context,
                       n_req_rows, w.dtype, w.device)

    # ---- forward -------------------------------------------------------------------------
    def _run(self, input_ids, positions, batch: AttnPlan, kv) -> Tensor:
        x = self.embed(input_ids)                                    # [n, H] replicated
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, batch, kv.k[i], kv.v[i])
        return self.norm(x)

    def local_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()                          # [n, V / W] this shard

    def logits(self, hidden: Tensor) -> Tensor:
        """All-gathered full logits [n, V]: vocab shards side by side in rank order."""
        parts = self.tp.all_gather(self.local_logits(hidden))        # [W * n, V / W]
        return rearrange(parts, "(w n) v -> n (w v)", w=self.tp.world)

    def greedy_ids(self, hidden: Tensor) -> Tensor:
        """argmax of the full logits [n] (ties to the lower id) from the distributed top-2."""
        return self.top2(hidden)[1][:, 0]

    def top2(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Distributed top-2 of the full logits: (values [n, 2] fp32, token ids [n, 2] int64),
        equal to `logits(hidden).topk(2)` with ties to the lower id, without gathering [n, V]."""
        v, i = self.local_logits(hidden).topk(2, dim=-1)             # [n, 2] each, local ids
        i = i + self.tp.rank * self.local.vocab_size                 # global ids (exact in fp32)
        parts = self.tp.all_gather(torch.cat([v, i.float()], dim=-1))   # [W * n, 4]
        cand = rearrange(parts, "(w n) c -> n w c", w=self.tp.world)
        return combine_top2(cand[..., :2].flatten(1), cand[..., 2:].flatten(1).long())

    def decode_top2(self, input_ids, positions, batch: Batch):
        """[bs] tokens → (top-2 logits [bs, 2] fp32, their ids [bs, 2]): the decode step with
        one [bs, 4] all-gather at the head instead of [bs, V]."""
        return self.top2(self._run(input_ids, positions, decode_batch(batch), batch.kv))


def combine_top2(values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Top-2 over candidates (values, ids [n, c]) with ties to the lower id, as torch.argmax
    picks the first maximum: (values [n, 2], ids [n, 2])."""
    big = torch.iinfo(ids.dtype).max
    best = values.max(-1, keepdim=True).values                        # [n, 1]
    first = torch.where(values == best, ids, big).min(-1, keepdim=True).values
    rest = torch.where(ids == first, float("-inf"), values)          # drop the winner only
    second = rest.max(-1, keepdim=True).values
    second_id = torch.where(rest == second, ids, big).min(-1, keepdim=True).values
    return torch.cat([best, second], -1), torch.cat([first, second_id], -1)


# ---------------------------------------------------------------------------------- shards

def _rows(t: Tensor, tp: TPGroup) -> Tensor:
    """Rank's block of rows (dim 0) out of `world` equal blocks."""
    return t.chunk(tp.world, dim=0)[tp.rank]


def _cols(t: Tensor, tp: TPGroup) -> Tensor:
    return t.chunk(tp.world, dim=1)[tp.rank]


def shard_tensor(name: str, full: Tensor, cfg: LlamaConfig, tp: TPGroup) -> Tensor:
    """The slice of a LlamaModel parameter that rank `tp.rank` holds under the name `name`.

    qkv_proj [(Hq + 2 Hkv) D, H]: this rank's query heads, then its K heads, then its V heads
    (heads are contiguous blocks of D rows, so a row block is a head block). gate_up [2F, H]:
    its gate rows then its up rows. o_proj, down: column blocks (row-parallel). embed, lm_head:
    vocab rows. Norms: replicated.
    """
    if name.endswith("qkv_proj.weight"):
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = full.split((q_size, kv_size, kv_size), dim=0)
        return torch.cat([_rows(q, tp), _rows(k, tp), _rows(v, tp)])
    if name.endswith("gate_up.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_rows(gate, tp), _rows(up, tp)])
    if name.endswith(("o_proj.weight", "down.weight")):
        return _cols(full, tp)
    if name in ("embed.weight", "lm_head.weight"):
        return _rows(full, tp)
    return full                                                      # norms: every rank
