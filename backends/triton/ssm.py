"""Mamba2-style selective state updates over a slot-indexed state pool (hybrid models' SSM layers).

Each request owns one slot of `state [n_slots, n_heads, head_dim, d_state]`; slot 0 is the pool's
sink (`pg.State(sink=0)`), where padded lanes (slot input padded with 0) read and write. Per head h
(group g = h // (n_heads // n_groups)) and token t, with dt' = clamp(softplus(dt + dt_bias), lo, hi):

    state <- state * exp(dt' * A[h]) + dt' * x_t[:, None] * B_t[g][None, :]     # [head_dim, d_state]
    y_t    = state @ C_t[g] + D[h] * x_t          then  y_t *= silu(z_t)  when z is given

A is one value per head (Mamba2) or a row per head, A [n_heads, d_state] (Mamba1, as Jamba's
layers: a channel per head, head_dim 1), then exp(dt' * A[h, n]) decays state column n.

Two ops, each a Triton kernel with its torch reference beside it:

- `ssm_decode_update`: one token per request (decode). Grid (bs, n_heads, head_dim blocks); a
  program reads its lane's slot, updates its [BLOCK_P, d_state] tile in fp32 and writes it back
  in the state's dtype. No other slot is touched.
- `ssm_chunked_scan`: prefill over packed variable-length sequences (`cu_seqlens`). Grid (n_seq,
  n_heads, head_dim blocks); a program holds its tile of the state in registers and walks its
  sequence, either one token a step (`method="sequential"`, the default: the recurrence as
  written, O(length) dependent steps per program) or CHUNK_T tokens a step (`method="chunked"`:
  Mamba2's SSD form, three fp32 matmuls a chunk and one state update; not tuned). It starts
  from the slot's state when `has_initial_state` is true (a continued request) and from zeros
  otherwise: a new request in a reused slot never reads the previous occupant's leftovers (a
  masked load and a select, so leftover inf / nan cannot leak), and writes its final state back
  to the slot.

- `ssm_tree_update`: a speculative verify's tree of k nodes per request (EAGLE's tree, or MTP's
  chain: node 0 the root, every other node's parent an earlier node). Grid (bs, n_heads,
  head_dim blocks); a program walks its lane's k nodes in order: node 0 starts from the lane's
  slot, node j from its parent's state in the per-node pool `tree [n_slots * k, ...]` (row
  slot * k + j), and each node's state is written to its own row there. The slot itself is
  never written (the commit after verify copies the accepted node's state into it). One launch
  does what k `ssm_decode_update` calls and 2k row copies did.

Graph-safe: shapes fix the grid, the wrappers read no device value (slots, lengths and flags are
read by the kernels), so both can be captured in a CUDA graph and replayed with new data. Slots
must lie in [0, n_slots): they are not checked on the host (that would be a sync). Padded lanes of
a call all share the sink, so they race there; the sink's contents are unspecified and no real
lane reads them. Arithmetic is fp32 whatever the dtypes; y is returned in x's dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .kv import resolve_impl

NO_LIMIT = (0.0, math.inf)
DECODE_TILE = 4096   # fp32 state elements a decode program updates (a [32, 128] tile at d_state 128)
SCAN_TILE = 1024     # smaller for the scan: its programs walk whole sequences, so more of them run at once
CHUNK_T, CHUNK_P = 32, 32   # the chunked scan: tokens a step, head_dim rows a program
SCAN_METHODS = ("sequential", "chunked")


# ---- torch references ---------------------------------------------------------------------------
def _dt_of(dt, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    """dt [..., n_heads] -> the step each head takes, fp32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(dt_limit[0], dt_limit[1])


def _step(h, x, dt, A, B, C, D, z):
    """One token for a batch of rows: h [r, n_heads, head_dim, d_state] fp32 -> (h', y)."""
    n_heads = h.shape[1]
    Bh = B.float().repeat_interleave(n_heads // B.shape[1], dim=1)         # [r, n_heads, d_state]
    Ch = C.float().repeat_interleave(n_heads // C.shape[1], dim=1)
    a = A.float() if A.dim() == 2 else A.float()[:, None]                 # [n_heads, d_state or 1]
    decay = torch.exp(dt[..., None] * a)                                   # [r, n_heads, d_state or 1]
    h = h * decay[:, :, None, :] + (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    y = (h * Ch[:, :, None, :]).sum(-1)                                    # [r, n_heads, head_dim]
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    return h, y


def ssm_decode_update_reference(state, slot, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                                dt_softplus=True, dt_limit=NO_LIMIT) -> torch.Tensor:
    """Torch reference of `ssm_decode_update`: lanes in order, so of several lanes on one slot
    (padded lanes on the sink) the last one's write stays."""
    slot = slot.long()
    h, y = _step(state[slot].float(), x, _dt_of(dt, dt_bias, dt_softplus, dt_limit), A, B, C, D, z)
    state.index_copy_(0, slot, h.to(state.dtype))   # CPU: sequential, last duplicate wins
    return y.to(x.dtype)


def ssm_tree_update_reference(state, tree, slot, parents, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                              dt_softplus=True, dt_limit=NO_LIMIT) -> torch.Tensor:
    """Torch reference of `ssm_tree_update`: node after node, each a copy of its parent's state
    (the root: the lane's slot) into the node's row, then `ssm_decode_update_reference` there."""
    bs, k = parents.shape
    slot = slot.long()
    node = slot[None, :] * k + torch.arange(k, device=slot.device)[:, None]           # [k, bs]
    parent = slot[None, :] * k + parents.t().long().clamp(min=0)
    per = lambda t: None if t is None else t.view(bs, k, *t.shape[1:])                 # noqa: E731
    xs, dts, Bs, Cs, zs = per(x), per(dt), per(B), per(C), per(z)
    ys = []
    for j in range(k):
        tree.index_copy_(0, node[j], state[slot] if j == 0 else tree[parent[j]])
        ys.append(ssm_decode_update_reference(tree, node[j], xs[:, j], dts[:, j], A, Bs[:, j], Cs[:, j], D,
                                              None if zs is None else zs[:, j], dt_bias, dt_softplus, dt_limit))
    return torch.stack(ys, 1).flatten(0, 1)


def ssm_chunked_scan_reference(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D=None,
                               z=None, dt_bias=None, dt_softplus=True, dt_limit=NO_LIMIT) -> torch.Tensor:
    """Torch reference of `ssm_chunked_scan`: the recurrence token by token (no host sync: the
    token's sequence is found on the device; tokens past cu_seqlens[-1] use a scratch row)."""
    n_tok, n_seq = x.shape[0], slot.shape[0]
    seq_of = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(n_tok, device=x.device), right=True)
    start = torch.where(has_initial_state[:, None, None, None], state[slot.long()].float(), 0.0)
    h_all = torch.cat([start, start.new_zeros((1, *start.shape[1:]))])     # [n_seq + 1, n_heads, head_dim, d_state]
    dts = _dt_of(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.zeros_like(x)
    for t in range(n_tok):
        s, pick = seq_of[t:t + 1], slice(t, t + 1)
        h, y_t = _step(h_all.index_select(0, s), x[pick], dts[pick], A, B[pick], C[pick], D,
                       None if z is None else z[pick])
        h_all.index_copy_(0, s, h)
        y[pick] = torch.where((s < n_seq)[:, None, None], y_t, 0.0).to(y.dtype)
    state.index_copy_(0, slot.long(), h_all[:n_seq].to(state.dtype))
    return y


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _dt_step(dt, bias, lo, hi, DT_SOFTPLUS: tl.constexpr):
    dt = dt + bias
    if DT_SOFTPLUS:   # torch's softplus: the identity past 20
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
    return tl.minimum(tl.maximum(dt, lo), hi)


@triton.jit
def _a_of(A, h, offs_n, mask_n, d_state, A_PER_STATE: tl.constexpr):
    """A of head h: a scalar (Mamba2), or its row [1, BLOCK_N] of A [n_heads, d_state] (Mamba1)."""
    if A_PER_STATE:
        return tl.load(A + h * d_state + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    return tl.load(A + h).to(tl.float32)


@triton.jit
def _token(h, offs_p, offs_n, mask_p, mask_n, X, Z, Bp, Cp, dt, a, d_skip,
           HAS_Z: tl.constexpr):
    """One token on a [BLOCK_P, BLOCK_N] fp32 tile: returns (h', y [BLOCK_P])."""
    x = tl.load(X + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    b = tl.load(Bp + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    c = tl.load(Cp + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    h = h * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]     # a: a scalar, or [1, BLOCK_N]
    y = tl.sum(h * c[None, :], axis=1) + d_skip * x
    if HAS_Z:
        zv = tl.load(Z + offs_p, mask=mask_p, other=0.0).to(tl.float32)
        y = y * zv * tl.sigmoid(zv)
    return h, y


@triton.jit
def _lane_head(Slot, head_dim, d_state, heads_per_group, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """A decode or tree program's lane b, its slot, head h and its group g, its [BLOCK_P, BLOCK_N]
    tile's offsets and masks (grid: lanes, heads, head_dim blocks); padded lanes' slot is the sink, 0."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < head_dim, offs_n < d_state
    return (b, tl.load(Slot + b).to(tl.int64), h, h // heads_per_group, offs_p, offs_n, mask_p, mask_n,
            mask_p[:, None] & mask_n[None, :])


@triton.jit
def _head_params(A, Dskip, DtBias, h, offs_n, mask_n, d_state, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                 A_PER_STATE: tl.constexpr):
    """Head h's dt bias, D and A (fp32; 0 where absent)."""
    bias = tl.load(DtBias + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    d_skip = tl.load(Dskip + h).to(tl.float32) if HAS_D else 0.0
    return bias, d_skip, _a_of(A, h, offs_n, mask_n, d_state, A_PER_STATE)


@triton.jit
def _ssm_decode_kernel(
    State, Slot, X, Dt, A, B, C, Dskip, Z, DtBias, Y,
    s_st_slot, s_st_head, s_st_p, s_x_b, s_x_h, s_dt_b, s_b_b, s_b_g, s_c_b, s_c_g,
    s_z_b, s_z_h, s_y_b, s_y_h,
    head_dim, d_state, heads_per_group, dt_lo, dt_hi,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    A_PER_STATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, slot, h, g, offs_p, offs_n, mask_p, mask_n, mask = _lane_head(Slot, head_dim, d_state, heads_per_group,
                                                                     BLOCK_P, BLOCK_N)
    tile = State + slot * s_st_slot + h * s_st_head + offs_p[:, None] * s_st_p + offs_n[None, :]
    st = tl.load(tile, mask=mask, other=0.0).to(tl.float32)
    bias, d_skip, a = _head_params(A, Dskip, DtBias, h, offs_n, mask_n, d_state, HAS_D, HAS_DT_BIAS, A_PER_STATE)
    dt = _dt_step(tl.load(Dt + b * s_dt_b + h).to(tl.float32), bias, dt_lo, dt_hi, DT_SOFTPLUS)
    st, y = _token(st, offs_p, offs_n, mask_p, mask_n, X + b * s_x_b + h * s_x_h, Z + b * s_z_b + h * s_z_h,
                   B + b * s_b_b + g * s_b_g, C + b * s_c_b + g * s_c_g, dt, a, d_skip, HAS_Z)
    tl.store(tile, st.to(State.dtype.element_ty), mask=mask)
    tl.store(Y + b * s_y_b + h * s_y_h + offs_p, y.to(Y.dtype.element_ty), mask=mask_p)


@triton.jit
def _ssm_tree_kernel(
    State, Tree, Slot, Parents, X, Dt, A, B, C, Dskip, Z, DtBias, Y,
    s_st_slot, s_st_head, s_st_p, s_tr_node, s_tr_head, s_tr_p, s_par_b,
    s_x_b, s_x_h, s_dt_b, s_b_b, s_b_g, s_c_b, s_c_g, s_z_b, s_z_h, s_y_b, s_y_h,
    k, head_dim, d_state, heads_per_group, dt_lo, dt_hi,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    A_PER_STATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, slot, h, g, offs_p, offs_n, mask_p, mask_n, mask = _lane_head(Slot, head_dim, d_state, heads_per_group,
                                                                     BLOCK_P, BLOCK_N)
    tile = h * s_tr_head + offs_p[:, None] * s_tr_p + offs_n[None, :]   # a node's tile (padded lanes: the sink's)
    bias, d_skip, a = _head_params(A, Dskip, DtBias, h, offs_n, mask_n, d_state, HAS_D, HAS_DT_BIAS, A_PER_STATE)
    st = tl.load(State + slot * s_st_slot + h * s_st_head + offs_p[:, None] * s_st_p + offs_n[None, :],
                 mask=mask, other=0.0).to(tl.float32)
    for j in range(0, k):
        if j > 0:   # every store of the nodes before is visible to every thread of the program
            tl.debug_barrier()
            par = tl.maximum(tl.load(Parents + b * s_par_b + j).to(tl.int64), 0)
            st = tl.load(Tree + (slot * k + par) * s_tr_node + tile, mask=mask, other=0.0).to(tl.float32)
        n = b * k + j                                 # the node's row of x, dt, B, C, z and y
        dt = _dt_step(tl.load(Dt + n * s_dt_b + h).to(tl.float32), bias, dt_lo, dt_hi, DT_SOFTPLUS)
        st, y = _token(st, offs_p, offs_n, mask_p, mask_n, X + n * s_x_b + h * s_x_h, Z + n * s_z_b + h * s_z_h,
                       B + n * s_b_b + g * s_b_g, C + n * s_c_b + g * s_c_g, dt, a, d_skip, HAS_Z)
        tl.store(Tree + (slot * k + j) * s_tr_node + tile, st.to(Tree.dtype.element_ty), mask=mask)
        tl.store(Y + n * s_y_b + h * s_y_h + offs_p, y.to(Y.dtype.element_ty), mask=mask_p)


@triton.jit
def _ssm_scan_kernel(
    State, Slot, CuSeqlens, HasInit, X, Dt, A, B, C, Dskip, Z, DtBias, Y,
    s_st_slot, s_st_head, s_st_p, s_x_t, s_x_h, s_dt_t, s_b_t, s_b_g, s_c_t, s_c_g,
    s_z_t, s_z_h, s_y_t, s_y_h,
    head_dim, d_state, heads_per_group, dt_lo, dt_hi,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    A_PER_STATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p, mask_n = offs_p < head_dim, offs_n < d_state
    mask = mask_p[:, None] & mask_n[None, :]
    g = h // heads_per_group
    lo = tl.load(CuSeqlens + s).to(tl.int64)
    hi = tl.load(CuSeqlens + s + 1).to(tl.int64)
    slot = tl.load(Slot + s).to(tl.int64)
    tile = State + slot * s_st_slot + h * s_st_head + offs_p[:, None] * s_st_p + offs_n[None, :]
    # a new request never reads its slot: the load is masked off and the tile selected, not scaled
    from_slot = (tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.int32) + tl.load(HasInit + s).to(tl.int32)) != 0
    st = tl.load(tile, mask=mask & from_slot, other=0.0).to(tl.float32)
    st = tl.where(from_slot, st, 0.0)
    a = _a_of(A, h, offs_n, mask_n, d_state, A_PER_STATE)
    bias = tl.load(DtBias + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    d_skip = tl.load(Dskip + h).to(tl.float32) if HAS_D else 0.0
    for t in range(lo, hi):
        dt = _dt_step(tl.load(Dt + t * s_dt_t + h).to(tl.float32), bias, dt_lo, dt_hi, DT_SOFTPLUS)
        st, y = _token(st, offs_p, offs_n, mask_p, mask_n, X + t * s_x_t + h * s_x_h, Z + t * s_z_t + h * s_z_h,
                       B + t * s_b_t + g * s_b_g, C + t * s_c_t + g * s_c_g, dt, a, d_skip, HAS_Z)
        tl.store(Y + t * s_y_t + h * s_y_h + offs_p, y.to(Y.dtype.element_ty), mask=mask_p)
    tl.debug_barrier()   # every read of the slot is done before it is overwritten
    tl.store(tile, st.to(State.dtype.element_ty), mask=mask)


@triton.jit
def _ssm_chunk_kernel(
    State, Slot, CuSeqlens, HasInit, X, Dt, A, B, C, Dskip, Z, DtBias, Y,
    s_st_slot, s_st_head, s_st_p, s_x_t, s_x_h, s_dt_t, s_b_t, s_b_g, s_c_t, s_c_g,
    s_z_t, s_z_h, s_y_t, s_y_h,
    head_dim, d_state, heads_per_group, dt_lo, dt_hi,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    A_PER_STATE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The same recurrence, BLOCK_T tokens at a time in the SSD form: within a chunk, with
    cum[t] = sum_{s <= t} dt_s * A, y_t = sum_{s <= t} exp(cum[t] - cum[s]) dt_s (C_t . B_s) x_s
    + exp(cum[t]) C_t . h, and h <- exp(cum[-1]) h + sum_s exp(cum[-1] - cum[s]) dt_s x_s B_s^T."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mask_p, mask_n = offs_p < head_dim, offs_n < d_state
    mask = mask_p[:, None] & mask_n[None, :]
    g = h // heads_per_group
    lo = tl.load(CuSeqlens + s).to(tl.int64)
    hi = tl.load(CuSeqlens + s + 1).to(tl.int64)
    slot = tl.load(Slot + s).to(tl.int64)
    tile = State + slot * s_st_slot + h * s_st_head + offs_p[:, None] * s_st_p + offs_n[None, :]
    from_slot = (tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.int32) + tl.load(HasInit + s).to(tl.int32)) != 0
    st = tl.where(from_slot, tl.load(tile, mask=mask & from_slot, other=0.0).to(tl.float32), 0.0)   # [P, N]
    a = tl.load(A + h).to(tl.float32)
    bias = tl.load(DtBias + h).to(tl.float32) if HAS_DT_BIAS else 0.0
    d_skip = tl.load(Dskip + h).to(tl.float32) if HAS_D else 0.0
    causal = offs_t[:, None] >= offs_t[None, :]                                # [T (t), T (s)]
    for c0 in range(lo, hi, BLOCK_T):
        t = c0 + offs_t
        t_ok = t < hi
        dt = _dt_step(tl.load(Dt + t * s_dt_t + h, mask=t_ok, other=0.0).to(tl.float32), bias, dt_lo, dt_hi,
                      DT_SOFTPLUS)
        dt = tl.where(t_ok, dt, 0.0)                                           # tokens past hi: no step
        cum = tl.cumsum(dt * a, axis=0)                                        # [T], non-increasing
        xm, nm = t_ok[:, None] & mask_p[None, :], t_ok[:, None] & mask_n[None, :]      # [T, P], [T, N]
        x = tl.load(X + t[:, None] * s_x_t + h * s_x_h + offs_p[None, :], mask=xm, other=0.0).to(tl.float32)
        b = tl.load(B + t[:, None] * s_b_t + g * s_b_g + offs_n[None, :], mask=nm, other=0.0).to(tl.float32)
        c = tl.load(C + t[:, None] * s_c_t + g * s_c_g + offs_n[None, :], mask=nm, other=0.0).to(tl.float32)
        # exp of a masked -inf, never of a positive difference: no inf * 0 above the diagonal
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))          # [T, T]
        m = tl.dot(c, tl.trans(b), input_precision="ieee") * decay * dt[None, :]
        y = tl.dot(m, x, input_precision="ieee")                                          # [T, P]
        y += tl.exp(cum)[:, None] * tl.dot(c, tl.trans(st), input_precision="ieee") + d_skip * x
        if HAS_Z:
            zv = tl.load(Z + t[:, None] * s_z_t + h * s_z_h + offs_p[None, :], mask=xm, other=0.0).to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        tl.store(Y + t[:, None] * s_y_t + h * s_y_h + offs_p[None, :], y.to(Y.dtype.element_ty), mask=xm)
        last = tl.sum(tl.where(offs_t == BLOCK_T - 1, cum, 0.0), axis=0)     # cum at the chunk's end
        w = tl.exp(last - cum) * dt                                            # [T]
        st = st * tl.exp(last) + tl.dot(tl.trans(x * w[:, None]), b, input_precision="ieee")
    tl.debug_barrier()   # every read of the slot is done before it is overwritten
    tl.store(tile, st.to(State.dtype.element_ty), mask=mask)


# ---- wrappers: check, allocate, launch ---------------------------------------------------------
def _check(state, x, dt, A, B, C, D, z, dt_bias, per: str) -> None:
    """Shapes, dtypes and layouts the kernels assume; `per` names x's first dim ("bs" / "n_tok")."""
    if state.dim() != 4 or state.stride(-1) != 1:
        raise ValueError(f"state must be [n_slots, n_heads, head_dim, d_state] with d_state contiguous; "
                         f"got shape {tuple(state.shape)} strides {state.stride()}")
    _, n_heads, head_dim, d_state = state.shape
    n = x.shape[0]
    if tuple(A.shape) not in ((n_heads,), (n_heads, d_state)) or not A.is_contiguous():
        raise ValueError(f"A must be contiguous [n_heads={n_heads}] (Mamba2) or [n_heads, d_state={d_state}] "
                         f"(Mamba1: a channel per head, head_dim 1); got {tuple(A.shape)}")
    want = {"x": (x, (n, n_heads, head_dim)), "dt": (dt, (n, n_heads)),
            "D": (D, (n_heads,)), "z": (z, (n, n_heads, head_dim)), "dt_bias": (dt_bias, (n_heads,))}
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape} ({per}, n_heads, head_dim from state); got {tuple(t.shape)}")
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 3 or t.shape[0] != n or t.shape[2] != d_state or n_heads % t.shape[1]:
            raise ValueError(f"{name} must be [{per}={n}, n_groups, d_state={d_state}] with n_groups dividing "
                             f"n_heads={n_heads}; got {tuple(t.shape)}")
    if B.shape[1] != C.shape[1]:
        raise ValueError(f"B and C must have the same n_groups; got {B.shape[1]} and {C.shape[1]}")
    for name, t in (("x", x), ("B", B), ("C", C), ("z", z)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; strides {t.stride()}")


def _unit_stride(t):
    """t with a unit stride on its last dim (the kernels index dt's heads, D and dt_bias by the
    head alone): itself where it has one, else a contiguous copy; None as given."""
    if t is None or t.dim() == 0 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _check_index(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 1 or t.shape[0] != n or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be [{n}] int32/int64; got {tuple(t.shape)} {t.dtype}")


def _blocks(head_dim: int, d_state: int, tile: int) -> dict:
    """Whole d_state per program, head_dim split to keep ~`tile` fp32 state elements a program."""
    block_n = triton.next_power_of_2(d_state)
    return {"BLOCK_P": min(triton.next_power_of_2(head_dim), max(1, tile // block_n)), "BLOCK_N": block_n}


def _chunk_blocks(head_dim: int, d_state: int) -> dict:
    """The chunked scan's tiles: every dim of its dots at least 16 (tl.dot's smallest)."""
    return {"BLOCK_P": max(16, min(triton.next_power_of_2(head_dim), CHUNK_P)),
            "BLOCK_N": max(16, triton.next_power_of_2(d_state)), "BLOCK_T": CHUNK_T}


def _launch(kernel, grid, blocks, state, index_args, x, dt, A, B, C, D, z, dt_bias, y, dt_softplus, dt_limit):
    """The launch every op shares: optional tensors replaced by A or x (never read: their flag is off)."""
    _, n_heads, head_dim, d_state = state.shape
    zz = z if z is not None else x
    index_args = tuple(t.contiguous() for t in index_args)   # read at ptr + lane: no stride
    kernel[grid(blocks["BLOCK_P"])](
        state, *index_args, x, dt, A, B, C, D if D is not None else A, zz,
        dt_bias if dt_bias is not None else A, y,
        state.stride(0), state.stride(1), state.stride(2), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), zz.stride(0), zz.stride(1), y.stride(0), y.stride(1),
        head_dim, d_state, n_heads // B.shape[1], float(dt_limit[0]), float(dt_limit[1]),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        A_PER_STATE=A.dim() == 2,
        num_warps=4 if blocks["BLOCK_P"] * blocks["BLOCK_N"] >= 2048 else 2, **blocks,
    )


def ssm_decode_update(state, slot, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                      dt_limit=NO_LIMIT, impl: str = "auto") -> torch.Tensor:
    """One decode token per request: updates `state[slot[i]]` in place, returns y [bs, n_heads, head_dim].

    state [n_slots, n_heads, head_dim, d_state]; slot [bs] (padded lanes: the sink, 0);
    x, z [bs, n_heads, head_dim]; dt [bs, n_heads]; D, dt_bias [n_heads]; B, C [bs, n_groups, d_state];
    A [n_heads] (Mamba2) or [n_heads, d_state] (Mamba1, head_dim 1).
    """
    _check(state, x, dt, A, B, C, D, z, dt_bias, "bs")
    dt, D, dt_bias = _unit_stride(dt), _unit_stride(D), _unit_stride(dt_bias)
    _check_index("slot", slot, x.shape[0])
    if resolve_impl(impl, state, slot, x, dt, B, C) == "torch":
        return ssm_decode_update_reference(state, slot, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    _, n_heads, head_dim, d_state = state.shape
    grid = lambda bp: (x.shape[0], n_heads, triton.cdiv(head_dim, bp))   # noqa: E731
    _launch(_ssm_decode_kernel, grid, _blocks(head_dim, d_state, DECODE_TILE), state, (slot,), x, dt, A, B, C, D, z,
            dt_bias, y, dt_softplus, dt_limit)
    return y


def ssm_tree_update(state, tree, slot, parents, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=NO_LIMIT, impl: str = "auto") -> torch.Tensor:
    """A verify's tree of k nodes per request: returns y [bs * k, n_heads, head_dim] (row b * k + j:
    lane b's node j) and leaves node j's state at `tree[slot[b] * k + j]`; `state` is only read.

    state [n_slots, n_heads, head_dim, d_state]; tree [n_slots * k, n_heads, head_dim, d_state] of
    state's dtype (a per-node pool `[n_slots, k, ...]` flattened); slot [bs] (padded lanes: the
    sink, 0); parents [bs, k]: node j's parent, an earlier node (node 0, the root, -1; a negative
    parent counts as node 0); x, z [bs * k, n_heads, head_dim]; dt [bs * k, n_heads]; B, C
    [bs * k, n_groups, d_state]; A, D, dt_bias as `ssm_decode_update`.
    """
    _check(state, x, dt, A, B, C, D, z, dt_bias, "bs * k")
    dt, D, dt_bias = _unit_stride(dt), _unit_stride(D), _unit_stride(dt_bias)
    bs, k = _check_tree(state, tree, slot, parents, x.shape[0])
    if resolve_impl(impl, state, tree, slot, parents, x, dt, B, C) == "torch":
        return ssm_tree_update_reference(state, tree, slot, parents, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                         dt_limit)
    y = torch.empty_like(x)
    if bs == 0 or k == 0:
        return y
    _, n_heads, head_dim, d_state = state.shape
    blocks = _blocks(head_dim, d_state, DECODE_TILE)
    zz = z if z is not None else x
    parents = parents.contiguous()
    _ssm_tree_kernel[(bs, n_heads, triton.cdiv(head_dim, blocks["BLOCK_P"]))](
        state, tree, slot.contiguous(), parents, x, dt, A, B, C, D if D is not None else A, zz,
        dt_bias if dt_bias is not None else A, y,
        state.stride(0), state.stride(1), state.stride(2), tree.stride(0), tree.stride(1), tree.stride(2),
        parents.stride(0), x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
        C.stride(1), zz.stride(0), zz.stride(1), y.stride(0), y.stride(1),
        k, head_dim, d_state, n_heads // B.shape[1], float(dt_limit[0]), float(dt_limit[1]),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus),
        A_PER_STATE=A.dim() == 2,
        num_warps=4 if blocks["BLOCK_P"] * blocks["BLOCK_N"] >= 2048 else 2, **blocks,
    )
    return y


def _check_tree(state, tree, slot, parents, n_nodes: int) -> tuple[int, int]:
    """(bs, k) of a tree call; refuses a per-node pool that does not match the slot pool."""
    if parents.dim() != 2 or parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be [bs, k] int32/int64; got {tuple(parents.shape)} {parents.dtype}")
    bs, k = parents.shape
    _check_index("slot", slot, bs)
    if n_nodes != bs * k:
        raise ValueError(f"the per-node inputs must have bs * k = {bs * k} rows; got {n_nodes}")
    if (tree.dim() != state.dim() or tree.shape[0] != state.shape[0] * k or tree.shape[1:] != state.shape[1:]
            or tree.dtype != state.dtype or tree.stride(-1) != 1):
        raise ValueError(f"tree must be [n_slots * k = {state.shape[0] * k}, {', '.join(map(str, state.shape[1:]))}] "
                         f"{state.dtype} with its last dim contiguous (state {tuple(state.shape)} {state.dtype}, "
                         f"k = {k}); got {tuple(tree.shape)} {tree.dtype}")
    return bs, k


def ssm_chunked_scan(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D=None, z=None,
                     dt_bias=None, dt_softplus=True, dt_limit=NO_LIMIT, method: str = "sequential",
                     impl: str = "auto") -> torch.Tensor:
    """Prefill of packed sequences: sequence s is tokens [cu_seqlens[s], cu_seqlens[s+1]) and owns
    `state[slot[s]]`, read first when `has_initial_state[s]` (else zeros) and overwritten with its
    final state. Returns y [n_tok, n_heads, head_dim]; tokens past cu_seqlens[-1] get y = 0.

    x, z [n_tok, n_heads, head_dim]; dt [n_tok, n_heads]; B, C [n_tok, n_groups, d_state];
    cu_seqlens [n_seq + 1] int32/int64 (non-decreasing; padded sequences are empty, slot 0).
    method: "sequential" (one token a step) or "chunked" (CHUNK_T tokens a step, as matmuls).
    """
    _check(state, x, dt, A, B, C, D, z, dt_bias, "n_tok")
    dt, D, dt_bias = _unit_stride(dt), _unit_stride(D), _unit_stride(dt_bias)
    n_seq = _check_packed(cu_seqlens, slot, has_initial_state)
    if method not in SCAN_METHODS:
        raise ValueError(f"method must be one of {SCAN_METHODS}; got {method!r}")
    if method == "chunked" and A.dim() == 2:
        raise ValueError(f"method='chunked' needs one A per head (Mamba2's SSD form); A is {tuple(A.shape)}: "
                         f"use method='sequential'")
    if resolve_impl(impl, state, slot, cu_seqlens, x, dt, B, C) == "torch":
        return ssm_chunked_scan_reference(state, slot, cu_seqlens, has_initial_state, x, dt, A, B, C, D, z,
                                          dt_bias, dt_softplus, dt_limit)
    y = torch.zeros_like(x)
    if n_seq == 0:
        return y
    _, n_heads, head_dim, d_state = state.shape
    grid = lambda bp: (n_seq, n_heads, triton.cdiv(head_dim, bp))   # noqa: E731
    kernel, blocks = ((_ssm_chunk_kernel, _chunk_blocks(head_dim, d_state)) if method == "chunked"
                      else (_ssm_scan_kernel, _blocks(head_dim, d_state, SCAN_TILE)))
    index_args = (slot, cu_seqlens, has_initial_state.view(torch.int8))
    _launch(kernel, grid, blocks, state, index_args, x, dt, A, B, C, D, z, dt_bias, y, dt_softplus, dt_limit)
    return y


def _check_packed(cu_seqlens, slot, has_initial_state) -> int:
    """cu_seqlens [n_seq + 1], slot [n_seq], has_initial_state [n_seq] bool: returns n_seq."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be [n_seq + 1]; got {tuple(cu_seqlens.shape)}")
    n_seq = cu_seqlens.shape[0] - 1
    _check_index("cu_seqlens", cu_seqlens, n_seq + 1)
    _check_index("slot", slot, n_seq)
    if has_initial_state.shape != (n_seq,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"has_initial_state must be [{n_seq}] bool; got {tuple(has_initial_state.shape)} "
                         f"{has_initial_state.dtype}")
    return n_seq
