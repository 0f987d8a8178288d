"""The routed MoE kernels (`backends/triton/moe_routed.py`, interpreted on the CPU) against their
torch reference and against the DeepSeek model's dense masked experts; the model's `MoePolicy`
(which path a token count takes, that the kernels are what runs, that greedy tokens do not
change); the op opaque under torch.compile. cuda-marked: the same equalities at the `lite`
preset's widths, bit-equal CUDA-graph replays with new routing, the routed kernels in a decode
step's profile, and greedy tokens through the cuda backend's graphs.

Sizes are awkward on purpose: 3 tokens, top-2 of 5 experts, hidden 48 and FFN 40 (neither a
multiple of a tile), a token routed twice to one expert. The CPU interpreter rounds fp32 -> bf16
by truncation (the GPU rounds to nearest), so bf16 comparisons there are loose; fp32 is tight.
"""
import math

import pytest
import torch

import padgraph as pg
from padgraph.backends.triton import moe_routed
from padgraph.backends.triton.moe_routed import routed_experts, routed_experts_reference
from padgraph.errors import ContractTypeError, ContractValueError
from padgraph.llm import Engine, SpecConfig
from padgraph.llm.models.deepseek import DeepSeekConfig, DeepSeekModel, MoE, MoePolicy

ROUTED = MoePolicy(routed_max_ratio=math.inf, impl="triton")     # every call routed, the kernels
DENSE = MoePolicy(routed_max_ratio=0)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=6e-2, atol=6e-2)}


def moe_layer(dtype, hidden=48, ffn=40, n_experts=5, top_k=2, seed=0, device="cpu", **kw) -> MoE:
    """A MoE layer with random weights of the model's init (router spread, experts of unit-ish
    output), in dtype; the router stays fp32 inside `select`."""
    cfg = DeepSeekConfig.tiny(hidden_size=hidden, moe_ffn_size=ffn, n_routed_experts=n_experts,
                              top_k=top_k, **kw)
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-2] ** -0.5 if p.dim() > 1
                    else torch.ones(p.shape))
    return moe.to(device=device, dtype=dtype).eval()


def tokens(n, hidden, dtype, seed=1, device="cpu"):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def dense_masked(moe: MoE, x):
    return moe.experts(x, moe.route(x))


# ------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@torch.no_grad()
def test_routed_kernels_equal_the_reference_and_the_dense_masked_experts(dtype, score_func):
    moe = moe_layer(dtype, score_func=score_func, norm_topk_prob=score_func == "sigmoid")
    x = tokens(3, 48, dtype)
    idx, w = moe.select(x)                                               # [3, 2] each
    got = routed_experts(x, idx, w, moe.gate_up, moe.down, impl="triton")
    ref = routed_experts_reference(x, idx, w, moe.gate_up, moe.down)
    dense = dense_masked(moe, x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, ref, **TOL[dtype])
    torch.testing.assert_close(got, dense, **TOL[dtype])
    if dtype == torch.float32:                                           # the fp32 oracle, loop
        torch.testing.assert_close(ref, dense, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_a_token_routed_twice_to_one_expert_and_ids_out_of_range_are_clamped():
    """Ids come from the caller: one expert twice for a token counts twice, and ids out of
    [0, n_experts) read the nearest expert (clamped), never past the weights."""
    moe = moe_layer(torch.float32)
    x = tokens(3, 48, torch.float32)
    ids = torch.tensor([[2, 2], [-7, 4], [5, 99]])
    w = torch.tensor([[0.25, 0.5], [1.0, 0.75], [0.5, 2.0]])
    got = routed_experts(x, ids, w, moe.gate_up, moe.down, impl="triton")
    clamped = ids.clamp(0, 4)
    combine = torch.zeros(3, 5).index_put_((torch.arange(3)[:, None].expand(-1, 2), clamped), w,
                                           accumulate=True)
    torch.testing.assert_close(got, moe.experts(x, combine), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, routed_experts_reference(x, clamped, w, moe.gate_up, moe.down),
                               rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_int32_ids_strided_rows_and_one_token_over_every_expert():
    moe = moe_layer(torch.float32, hidden=40, ffn=72, n_experts=3, top_k=3)
    x = tokens(2, 64, torch.float32)[:1, :40]                           # row stride 64, not 40
    idx, w = moe.select(x)
    got = routed_experts(x, idx.int(), w, moe.gate_up, moe.down, impl="triton")
    torch.testing.assert_close(got, dense_masked(moe, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tiles", [moe_routed.RoutedTiles(16, 16, 16, 16, 2),
                                   moe_routed.RoutedTiles(64, 32, 32, 32, 1)])
@torch.no_grad()
def test_other_tiles_loop_over_k_and_mask_the_tails(tiles):
    """Tiles under the widths (several K steps over hidden 48 and FFN 40, masked last tiles)
    and over them (one masked tile)."""
    moe = moe_layer(torch.float32)
    x = tokens(3, 48, torch.float32)
    idx, w = moe.select(x)
    got = moe_routed.launch_routed(x, idx, w, moe.gate_up, moe.down, tiles)
    torch.testing.assert_close(got, dense_masked(moe, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ContractValueError, match="block_k must be a power of two"):
        moe_routed.RoutedTiles(block_k=48)


CUDA_GRID = (2 ** 31 - 1, 65535, 65535)      # the most programs a CUDA grid takes per axis


def test_launch_grids_stay_within_cudas_limits(monkeypatch):
    """72,000 (token, slot) rows, as a long prefill routed with routed_max_ratio inf gives: every
    launch's grid fits CUDA's (axis 0 below 2**31, axes 1 and 2 at most 65535) and holds one
    program per (row, output tile). A grid with the rows on its second axis launches in the
    interpreter but is refused by the GPU, so the launches are recorded here, not run."""
    grids = []

    class Recorded:
        def __init__(self, kernel):
            self.name = kernel.fn.__name__

        def __getitem__(self, grid):
            grids.append((self.name, tuple(grid)))
            return lambda *args, **kw: None

    for name in ("_gate_up_kernel", "_down_kernel", "_combine_kernel"):
        monkeypatch.setattr(moe_routed, name, Recorded(getattr(moe_routed, name)))
    n, k, hidden, ffn, n_exp = 12000, 6, 40, 72, 8
    tiles = moe_routed.RoutedTiles(block_f=32, block_h=16, block_k=16, combine_h=16)
    moe_routed.launch_routed(torch.zeros(n, hidden), torch.zeros(n, k, dtype=torch.long),
                             torch.ones(n, k), torch.zeros(n_exp, hidden, 2 * ffn),
                             torch.zeros(n_exp, ffn, hidden), tiles)
    programs = {"_gate_up_kernel": n * k * 3, "_down_kernel": n * k * 3, "_combine_kernel": n * 3}
    assert [name for name, _ in grids] == list(programs)
    for name, grid in grids:
        assert all(1 <= g <= most for g, most in zip(grid, CUDA_GRID)), (name, grid)
        assert math.prod(grid) == programs[name], (name, grid)


def test_the_arguments_are_checked():
    moe = moe_layer(torch.float32)
    x, ids, w = tokens(3, 48, torch.float32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    bad = [((x[:, :40], ids, w, moe.gate_up, moe.down), ContractValueError, "hidden=40"),
           ((x, ids, w, moe.gate_up, moe.down[:, :8]), ContractValueError, "down must be"),
           ((x, ids[:2], w, moe.gate_up, moe.down), ContractValueError, "topk_ids must be"),
           ((x, ids, w[:, :1], moe.gate_up, moe.down), ContractValueError, "topk_weights must"),
           ((x, ids.float(), w, moe.gate_up, moe.down), ContractTypeError, "integer"),
           ((x.half(), ids, w, moe.gate_up, moe.down), ContractTypeError, "x's dtype")]
    for args, err, msg in bad:
        with pytest.raises(err, match=msg):
            routed_experts(*args, impl="triton")


def test_with_autograd_the_reference_runs_and_gives_gradients():
    moe = moe_layer(torch.float32)
    x = tokens(3, 48, torch.float32).requires_grad_()
    idx, w = moe.select(x.detach())
    out = routed_experts(x, idx, w, moe.gate_up, moe.down, impl="triton")
    out.sum().backward()
    assert x.grad is not None and moe.gate_up.grad is not None
    assert (moe.gate_up.grad[idx.unique()] != 0).any()
    unpicked = sorted(set(range(5)) - set(idx.view(-1).tolist()))
    assert all((moe.gate_up.grad[e] == 0).all() for e in unpicked)      # only picked slices


def _expert_ops(gm) -> set:
    """The expert computations of a traced graph: the routed op, the dense path's bmm."""
    names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    return {"routed" if "padgraph.routed_experts" in s else "dense" for s in names
            if "padgraph.routed_experts" in s or "bmm" in s}


def test_the_op_is_opaque_under_compile():
    """Traced, the routed experts are one `padgraph::routed_experts` node (the kernels run at
    replay); the MoE layer traces whole (fullgraph), and with a dynamic token count the policy
    is a guard: 2 tokens (4 slices of 5 experts) routed, 3 and 4 dense, 1 routed again."""
    moe = moe_layer(torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(_expert_ops(gm))
        return gm

    for policy, dynamic, sizes, want in ((ROUTED, False, (3,), [{"routed"}]),
                                         (MoePolicy(), True, (2, 3, 4, 2, 1),
                                          [{"routed"}, {"dense"}, {"routed"}])):
        torch._dynamo.reset()
        graphs.clear()
        moe.cfg = moe.cfg.replace(moe_policy=policy)
        cmoe = torch.compile(moe, backend=backend, fullgraph=True, dynamic=dynamic)
        with torch.no_grad():
            for n in sizes:
                x = tokens(n, 48, torch.float32)
                torch.testing.assert_close(cmoe(x), moe(x), rtol=1e-6, atol=1e-6)
        assert graphs == want, (policy, graphs)


# ------------------------------------------------------------------------------- policy

def test_the_policy_rule_and_its_refusals():
    lite = DeepSeekConfig.lite()
    moe_rule = MoePolicy()
    assert [moe_rule.routed(t, lite.top_k, lite.n_routed_experts) for t in (1, 2, 3, 16)] \
        == [True, True, False, False]                                    # 6, 12 <= 16 < 18
    assert MoePolicy(routed_max_ratio=6.0).routed(16, 6, 16)             # 96 slices <= 96
    assert not MoePolicy(routed_max_ratio=6.0).routed(17, 6, 16)
    assert not DENSE.routed(1, 1, 64) and ROUTED.routed(10 ** 6, 8, 8)
    for kw, msg in ((dict(routed_max_ratio=-1.0), "routed_max_ratio"),
                    (dict(routed_max_ratio=math.nan), "routed_max_ratio"),
                    (dict(impl="cuda"), "impl")):
        with pytest.raises(ContractValueError, match=msg):
            MoePolicy(**kw)


@torch.no_grad()
def test_padded_tokens_cannot_change_real_tokens_on_the_routed_path():
    """`pg.check` over buckets with the kernels: every token routes on its own, so pad rows
    (zeros: they route like any token, to in-range experts) leave real rows' outputs alone."""
    moe = moe_layer(torch.float32, hidden=64, ffn=40)
    moe.cfg = moe.cfg.replace(moe_policy=ROUTED)
    axis = pg.Axis("tokens")
    program = pg.Program("moe_routed", inputs={"x": pg.Input((axis, 64), torch.float32, pad=0)},
                         outputs={"y": pg.Output((axis, 64), torch.float32)},
                         buckets=pg.Buckets([1, 2, 4]))
    report = pg.check(program, lambda v: {"y": moe(v.x)}, trials=4)
    assert report.ok, str(report)


# ------------------------------------------------------------------------------- model

def greedy_outputs(target):
    from test_eagle_e2e import LENS, prompts
    w = Engine(target, None, SpecConfig(), max_bs=8, max_context=64,
               buckets=pg.Buckets([1, 2, 4, 8]))
    with torch.no_grad():
        reqs, _ = w.generate_greedy(prompts(target.cfg.vocab_size), [m for _, m in LENS])
    return [r.output for r in reqs]


def test_greedy_tokens_are_unchanged_with_the_routed_kernels(monkeypatch):
    """The tiny DeepSeek target (fp32, 8 experts top-2) decoding 5 requests that finish one by
    one (buckets 8, 4, 2, 1): the default policy routes the steps of <= 4 rows (8 slices) through
    the kernels, dense above; `DENSE` never routes. The tokens are the same, and the kernels are
    what ran the small steps (launches counted; no dense expert call at <= 4 rows). Both layers
    are MoE and init_std is 0.1, so the tokens depend on the experts: with every expert's weights
    moved to the next expert's place, 33 of the 51 tokens change."""
    torch.manual_seed(0)
    target = DeepSeekModel(DeepSeekConfig.tiny(init_std=0.1, n_dense_layers=0)).eval()
    target.set_moe_policy(DENSE)
    want = greedy_outputs(target)

    launches, dense_rows = [], []
    launch, experts = moe_routed.launch_routed, MoE.experts
    monkeypatch.setattr(moe_routed, "launch_routed",
                        lambda x, *a: launches.append(x.shape[0]) or launch(x, *a))
    monkeypatch.setattr(MoE, "experts", lambda self, x, c: dense_rows.append(x.shape[0]) or experts(self, x, c))
    target.set_moe_policy(MoePolicy(impl="triton"))
    assert greedy_outputs(target) == want
    assert launches and set(launches) <= {1, 2, 3, 4}, launches
    assert all(n > 4 for n in dense_rows), dense_rows                  # bucket 8 and the prefills
    assert all(m.cfg.moe_policy == MoePolicy(impl="triton")
               for m in target.modules() if isinstance(m, MoE))


# ---------------------------------------------------------------------------------- GPU

def lite_moe(dtype=torch.bfloat16):
    c = DeepSeekConfig.lite()
    return moe_layer(dtype, hidden=c.hidden_size, ffn=c.moe_ffn_size, n_experts=c.n_routed_experts,
                     top_k=c.top_k, score_func=c.score_func, norm_topk_prob=c.norm_topk_prob,
                     device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 16])
@torch.no_grad()
def test_cuda_routed_kernels_equal_dense_masked_at_lite_widths(dtype, n):
    moe = lite_moe(dtype)
    x = tokens(n, moe.cfg.hidden_size, dtype, device="cuda")
    idx, w = moe.select(x)
    got = routed_experts(x, idx, w, moe.gate_up, moe.down)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, routed_experts_reference(x, idx, w, moe.gate_up, moe.down), **tol)
    torch.testing.assert_close(got, dense_masked(moe, x), **tol)


@pytest.mark.cuda
@torch.no_grad()
def test_cuda_routed_kernels_past_65535_rows():
    """12,000 tokens top-6 (72,000 (token, slot) rows, more than a CUDA grid's second axis takes)
    through the kernels, against the dense masked experts."""
    moe = moe_layer(torch.float32, hidden=64, ffn=48, n_experts=8, top_k=6, device="cuda")
    x = tokens(12000, 64, torch.float32, device="cuda")
    idx, w = moe.select(x)
    got = routed_experts(x, idx, w, moe.gate_up, moe.down)
    torch.testing.assert_close(got, dense_masked(moe, x), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@torch.no_grad()
def test_cuda_graph_replays_follow_new_routing_bit_for_bit():
    """One capture at 2 tokens; replays with new tokens (so new experts) give the eager kernels'
    bits, twice over (no atomics: one summation order)."""
    moe = lite_moe()
    x = tokens(2, moe.cfg.hidden_size, torch.bfloat16, device="cuda")
    idx, w = moe.select(x)
    args = [x, idx, w]
    routed_experts(*args, moe.gate_up, moe.down)                       # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(*args, moe.gate_up, moe.down)
    for seed in (5, 6):
        new = tokens(2, moe.cfg.hidden_size, torch.bfloat16, seed=seed, device="cuda")
        new_idx, new_w = moe.select(new)
        for dst, src in zip(args, (new, new_idx, new_w)):
            dst.copy_(src)
        graph.replay()
        first = out.clone()
        graph.replay()
        want = routed_experts(new, new_idx, new_w, moe.gate_up, moe.down)
        assert torch.equal(out, first) and torch.equal(out, want)


def _kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.cuda
@torch.no_grad()
def test_cuda_decode_step_runs_the_routed_kernels_at_bs1_and_dense_at_bs3():
    """The lite preset (2 layers, one MoE) decoding eagerly: at bs 1 the profile holds the three
    routed kernels; at bs 3 (18 slices > 16 experts) none of them (the dense masked path)."""
    from padgraph.llm import Batch
    from padgraph.llm.models.deepseek import LatentCache
    torch.manual_seed(0)
    target = DeepSeekModel(DeepSeekConfig.lite(n_layers=2, vocab_size=4096)).cuda().bfloat16().eval()
    routed_names = ("_gate_up_kernel", "_down_kernel", "_combine_kernel")
    for bs, routed in ((1, True), (3, False)):
        kv = LatentCache(2, 64, target.cfg.latent_width, 16, bs + 1, torch.bfloat16, "cuda")
        rows = torch.arange(1, bs + 1, dtype=torch.int32, device="cuda")
        kv.req_to_token[1:] = torch.arange(1, 1 + bs * 16, device="cuda").view(bs, 16)
        lens = torch.full((bs,), 4, dtype=torch.int32, device="cuda")
        loc = kv.req_to_token[rows.long(), 3].long()
        batch = Batch(kv, kv.req_to_token, rows, lens, loc)
        ids, pos = torch.arange(bs, device="cuda") + 7, torch.full((bs,), 3, device="cuda")
        target.forward_decode(ids, pos, batch)                          # compile the kernels
        names = _kernel_names(lambda: target.forward_decode(ids, pos, batch))
        ran = [n for n in routed_names if any(n in k for k in names)]
        assert ran == (list(routed_names) if routed else []), (bs, names)


@pytest.mark.cuda
def test_cuda_greedy_tokens_routed_against_dense_up_to_ties():
    """bf16 through the cuda backend (captured graphs, compiled layers with the op inside):
    greedy tokens with the default policy (routed at <= 4 rows) against always-dense, equal
    except at top-2 logit ties or router near-ties (test_cuda_deepseek.py's allowance)."""
    from test_cuda_deepseek import ROUTER_TIES, small_gpu_config
    from test_cuda_eagle import TIE_TOL, _prompts
    torch.manual_seed(0)
    target = DeepSeekModel(small_gpu_config(n_layers=3)).cuda().bfloat16().eval()
    prompts, news = _prompts(target.cfg.vocab_size, 11)

    def run(policy):
        target.set_moe_policy(policy)
        w = Engine(target, None, SpecConfig(), backend="cuda", max_bs=16, max_context=96,
                   buckets=pg.Buckets([1, 2, 4, 8, 16]))
        with torch.no_grad():
            reqs, _ = w.generate_greedy(prompts, news)
        return reqs

    dense, routed = run(DENSE), run(MoePolicy())
    bad = []
    for d, r in zip(dense, routed):
        if d.output != r.output:
            i = next((j for j, (a, b) in enumerate(zip(d.output, r.output)) if a != b),
                     min(len(d.output), len(r.output)))
            if d.gaps[i] > TIE_TOL:
                bad.append((d.rid, i, d.gaps[i]))
    assert len(bad) <= ROUTER_TIES, bad
