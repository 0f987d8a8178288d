"""The sampling kernels (`padgraph.backends.triton.sampling`) against the torch reference
(`padgraph.llm.sampling`): the same tokens bit for bit for the same keys, on awkward vocabulary
sizes, several chunks a row, ties, non-finite logits and every parameter at its edges; on a GPU
at a 128256-token vocabulary, eager and inside a CUDA graph."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sampling_stats import exact_half_row, one_thread  # noqa: F401 (fixture)

from padgraph.backends.triton import sampling as K
from padgraph.llm import sampling as S
from padgraph.llm.sampling import PURPOSE_DECODE, PURPOSE_DRAFT


def random_lanes(n, V, g, device="cpu"):
    """Parameters that reach every branch: greedy, temperature only, top-k at 1 / V-1 / >= V,
    top-p tiny to 1, min-p up to 1, seeds over the whole int64 range."""
    r = lambda *s: torch.rand(*s, generator=g)                                  # noqa: E731
    temp = torch.where(r(n) < 0.2, 0.0, r(n) * 2 + 0.05)
    top_k = torch.randint(0, 6, (n,), generator=g)
    top_k = torch.where(r(n) < 0.2, torch.tensor([1, V - 1, V, V + 5])[torch.randint(4, (n,),
                                                                         generator=g)], top_k)
    top_k = torch.where(r(n) < 0.4, 0, top_k).int()
    top_p = torch.where(r(n) < 0.5, 1.0, r(n).clamp_min(1e-6))
    top_p = torch.where(r(n) < 0.05, 1e-7, top_p)
    min_p = torch.where(r(n) < 0.6, 0.0, r(n) * 0.3)
    min_p = torch.where(r(n) < 0.05, 1.0, min_p)
    seed = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=g).abs()
    pos = torch.randint(0, 1 << 20, (n,), generator=g)
    return [t.to(device) for t in (temp, top_k, top_p, min_p, seed, pos)]


def awkward_logits(n, V, g, device="cpu"):
    """Gaussian rows, rows of few distinct values (ties), rows with NaN / +-inf, a dead row."""
    x = torch.randn(n, V, generator=g) * torch.rand(n, 1, generator=g) * 6
    x[1::4] = torch.randint(-2, 3, (len(range(1, n, 4)), V), generator=g).float()
    x[2::7, 3] = float("nan")
    x[3::9, V // 2] = float("inf")
    x[3::9, 1] = float("inf")
    x[4::5, : V // 3] = float("-inf")
    x[5::11] = float("-inf")
    return x.to(device)


@pytest.mark.parametrize("V,block,chunk,cands", [(37, 16, 16, 4), (100, 1024, 32, 2),
                                                  (257, 64, 64, 8)])
def test_kernel_matches_the_reference_bit_for_bit(V, block, chunk, cands):
    """cands: the keys a chunk keeps for the threshold search; few send rows to the fallback."""
    g = torch.Generator().manual_seed(V + block)
    n = 24
    logits = awkward_logits(n, V, g)
    args = random_lanes(n, V, g)
    purpose = PURPOSE_DRAFT if V % 2 else PURPOSE_DECODE
    want = S.sample(logits, *args, purpose, impl="torch")
    got = K.sample_triton(logits, *args, purpose, block=block, chunk=chunk, candidates=cands)
    assert torch.equal(got, want), (got != want).nonzero()[:, 0].tolist()
    kf = K.chunk_stages(logits, args[:4], chunk, cands).kf
    searched = (args[0] > 0) & (((args[1] > 0) & (args[1] < V)) | (args[2] < 1))
    assert (kf[searched] >= 0).any() and (kf[searched] < 0).any()   # both paths ran


def test_kernel_matches_on_bf16_strided_rows_and_empty_batches():
    g = torch.Generator().manual_seed(3)
    V = 100
    wide = (torch.randn(16, 2 * V, generator=g) * 3).to(torch.bfloat16)
    logits = wide[:, ::2]                                   # stride 2 along the vocabulary
    args = random_lanes(16, V, g)
    assert torch.equal(K.sample_triton(logits, *args, PURPOSE_DECODE, block=32, chunk=16),
                       S.sample(logits, *args, PURPOSE_DECODE, impl="torch"))
    rows = wide[::2, :V]                                    # a row stride of 4 * V
    args = [a[::2].contiguous() for a in args]
    assert torch.equal(K.sample_triton(rows, *args, PURPOSE_DECODE, block=64),
                       S.sample(rows, *args, PURPOSE_DECODE, impl="torch"))
    empty = [a[:0] for a in args]
    assert K.sample_triton(torch.zeros(0, V), *empty, PURPOSE_DECODE).shape == (0,)


def test_kernel_is_exact_at_parameter_edges():
    """Narrow nuclei, top-k at the tie boundary, min-p = 1 (only the top token and its ties),
    near-equal logits (thresholds between neighbouring floats)."""
    g = torch.Generator().manual_seed(4)
    V, n = 64, 6
    base = torch.randn(1, V, generator=g)
    logits = base + torch.arange(n)[:, None] * 1e-6 * torch.randn(n, V, generator=g)
    logits[:, 10:20] = logits[:, 10:11]                   # ten equal values
    temp = torch.full((n,), 0.9)
    for top_k, top_p, min_p in ((11, 1.0, 0.0), (15, 0.5, 0.0), (0, 0.02, 0.0),
                                (0, 1.0, 1.0), (3, 0.999, 0.5), (V - 1, 0.9999, 1e-4)):
        args = (temp, torch.full((n,), top_k, dtype=torch.int32), torch.full((n,), top_p),
                torch.full((n,), min_p), torch.arange(n), torch.full((n,), 9))
        assert torch.equal(K.sample_triton(logits, *args, PURPOSE_DECODE, block=32, chunk=16),
                           S.sample(logits, *args, PURPOSE_DECODE, impl="torch"))


@pytest.mark.parametrize("cands", [3, 6])
def test_candidate_thresholds_are_exact_under_heavy_ties(cands):
    """Five distinct logits in 64: chunks hold more ties than candidates, so the candidates
    stop inside a tie group, where a threshold is exact only strictly below tau."""
    g = torch.Generator().manual_seed(cands)
    n, V = 12, 64
    logits = torch.randint(-2, 3, (n, V), generator=g).float()
    args = (torch.full((n,), 0.8), torch.tensor([3, 10, 20, 0] * 3, dtype=torch.int32),
            torch.tensor([1.0] * 4 + [0.3] * 4 + [0.7] * 4), torch.zeros(n), torch.arange(n),
            torch.full((n,), 5))
    want = S.sample(logits, *args, PURPOSE_DECODE, impl="torch")
    assert torch.equal(K.sample_triton(logits, *args, PURPOSE_DECODE, block=32, chunk=16,
                                       candidates=cands), want)


def test_settled_thresholds_keep_exactly_the_references_weights():
    """Every row the candidates settle (Kf >= 0) keeps the reference's weights, with the top
    tokens spread over the chunks or packed into one (sorted logits: that chunk's candidates
    run out first, the case tau guards)."""
    g = torch.Generator().manual_seed(9)
    n, V, chunk, cands = 48, 100, 16, 4
    logits = torch.randn(n, V, generator=g) * 2
    logits[::2] = logits[::2].sort(-1, descending=True).values
    logits[1::4] = logits[1::4].sort(-1).values
    temp = torch.rand(n, generator=g) + 0.2
    top_k = torch.tensor([0, 2, 5, 9, 17, 40] * 8, dtype=torch.int32)
    top_p = torch.tensor([0.2, 0.5, 0.9, 0.99, 1.0, 0.7, 0.8, 1.0] * 6)
    lanes = (temp, top_k, top_p, torch.zeros(n))
    kf = K.chunk_stages(logits, lanes, chunk, cands).kf
    d, _ = S._scaled(logits, temp)
    key = d.view(torch.int32) & 0x7FFFFFFF
    mine = torch.where(key <= kf[:, None].long(), S.fixed_exp(d), 0)
    want, _ = S.sampling_weights(logits, *lanes)
    settled = kf >= 0
    assert settled.sum() >= 8 and (~settled).sum() >= 4, settled.tolist()
    assert torch.equal(mine[settled], want[settled])


def test_kernel_keeps_top_ps_strict_boundary():
    """The weight above the tie equals top_p * total exactly: the tie must go (a kernel
    comparing with <= keeps it and draws it half of the time)."""
    logits = exact_half_row().expand(16, -1)
    n = logits.shape[0]
    args = (torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.full((n,), 0.5),
            torch.zeros(n), torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert (K.sample_triton(logits, *args, PURPOSE_DECODE, block=64) == 0).all()


def test_the_kernels_integer_helpers_are_the_references():
    """fixed_exp, mulhi62 and the stream through a one-program probe kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(D, W, U, Z, H, SEED, POS, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ok = i < n
        tl.store(W + i, K._fixed_exp_t(tl.load(D + i, mask=ok, other=0.0)), mask=ok)
        tl.store(H + i, K._random_bits_t(tl.load(SEED + i, mask=ok), tl.load(POS + i, mask=ok),
                                         2, 5), mask=ok)
        tl.store(U + i, K._mulhi62_t(tl.load(U + i, mask=ok), tl.load(Z + i, mask=ok)), mask=ok)

    g = torch.Generator().manual_seed(5)
    n = 500
    d = torch.cat([-torch.rand(n - 4, generator=g) * 30, torch.tensor([0.0, -0.0, -28.0,
                                                                        float("-inf")])])
    u = torch.randint(0, 2 ** 62, (n,), generator=g)
    z = torch.randint(0, 2 ** 58 + 1, (n,), generator=g)
    seed = torch.randint(0, 2 ** 63 - 1, (n,), generator=g)
    pos = torch.randint(0, 2 ** 40, (n,), generator=g)
    w, h, got_u = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.long), u.clone()
    probe[(1,)](d, w, got_u, z, h, seed, pos, n, BLOCK=512)
    assert torch.equal(w, S.fixed_exp(d))
    assert torch.equal(got_u, S.mulhi62(u, z))
    assert torch.equal(h, S.random_bits(seed, pos, 2, 5))


def test_auto_picks_torch_on_cpu_tensors():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 37, generator=g)
    args = random_lanes(4, 37, g)
    assert torch.equal(S.sample(logits, *args, PURPOSE_DECODE),
                       S.sample(logits, *args, PURPOSE_DECODE, impl="torch"))


# --------------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_kernel_matches_the_reference_on_gpu_at_llama3_vocabulary(bs):
    V = 128256
    g = torch.Generator().manual_seed(bs)
    logits = (torch.randn(bs, V, generator=g) * torch.rand(bs, 1, generator=g) * 8).cuda()
    logits[1::4, ::3] = float("-inf")
    args = random_lanes(bs, V, g, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        want = S.sample(x, *args, PURPOSE_DECODE, impl="torch")
        got = S.sample(x, *args, PURPOSE_DECODE)                 # auto: the kernel on CUDA
        assert torch.equal(got, want), (got != want).nonzero()[:, 0].tolist()
        greedy = args[0] == 0
        assert torch.equal(got[greedy], x.argmax(-1)[greedy])


@pytest.mark.cuda
def test_kernel_in_a_cuda_graph_draws_fresh_keys_on_every_replay():
    """Captured once; each replay reads the seeds and positions in its input buffers, and
    returns the eager call's tokens for them (no capture-time value survives)."""
    V, bs = 128256, 16
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(bs, V, generator=g).cuda()
    args = random_lanes(bs, V, g, device="cuda")
    static = [a.clone() for a in args]
    S.sample(logits, *static, PURPOSE_DECODE)                    # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = S.sample(logits, *static, PURPOSE_DECODE)
    for step in range(3):
        fresh = random_lanes(bs, V, g, device="cuda")
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        assert torch.equal(out, S.sample(logits, *fresh, PURPOSE_DECODE, impl="torch"))


COMPILE_SCRIPT = textwrap.dedent('''
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from padgraph.backends.triton import sampling as K

    def build(kernel, types, constexprs, num_warps):
        params = inspect.signature(kernel.fn).parameters
        sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
        out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=num_warps, enable_fp_fusion=False))
        assert "cubin" in out.asm, sorted(out.asm)
        ptx = out.asm["ptx"]
        assert "fma.rn.f32" not in ptx, "an fp32 FMA: the weights would differ"
        assert "div.full.f32" not in ptx and "div.approx.f32" not in ptx, "an inexact divide"
        print("compiled", kernel.fn.__name__)

    lanes = {"L": "*bf16", "Temp": "*fp32", "TopK": "*i32", "TopP": "*fp32", "MinP": "*fp32",
             "Seed": "*i64", "Pos": "*i64", "Out": "*i64", "PartV": "*fp32", "PartI": "*i32",
             "PartNan": "*i32", "PartM": "*fp32", "PartZ": "*i64", "CandKey": "*i32",
             "CandW": "*i64", "Kf": "*i32"}
    build(K._sample_kernel, lanes, dict(FALLBACK_ONLY=True, BLOCK=1024), 8)
    build(K._chunk_max_kernel, lanes, dict(CHUNK=2048), 4)
    build(K._chunk_cand_kernel, lanes, dict(M=16, CHUNK=2048, CP=64), 4)
    build(K._threshold_kernel, lanes, dict(M=16, CP=64, CM=1024), 4)
    build(K._chunk_weight_kernel, lanes, dict(CHUNK=2048, CP=64), 4)
    build(K._finish_kernel, lanes, dict(CHUNK=2048, CP=64), 4)
''')


def test_kernels_compile_for_sm90_without_fp32_fmas(tmp_path):
    """Triton's real compiler (no GPU): the interpreter would not catch code it rejects (a
    non-constexpr global, a loop-carried type change), nor an FMA that breaks bit-exactness."""
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no NVIDIA backend in this Triton: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True,
                       text=True)
    if p.returncode and "ptxas" in p.stderr and "not found" in p.stderr.lower():
        pytest.skip("no ptxas for sm_90 in this Triton")
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stdout.count("compiled") == 6
