"""The gated delta rule (Qwen3-Next's linear attention, "gated delta net") over a slot-indexed state pool.

Each request owns one slot of `state [n_slots, n_v_heads, dk, dv]` (the layout of transformers'
Qwen3-Next cache); slot 0 is the pool's sink (`pg.State(sink=0)`), where padded lanes (slot input
padded with 0) read and write. Value head h reads query/key head h // (n_v_heads // n_k_heads)
(grouped heads, as transformers' `repeat_interleave`). Per token, with q and k l2-normalised
(`x * rsqrt(sum x^2 + 1e-6)`, when `use_qk_l2norm`) and q scaled by `scale` (dk ** -0.5):

    S     <- S * exp(g)                              # g <= 0: the decay, in log space
    delta  = beta * (v - S^T k)                      # [dv]: the part of v the state does not predict
    S     <- S + k delta^T                           # [dk, dv]
    o      = S^T q                                   # [dv]

which is `torch_recurrent_gated_delta_rule` (and, chunked, `torch_chunk_gated_delta_rule`) of
transformers' modeling_qwen3_next. g and beta arrive computed (Qwen3-Next: g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b)), as in that function and FLA's kernels.

Two ops, each a Triton kernel with its torch reference beside it:

- `delta_rule_decode_update`: one token per request. Grid (bs, n_v_heads, dv blocks): a program
  reads its lane's slot, keeps the whole dk and a block of dv columns ([dk, BLOCK_V] in fp32;
  the columns of S are independent in the rule) and writes them back in the state's dtype.
- `delta_rule_prefill`: packed variable-length sequences (`cu_seqlens`). Grid (n_seq, n_v_heads,
  dv blocks); a program holds its state tile in registers and walks its sequence, one token a
  step (`method="sequential"`, the default: the recurrence as written, O(length) dependent
  steps) or CHUNK_T tokens a step (`method="chunked"`: the WY / UT form of the chunk function,
  the unit-lower-triangular system inverted by forward substitution in registers, then matmuls;
  not tuned). It starts from the slot when `has_initial_state` is true and from zeros otherwise
  (a masked load and a select: leftover inf / nan of a reused slot cannot leak), and writes its
  final state back to the slot.

Graph-safe: shapes fix the grid, the wrappers read no device value (slots, lengths and flags are
read by the kernels), so both can be captured in a CUDA graph and replayed with new data. Slots
must lie in [0, n_slots): not checked on the host (that would be a sync). Padded lanes of a call
share the sink and race there; its contents are unspecified and no real lane reads them.
Arithmetic is fp32 whatever the dtypes; o is returned in q's dtype (as transformers does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from padgraph.errors import ContractTypeError, ContractValueError, mismatch

from .kv import resolve_impl

L2NORM_EPS = 1e-6     # transformers' (and FLA's) l2norm epsilon
DECODE_TILE = 4096    # fp32 state elements a decode program updates ([128, 32] at dk 128)
SCAN_TILE = 2048      # smaller for the scan: its programs walk whole sequences, so more of them run at once
CHUNK_T, CHUNK_V = 16, 32   # the chunked prefill: tokens a step, dv columns a program
PREFILL_METHODS = ("sequential", "chunked")


# ---- torch references ---------------------------------------------------------------------------
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _qk_per_v_head(q, k, n_v_heads, use_qk_l2norm, scale):
    """q, k [r, n_k_heads, dk] -> fp32 [r, n_v_heads, dk]: normalised, grouped, q scaled."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    group = n_v_heads // k.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q * _scale_of(scale, q.shape[-1]), k


def _scale_of(scale, dk: int) -> float:
    return dk ** -0.5 if scale is None else float(scale)


def _step(S, q, k, v, g, beta):
    """One token for a batch of rows: S [r, n_v_heads, dk, dv] fp32; q, k [r, n_v_heads, dk] fp32
    (prepared); v [r, n_v_heads, dv]; g, beta [r, n_v_heads] -> (S', o [r, n_v_heads, dv])."""
    S = S * torch.exp(g.float())[..., None, None]
    kv = torch.einsum("rhkv,rhk->rhv", S, k)
    delta = (v.float() - kv) * beta.float()[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return S, torch.einsum("rhkv,rhk->rhv", S, q)


def delta_rule_decode_update_reference(state, slot, q, k, v, g, beta, use_qk_l2norm=True,
                                       scale=None) -> torch.Tensor:
    """Torch reference of `delta_rule_decode_update`: lanes in order, so of several lanes on one
    slot (padded lanes on the sink) the last one's write stays."""
    slot = slot.long()
    qh, kh = _qk_per_v_head(q, k, v.shape[1], use_qk_l2norm, scale)
    S, o = _step(state[slot].float(), qh, kh, v, g, beta)
    state.index_copy_(0, slot, S.to(state.dtype))   # CPU: sequential, last duplicate wins
    return o.to(q.dtype)


def delta_rule_prefill_reference(state, slot, cu_seqlens, has_initial_state, q, k, v, g, beta,
                                 use_qk_l2norm=True, scale=None) -> torch.Tensor:
    """Torch reference of `delta_rule_prefill`: the recurrence token by token (no host sync: the
    token's sequence is found on the device; tokens before cu_seqlens[0] or past cu_seqlens[-1]
    belong to no sequence: a scratch row, o = 0)."""
    n_tok, n_seq = v.shape[0], slot.shape[0]
    t_all = torch.arange(n_tok, device=v.device)
    seq_of = torch.searchsorted(cu_seqlens[1:].long(), t_all, right=True)
    seq_of = torch.where(t_all < cu_seqlens[0].long(), n_seq, seq_of)    # before cu_seqlens[0]: none
    # selected, not scaled: a reused slot's nan never reaches a new request
    start = torch.where(has_initial_state[:, None, None, None], state[slot.long()].float(), 0.0)
    S_all = torch.cat([start, start.new_zeros((1, *start.shape[1:]))])   # [n_seq + 1, n_v_heads, dk, dv]
    qh, kh = _qk_per_v_head(q, k, v.shape[1], use_qk_l2norm, scale)
    o = torch.zeros(v.shape, dtype=q.dtype, device=v.device)
    for t in range(n_tok):
        s, pick = seq_of[t:t + 1], slice(t, t + 1)
        S, o_t = _step(S_all.index_select(0, s), qh[pick], kh[pick], v[pick], g[pick], beta[pick])
        S_all.index_copy_(0, s, S)
        o[pick] = torch.where((s < n_seq)[:, None, None], o_t, 0.0).to(o.dtype)
    state.index_copy_(0, slot.long(), S_all[:n_seq].to(state.dtype))
    return o


# ---- kernels ------------------------------------------------------------------------------------
@triton.jit
def _load_qk(Ptr, offs_k, mask_k, scale, L2NORM: tl.constexpr):
    """One q or k row [BLOCK_K] in fp32, l2-normalised when asked, times `scale`."""
    x = tl.load(Ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)
    return x * scale


@triton.jit
def _token(S, q, k, v, g, beta):
    """One token on a [BLOCK_K, BLOCK_V] fp32 tile: returns (S', o [BLOCK_V])."""
    S = S * tl.exp(g)
    kv = tl.sum(S * k[:, None], axis=0)                    # [BLOCK_V]: S^T k
    S = S + k[:, None] * ((v - kv) * beta)[None, :]
    return S, tl.sum(S * q[:, None], axis=0)


@triton.jit
def _delta_decode_kernel(
    State, Slot, Q, K, V, G, Beta, O,
    s_st_slot, s_st_head, s_st_k, s_q_b, s_q_h, s_k_b, s_k_h, s_v_b, s_v_h, s_g_b, s_beta_b, s_o_b, s_o_h,
    dk, dv, v_per_k, scale,
    L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < dk, offs_v < dv
    mask = mask_k[:, None] & mask_v[None, :]
    hk = h // v_per_k
    slot = tl.load(Slot + b).to(tl.int64)            # padded lanes: the sink slot 0
    tile = State + slot * s_st_slot + h * s_st_head + offs_k[:, None] * s_st_k + offs_v[None, :]
    S = tl.load(tile, mask=mask, other=0.0).to(tl.float32)
    q = _load_qk(Q + b * s_q_b + hk * s_q_h, offs_k, mask_k, scale, L2NORM)
    k = _load_qk(K + b * s_k_b + hk * s_k_h, offs_k, mask_k, 1.0, L2NORM)
    v = tl.load(V + b * s_v_b + h * s_v_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    g = tl.load(G + b * s_g_b + h).to(tl.float32)
    beta = tl.load(Beta + b * s_beta_b + h).to(tl.float32)
    S, o = _token(S, q, k, v, g, beta)
    tl.store(tile, S.to(State.dtype.element_ty), mask=mask)
    tl.store(O + b * s_o_b + h * s_o_h + offs_v, o.to(O.dtype.element_ty), mask=mask_v)


@triton.jit
def _initial_tile(State, Slot, HasInit, s, h, offs_k, offs_v, mask, s_st_slot, s_st_head, s_st_k,
                  BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """(tile pointers, fp32 start) of sequence s: the slot's state, or zeros for a new request
    (the load masked off and the tile selected, never scaled: leftover nan cannot leak)."""
    slot = tl.load(Slot + s).to(tl.int64)
    tile = State + slot * s_st_slot + h * s_st_head + offs_k[:, None] * s_st_k + offs_v[None, :]
    from_slot = (tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.int32) + tl.load(HasInit + s).to(tl.int32)) != 0
    S = tl.load(tile, mask=mask & from_slot, other=0.0).to(tl.float32)
    return tile, tl.where(from_slot, S, 0.0)


@triton.jit
def _delta_scan_kernel(
    State, Slot, CuSeqlens, HasInit, Q, K, V, G, Beta, O,
    s_st_slot, s_st_head, s_st_k, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_g_t, s_beta_t, s_o_t, s_o_h,
    dk, dv, v_per_k, scale,
    L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < dk, offs_v < dv
    mask = mask_k[:, None] & mask_v[None, :]
    hk = h // v_per_k
    lo = tl.load(CuSeqlens + s).to(tl.int64)
    hi = tl.load(CuSeqlens + s + 1).to(tl.int64)
    tile, S = _initial_tile(State, Slot, HasInit, s, h, offs_k, offs_v, mask, s_st_slot, s_st_head, s_st_k,
                            BLOCK_K, BLOCK_V)
    for t in range(lo, hi):
        q = _load_qk(Q + t * s_q_t + hk * s_q_h, offs_k, mask_k, scale, L2NORM)
        k = _load_qk(K + t * s_k_t + hk * s_k_h, offs_k, mask_k, 1.0, L2NORM)
        v = tl.load(V + t * s_v_t + h * s_v_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        S, o = _token(S, q, k, v, tl.load(G + t * s_g_t + h).to(tl.float32),
                      tl.load(Beta + t * s_beta_t + h).to(tl.float32))
        tl.store(O + t * s_o_t + h * s_o_h + offs_v, o.to(O.dtype.element_ty), mask=mask_v)
    tl.debug_barrier()   # every read of the slot is done before it is overwritten
    tl.store(tile, S.to(State.dtype.element_ty), mask=mask)


@triton.jit
def _load_chunk_qk(Ptr, t, t_ok, offs_k, mask_k, s_t, scale, L2NORM: tl.constexpr):
    """Rows t of q or k [BLOCK_T, BLOCK_K] fp32 (zeros past the sequence), normalised, scaled."""
    m = t_ok[:, None] & mask_k[None, :]
    x = tl.load(Ptr + t[:, None] * s_t + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x * scale


@triton.jit
def _unit_lower_inverse(A, BLOCK_T: tl.constexpr):
    """(I + A)^-1 for A [T, T] strictly lower triangular, by forward substitution on rows:
    row i of the inverse is e_i - sum_{j < i} A[i, j] * (row j of the inverse)."""
    offs = tl.arange(0, BLOCK_T)
    eye = (offs[:, None] == offs[None, :]).to(tl.float32)
    inv = eye
    for i in range(1, BLOCK_T):
        a_i = tl.sum(tl.where(offs[:, None] == i, A, 0.0), axis=0)           # [T]: row i of A
        row = tl.sum(a_i[:, None] * inv, axis=0)                              # rows j < i are final
        inv = tl.where(offs[:, None] == i, eye - row[None, :], inv)
    return inv


@triton.jit
def _delta_chunk_kernel(
    State, Slot, CuSeqlens, HasInit, Q, K, V, G, Beta, O,
    s_st_slot, s_st_head, s_st_k, s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_g_t, s_beta_t, s_o_t, s_o_h,
    dk, dv, v_per_k, scale,
    L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The same recurrence, BLOCK_T tokens a step. With cum = cumsum(g) in the chunk and
    D[i, j] = exp(cum_i - cum_j) (j <= i), L = I + strictly_lower(beta_i k_i.k_j D[i, j]):
    U = L^-1 (beta v), W = L^-1 (beta exp(cum) k), v' = U - W S,
    o = exp(cum) q S + lower(q_i.k_j D[i, j]) v',  S <- exp(cum_T) S + (exp(cum_T - cum) k)^T v'."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_t = tl.arange(0, BLOCK_T)
    mask_k, mask_v = offs_k < dk, offs_v < dv
    mask = mask_k[:, None] & mask_v[None, :]
    hk = h // v_per_k
    lo = tl.load(CuSeqlens + s).to(tl.int64)
    hi = tl.load(CuSeqlens + s + 1).to(tl.int64)
    tile, S = _initial_tile(State, Slot, HasInit, s, h, offs_k, offs_v, mask, s_st_slot, s_st_head, s_st_k,
                            BLOCK_K, BLOCK_V)
    lower = offs_t[:, None] >= offs_t[None, :]
    for c0 in range(lo, hi, BLOCK_T):
        t = c0 + offs_t
        t_ok = t < hi                       # tokens past the sequence: k = v = beta = g = 0, no effect
        q = _load_chunk_qk(Q + hk * s_q_h, t, t_ok, offs_k, mask_k, s_q_t, scale, L2NORM)       # [T, K]
        k = _load_chunk_qk(K + hk * s_k_h, t, t_ok, offs_k, mask_k, s_k_t, 1.0, L2NORM)
        vm = t_ok[:, None] & mask_v[None, :]
        v = tl.load(V + t[:, None] * s_v_t + h * s_v_h + offs_v[None, :], mask=vm, other=0.0).to(tl.float32)
        g = tl.load(G + t * s_g_t + h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(Beta + t * s_beta_t + h, mask=t_ok, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)                                                # [T], non-increasing
        # exp of a masked -inf, never of a positive difference: no inf * 0 above the diagonal
        decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))          # [T, T]
        kk = tl.dot(k, tl.trans(k), input_precision="ieee")
        inv = _unit_lower_inverse(tl.where(offs_t[:, None] > offs_t[None, :], kk * decay * beta[:, None], 0.0),
                                  BLOCK_T)
        u = tl.dot(inv, v * beta[:, None], input_precision="ieee")                          # [T, V]
        w = tl.dot(inv, k * (beta * tl.exp(cum))[:, None], input_precision="ieee")          # [T, K]
        v_new = u - tl.dot(w, S, input_precision="ieee")
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.exp(cum)[:, None] * tl.dot(q, S, input_precision="ieee") + tl.dot(qk, v_new, input_precision="ieee")
        tl.store(O + t[:, None] * s_o_t + h * s_o_h + offs_v[None, :], o.to(O.dtype.element_ty), mask=vm)
        last = tl.sum(tl.where(offs_t == BLOCK_T - 1, cum, 0.0), axis=0)       # cum at the chunk's end
        k_end = k * tl.exp(last - cum)[:, None]
        S = S * tl.exp(last) + tl.dot(tl.trans(k_end), v_new, input_precision="ieee")
    tl.debug_barrier()   # every read of the slot is done before it is overwritten
    tl.store(tile, S.to(State.dtype.element_ty), mask=mask)


# ---- wrappers: check, allocate, launch ---------------------------------------------------------
def _fail(op: str, name: str, what: str, expected, got, error=ContractValueError):
    raise error(mismatch(op, name, what, expected, got))


def _check(op, state, q, k, v, g, beta, per: str) -> None:
    """Shapes, dtypes and layouts the kernels assume; `per` names the first dim ("bs" / "n_tok")."""
    if state.dim() != 4 or state.stride(-1) != 1:
        _fail(op, "state", "shape", "[n_slots, n_v_heads, dk, dv] with dv contiguous",
              f"shape {tuple(state.shape)} strides {state.stride()}")
    _, n_v_heads, dk, dv = state.shape
    n = v.shape[0] if v.dim() else 0
    n_k_heads = q.shape[1] if q.dim() == 3 else 0
    if n_k_heads == 0 or n_v_heads % n_k_heads:
        _fail(op, "q", "shape", f"[{per}, n_k_heads, dk={dk}] with n_k_heads dividing n_v_heads={n_v_heads}",
              tuple(q.shape))
    want = {"q": (q, (n, n_k_heads, dk)), "k": (k, (n, n_k_heads, dk)), "v": (v, (n, n_v_heads, dv)),
            "g": (g, (n, n_v_heads)), "beta": (beta, (n, n_v_heads))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            _fail(op, name, f"shape ({per}, heads, width; heads and widths from state)", shape, tuple(t.shape))
        if not t.dtype.is_floating_point:
            _fail(op, name, "dtype", "a floating dtype", t.dtype, ContractTypeError)
        if t.stride(-1) != 1:
            _fail(op, name, "layout", "contiguous in its last dim", f"strides {t.stride()}")
    if not state.dtype.is_floating_point:
        _fail(op, "state", "dtype", "a floating dtype", state.dtype, ContractTypeError)


def _check_index(op: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        _fail(op, name, "shape", f"[{n}]", tuple(t.shape))
    if t.dtype not in (torch.int32, torch.int64):
        _fail(op, name, "dtype", "int32 or int64", t.dtype, ContractTypeError)


def _check_packed(op, cu_seqlens, slot, has_initial_state) -> int:
    """cu_seqlens [n_seq + 1], slot [n_seq], has_initial_state [n_seq] bool: returns n_seq."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        _fail(op, "cu_seqlens", "shape", "[n_seq + 1]", tuple(cu_seqlens.shape))
    n_seq = cu_seqlens.shape[0] - 1
    _check_index(op, "cu_seqlens", cu_seqlens, n_seq + 1)
    _check_index(op, "slot", slot, n_seq)
    if tuple(has_initial_state.shape) != (n_seq,):
        _fail(op, "has_initial_state", "shape", f"[{n_seq}]", tuple(has_initial_state.shape))
    if has_initial_state.dtype != torch.bool:
        _fail(op, "has_initial_state", "dtype", "bool", has_initial_state.dtype, ContractTypeError)
    return n_seq


def _blocks(dk: int, dv: int, tile: int) -> dict:
    """Whole dk per program (S^T k sums over it), dv split to keep ~`tile` fp32 state elements."""
    block_k = triton.next_power_of_2(dk)
    return {"BLOCK_K": block_k, "BLOCK_V": min(triton.next_power_of_2(dv), max(1, tile // block_k))}


def _chunk_blocks(dk: int, dv: int) -> dict:
    """The chunked prefill's tiles: every dim of its dots at least 16 (tl.dot's smallest)."""
    return {"BLOCK_K": max(16, triton.next_power_of_2(dk)),
            "BLOCK_V": max(16, min(triton.next_power_of_2(dv), CHUNK_V)), "BLOCK_T": max(16, CHUNK_T)}


def _launch(kernel, n_rows, blocks, state, index_args, q, k, v, g, beta, o, use_qk_l2norm, scale):
    """The launch every op shares: grid (n_rows, n_v_heads, dv blocks)."""
    _, n_v_heads, dk, dv = state.shape
    grid = (n_rows, n_v_heads, triton.cdiv(dv, blocks["BLOCK_V"]))
    index_args = tuple(t.contiguous() for t in index_args)   # read at ptr + lane: no stride
    kernel[grid](
        state, *index_args, q, k, v, g, beta, o,
        state.stride(0), state.stride(1), state.stride(2), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
        dk, dv, n_v_heads // q.shape[1], _scale_of(scale, dk),
        L2NORM=bool(use_qk_l2norm), num_warps=4 if blocks["BLOCK_K"] * blocks["BLOCK_V"] >= 2048 else 2, **blocks,
    )


def delta_rule_decode_update(state, slot, q, k, v, g, beta, use_qk_l2norm: bool = True, scale: float | None = None,
                             impl: str = "auto") -> torch.Tensor:
    """One decode token per request: updates `state[slot[i]]` in place, returns o [bs, n_v_heads, dv].

    state [n_slots, n_v_heads, dk, dv]; slot [bs] (padded lanes: the sink, 0); q, k [bs, n_k_heads, dk]
    (n_k_heads divides n_v_heads); v [bs, n_v_heads, dv]; g (log decay), beta [bs, n_v_heads];
    scale defaults to dk ** -0.5. Every lane continues its slot's state: a new request enters
    through `delta_rule_prefill` (has_initial_state false), which never reads the slot.
    """
    op = "delta_rule_decode_update"
    _check(op, state, q, k, v, g, beta, "bs")
    _check_index(op, "slot", slot, v.shape[0])
    if resolve_impl(impl, state, slot, q, k, v, g, beta) == "torch":
        return delta_rule_decode_update_reference(state, slot, q, k, v, g, beta, use_qk_l2norm, scale)
    o = torch.empty(v.shape, dtype=q.dtype, device=v.device)
    if v.shape[0] == 0:
        return o
    _launch(_delta_decode_kernel, v.shape[0], _blocks(state.shape[2], state.shape[3], DECODE_TILE), state, (slot,),
            q, k, v, g, beta, o, use_qk_l2norm, scale)
    return o


# The chunked kernel differences cumulative log-decays; a token's g below this (exp(-88) is
# below fp32's smallest normal) is taken as this: the same decay to fp32's precision, and a
# g of -inf no longer turns the chunk's differences into NaN.
CHUNK_G_FLOOR = -88.0


def delta_rule_prefill(state, slot, cu_seqlens, has_initial_state, q, k, v, g, beta, use_qk_l2norm: bool = True,
                       scale: float | None = None, method: str = "sequential", impl: str = "auto") -> torch.Tensor:
    """Prefill of packed sequences: sequence s is tokens [cu_seqlens[s], cu_seqlens[s+1]) and owns
    `state[slot[s]]`, read first when `has_initial_state[s]` (else zeros) and overwritten with its
    final state. Returns o [n_tok, n_v_heads, dv]; tokens before cu_seqlens[0] or past
    cu_seqlens[-1] get o = 0.

    q, k [n_tok, n_k_heads, dk]; v [n_tok, n_v_heads, dv]; g, beta [n_tok, n_v_heads];
    cu_seqlens [n_seq + 1] int32/int64 (non-decreasing; padded sequences are empty, slot 0).
    method: "sequential" (one token a step) or "chunked" (CHUNK_T tokens a step, as matmuls).
    """
    op = "delta_rule_prefill"
    _check(op, state, q, k, v, g, beta, "n_tok")
    n_seq = _check_packed(op, cu_seqlens, slot, has_initial_state)
    if method not in PREFILL_METHODS:
        _fail(op, None, "method", f"one of {PREFILL_METHODS}", repr(method))
    if resolve_impl(impl, state, slot, cu_seqlens, q, k, v, g, beta) == "torch":
        return delta_rule_prefill_reference(state, slot, cu_seqlens, has_initial_state, q, k, v, g, beta,
                                            use_qk_l2norm, scale)
    o = torch.zeros(v.shape, dtype=q.dtype, device=v.device)
    if n_seq == 0:
        return o
    dk, dv = state.shape[2:]
    if method == "chunked":     # a -inf decay (a full reset) would make cum_i - cum_j = -inf + inf
        g = g.clamp_min(CHUNK_G_FLOOR)
    kernel, blocks = ((_delta_chunk_kernel, _chunk_blocks(dk, dv)) if method == "chunked"
                      else (_delta_scan_kernel, _blocks(dk, dv, SCAN_TILE)))
    index_args = (slot, cu_seqlens, has_initial_state.view(torch.int8))
    _launch(kernel, n_seq, blocks, state, index_args, q, k, v, g, beta, o, use_qk_l2norm, scale)
    return o
