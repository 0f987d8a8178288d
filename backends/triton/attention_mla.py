"""MLA (multi-head latent attention, DeepSeek-V2/V3) over a paged latent KV cache; torch
references beside it.

Cache: one "KV head" per slot, `latent_cache [n_slots, 1, kv_lora_rank + rope_dim]`: the
compressed KV `c_kv` (first kv_lora_rank columns), then the decoupled rope key. `req_to_token`,
slot 0, row 0 and the padded-lane fills are those of `kv.py` (padded lanes: seq_lens 1, row 0).

Absorbed form (what the kernels run): the caller folds W_UK into the query, `q_latent =
[q_nope @ W_UK, q_rope]`, and applies W_UV after, `out = o_latent @ W_UV`. Attention is then MQA
with keys = the whole latent row and values = its first kv_lora_rank columns. Decode, tree
verify and extend all run the dedicated kernel of `attention_mla_decode.py` (512 + 64 column
tiles, each latent tile loaded once for both products and for all heads of a row block); under
`torch.compile` the three are opaque custom ops (`compile_ops.py`).

The reference (`mla_reference`) is the non-absorbed formulation: up-project the latent cache into
per-head K = [c_kv @ W_UK^T, k_rope] and V = c_kv @ W_UV and run plain multi-head attention.
"""
from __future__ import annotations

import torch

from .attention_decode import (acc_dtype, check_paged_args, check_tree_args,
                               decode_attention_reference)
from .attention_extend import extend_attention_reference
from .attention_meta import PagedMeta, check_qo_indptr
from .attention_mla_decode import MlaPolicy, mla_paged_attention
from .attention_verify import tree_verify_attention_reference
from .compile_ops import opaque_under_compile
from .kv import resolve_impl
from .store import store_kv


# ----------------------------------------------------------------------------- reference

def mla_sm_scale(qk_nope_head_dim: int, qk_rope_head_dim: int) -> float:
    """Softmax scale of MLA: 1/sqrt of the per-head q.k width (nope + rope), not of the latent."""
    return (qk_nope_head_dim + qk_rope_head_dim) ** -0.5


def up_project(latent, W_UK, W_UV):
    """Per-head K and V of latent rows: latent [n, 1, r + rope] -> (k [n, H, nope + rope],
    v [n, H, v_head_dim]); W_UK [H, nope, r], W_UV [H, r, v_head_dim]. In fp32 (fp64 for fp64)."""
    acc = acc_dtype(latent.dtype)
    n_heads, _, kv_lora_rank = W_UK.shape
    c_kv = latent[:, 0, :kv_lora_rank].to(acc)  # [n, r]
    k_rope = latent[:, :, kv_lora_rank:].to(acc).expand(-1, n_heads, -1)  # [n, H, rope]
    k_nope = torch.einsum("nc,hdc->nhd", c_kv, W_UK.to(acc))  # [n, H, nope]
    v = torch.einsum("nc,hcv->nhv", c_kv, W_UV.to(acc))  # [n, H, v_head_dim]
    return torch.cat([k_nope, k_rope], dim=-1), v


def mla_reference(q_nope, q_rope, latent_cache, W_UK, W_UV, req_to_token, req_pool_indices,
                  seq_lens, sm_scale, qo_indptr=None, tree_mask=None):
    """Non-absorbed MLA: q_nope [n, H, nope], q_rope [n, H, rope] -> [n, H, v_head_dim].

    Decode by default (n = bs); causal extend with `qo_indptr [bs+1]`; draft-tree verify with
    `tree_mask [bs, k, k]` (n = bs * k). The whole cache is up-projected: a test oracle only.
    """
    k_cache, v_cache = up_project(latent_cache, W_UK, W_UV)  # [n_slots, H, ..]
    q = torch.cat([q_nope, q_rope], dim=-1).to(k_cache.dtype)  # [n, H, nope + rope]
    paged = (k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    if qo_indptr is not None:
        o = extend_attention_reference(q, *paged, qo_indptr, sm_scale)
    elif tree_mask is not None:
        o = tree_verify_attention_reference(q, *paged, tree_mask, sm_scale)
    else:
        o = decode_attention_reference(q, *paged, sm_scale)
    return o.to(q_nope.dtype)


def absorb_query(q_nope, q_rope, W_UK):
    """q_latent = [q_nope @ W_UK, q_rope]: [n, H, nope], [n, H, rope], W_UK [H, nope, r]
    -> [n, H, r + rope] in q_nope's dtype.

    One batched GEMM over the heads in the operands' own dtype: bf16 / fp16 products accumulate
    in fp32 inside the GEMM and are rounded once, as an fp32 product rounded to bf16 would be,
    without upcasting W_UK and the queries on every call (on the H200 the fp32 form ran as
    SIMT sgemm kernels). fp32 and fp64 stay in their own precision."""
    q_c = torch.bmm(q_nope.transpose(0, 1), W_UK.to(q_nope.dtype)).transpose(0, 1)  # [n, H, r]
    return torch.cat([q_c, q_rope.to(q_nope.dtype)], dim=-1)


def project_output(o_latent, W_UV):
    """out = o_latent @ W_UV: [n, H, r], W_UV [H, r, v_head_dim] -> [n, H, v_head_dim], one
    batched GEMM over the heads in o_latent's dtype (fp32 accumulation for bf16 / fp16)."""
    return torch.bmm(o_latent.transpose(0, 1), W_UV.to(o_latent.dtype)).transpose(0, 1)


# ----------------------------------------------------------------------------- host side

def check_latent_args(q_latent, latent_cache, kv_lora_rank: int) -> None:
    """latent_cache [n_slots, 1, r + rope] and q_latent [n, H, r + rope], 0 < r < width."""
    if latent_cache.dim() != 3 or latent_cache.shape[1] != 1:
        raise ValueError(f"latent_cache must be [n_slots, 1, kv_lora_rank + rope_dim] (one "
                         f"latent head); got {tuple(latent_cache.shape)}")
    width = latent_cache.shape[2]
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank must be in 1 .. {width - 1} (the latent row is "
                         f"kv_lora_rank + rope_dim = {width} wide); got {kv_lora_rank}")
    if q_latent.dim() != 3 or q_latent.shape[2] != width:
        raise ValueError(f"q_latent must be [n, n_heads, {width}] (absorbed q_nope @ W_UK, then "
                         f"q_rope); got {tuple(q_latent.shape)}")


def latent_kv(latent_cache, kv_lora_rank: int):
    """(K, V) views of the latent cache for the torch paths: K [n_slots, 1, r + rope] (the cache),
    V [n_slots, 1, r] (its first r columns), no copy."""
    return latent_cache, latent_cache[:, :, :kv_lora_rank]


@opaque_under_compile
def mla_decode_attention(q_latent, latent_cache, req_to_token, req_pool_indices, seq_lens,
                         kv_lora_rank, sm_scale, num_splits=None, impl="auto"):
    """Absorbed MLA decode: q_latent [bs, n_heads, r + rope] -> o_latent [bs, n_heads, r].

    MQA over the latent cache (keys: whole rows; values: first r columns) with the dedicated
    MLA kernel. `sm_scale` is required (see `mla_sm_scale`); padded lanes read slot 0 only.
    """
    check_latent_args(q_latent, latent_cache, kv_lora_rank)
    k_cache, v_cache = latent_kv(latent_cache, kv_lora_rank)
    bs = q_latent.shape[0]
    check_paged_args(q_latent, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    if resolve_impl(impl, q_latent, latent_cache, req_to_token, req_pool_indices,
                    seq_lens) == "torch":
        return decode_attention_reference(q_latent, k_cache, v_cache, req_to_token,
                                          req_pool_indices, seq_lens, sm_scale)
    meta = PagedMeta.decode(req_to_token, req_pool_indices, seq_lens)
    return mla_paged_attention(q_latent, latent_cache, meta, kv_lora_rank, sm_scale,
                               MlaPolicy(num_splits=num_splits))


@opaque_under_compile
def mla_tree_verify_attention(q_latent, latent_cache, req_to_token, req_pool_indices, seq_lens,
                              tree_mask, kv_lora_rank, sm_scale, num_splits=None, impl="auto"):
    """Absorbed MLA draft-tree verify: q_latent [bs * k, n_heads, r + rope] (request-major),
    tree_mask [bs, k, k] bool -> o_latent [bs * k, n_heads, r]. Semantics: `attention_verify`."""
    check_latent_args(q_latent, latent_cache, kv_lora_rank)
    bs, _ = check_tree_args(q_latent, tree_mask, "q_latent")
    k_cache, v_cache = latent_kv(latent_cache, kv_lora_rank)
    check_paged_args(q_latent, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    if resolve_impl(impl, q_latent, latent_cache, req_to_token, req_pool_indices, seq_lens,
                    tree_mask) == "torch":
        return tree_verify_attention_reference(q_latent, k_cache, v_cache, req_to_token,
                                               req_pool_indices, seq_lens, tree_mask, sm_scale)
    meta = PagedMeta.tree(req_to_token, req_pool_indices, seq_lens, tree_mask.contiguous())
    return mla_paged_attention(q_latent, latent_cache, meta, kv_lora_rank, sm_scale,
                               MlaPolicy(num_splits=num_splits))


@opaque_under_compile
def mla_extend_attention(q_latent, latent_cache, req_to_token, req_pool_indices, seq_lens,
                         qo_indptr, kv_lora_rank, sm_scale, impl="auto"):
    """Absorbed MLA causal extend: q_latent [n_tok, n_heads, r + rope], qo_indptr [bs+1] ->
    o_latent [n_tok, n_heads, r] (padding tokens give 0). Semantics: `attention_extend`."""
    check_latent_args(q_latent, latent_cache, kv_lora_rank)
    bs = req_pool_indices.shape[0]
    check_qo_indptr(qo_indptr, bs)
    k_cache, v_cache = latent_kv(latent_cache, kv_lora_rank)
    check_paged_args(q_latent, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, bs)
    if resolve_impl(impl, q_latent, latent_cache, req_to_token, req_pool_indices, seq_lens,
                    qo_indptr) == "torch":
        return extend_attention_reference(q_latent, k_cache, v_cache, req_to_token,
                                          req_pool_indices, seq_lens, qo_indptr, sm_scale)
    meta = PagedMeta.causal(req_to_token, req_pool_indices, seq_lens, qo_indptr)
    return mla_paged_attention(q_latent, latent_cache, meta, kv_lora_rank, sm_scale)


def store_latent(latent_cache, loc, c_kv, k_rope, impl: str = "auto") -> None:
    """Write c_kv [n_tok, r] and k_rope [n_tok, rope] into the latent rows `loc [n_tok]` (in
    place; padded lanes carry loc 0, the sink). `store_kv` over the two column views."""
    kv_lora_rank = c_kv.shape[-1]
    if c_kv.dim() != 2 or k_rope.dim() != 2 or latent_cache.dim() != 3 \
            or latent_cache.shape[1:] != (1, kv_lora_rank + k_rope.shape[-1]):
        raise ValueError(f"c_kv [n_tok, r] and k_rope [n_tok, rope] must fill latent_cache "
                         f"[n_slots, 1, r + rope]; got {tuple(c_kv.shape)}, "
                         f"{tuple(k_rope.shape)}, {tuple(latent_cache.shape)}")
    store_kv(latent_cache[:, :, :kv_lora_rank], latent_cache[:, :, kv_lora_rank:], loc,
             c_kv[:, None], k_rope[:, None], impl=impl)
