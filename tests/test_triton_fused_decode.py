"""The fused decode-layer kernels, one-row and tensor-core (interpreted on CPU), against their
torch references, and the references against the Llama model's own decode step; the model's
fused greedy step against its eager greedy tokens at bs 1, 2, 5 and 16; what ptxas makes of
every kernel for sm_90; cuda-marked: the whole fused step at the 1B shape against
`LlamaModel.forward_decode`, eager and under CUDA-graph replay with new data, with and without
programmatic dependent launch.

Sizes are awkward on purpose: H 80 and 100 (not a power of two), 3 query heads over 1 KV head,
FFN widths not multiples of the tile, a down split that gets no K at all, head_dim 12 (tiles of
2 columns, padded to a 16-row dot), M 1, 2, 3, 5 and 16, padded lanes writing the sink slot.
The CPU interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest), so bf16
comparisons allow a few ulps; fp16 ones are tight."""
import copy
import json
import os

import pytest
import torch
import triton

from padgraph.backends.triton import fused_decode as fd
from padgraph.backends.triton import fused_tail
from padgraph.errors import ContractValueError
from padgraph.llm import Batch
from padgraph.llm.kv import FIRST, KVCache
from padgraph.llm.models.llama import LlamaConfig, LlamaModel, decode_batch

DTYPES = [torch.float16, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=3e-2, atol=3e-2)


def _layer(h, n_q, n_kv, d, f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    qkv = r((n_q + 2 * n_kv) * d, h)               # one matrix, as the model keeps it: views
    gate_up = r(2 * f, h)
    wq, wk, wv = qkv.split((n_q * d, n_kv * d, n_kv * d))
    norm = lambda: (torch.rand(h, generator=g) + 0.5).to(dtype)   # noqa: E731
    return fd.LayerWeights(norm(), wq, wk, wv, r(h, n_q * d), norm(), *gate_up.chunk(2),
                           r(h, f), 1e-5)


def _rope(d, max_pos=64):
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return fd.RopeTables(ang.cos().float(), ang.sin().float())


SHAPES = [  # (m, h, n_q, n_kv, d, f)
    (1, 80, 3, 1, 32, 72), (3, 100, 4, 2, 64, 100), (16, 80, 2, 2, 32, 48), (5, 64, 3, 1, 64, 40)]


@pytest.mark.parametrize("m,h,n_q,n_kv,d,f", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_parts", [False, True])
def test_norm_qkv_rope_store_matches_reference(m, h, n_q, n_kv, d, f, dtype, with_parts):
    w = _layer(h, n_q, n_kv, d, f, dtype, seed=m)
    g = torch.Generator().manual_seed(h)
    x = torch.randn(m, h, generator=g).to(dtype)
    parts = torch.randn(3, m, h, generator=g) if with_parts else None
    positions = torch.randint(0, 64, (m,), generator=g)
    loc = torch.randperm(40, generator=g)[:m] + 1
    loc[-1] = 0 if m > 1 else loc[-1]                           # a padded lane: the sink slot
    out = {}
    for impl in ("torch", "triton"):
        caches = [torch.full((41, n_kv, d), 7.0, dtype=dtype) for _ in range(2)]
        q, resid = fd.norm_qkv_rope_store(x, parts, w, _rope(d), positions, loc, *caches, impl=impl)
        out[impl] = (q, resid, *caches)
    for got, want in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    k_cache = out["triton"][2]
    untouched = torch.ones(41, dtype=torch.bool)
    untouched[loc] = False
    assert (k_cache[untouched] == 7.0).all() and (out["triton"][3][untouched] == 7.0).all()
    if parts is None:                                           # no partials: resid is x itself
        assert out["triton"][1] is x


def test_qkv_rope_rotates_q_and_k_but_not_v():
    """The kernel against RoPE written out by hand for one head at position p (not the reference)."""
    dtype, d, h = torch.float16, 32, 64
    w = _layer(h, 1, 1, d, 32, dtype)
    x = torch.randn(1, h).to(dtype)
    rope, p = _rope(d), 9
    kc, vc = torch.zeros(4, 1, d, dtype=dtype), torch.zeros(4, 1, d, dtype=dtype)
    q, _ = fd.norm_qkv_rope_store(x, None, w, rope, torch.tensor([p]), torch.tensor([2]), kc, vc,
                                  impl="triton")
    xn = fd.rms_norm_reference(x, w.input_norm, w.eps).float()
    for got, wt, rotated in ((q[0, 0], w.wq, True), (kc[2, 0], w.wk, True), (vc[2, 0], w.wv, False)):
        y = (xn @ wt.float().T)[0]
        if rotated:
            c, s = rope.cos[p], rope.sin[p]
            y = torch.cat([y[:d // 2] * c - y[d // 2:] * s, y[d // 2:] * c + y[:d // 2] * s])
        torch.testing.assert_close(got.float(), y, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("m,h,n_q,n_kv,d,f", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_o_proj_residual_matches_reference(m, h, n_q, n_kv, d, f, dtype):
    w = _layer(h, n_q, n_kv, d, f, dtype)
    g = torch.Generator().manual_seed(m)
    attn, resid = torch.randn(m, n_q * d, generator=g).to(dtype), torch.randn(m, h, generator=g).to(dtype)
    got = fd.o_proj_residual(attn, w.wo, resid, impl="triton")
    torch.testing.assert_close(got.float(), fd.o_proj_residual_reference(attn, w.wo, resid).float(),
                               **_tol(dtype))


@pytest.mark.parametrize("m,h,n_q,n_kv,d,f", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n", [16, 32])
def test_norm_gate_up_silu_matches_reference(m, h, n_q, n_kv, d, f, dtype, block_n):
    w = _layer(h, n_q, n_kv, d, f, dtype)
    x = (torch.randn(m, h, generator=torch.Generator().manual_seed(f)) * 3).to(dtype)
    got = fd.norm_gate_up_silu(x, w, policy=fd.FusedDecodePolicy(block_n=block_n), impl="triton")
    assert got.shape == (m, f)
    torch.testing.assert_close(got.float(), fd.norm_gate_up_silu_reference(x, w).float(), **_tol(dtype))


@pytest.mark.parametrize("m,k,splits", [(1, 72, 1), (3, 100, 3), (16, 48, 4), (2, 9, 4), (4, 40, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_down_partials_are_the_split_products(m, k, splits, dtype):
    """Each split is its own K range's product ((9, 4): the last split gets no K and must be 0),
    and the partials summed are the projection."""
    g = torch.Generator().manual_seed(k)
    act, w_down = torch.randn(m, k, generator=g).to(dtype), torch.randn(80, k, generator=g).to(dtype)
    got = fd.down_partials(act, w_down, policy=fd.FusedDecodePolicy(down_splits=splits), impl="triton")
    assert got.shape == (splits, m, 80) and got.dtype == torch.float32
    torch.testing.assert_close(got, fd.down_partials_reference(act, w_down, splits), rtol=1e-5, atol=1e-4)
    for s, (lo, hi) in enumerate(fd.split_bounds(k, splits)):
        if hi == lo:
            assert (got[s] == 0).all()
    torch.testing.assert_close(got.sum(0), act.double().matmul(w_down.double().T).float(),
                               rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_norm_matches_reference(m, dtype):
    g = torch.Generator().manual_seed(m)
    h, parts = torch.randn(m, 100, generator=g).to(dtype), torch.randn(5, m, 100, generator=g)
    norm_w = (torch.rand(100, generator=g) + 0.5).to(dtype)
    got = fd.residual_norm(h, parts, norm_w, 1e-5, impl="triton")
    want = fd.residual_norm_reference(h, parts, norm_w, 1e-5)
    assert len(got) == len(want) == 3 and got[2].shape == (1, m)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **_tol(dtype))


# --------------------------------------------------------------- tensor-core kernels

@pytest.mark.parametrize("m,h,n_q,n_kv,d,f,splits", [s + (1,) for s in SHAPES]
                         + [(2, 48, 3, 1, 12, 40, 1), (3, 100, 4, 2, 64, 100, 2),
                            (16, 80, 2, 2, 32, 48, 3), (1, 80, 3, 1, 32, 72, 4),
                            (24, 80, 2, 2, 32, 48, 1), (64, 64, 3, 1, 32, 40, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_qkv_rope_store_tc_matches_reference(m, h, n_q, n_kv, d, f, splits, dtype):
    """The tensor-core qkv kernel, normalizing with the rows' sums of squares given as partials
    (16-column ones, as `proj_residual_tc` writes them), against the reference from x alone;
    head_dim 12 and 32 give tiles under 16 rows (padded, masked lanes); K loop steps of 32.
    splits > 1: H in K splits of whole steps (100 in 2: 64 + 36; 80 in 3: 32 + 32 + 16; 80 in
    4 asks for 3 of 32), the tile's last split summing the partials; twice, to show the ticket
    counters left zeroed, with the same bits."""
    w = _layer(h, n_q, n_kv, d, f, dtype, seed=m)
    g = torch.Generator().manual_seed(h + 1)
    x = torch.randn(m, h, generator=g).to(dtype)
    positions = torch.randint(0, 64, (m,), generator=g)
    slots = max(40, m + 8)
    loc = torch.randperm(slots, generator=g)[:m] + 1
    loc[-1] = 0 if m > 1 else loc[-1]
    out = {}
    policy = fd.FusedDecodePolicy(tc_block_k=32, tc_qkv_splits=splits)
    for impl in ("torch", "triton", "again"):
        caches = [torch.full((slots + 1, n_kv, d), 7.0, dtype=dtype) for _ in range(2)]
        q = fd.norm_qkv_rope_store_tc(x, fd.ssq_partials_reference(x, 16), w, _rope(d), positions,
                                      loc, *caches, policy=policy,
                                      impl="triton" if impl == "again" else impl)
        out[impl] = (q, *caches)
    for got, want, again in zip(out["triton"], out["torch"], out["again"]):
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
        assert torch.equal(got, again)
    if splits > 1:
        from padgraph.backends.triton.attention_split import tickets
        assert not tickets(x.device, 64, True)[0][:64].any()
    untouched = torch.ones(slots + 1, dtype=torch.bool)
    untouched[loc] = False
    assert (out["triton"][1][untouched] == 7.0).all() and (out["triton"][2][untouched] == 7.0).all()


@pytest.mark.parametrize("m,n,k,block_n", [(1, 80, 96, 16), (5, 100, 72, 16), (16, 64, 300, 32),
                                           (3, 40, 9, 16), (33, 48, 100, 16), (64, 40, 72, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_proj_residual_tc_is_the_residual_add_and_its_row_sums_of_squares(m, n, k, block_n, dtype):
    """out = resid + a @ w.T over the whole of K (K 300: several loop steps and a ragged one),
    and ssq [cdiv(N, block_n), M]: each row's sum of squares of out over each block_n columns."""
    g = torch.Generator().manual_seed(k)
    a, resid = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    policy = fd.FusedDecodePolicy(tc_block_n=block_n, tc_proj_block_k=64)
    out, ssq = fd.proj_residual_tc(a, w, resid, policy=policy, impl="triton")
    want, _ = fd.proj_residual_reference(a, w, resid, block_n)
    assert ssq.shape == (triton.cdiv(n, block_n), m) and ssq.dtype == torch.float32
    torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))
    torch.testing.assert_close(ssq, fd.ssq_partials_reference(out, block_n), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ssq.sum(0), out.float().pow(2).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,n,k,splits", [(1, 80, 96, 2), (5, 100, 300, 3), (16, 64, 300, 4),
                                          (3, 40, 72, 8), (40, 48, 300, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fold", [False, True])
def test_proj_residual_tc_in_k_splits_is_the_same_residual_add(m, n, k, splits, dtype, fold):
    """K in fp32 partials summed in split order, by a second kernel or (fold) by each tile's
    last split: the same out as the whole-K reference (K 300 in 64-column steps over 3 or 4
    splits: ragged last splits; K 72 over 8: splits past the end are empty), ssq over each
    tc_sum_block (second kernel) or tc_block_n (fold) columns, the same bits on a second call,
    and the ticket counters left zeroed."""
    from padgraph.backends.triton.attention_split import tickets
    g = torch.Generator().manual_seed(k + splits)
    a, resid = torch.randn(m, k, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    policy = fd.FusedDecodePolicy(tc_proj_block_k=64, tc_sum_block=32, tc_fold=fold)
    block = policy.tc_block_n if fold else 32
    out, ssq = fd.proj_residual_tc(a, w, resid, splits=splits, policy=policy, impl="triton")
    want, want_ssq = fd.proj_residual_tc(a, w, resid, splits=splits, policy=policy, impl="torch")
    assert ssq.shape == want_ssq.shape == (triton.cdiv(n, block), m) and ssq.dtype == torch.float32
    torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))
    torch.testing.assert_close(ssq, fd.ssq_partials_reference(out, block), rtol=1e-5, atol=1e-4)
    again, ssq2 = fd.proj_residual_tc(a, w, resid, splits=splits, policy=policy, impl="triton")
    assert torch.equal(again, out) and torch.equal(ssq2, ssq)
    assert not tickets(a.device, 64, True)[0][:64].any()


@pytest.mark.parametrize("m,h,n_q,n_kv,d,f", SHAPES + [(40, 80, 2, 2, 32, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ffn_n", [16, 32])
def test_norm_gate_up_silu_tc_matches_reference(m, h, n_q, n_kv, d, f, dtype, ffn_n):
    w = _layer(h, n_q, n_kv, d, f, dtype)
    x = (torch.randn(m, h, generator=torch.Generator().manual_seed(f)) * 3).to(dtype)
    policy = fd.FusedDecodePolicy(tc_ffn_n=ffn_n, tc_block_k=32)
    got = fd.norm_gate_up_silu_tc(x, fd.ssq_partials_reference(x, 16), w, policy=policy,
                                  impl="triton")
    assert got.shape == (m, f)
    want = fd.norm_gate_up_silu_reference(x, w)
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def test_the_tc_norm_reads_the_sums_of_squares_it_is_given():
    """The kernels normalize with ssq, not with a norm of their own: ssq scaled by 4 halves every
    normed input, so v (linear in it, not roped) halves too."""
    dtype, d, h = torch.float16, 32, 64
    w = _layer(h, 1, 1, d, 32, dtype)
    x = torch.randn(2, h).to(dtype)
    ssq = fd.ssq_partials_reference(x, 16)
    vs = []
    for s in (ssq, ssq * 4):
        kc, vc = torch.zeros(4, 1, d, dtype=dtype), torch.zeros(4, 1, d, dtype=dtype)
        fd.norm_qkv_rope_store_tc(x, s.contiguous(), w, _rope(d), torch.tensor([1, 2]),
                                  torch.tensor([1, 2]), kc, vc, impl="triton")
        vs.append(vc[1:3].float())
    torch.testing.assert_close(vs[1], vs[0] / 2, rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------- the whole decode step

def _decode_setup(model, m: int, max_ctx: int = 48, seed: int = 0, n_pad: int = 0):
    """A KV cache with random past K/V and m requests (the last n_pad of them padded lanes:
    row 0, seq_len 1, position 0, the sink slot); returns (kv, ids, positions, batch)."""
    cfg, dtype = model.cfg, model.embed.weight.dtype
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(cfg.n_layers, FIRST + m * max_ctx, cfg.n_kv_heads, cfg.head_dim, max_ctx,
                 FIRST + m, dtype, "cpu")
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    ctx = torch.randint(1, max_ctx, (m,), generator=g)
    slots = FIRST + torch.arange(m)[:, None] * max_ctx + torch.arange(max_ctx)[None]
    kv.req_to_token[FIRST:FIRST + m] = slots.int()
    rows = torch.arange(FIRST, FIRST + m, dtype=torch.int32)
    loc = slots[torch.arange(m), ctx - 1]
    real = m - n_pad
    rows[real:], ctx[real:], loc[real:] = 0, 1, 0
    batch = Batch(kv, kv.req_to_token, rows, ctx.int(), loc)
    ids = torch.randint(0, cfg.vocab_size, (m,), generator=g)
    return kv, ids, ctx - 1, batch


def _clone_kv(kv):
    c = KVCache.__new__(KVCache)
    c.__dict__.update(kv.__dict__, k=[t.clone() for t in kv.k], v=[t.clone() for t in kv.v])
    return c


def _fused_hidden(model, ids, positions, batch, **kw):
    return fd.decode_hidden(model, ids, positions, batch.out_cache_loc, batch.kv,
                            decode_batch(batch).attend, **kw)


def _model(dtype, fused=None, **kw):
    cfg = LlamaConfig.tiny(hidden_size=80, n_heads=3, n_kv_heads=1, head_dim=32, ffn_size=72, **kw)
    return LlamaModel(cfg, seed=1, fused=fused).to(dtype).eval()


ROW_KERNELS = fd.FusedDecodePolicy(tc_min_rows=fd.ONE_ROW_MAX_M + 1)   # the one-row kernels


def _with_kv(batch, kv, impl: str = "auto"):
    return Batch(kv, kv.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                 impl=impl)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(rtol=1e-5, atol=1e-5)),
                                       (torch.bfloat16, dict(rtol=2e-2, atol=2e-2))])
@pytest.mark.parametrize("policy", [fd.FusedDecodePolicy(), ROW_KERNELS], ids=["tc", "rows"])
def test_references_are_the_models_decode_step(dtype, tol, policy):
    """The torch references chained (q/k/v and gate/up from the weights' row views; the down
    projection as split partials summed, or as the residual add with its sums of squares)
    give the model's own decode step: hidden, logits and every layer's KV cache."""
    model = _model(dtype)
    kv, ids, positions, batch = _decode_setup(model, 4, n_pad=1)
    kv_ref = _clone_kv(kv)
    with torch.no_grad():
        _, want = model.forward_decode(ids, positions, _with_kv(batch, kv_ref))
        got = _fused_hidden(model, ids, positions, batch, policy=policy, impl="torch")
    torch.testing.assert_close(got.float(), want.float(), **tol)
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_attend_options_ask_for_pdl_only_with_attn_pdl():
    """attn_pdl (the default) asks the attention for PDL in every layer; without it `attend`
    gets no keyword (any AttendFn takes that)."""
    P = fd.FusedDecodePolicy
    assert fd.attend_options(P()) == {"pdl": True} == fd.attend_options(P(attn_pdl=True))
    assert fd.attend_options(P(attn_pdl=True, pdl=False)) == {"pdl": True}
    off = P(attn_pdl=False)
    assert fd.attend_options(off) == {} == fd.attend_options(P(pdl=False, tc_pdl=True, attn_pdl=False))


@pytest.mark.parametrize("m,n_pad,kernels", [(1, 0, "fold"), (5, 2, "fold"), (5, 2, "reduce"),
                                             (5, 2, "tc"), (5, 2, "tc-splits"),
                                             (5, 2, "tc-splits-kernel"), (1, 0, "fold+apdl"),
                                             (5, 2, "tc+apdl"), (33, 3, "tc"), (64, 5, "tc"),
                                             (40, 4, "tc-splits"), (64, 5, "tc-rowsm"),
                                             (64, 3, "tc-splits-rowsm")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_give_the_models_decode_step(m, n_pad, kernels, dtype):
    """Every layer through the kernels (interpreted) against the model's decode step, at 1 to
    MAX_M rows (the tensor-core dots 16, 64 and 64 rows wide, the rows past M masked): hidden,
    the greedy tokens where the top two logits are apart, the KV written, the sink only for the
    padded lanes; one-row kernels with the partials summed in the qkv kernel (fold) or by the
    reduce kernel, or the tensor-core ones (K loop steps of 32: several a projection; the o
    and down projections whole or in K splits, summed by the tile's last split or a second
    kernel; the qkv kernel in 2 K splits); +apdl: the attention's PDL shape too; rowsm:
    tc_rows_as_m, the 64-row dots with the rows as their M side."""
    model = _model(dtype)
    kv, ids, positions, batch = _decode_setup(model, m, seed=m, n_pad=n_pad)
    kv_ref = _clone_kv(kv)
    policy = fd.FusedDecodePolicy(fold_max_m=0 if kernels == "reduce" else fd.MAX_M, down_splits=3,
                                  tc_min_rows=2 if kernels.startswith("tc") else fd.ONE_ROW_MAX_M + 1,
                                  tc_block_k=32, tc_proj_block_k=32,
                                  **(dict(tc_o_splits=2, tc_down_splits=3, tc_sum_block=16,
                                          tc_qkv_splits=2, tc_fold=kernels == "tc-splits")
                                     if kernels.startswith("tc-splits") else {}),
                                  attn_pdl="apdl" in kernels, tc_rows_as_m="rowsm" in kernels)
    with torch.no_grad():
        logits, want = model.forward_decode(ids, positions, _with_kv(batch, kv_ref))
        got = _fused_hidden(model, ids, positions, batch, policy=policy, impl="triton")
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
    real = slice(0, m - n_pad)
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
        torch.testing.assert_close(a[1:].float(), b[1:].float(), **_tol(dtype))   # slot 0: sink
    top2 = logits[real].topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    fused_ids = model.logits(got)[real].argmax(-1)
    assert (fused_ids[clear] == logits[real].argmax(-1)[clear]).all()


@pytest.mark.parametrize("m", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_greedy_step_gives_the_eager_models_tokens(m, dtype):
    """`forward_decode_greedy` of a model with the default policy (one-row kernels at 1 row,
    tensor-core ones above, the fused norm + lm_head + argmax tail; at 40 rows max_rows raised
    to take them, the dots 64 rows wide) against the same model
    without it: the same greedy token wherever the eager top-2 gap is over twice the gap's
    tolerance (a sharper model than the tiny default, init_std 0.2, so many rows are clear;
    bf16's tolerance covers the interpreter's truncating rounding through two layers), the
    top-2 gap, the hidden, the KV written."""
    policy = fd.FusedDecodePolicy(max_rows=max(m, fd.FusedDecodePolicy().max_rows))
    eager, fused = (_model(dtype, init_std=0.2, fused=f) for f in (None, policy))
    kv, ids, positions, batch = _decode_setup(eager, m, seed=m, n_pad=1 if m > 2 else 0)
    kv_ref = _clone_kv(kv)
    with torch.no_grad():
        logits, want = eager.forward_decode(ids, positions, _with_kv(batch, kv_ref))
        got_ids, gap, hidden = fused.forward_decode_greedy(ids, positions,
                                                           _with_kv(batch, kv, "triton"))
    tol = 0.25 if dtype == torch.bfloat16 else 0.02
    want_ids, want_gap = fused_tail.greedy_reference(logits)
    clear = want_gap > 2 * tol
    assert clear.sum() >= max(1, m // 3), "the model must make many choices clear for this test"
    assert (got_ids[clear] == want_ids[clear]).all()
    torch.testing.assert_close(gap, want_gap, rtol=0, atol=tol)
    pairs = [(hidden, want)] + [(a[1:], b[1:]) for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v)]
    for a, b in ((a.float(), b.float()) for a, b in pairs):        # KV slot 0: the sink
        if dtype == torch.float16:
            torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)
        else:                   # truncation's error compounds through the layers: norm-wise
            assert (a - b).norm() <= 0.03 * b.norm()


def test_the_shapes_the_kernels_do_not_take_are_refused_or_left_to_the_caller():
    model = _model(torch.bfloat16)
    kv, ids, positions, batch = _decode_setup(model, 3)
    assert fd.takes(model, ids, kv)
    assert fd.takes(model, ids, kv, fd.FusedDecodePolicy(max_rows=3))
    assert not fd.takes(model, ids, kv, fd.FusedDecodePolicy(max_rows=2))   # rows past the policy's
    P = fd.FusedDecodePolicy
    rows = lambda n: torch.zeros(n, dtype=torch.long)                       # noqa: E731
    assert fd.takes(model, rows(P().max_rows), kv, P())                      # default: max_rows
    assert not fd.takes(model, rows(P().max_rows + 1), kv, P())
    assert fd.takes(model, rows(fd.MAX_M), kv, P(max_rows=fd.MAX_M))        # at most MAX_M
    assert not fd.takes(model, rows(fd.MAX_M + 1), kv, P(max_rows=fd.MAX_M + 1))
    assert not fd.takes(model, rows(fd.MAX_M + 1), kv)
    # below tc_min_rows the one-row kernels run: at most ONE_ROW_MAX_M rows
    one_row = P(max_rows=fd.MAX_M, tc_min_rows=fd.MAX_M)
    assert fd.takes(model, rows(fd.ONE_ROW_MAX_M), kv, one_row)
    assert not fd.takes(model, rows(fd.ONE_ROW_MAX_M + 1), kv, one_row)
    assert fd.takes(model, rows(fd.MAX_M), kv, one_row)                      # tensor cores again
    assert not fd.takes(_model(torch.float32), ids, _decode_setup(_model(torch.float32), 3)[0])
    small = LlamaModel(LlamaConfig.tiny(), seed=0).to(torch.bfloat16)       # head_dim 16
    assert fd.takes(small, ids, _decode_setup(small, 3)[0])
    w = fd.layer_weights(model)[0]
    x = torch.zeros(fd.ONE_ROW_MAX_M + 1, 80, dtype=torch.bfloat16)
    with pytest.raises(ContractValueError, match="fused_decode.*'h'.*1 <= M <= 16"):
        fd.norm_gate_up_silu(x, w, impl="triton")
    ssq = torch.ones(1, fd.MAX_M + 1)
    with pytest.raises(ContractValueError, match="fused_decode.*'h'.*1 <= M <= 64"):
        fd.norm_gate_up_silu_tc(torch.zeros(fd.MAX_M + 1, 80, dtype=torch.bfloat16), ssq, w,
                                impl="triton")
    with pytest.raises(ContractValueError, match="'w_down'.*weight"):
        fd.down_partials(torch.zeros(2, 80, dtype=torch.bfloat16), w.w_down, impl="triton")
    with pytest.raises(ContractValueError, match="head_dim.*even"):
        fd.qkv_tile(15, 8)
    with pytest.raises(ContractValueError, match="policy.block_n must be a power of two, got 12"):
        fd.o_proj_residual(torch.zeros(2, 96, dtype=torch.bfloat16), w.wo,
                           torch.zeros(2, 80, dtype=torch.bfloat16),
                           policy=fd.FusedDecodePolicy(block_n=12), impl="triton")
    with pytest.raises(ContractValueError, match="down_splits"):
        fd.down_partials(torch.zeros(2, 72, dtype=torch.bfloat16), w.w_down,
                         policy=fd.FusedDecodePolicy(down_splits=0))
    h2 = torch.zeros(2, 80, dtype=torch.bfloat16)
    with pytest.raises(ContractValueError, match="tc_block_n must be a power of two >= 16.*got 8"):
        fd.proj_residual_tc(torch.zeros(2, 96, dtype=torch.bfloat16), w.wo, h2,
                            policy=fd.FusedDecodePolicy(tc_block_n=8), impl="triton")
    with pytest.raises(ContractValueError, match="tc_down_splits must be >= 1.*got 0"):
        fd.proj_residual_tc(torch.zeros(2, 96, dtype=torch.bfloat16), w.wo, h2,
                            policy=fd.FusedDecodePolicy(tc_down_splits=0), impl="triton")
    with pytest.raises(ContractValueError, match="policy.tc_stages must be >= 1"):
        fd.norm_gate_up_silu_tc(h2, torch.ones(1, 2), w, policy=fd.FusedDecodePolicy(tc_stages=0),
                                impl="triton")
    with pytest.raises(ContractValueError, match="policy.tc_ffn_stages must be >= 1"):
        fd.norm_gate_up_silu_tc(h2, torch.ones(1, 2), w, policy=fd.FusedDecodePolicy(tc_ffn_stages=0),
                                impl="triton")
    with pytest.raises(ContractValueError, match="'ssq'.*\\[P >= 1, 2\\] fp32"):
        fd.norm_gate_up_silu_tc(h2, torch.ones(1, 3), w, impl="triton")


@pytest.mark.parametrize("head_dim,half_n,tile", [(64, 8, 8), (16, 32, 8), (12, 8, 2), (10, 8, 1),
                                                  (128, 16, 16)])
def test_the_qkv_tile_divides_half_a_head(head_dim, half_n, tile):
    assert fd.qkv_tile(head_dim, half_n) == tile


@pytest.mark.parametrize("head_dim", [16, 12])
def test_head_sizes_whose_half_is_not_a_tile_multiple_still_match(head_dim):
    """head_dim 12: tiles of 2 columns (3 a half-head); the step equals the reference."""
    dtype = torch.float16
    w = _layer(48, 3, 1, head_dim, 40, dtype)
    x = torch.randn(2, 48).to(dtype)
    loc, pos = torch.tensor([3, 5]), torch.tensor([7, 60])
    out = {}
    for impl in ("torch", "triton"):
        caches = [torch.zeros(8, 1, head_dim, dtype=dtype) for _ in range(2)]
        out[impl] = (*fd.norm_qkv_rope_store(x, None, w, _rope(head_dim), pos, loc, *caches,
                                             impl=impl), *caches)
    for got, want in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def test_layer_weights_are_views_of_the_model():
    """No weight is copied: an in-place update of the model is what the next step reads."""
    model = _model(torch.bfloat16)
    w = fd.layer_weights(model)[1]
    layer = model.layers[1]
    for view, full in ((w.wq, layer.attn.qkv_proj.weight), (w.wv, layer.attn.qkv_proj.weight),
                       (w.w_up, layer.mlp.gate_up.weight)):
        assert view.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    assert w.wk.data_ptr() == layer.attn.qkv_proj.weight[96:].data_ptr()
    assert w.w_up.data_ptr() == layer.mlp.gate_up.weight[72:].data_ptr()


def test_pdl_is_off_where_it_cannot_run():
    assert not fd.pdl_supported(torch.device("cpu"))
    assert fd._launch(fd.FusedDecodePolicy(pdl=True), torch.device("cpu"))["PDL"] is False


@pytest.mark.parametrize("m,fused_runs", [(3, True), (fd.MAX_M + 1, False)])
def test_the_model_hook_takes_small_steps_and_leaves_larger_ones(m, fused_runs, monkeypatch):
    """forward_decode (logits for the sampler) and forward_decode_greedy (ids, gap) both go
    through `fused_tail.decode_step` where the policy takes the step, else the eager path: the
    same hidden and greedy outputs either way."""
    plain, hooked = _model(torch.float16), _model(torch.float16, fused=fd.FusedDecodePolicy())
    kv, ids, positions, batch = _decode_setup(plain, m, seed=m)
    kv_ref, kv_greedy = _clone_kv(kv), _clone_kv(kv)
    calls = []
    real = fused_tail.decode_step
    monkeypatch.setattr(fused_tail, "decode_step",
                        lambda *a, **k: calls.append((k["impl"], k["logits"])) or real(*a, **k))
    with torch.no_grad():
        logits, want = plain.forward_decode(ids, positions, _with_kv(batch, kv_ref))
        b = Batch(kv, kv.req_to_token, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                  impl="triton")
        got_logits, got = hooked.forward_decode(ids, positions, b)
        greedy = hooked.forward_decode_greedy(ids, positions, _with_kv(b, kv_greedy, "triton"))
    assert calls == ([("triton", True), ("triton", False)] if fused_runs else [])
    torch.testing.assert_close(got.float(), want.float(), **_tol(torch.float16))
    torch.testing.assert_close(got_logits, logits, rtol=1e-3, atol=2e-3)
    assert greedy[0].shape == greedy[1].shape == (m,) and greedy[0].dtype == torch.int64
    torch.testing.assert_close(greedy[2].float(), want.float(), **_tol(torch.float16))
    if not fused_runs:      # the eager fallback: exactly its logits' argmax and top-2 gap
        want_ids, want_gap = fused_tail.greedy_reference(got_logits)
        assert torch.equal(greedy[0], want_ids) and torch.equal(greedy[1], want_gap)


_SM90_COMPILE = r"""
import json, os, subprocess, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padgraph.backends.triton import fused_decode as fd, fused_tail as ft

policy, h, d, ffn, vocab = fd.FusedDecodePolicy(), 2048, 64, 8192, 128256     # the 1B shape
k_split = triton.next_power_of_2(triton.cdiv(ffn, policy.down_splits))
half_tc = fd.qkv_tile(d, policy.tc_half_n)
tc = dict(BM=fd.ROW_BLOCK, BK=policy.tc_block_k, F32=False)
n_ssq = triton.next_power_of_2(triton.cdiv(h, policy.tc_block_n))
# name: (kernel, constexprs, warps, bytes of weights a program loads before its wait or None)
kernels = {
    "norm_qkv": (fd._norm_qkv_kernel, dict(N_PARTS=policy.down_splits, HEAD_DIM=d,
                 HALF=fd.qkv_tile(d, policy.half_n), BLOCK_H=h), policy.num_warps, None),
    "o_residual": (fd._o_residual_kernel, dict(BLOCK_N=policy.block_n, BLOCK_K=h),
                   policy.num_warps, None),
    "norm_gate_up": (fd._norm_gate_up_kernel, dict(BLOCK_N=policy.block_n, BLOCK_H=h),
                     policy.num_warps, None),
    "down_partials": (fd._down_partials_kernel, dict(BLOCK_N=policy.block_n, BLOCK_K=k_split),
                      policy.num_warps, None),
    "residual_norm": (fd._residual_norm_kernel, dict(N_PARTS=policy.down_splits, BLOCK_H=h),
                      policy.num_warps, None),
    "qkv_tc": (fd._norm_qkv_tc_kernel, dict(tc, HEAD_DIM=d, HALF=half_tc, TILE=max(16, half_tc),
               BLOCK_P=n_ssq, SPLITS=1), policy.tc_warps,
               2 * max(16, half_tc) * policy.tc_block_k * 2),
    "qkv_tc_split": (fd._norm_qkv_tc_kernel, dict(tc, HEAD_DIM=d, HALF=half_tc,
                     TILE=max(16, half_tc), BLOCK_P=n_ssq, SPLITS=2), policy.tc_warps,
                     2 * max(16, half_tc) * policy.tc_block_k * 2),
    "proj_residual_tc": (fd._proj_residual_tc_kernel, dict(tc, BLOCK_N=policy.tc_block_n,
                         BK=policy.tc_proj_block_k), policy.tc_warps,
                         policy.tc_block_n * policy.tc_proj_block_k * 2),
    "proj_partials_tc": (fd._proj_partials_tc_kernel, dict(tc, BLOCK_N=policy.tc_block_n,
                         BK=policy.tc_proj_block_k, S=4, FOLD=True), policy.tc_warps,
                         policy.tc_block_n * policy.tc_proj_block_k * 2),
    "sum_residual": (fd._sum_residual_kernel, dict(S=4, BLOCK_N=policy.tc_sum_block,
                     BM=fd.ROW_BLOCK), 4, 0),
    "gate_up_tc": (fd._norm_gate_up_tc_kernel, dict(tc, BLOCK_N=policy.tc_ffn_n, BLOCK_P=n_ssq),
                   policy.tc_warps, 2 * policy.tc_ffn_n * policy.tc_block_k * 2),
    "lm_head": (ft._lm_head_kernel, dict(tc, BLOCK_V=policy.tail_block_v, BLOCK_P=n_ssq,
                LOGITS=False), policy.tc_warps, policy.tail_block_v * policy.tc_block_k * 2),
    "lm_head_logits": (ft._lm_head_kernel, dict(tc, BLOCK_V=policy.tail_block_v, BLOCK_P=n_ssq,
                       LOGITS=True), policy.tc_warps, policy.tail_block_v * policy.tc_block_k * 2),
    "argmax_reduce": (ft._argmax_reduce_kernel, dict(BLOCK_C=triton.next_power_of_2(
                      triton.cdiv(vocab, policy.tail_block_v))), 4, 0),
}
# the tensor-core kernels at 32 and 64 rows too (BM 32 / 64; at 64 tc_wide_warps, and the
# stages of `stages_for`): name: (weight rows a stage, K step, the policy's stages)
wide = {"qkv_tc": (2 * max(16, half_tc), policy.tc_block_k, policy.tc_stages),
        "proj_residual_tc": (policy.tc_block_n, policy.tc_proj_block_k, policy.tc_stages),
        "gate_up_tc": (2 * policy.tc_ffn_n, policy.tc_block_k, policy.tc_ffn_stages),
        "lm_head": (policy.tail_block_v, policy.tc_block_k, policy.tc_stages)}
stage_of = {name: fd.stages_for(base, fd.ROW_BLOCK, bk, rows) for name, (rows, bk, base) in wide.items()}
stage_of["lm_head_logits"] = stage_of["lm_head"]
for bm in (32, 64):
    for name, (rows, bk, base) in wide.items():
        fn, consts, warps, preload = kernels[name]
        warps = fd.launch_tc(policy, torch.device("cpu"), bm=bm)["num_warps"]
        kernels[f"{name}@{bm}"] = (fn, {**consts, "BM": bm}, warps, preload)
        stage_of[f"{name}@{bm}"] = fd.stages_for(base, bm, bk, rows)
        if bm == 64:            # tc_rows_as_m: the rows on the dots' M side
            kernels[f"{name}@64m"] = (fn, {**consts, "BM": bm, "ROWS_M": True}, warps, preload)
            stage_of[f"{name}@64m"] = stage_of[f"{name}@64"]
for name, (fn, consts, warps, preload) in kernels.items():   # the norm weight's rows
    if "REP" in fn.arg_names:
        consts["REP"] = fd.norm_rep(warps)
    if "ROWS_M" in fn.arg_names:
        consts.setdefault("ROWS_M", False)
fp32 = "Parts Cos Sin Ssq Logits Top Second Gap".split()
types = {"Pos": "*i64", "Loc": "*i64", "Counter": "*i32", "Ids": "*i64", "Idx": "*i32", "eps": "fp32",
         **{a: "*fp32" for a in fp32},
         **{a: "*bf16" for a in "X Resid NormW Wq Wk Wv Q KCache VCache A Wo Out Wg Wu Act Wd W "
                                "Hidden".split()}}
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
out = {}
for name, (fn, consts, warps, preload) in kernels.items():
    consts = {**consts, "PDL": True}
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    # the tensor-core kernels as the launcher specializes them at this shape: pointers, strides
    # and sizes divisible by 16 (M, the head counts and C are not asserted); the one-row ones
    # without the hints (the figures in fused_decode's docstring)
    attrs = {} if preload is None else {
        (i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
        if a not in consts and a not in ("M", "eps", "n_q_heads", "n_kv_heads", "C")}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()},
                    attrs=attrs)
    stages = 1 if preload is None else stage_of.get(name, policy.tc_stages)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    path = os.path.join(sys.argv[1], name + ".cubin")
    open(path, "wb").write(k.asm["cubin"])
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                           capture_output=True, text=True, check=True).stdout
    fields = dict(f.split(":") for f in usage.split() if f.startswith(("REG:", "STACK:")))
    ptx = k.asm["ptx"]
    before = ptx[:ptx.find("griddepcontrol.wait")]
    depth, sync_in_loops = 0, 0         # synchronous loads inside a K loop (TTGIR)
    for line in k.asm["ttgir"].splitlines():
        depth += "scf.for" in line
        sync_in_loops += depth > 0 and " tt.load " in line
        depth -= depth > 0 and "scf.yield" in line
    out[name] = {"regs": int(fields["REG"]), "stack": int(fields["STACK"]),
                 "smem": k.metadata.shared, "waits": ptx.count("griddepcontrol.wait"),
                 "loads_before_wait": before.count("ld.global"),
                 "async_before_wait": before.count("cp.async"),
                 "stages": stages, "wgmma": ptx.count("wgmma.mma_async"),
                 "preload_loads": None if preload is None else preload // (32 * warps * 16),
                 "sync_loads_in_loops": sync_in_loops}
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90_with_pdl_and_no_register_spills(tmp_path):
    """What the CPU interpreter cannot show: every kernel (one-row, tensor-core, the tail's)
    compiles for sm_90 (ptxas) at the 1B shape and the default policy with PDL on, spills
    nothing, fits an H100's shared memory, waits once, and issues its weight loads before the
    wait; a tensor-core kernel loads exactly its first weight chunk there (16-byte vector
    loads: nothing else is read before the wait) and starts its pipelined copies after it, and
    its K loop has no synchronous load."""
    import subprocess
    import sys

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not all(os.path.exists(os.path.join(tools, t)) for t in ("ptxas", "cuobjdump")):
        pytest.skip("Triton's bundled ptxas / cuobjdump are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", _SM90_COMPILE, str(tmp_path)], env=env,
                         capture_output=True, text=True)   # no timeout: slow is not wrong
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    assert len(results) == 26
    # with tc_rows_as_m the 64-row dots take the rows as their M side: sm_90's wgmma; with the
    # weights as M, tiles of 16 / 32 weight rows run mma.sync (the lm_head's 128 take wgmma)
    for name, r in results.items():
        if name.endswith("@64m") or name.startswith("lm_head"):
            assert r["wgmma"] > 0, f"{name}: {r}"
        elif name.startswith(("qkv_tc", "proj_", "gate_up_tc")):
            assert r["wgmma"] == 0, f"{name}: {r}"
    # at 16 rows the layer kernels' stages fit as the policy gives them; the lm_head's (128
    # rows a chunk) and at 64 rows the o / down projections' are cut to stay in shared memory
    policy = fd.FusedDecodePolicy()
    assert [results[n]["stages"] for n in ("qkv_tc", "proj_residual_tc", "gate_up_tc")] == [
        policy.tc_stages, policy.tc_stages, policy.tc_ffn_stages]
    assert results["lm_head"]["stages"] == results["lm_head_logits"]["stages"] < policy.tc_stages
    assert results["proj_residual_tc@64"]["stages"] < policy.tc_stages
    for name, r in results.items():
        assert r["stack"] == 0, f"{name} spills: {r}"
        assert r["smem"] <= 227 * 1024, f"{name} needs more shared memory than an H100 has: {r}"
        assert r["waits"] == 1 and r["async_before_wait"] == 0, f"{name}: {r}"
        if r["preload_loads"] is None:
            assert r["loads_before_wait"] > 0, f"{name}: {r}"
        else:
            assert r["loads_before_wait"] == r["preload_loads"], f"{name}: {r}"
    # the K loops of the tensor-core kernels stream everything through async copies: a load
    # left synchronous (as the norm weight's [BK] chunk once was, 2 bytes a thread) pays an L2
    # round trip every K step
    for name in ("qkv_tc", "proj_residual_tc", "proj_partials_tc", "gate_up_tc", "lm_head",
                 "lm_head_logits", *(f"{n}@{bm}" for bm in ("32", "64", "64m") for n in (
                     "qkv_tc", "proj_residual_tc", "gate_up_tc", "lm_head"))):
        assert results[name]["sync_loads_in_loops"] == 0, f"{name}: {results[name]}"


# ------------------------------------------------------------------------------------ CUDA

ROWS = fd.ONE_ROW_MAX_M + 1     # tc_min_rows of the one-row policies


def _policy(**kw):
    return fd.FusedDecodePolicy(max_rows=fd.MAX_M, **kw)     # every row count the kernels take


POLICIES = {   # the kernel families and launch modes the CUDA tests run
    "rows": _policy(pdl=False, tc_min_rows=ROWS),
    "rows+pdl": _policy(pdl=True, tc_min_rows=ROWS),
    "rows+pdl+reduce": _policy(pdl=True, tc_min_rows=ROWS, fold_max_m=0),
    "tc": _policy(pdl=False, tc_min_rows=1),
    "tc+pdl": _policy(pdl=True, tc_min_rows=1),
    "tc+splits+pdl": _policy(pdl=True, tc_pdl=True, tc_min_rows=1, tc_o_splits=2,
                             tc_down_splits=4),
    "tc+qkv_splits+pdl": _policy(pdl=True, tc_pdl=True, tc_min_rows=1, tc_qkv_splits=2),
    "rows+pdl+attn_pdl": _policy(pdl=True, tc_min_rows=ROWS, attn_pdl=True),
    "tc+attn_pdl": _policy(pdl=True, tc_min_rows=1, attn_pdl=True),
    "tc+weights_as_m": _policy(pdl=True, tc_min_rows=1, tc_rows_as_m=False),
}


def _cuda_model(n_layers=2, vocab_size=4096):
    cfg = LlamaConfig.llama_1b(n_layers=n_layers, vocab_size=vocab_size)
    return LlamaModel(cfg, seed=0).to("cuda", torch.bfloat16).eval()


@pytest.fixture(scope="module")
def cuda_model():
    return _cuda_model()


def _with_policy(model, policy):
    """The same model (its modules shared, not copied) with `fused` = policy."""
    out = copy.copy(model)
    out.fused = policy
    return out


def _to_cuda(setup):
    kv, ids, positions, batch = setup
    kv.k, kv.v = [t.cuda() for t in kv.k], [t.cuda() for t in kv.v]
    kv.req_to_token, kv.device = kv.req_to_token.cuda(), torch.device("cuda")
    b = Batch(kv, kv.req_to_token, batch.req_pool_indices.cuda(), batch.seq_lens.cuda(),
              batch.out_cache_loc.cuda())
    return kv, ids.cuda(), positions.cuda(), b


def _cuda_case(model, m, seed, n_pad=0):
    return _to_cuda(_decode_setup(model, m, max_ctx=512, seed=seed, n_pad=n_pad))


@pytest.mark.cuda
@pytest.mark.parametrize("m,kernels", [(m, k) for m in (1, 2, 5, 16, 33, 64) for k in POLICIES
                                       if m <= fd.ONE_ROW_MAX_M or k.startswith("tc")])
def test_cuda_fused_step_matches_forward_decode_at_the_1b_shape(cuda_model, m, kernels):
    """Both kernel families at every row count they may run (the one-row kernels to 16 rows,
    the tensor-core ones to 64: dots 16, 64 and 64 rows wide), PDL on and off, against the
    eager step: hidden, the KV written, the greedy token where the top two logits are apart."""
    model = cuda_model
    kv, ids, positions, batch = _cuda_case(model, m, seed=m, n_pad=1 if m > 1 else 0)
    kv_ref = _clone_kv(kv)
    with torch.no_grad():
        logits, want = model.forward_decode(ids, positions, _with_kv(batch, kv_ref))
        got = _fused_hidden(model, ids, positions, batch, policy=POLICIES[kernels])
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
        torch.testing.assert_close(a[1:].float(), b[1:].float(), rtol=2e-2, atol=2e-2)
    top2 = logits.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert (model.logits(got).argmax(-1)[clear] == logits.argmax(-1)[clear]).all()


@pytest.fixture(scope="module")
def cuda_model_full_vocab():
    return _cuda_model(vocab_size=128256)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4, 16, 40, 64])
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_fused_greedy_step_gives_the_eager_tokens(cuda_model_full_vocab, m, pdl):
    """The model's fused greedy step (layers and the norm + lm_head + argmax tail, the full
    128256 vocabulary: 1002 lm_head programs) against the eager one: tokens equal wherever the
    eager top-2 gap is over 0.05, the gap and the hidden close; the sampling path's logits
    (`forward_decode`) close to the eager logits, their argmax the greedy step's token. Past
    the default max_rows (16) the policy is raised to take the rows."""
    eager = cuda_model_full_vocab
    fused = _with_policy(eager, fd.FusedDecodePolicy(pdl=pdl, max_rows=max(16, m)))
    kv, ids, positions, batch = _cuda_case(eager, m, seed=10 + m, n_pad=1 if m > 2 else 0)
    kv_ref, kv_logits = _clone_kv(kv), _clone_kv(kv)
    with torch.no_grad():
        logits, want = eager.forward_decode(ids, positions, _with_kv(batch, kv_ref))
        got_ids, gap, hidden = fused.forward_decode_greedy(ids, positions, batch)
        got_logits, _ = fused.forward_decode(ids, positions, _with_kv(batch, kv_logits))
    want_ids, want_gap = fused_tail.greedy_reference(logits)
    clear = want_gap > 0.05
    assert (got_ids[clear] == want_ids[clear]).all()
    assert torch.equal(fused_tail.greedy_reference(got_logits)[0], got_ids)
    torch.testing.assert_close(gap, want_gap, rtol=0, atol=0.05)
    torch.testing.assert_close(got_logits, logits, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(hidden.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("kernels,m", [("rows", 8), ("rows+pdl", 8), ("tc", 8), ("tc+pdl", 8),
                                       ("tc+qkv_splits+pdl", 8), ("rows+pdl+attn_pdl", 1),
                                       ("rows+pdl+attn_pdl", 8), ("tc+attn_pdl", 8),
                                       ("tc+attn_pdl", 64), ("tc+weights_as_m", 64)])
def test_cuda_graph_replays_of_the_fused_step_follow_new_data_bit_for_bit(cuda_model, kernels,
                                                                          m):
    """The greedy step (layers and tail) captured once; replays with new tokens / positions /
    slots written into the static inputs equal the eager model on that data, and two replays
    of one input give the same bits (hidden, ids, gap). attn_pdl at 1 row: the attention's
    double-buffered loop, its first tile read before the wait."""
    model = cuda_model
    fused = _with_policy(model, POLICIES[kernels])
    kv, ids, positions, batch = _cuda_case(model, m, seed=0)
    static = [ids.clone(), positions.clone(), batch.out_cache_loc.clone(), batch.seq_lens.clone(),
              batch.req_pool_indices.clone()]

    def step():
        b = Batch(kv, kv.req_to_token, static[4], static[3], static[2])
        return fused.forward_decode_greedy(static[0], static[1], b)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for seed in (1, 2):
            _, ids2, pos2, b2 = _cuda_case(model, m, seed=seed)
            new = (ids2, pos2, b2.out_cache_loc, b2.seq_lens, b2.req_pool_indices)
            for dst, src in zip(static, new):
                dst.copy_(src)
            kv_ref = _clone_kv(kv)
            logits, want = model.forward_decode(ids2, pos2, Batch(kv_ref, kv_ref.req_to_token,
                                                                  b2.req_pool_indices, b2.seq_lens,
                                                                  b2.out_cache_loc))
            graph.replay()
            first = [t.clone() for t in out]
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(first, out))
            torch.testing.assert_close(out[2].float(), want.float(), rtol=2e-2, atol=2e-2)
            want_ids, want_gap = fused_tail.greedy_reference(logits)
            clear = want_gap > 0.05
            assert (out[0][clear] == want_ids[clear]).all()


def _verify_setup(model, bs: int, k: int, max_ctx: int = 48, seed: int = 0):
    """A cache with random past K/V and bs requests, each verifying a k-token draft tree
    (`tree_masks`: a chain, then small trees) at positions prefix .. prefix + k - 1; returns
    (kv, ids [bs*k], positions [bs*k], the verify Batch)."""
    from attention_cases import tree_masks
    cfg, dtype = model.cfg, model.embed.weight.dtype
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(cfg.n_layers, FIRST + bs * max_ctx, cfg.n_kv_heads, cfg.head_dim, max_ctx, FIRST + bs, dtype, "cpu")
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    prefix = torch.randint(1, max_ctx - k, (bs,), generator=g)
    slots = FIRST + torch.arange(bs)[:, None] * max_ctx + torch.arange(max_ctx)[None]
    kv.req_to_token[FIRST:FIRST + bs] = slots.int()
    rows = torch.arange(FIRST, FIRST + bs, dtype=torch.int32)
    depth = torch.arange(k)[None].expand(bs, k)
    positions = (prefix[:, None] + depth).reshape(-1)
    loc = slots.gather(1, prefix[:, None] + depth).reshape(-1)
    masks = tree_masks(bs, [])[:, :k, :k]
    batch = Batch(kv, kv.req_to_token, rows, (prefix + k).int(), loc, tree_mask=masks)
    return kv, torch.randint(0, cfg.vocab_size, (bs * k,), generator=g), positions, batch


@pytest.mark.parametrize("bs,k", [(1, 1), (1, 4), (2, 4), (4, 4)])
def test_a_tree_verify_through_the_fused_layers_is_the_models(bs, k):
    """`forward_verify_hidden` of a model with a fused policy (its layers in the fused kernels,
    interpreted; the tree attention kernel between them) against the same model without one:
    the hidden and the K/V written at every tree token's slot. 16 tokens and fewer go through
    the fused kernels (one row at bs*k = 1, tensor-core kernels above); the test counts it."""
    plain, fused = (_model(torch.float16, fused=f) for f in (None, fd.FusedDecodePolicy()))
    kv, ids, positions, batch = _verify_setup(plain, bs, k, seed=bs)
    kv_ref = _clone_kv(kv)
    ran = []
    real = fd.decode_hidden
    fd_hidden = lambda *a, **kw: ran.append(a[1].shape[0]) or real(*a, **kw)   # noqa: E731
    import unittest.mock as mock
    with torch.no_grad(), mock.patch.object(fd, "decode_hidden", fd_hidden):
        want = plain.forward_verify_hidden(ids, positions, Batch(kv_ref, kv_ref.req_to_token, batch.req_pool_indices,
                                                                 batch.seq_lens, batch.out_cache_loc,
                                                                 tree_mask=batch.tree_mask))
        got = fused.forward_verify_hidden(ids, positions, Batch(kv, kv.req_to_token, batch.req_pool_indices,
                                                                batch.seq_lens, batch.out_cache_loc,
                                                                tree_mask=batch.tree_mask, impl="triton"))
    assert ran == [bs * k]
    torch.testing.assert_close(got.float(), want.float(), **_tol(torch.float16))
    for a, b in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
        torch.testing.assert_close(a.float(), b.float(), **_tol(torch.float16))


def _strided(t):
    """t's values at stride 2 along its last dim (a view into a wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("tc", [False, True])
def test_strided_positions_slots_tables_and_norm_weights_are_read_as_their_values(tc):
    """The wrappers hand the kernels unit-stride copies of positions, slots, norm weights and
    rope tables (the kernels read them densely, sin with cos's row stride): a strided one gives
    the reference's result; a cache whose head rows are strided (written in place, cannot be
    copied) or a v_cache of another shape is refused."""
    m, h, n_q, n_kv, d, f, dtype = 3, 64, 3, 1, 32, 40, torch.float16
    w = _layer(h, n_q, n_kv, d, f, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, h, generator=g).to(dtype)
    positions = torch.randint(0, 64, (m,), generator=g)
    loc = torch.randperm(12, generator=g)[:m] + 1
    rope = _rope(d)
    odd = fd.RopeTables(rope.cos, torch.cat([rope.sin, rope.sin], 1)[:, :d // 2])
    odd_w = fd.LayerWeights(_strided(w.input_norm), w.wq, w.wk, w.wv, w.wo,
                            _strided(w.post_norm), w.w_gate, w.w_up, w.w_down, w.eps)
    policy = fd.FusedDecodePolicy(tc_block_k=32)

    def qkv(weights, tables, pos, slots, impl, caches=None):
        caches = caches or [torch.full((13, n_kv, d), 7.0, dtype=dtype) for _ in range(2)]
        if tc:
            q = fd.norm_qkv_rope_store_tc(x, fd.ssq_partials_reference(x, 16), weights, tables,
                                          pos, slots, *caches, policy=policy, impl=impl)
        else:
            q = fd.norm_qkv_rope_store(x, None, weights, tables, pos, slots, *caches,
                                       impl=impl)[0]
        return q, *caches

    want = qkv(w, rope, positions, loc, "torch")
    got = qkv(odd_w, odd, _strided(positions), _strided(loc), "triton")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **_tol(dtype))
    if tc:
        act = fd.norm_gate_up_silu_tc(x, fd.ssq_partials_reference(x, 16), odd_w, policy=policy,
                                      impl="triton")
    else:
        act = fd.norm_gate_up_silu(x, odd_w, impl="triton")
    torch.testing.assert_close(act.float(), fd.norm_gate_up_silu_reference(x, w).float(),
                               **_tol(dtype))
    for caches in ([_strided(torch.zeros(13, n_kv, d, dtype=dtype)) for _ in range(2)],
                   [torch.zeros(13, n_kv, d, dtype=dtype), torch.zeros(13, n_kv, d // 2, dtype=dtype)]):
        with pytest.raises(ContractValueError, match="cache"):
            qkv(w, rope, positions, loc, "triton", caches)


def test_strided_norm_weights_of_the_residual_norm_and_the_tail_are_read_as_their_values():
    g = torch.Generator().manual_seed(7)
    m, h, v, dtype = 3, 64, 96, torch.float16
    x, parts = torch.randn(m, h, generator=g).to(dtype), torch.randn(2, m, h, generator=g)
    norm_w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    got = fd.residual_norm(x, parts, _strided(norm_w), 1e-5, impl="triton")
    for a, b in zip(got, fd.residual_norm_reference(x, parts, norm_w, 1e-5)):
        torch.testing.assert_close(a.float(), b.float(), **_tol(dtype))
    weight = (torch.randn(v, h, generator=g) * 0.1).to(dtype)
    tail = fused_tail.lm_head_tail(x, fd.ssq_partials_reference(x, 16), _strided(norm_w), 1e-5,
                                   weight, logits=True, impl="triton")
    want = fused_tail.lm_head_tail_reference(x, norm_w, 1e-5, weight, logits=True)
    torch.testing.assert_close(tail.logits, want.logits, **_tol(dtype))
