"""Scatter the new tokens' K and V into the paged cache: `k_cache[loc] = k`, `v_cache[loc] = v`.

Padded lanes carry `loc = 0` and so write into the sink slot 0, which no real lane reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv import resolve_impl


def store_kv_reference(k_cache, v_cache, loc, k, v) -> None:
    """Torch reference (and CPU path): index_copy of k/v rows into their slots."""
    loc = loc.long()
    k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
    v_cache.index_copy_(0, loc, v.to(v_cache.dtype))


@triton.jit
def _store_kv_kernel(
    KCache, VCache, Loc, K, V,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    n_kv_heads, head_dim, v_head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # one program per token: copy its [n_kv_heads, head_dim] K row and V row to its slot
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_ok = offs_h < n_kv_heads

    mask_k = h_ok[:, None] & (offs_d < head_dim)[None, :]
    k = tl.load(K + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask_k)
    tl.store(KCache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(KCache.dtype.element_ty), mask=mask_k)

    mask_v = h_ok[:, None] & (offs_dv < v_head_dim)[None, :]
    v = tl.load(V + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_dv[None, :], mask=mask_v)
    tl.store(VCache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_dv[None, :],
             v.to(VCache.dtype.element_ty), mask=mask_v)


def _check_store_args(k_cache, v_cache, loc, k, v) -> None:
    if loc.dim() != 1 or loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"loc must be [n_tok] int32/int64; got {tuple(loc.shape)} {loc.dtype}")
    n_tok = loc.shape[0]
    want_k = (n_tok, *k_cache.shape[1:])
    want_v = (n_tok, *v_cache.shape[1:])
    if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
        raise ValueError(f"k/v must be {want_k}/{want_v} (n_tok from loc, heads and dims from "
                         f"the caches); got {tuple(k.shape)}/{tuple(v.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; strides {t.stride()}")


def store_kv(k_cache, v_cache, loc, k, v, impl: str = "auto") -> None:
    """Write `k [n_tok, n_kv_heads, head_dim]` / `v` into the slots `loc [n_tok]` (in place)."""
    _check_store_args(k_cache, v_cache, loc, k, v)
    if (resolve_impl(impl, k_cache, v_cache, loc, k, v) == "torch" or k_cache.dim() != 3
            or v_cache.dim() != 3):     # the kernel takes [slots, heads, dim] caches
        store_kv_reference(k_cache, v_cache, loc, k, v)
        return
    n_tok, n_kv_heads, head_dim = k.shape
    v_head_dim = v.shape[2]
    if n_tok == 0:
        return
    _store_kv_kernel[(n_tok,)](
        k_cache, v_cache, loc.contiguous(), k, v,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        n_kv_heads, head_dim, v_head_dim,
        BLOCK_H=triton.next_power_of_2(n_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_head_dim),
        num_warps=4 if n_kv_heads * max(head_dim, v_head_dim) >= 2048 else 2,
    )
