"""Causal depthwise conv1d over a slot-indexed window pool (Mamba's conv, LFM2's short conv).

Each request owns one slot of `conv_state [n_slots, d, k - 1]`: its last k - 1 inputs, oldest
first (slot 0 is the pool's sink, where padded lanes read and write). With the window w and the
new input x_t of channel c:

    out_t[c] = sum_j weight[c, j] * [w, x_t][c, j] + bias[c]      (j < k; then silu when asked)
    w <- [w, x_t][c, 1:]

- `conv_state_update`: one token per request (decode). Grid (bs, d blocks): a program reads its
  lane's window, writes the output and the shifted window back. No other slot is touched.
- `conv_state_prefill`: packed variable-length sequences (`cu_seqlens`). Grid (n_seq, d blocks):
  a program walks its sequence BLOCK_T tokens at a time, each tap a gather from the packed input
  or, before the sequence's first token, from the slot's window when `has_initial_state` is true
  (zeros otherwise: a new request in a reused slot never reads the previous occupant's inputs),
  then writes the sequence's last k - 1 inputs (fewer tokens than that: the tail of the old
  window, or zeros, before them) into the slot.

- `conv_tree_update`: a speculative verify's tree of k nodes per request (node 0 the root, every
  other node's parent an earlier node). Grid (bs, d blocks): a program walks its lane's k nodes
  in order, node 0 from the lane's window, node j from its parent's window in the per-node pool
  `tree [n_slots * k, d, k_conv - 1]` (row slot * k + j), writing each node's output and its
  shifted window to the node's own row. The slot's window is only read. One launch does what k
  `conv_state_update` calls and 2k row copies did.

Graph-safe: shapes fix the grid, the wrappers read no device value. Slots must lie in
[0, n_slots) (not checked on the host: that would be a sync). Arithmetic in fp32; the output has
x's dtype and the window the state's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .kv import resolve_impl
from .ssm import _check_packed, _unit_stride

ACTIVATIONS = (None, "silu")


# ---- torch references ---------------------------------------------------------------------------
def _finish(out, bias, activation):
    if bias is not None:
        out = out + bias.float()
    return F.silu(out) if activation == "silu" else out


def conv_state_update_reference(conv_state, slot, x, weight, bias=None, activation=None) -> torch.Tensor:
    """Torch reference of `conv_state_update`: x [bs, d] -> out [bs, d]; windows shifted in place."""
    slot = slot.long()
    full = torch.cat([conv_state[slot].float(), x.float()[..., None]], dim=-1)    # [bs, d, k]
    out = _finish((full * weight.float()).sum(-1), bias, activation)
    conv_state.index_copy_(0, slot, full[..., 1:].to(conv_state.dtype))
    return out.to(x.dtype)


def conv_tree_update_reference(conv_state, tree, slot, parents, x, weight, bias=None, activation=None) -> torch.Tensor:
    """Torch reference of `conv_tree_update`: node after node, each a copy of its parent's window
    (the root: the lane's slot) into the node's row, then `conv_state_update_reference` there."""
    bs, k = parents.shape
    slot = slot.long()
    node = slot[None, :] * k + torch.arange(k, device=slot.device)[:, None]           # [k, bs]
    parent = slot[None, :] * k + parents.t().long().clamp(min=0)
    xs = x.view(bs, k, -1)
    outs = []
    for j in range(k):
        tree.index_copy_(0, node[j], conv_state[slot] if j == 0 else tree[parent[j]])
        outs.append(conv_state_update_reference(tree, node[j], xs[:, j], weight, bias, activation))
    return torch.stack(outs, 1).flatten(0, 1)


def _gather(x, window, from_slot, pos, start):
    """Inputs at packed positions `pos` of sequences starting at `start` (pos, start, from_slot of
    one shape [..]): x's rows from `start` on, the window's tail (or zeros) before it.
    x [n_tok, d], window [.., d, W] -> [.., d]."""
    n_w, d = window.shape[-1], window.shape[-2]
    rel = n_w + pos - start                                     # index into the window before the sequence
    xz = torch.cat([x.float(), x.new_zeros((1, d), dtype=torch.float32)])
    from_x = xz[pos.clamp(0, x.shape[0])]
    from_w = torch.gather(window.float(), -1, rel.clamp(0, n_w - 1)[..., None, None].expand(*rel.shape, d, 1))[..., 0]
    from_w = torch.where(((rel >= 0) & from_slot)[..., None], from_w, 0.0)
    return torch.where((pos >= start)[..., None], from_x, from_w)


def conv_state_prefill_reference(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias=None,
                                 activation=None) -> torch.Tensor:
    """Torch reference of `conv_state_prefill` (vectorised, no host sync)."""
    n_tok, n_seq, k = x.shape[0], slot.shape[0], weight.shape[1]
    if n_seq == 0:
        return torch.zeros_like(x)
    window, init = conv_state[slot.long()], has_initial_state                   # [n_seq, d, k - 1]
    t = torch.arange(n_tok, device=x.device)
    seq_of = torch.searchsorted(cu_seqlens[1:].long(), t, right=True).clamp(max=n_seq - 1)
    start = cu_seqlens[:-1].long()[seq_of]                                        # [n_tok]
    out = torch.zeros(n_tok, x.shape[1], device=x.device)
    for j in range(k):
        out += weight.float()[:, j] * _gather(x, window[seq_of], init[seq_of], t - (k - 1) + j, start)
    out = torch.where((t < cu_seqlens[-1].long())[:, None], _finish(out, bias, activation), 0.0)
    # the last k - 1 inputs of each sequence, oldest first
    shape = (n_seq, k - 1)
    pos = cu_seqlens[1:].long()[:, None] - (k - 1) + torch.arange(k - 1, device=x.device)
    last = _gather(x, window[:, None].expand(*shape, *window.shape[1:]), init[:, None].expand(shape), pos,
                   cu_seqlens[:-1].long()[:, None].expand(shape))               # [n_seq, k - 1, d]
    conv_state.index_copy_(0, slot.long(), last.transpose(1, 2).to(conv_state.dtype))
    return out.to(x.dtype)


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _conv_decode_kernel(
    State, Slot, X, W, Bias, Out,
    s_st_slot, s_st_d, s_st_w, s_x_b, s_w_d, s_w_k, s_o_b, d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, BLOCK_W)
    d_ok = offs_d < d
    slot = tl.load(Slot + b).to(tl.int64)                # padded lanes: the sink slot 0
    row = State + slot * s_st_slot + offs_d[:, None] * s_st_d
    x = tl.load(X + b * s_x_b + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    acc = tl.load(W + offs_d * s_w_d + (K - 1) * s_w_k, mask=d_ok, other=0.0).to(tl.float32) * x
    for j in tl.static_range(K - 1):
        w_j = tl.load(W + offs_d * s_w_d + j * s_w_k, mask=d_ok, other=0.0).to(tl.float32)
        w_old = tl.load(State + slot * s_st_slot + offs_d * s_st_d + j * s_st_w, mask=d_ok, other=0.0)
        acc += w_j * w_old.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Out + b * s_o_b + offs_d, acc.to(Out.dtype.element_ty), mask=d_ok)
    # the window moves one left and takes x at its end
    keep = d_ok[:, None] & (offs_w < K - 2)[None, :]
    shifted = tl.load(row + (offs_w[None, :] + 1) * s_st_w, mask=keep, other=0.0)
    new = tl.where((offs_w == K - 2)[None, :], x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()   # every read of the window is done before it is overwritten
    tl.store(row + offs_w[None, :] * s_st_w, new.to(State.dtype.element_ty),
             mask=d_ok[:, None] & (offs_w < K - 1)[None, :])


@triton.jit
def _conv_node(src, s_src_w, dst, s_dst_w, X, W, Bias, Out, offs_d, offs_w, d_ok, s_w_d, s_w_k,
               K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One tree node: the window at `src` (per channel, taps at s_src_w) and input x -> the output
    at Out and the shifted window at `dst` (`_conv_decode_kernel`'s arithmetic, one row into another)."""
    x = tl.load(X + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    acc = tl.load(W + offs_d * s_w_d + (K - 1) * s_w_k, mask=d_ok, other=0.0).to(tl.float32) * x
    for i in tl.static_range(K - 1):
        w_i = tl.load(W + offs_d * s_w_d + i * s_w_k, mask=d_ok, other=0.0).to(tl.float32)
        w_old = tl.load(src + i * s_src_w, mask=d_ok, other=0.0)
        acc += w_i * w_old.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Out + offs_d, acc.to(Out.dtype.element_ty), mask=d_ok)
    keep = d_ok[:, None] & (offs_w < K - 2)[None, :]
    shifted = tl.load(src[:, None] + (offs_w[None, :] + 1) * s_src_w, mask=keep, other=0.0)
    new = tl.where((offs_w == K - 2)[None, :], x[:, None].to(shifted.dtype), shifted)
    tl.store(dst[:, None] + offs_w[None, :] * s_dst_w, new.to(dst.dtype.element_ty),
             mask=d_ok[:, None] & (offs_w < K - 1)[None, :])


@triton.jit
def _conv_tree_kernel(
    State, Tree, Slot, Parents, X, W, Bias, Out,
    s_st_slot, s_st_d, s_st_w, s_tr_node, s_tr_d, s_tr_w, s_par_b, s_x_b, s_w_d, s_w_k, s_o_b, k, d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, BLOCK_W)
    d_ok = offs_d < d
    slot = tl.load(Slot + b).to(tl.int64)                # padded lanes: the sink slot 0 (and its nodes)
    node = Tree + slot * k * s_tr_node + offs_d * s_tr_d  # the lane's node 0 in the tree
    # node 0 from the slot's window
    _conv_node(State + slot * s_st_slot + offs_d * s_st_d, s_st_w, node, s_tr_w, X + b * k * s_x_b, W, Bias,
               Out + b * k * s_o_b, offs_d, offs_w, d_ok, s_w_d, s_w_k, K, HAS_BIAS, SILU)
    for j in range(1, k):
        tl.debug_barrier()   # every store of the nodes before is visible to every thread of the program
        par = tl.maximum(tl.load(Parents + b * s_par_b + j).to(tl.int64), 0)
        _conv_node(node + par * s_tr_node, s_tr_w, node + j * s_tr_node, s_tr_w, X + (b * k + j) * s_x_b, W,
                   Bias, Out + (b * k + j) * s_o_b, offs_d, offs_w, d_ok, s_w_d, s_w_k, K, HAS_BIAS, SILU)


@triton.jit
def _tap(X, row, pos, lo, hi, init, offs_d, d_ok, s_x_t, s_st_w, K: tl.constexpr):
    """Inputs at packed positions pos [R] of the sequence [lo, hi): [R, BLOCK_D] fp32. Before lo
    they come from the slot's window when `init` is set (never loaded otherwise), else 0; at or
    past hi, 0 (never loaded)."""
    in_x = (pos >= lo) & (pos < hi)
    w_idx = (K - 1) + pos - lo
    m = d_ok[None, :]
    v = tl.load(X + pos[:, None] * s_x_t + offs_d[None, :], mask=m & in_x[:, None], other=0.0).to(tl.float32)
    w_ok = (pos < lo) & (w_idx >= 0) & ((w_idx * 0 + init) != 0)
    old = tl.load(row + w_idx[:, None] * s_st_w, mask=m & w_ok[:, None], other=0.0)
    return tl.where(in_x[:, None], v, tl.where(w_ok[:, None], old.to(tl.float32), 0.0))


@triton.jit
def _conv_prefill_kernel(
    State, Slot, CuSeqlens, HasInit, X, W, Bias, Out,
    s_st_slot, s_st_d, s_st_w, s_x_t, s_w_d, s_w_k, s_o_t, d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    s = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    lo = tl.load(CuSeqlens + s).to(tl.int64)
    hi = tl.load(CuSeqlens + s + 1).to(tl.int64)
    slot = tl.load(Slot + s).to(tl.int64)
    row = State + slot * s_st_slot + offs_d[None, :] * s_st_d          # [1, BLOCK_D]: the slot's channels
    init = tl.load(HasInit + s).to(tl.int32)
    bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(Bias + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32) + bias[None, :]
        for j in tl.static_range(K):
            w_j = tl.load(W + offs_d * s_w_d + j * s_w_k, mask=d_ok, other=0.0).to(tl.float32)
            acc += w_j[None, :] * _tap(X, row, offs_t - (K - 1) + j, lo, hi, init, offs_d, d_ok, s_x_t, s_st_w, K)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        out_ok = (offs_t < hi)[:, None] & d_ok[None, :]
        tl.store(Out + offs_t[:, None] * s_o_t + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=out_ok)
    # the last k - 1 inputs, oldest first: [BLOCK_W, BLOCK_D]
    offs_w = tl.arange(0, BLOCK_W)
    last = _tap(X, row, hi - (K - 1) + offs_w, lo, hi, init, offs_d, d_ok, s_x_t, s_st_w, K)
    tl.debug_barrier()   # every read of the window is done before it is overwritten
    tl.store(row + offs_w[:, None] * s_st_w, last.to(State.dtype.element_ty),
             mask=(offs_w < K - 1)[:, None] & d_ok[None, :])


# ---- wrappers: check, allocate, launch ---------------------------------------------------------
def _check(conv_state, x, weight, bias, activation) -> None:
    if conv_state.dim() != 3 or conv_state.shape[2] < 1:
        raise ValueError(f"conv_state must be [n_slots, d, k - 1] with k >= 2; got {tuple(conv_state.shape)}")
    _, d, n_w = conv_state.shape
    if tuple(weight.shape) != (d, n_w + 1):
        raise ValueError(f"weight must be [d={d}, k={n_w + 1}] (d and k - 1 from conv_state; a Conv1d's "
                         f"[d, 1, k] weight squeezed); got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (d,):
        raise ValueError(f"bias must be [{d}]; got {tuple(bias.shape)}")
    if x.dim() != 2 or x.shape[1] != d or x.stride(1) != 1:
        raise ValueError(f"x must be [n, d={d}] with d contiguous; got shape {tuple(x.shape)} strides {x.stride()}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")


def _check_index(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 1 or t.shape[0] != n or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be [{n}] int32/int64; got {tuple(t.shape)} {t.dtype}")


def _common(conv_state, x, weight, bias, activation) -> dict:
    _, d, n_w = conv_state.shape
    return dict(K=n_w + 1, HAS_BIAS=bias is not None, SILU=activation == "silu",
                BLOCK_D=min(triton.next_power_of_2(d), 256), BLOCK_W=triton.next_power_of_2(n_w))


def conv_state_update(conv_state, slot, x, weight, bias=None, activation=None, impl: str = "auto") -> torch.Tensor:
    """One decode token per request: out [bs, d]; `conv_state[slot[i]]` shifted to take x[i].

    conv_state [n_slots, d, k - 1]; slot [bs] (padded lanes: the sink, 0); x [bs, d];
    weight [d, k]; bias [d]; activation None or "silu".
    """
    _check(conv_state, x, weight, bias, activation)
    bias = _unit_stride(bias)
    _check_index("slot", slot, x.shape[0])
    if resolve_impl(impl, conv_state, slot, x, weight) == "torch":
        return conv_state_update_reference(conv_state, slot, x, weight, bias, activation)
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    meta = _common(conv_state, x, weight, bias, activation)
    _conv_decode_kernel[(x.shape[0], triton.cdiv(x.shape[1], meta["BLOCK_D"]))](
        conv_state, slot.contiguous(), x, weight, bias if bias is not None else weight, out,   # slot: read at ptr + lane
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), x.stride(0),
        weight.stride(0), weight.stride(1), out.stride(0), x.shape[1], **meta)
    return out


def conv_tree_update(conv_state, tree, slot, parents, x, weight, bias=None, activation=None,
                     impl: str = "auto") -> torch.Tensor:
    """A verify's tree of k nodes per request: out [bs * k, d] (row b * k + j: lane b's node j); node
    j's window is left at `tree[slot[b] * k + j]`; `conv_state` is only read.

    conv_state [n_slots, d, k_conv - 1]; tree [n_slots * k, d, k_conv - 1] of conv_state's dtype (a
    per-node pool `[n_slots, k, ...]` flattened); slot [bs] (padded lanes: the sink, 0); parents
    [bs, k]: node j's parent, an earlier node (node 0, the root, -1; a negative parent counts as
    node 0); x [bs * k, d]; weight, bias, activation as `conv_state_update`.
    """
    from .ssm import _check_tree
    _check(conv_state, x, weight, bias, activation)
    bias = _unit_stride(bias)
    bs, k = _check_tree(conv_state, tree, slot, parents, x.shape[0])
    if resolve_impl(impl, conv_state, tree, slot, parents, x, weight) == "torch":
        return conv_tree_update_reference(conv_state, tree, slot, parents, x, weight, bias, activation)
    out = torch.empty_like(x)
    if bs == 0 or k == 0:
        return out
    meta = _common(conv_state, x, weight, bias, activation)
    parents = parents.contiguous()
    _conv_tree_kernel[(bs, triton.cdiv(x.shape[1], meta["BLOCK_D"]))](
        conv_state, tree, slot.contiguous(), parents, x, weight, bias if bias is not None else weight, out,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), tree.stride(0), tree.stride(1),
        tree.stride(2), parents.stride(0), x.stride(0), weight.stride(0), weight.stride(1), out.stride(0), k,
        x.shape[1], **meta)
    return out


def conv_state_prefill(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias=None, activation=None,
                       impl: str = "auto") -> torch.Tensor:
    """Packed sequences: sequence s is tokens [cu_seqlens[s], cu_seqlens[s+1]) of x [n_tok, d] and
    owns `conv_state[slot[s]]` (read first when `has_initial_state[s]`, else zeros; then its last
    k - 1 inputs). Returns out [n_tok, d]; tokens past cu_seqlens[-1] get 0."""
    _check(conv_state, x, weight, bias, activation)
    bias = _unit_stride(bias)
    n_seq = _check_packed(cu_seqlens, slot, has_initial_state)
    if resolve_impl(impl, conv_state, slot, cu_seqlens, x, weight) == "torch":
        return conv_state_prefill_reference(conv_state, slot, cu_seqlens, has_initial_state, x, weight, bias,
                                            activation)
    out = torch.zeros_like(x)
    if n_seq == 0:
        return out
    meta = _common(conv_state, x, weight, bias, activation)
    _conv_prefill_kernel[(n_seq, triton.cdiv(x.shape[1], meta["BLOCK_D"]))](
        conv_state, slot.contiguous(), cu_seqlens.contiguous(), has_initial_state.contiguous().view(torch.int8), x, weight,
        bias if bias is not None else weight, out,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), x.stride(0),
        weight.stride(0), weight.stride(1), out.stride(0), x.shape[1], BLOCK_T=16, **meta)
    return out
