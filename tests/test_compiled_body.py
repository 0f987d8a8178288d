"""`torch_compile=`: one torch.compile of the body for the whole ladder, on every backend."""
import dataclasses
import functools

import pytest
import torch

import padgraph as pg

bs = pg.Axis("bs")
tok = pg.Axis("tokens", capacity=bs * 2)


def program():
    return pg.Program(
        "compiled",
        inputs={"h": pg.Input((bs, 8), torch.float32, pad=0.0), "ids": pg.Input((tok,), torch.int64, pad=0),
                "cu": pg.Input((bs + 1,), torch.int32, pad=pg.Edge())},
        outputs={"y": pg.Output((bs, 8), torch.float32), "z": pg.Output((tok,), torch.int64)},
        state={"w": pg.State()},
        buckets=pg.Buckets([1, 2, 4, 8, 16]),
    )


def body(x):
    y = torch.relu(x.h @ x.w) * x.cu[1:, None] + x.bucket
    return {"y": y, "z": x.ids * 2 + x.extent("tokens")}


def raw(n, t, device="cpu"):
    g = torch.Generator().manual_seed(n * 31 + t)
    return {"h": torch.randn(n, 8, generator=g).to(device), "ids": torch.arange(t, device=device),
            "cu": torch.arange(n + 1, dtype=torch.int32, device=device)}


CALLS = [(16, 3), (5, 7), (3, 1), (9, 18), (2, 2), (12, 1), (1, 0)]


def test_one_compilation_serves_the_ladder_on_the_reference_backend():
    w = torch.randn(8, 8)
    runner = pg.compile(program(), body, backend="reference", state={"w": w}, torch_compile=True)
    eager = pg.compile(program(), body, backend="reference", state={"w": w})
    for n, t in CALLS:
        a, b = runner(**raw(n, t)), eager(**raw(n, t))
        torch.testing.assert_close(a.y, b.y, msg=f"n={n} t={t}")
        assert torch.equal(a.z, b.z)
    # one graph for every bucket >= 2; torch specialises size 1, so bucket 1 adds one
    assert runner.stats.compiles <= 2 and runner.stats.recompiles <= 1, runner.stats.table()
    assert "torch.compile graphs" in runner.stats.table()
    # the calls that compiled are timed; calls served by a compiled graph add nothing
    spent = runner.stats.compile_seconds
    assert spent > 0, runner.stats.table()
    for n, t in CALLS:
        runner(**raw(n, t))
    assert runner.stats.compile_seconds == spent and runner.stats.compiles <= 2


def _tanh_body(x):
    return {"y": torch.tanh(x.h @ x.w) + x.bucket, "z": x.ids * 3 + x.extent("tokens")}


@pytest.mark.parametrize("size_oblivious", [True, False])
def test_bucket_1_shares_the_graph_when_size_oblivious(size_oblivious, no_compile_caches):
    torch._dynamo.reset()
    w = torch.randn(8, 8)
    runner = pg.compile(program(), _tanh_body, backend="reference", state={"w": w},
                        torch_compile={"size_oblivious": size_oblivious})
    eager = pg.compile(program(), _tanh_body, backend="reference", state={"w": w})
    for n, t in CALLS:                          # buckets 16, 8, 4, 16, 2, 16, 1
        a, b = runner(**raw(n, t)), eager(**raw(n, t))
        torch.testing.assert_close(a.y, b.y, msg=f"n={n} t={t}")
        assert torch.equal(a.z, b.z)
    want = 1 if size_oblivious else 2           # by default torch specialises size 1
    assert runner.stats.compiles == want and runner.stats.recompiles == want - 1, runner.stats.table()


def test_many_whole_compiled_runners_in_one_process():
    """Each runner's body compiles on a code object of its own: a process holds more runners
    than dynamo's recompile limit (8 per code object) allows graphs on one, each with its
    bucket-1 graph, and none fails (fullgraph) or falls back to eager."""
    torch._dynamo.reset()
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    runners = []
    for i in range(limit + 2):
        w = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
        r = pg.compile(program(), body, backend="reference", state={"w": w}, torch_compile={"fullgraph": True})
        e = pg.compile(program(), body, backend="reference", state={"w": w})
        for n, t in ((5, 3), (1, 1)):
            torch.testing.assert_close(r(**raw(n, t)).y, e(**raw(n, t)).y)
        runners.append(r)
    assert all(1 <= r.stats.compiles <= 2 for r in runners), [r.stats.compiles for r in runners]


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_body_that_specialises_per_bucket_compiles_every_bucket(fullgraph):
    """A body with a Python loop over its bucket size compiles one graph per bucket, all counted;
    dynamo's limit of 8 graphs per code object would run buckets 9.. eagerly (or fail under
    fullgraph)."""
    ladder = list(range(1, 13))
    prog = pg.Program("per_bucket", inputs={"h": pg.Input((bs, 4), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((bs, 4), torch.float32)}, buckets=pg.Buckets(ladder))

    def per_bucket(x):
        return {"y": x.h * sum(i % 5 for i in range(x.h.shape[0]))}

    runner = pg.compile(prog, per_bucket, backend="reference", torch_compile={"fullgraph": fullgraph})
    for n in ladder:
        h = torch.randn(n, 4)
        torch.testing.assert_close(runner(h=h).y, h * sum(i % 5 for i in range(n)))
    assert runner.stats.compiles == len(ladder), runner.stats.table()
    assert runner.stats.recompiles == len(ladder) - 1


def test_reduce_overhead_is_refused_with_the_reason():
    with pytest.raises(pg.ContractValueError, match="captures the CUDA graphs itself"):
        pg.compile(program(), body, backend="reference", state={"w": torch.zeros(8, 8)},
                   torch_compile={"mode": "reduce-overhead"})


@pytest.mark.cuda
def test_inductor_kernels_are_captured_in_padgraphs_graphs():
    torch._logging.set_logs(recompiles=True)        # a failure shows torch's reason for each recompile
    w = torch.randn(8, 8, device="cuda")
    runner = pg.compile(program(), body, backend="cuda", state={"w": w},
                        torch_compile={"mode": "max-autotune-no-cudagraphs"})
    eager = pg.compile(program(), body, backend="reference", state={"w": w})
    assert runner.stats.compiles <= 2 and runner.stats.recompiles <= 1, runner.capture_report()
    assert "torch.compile" in runner.capture_report()
    compiles = runner.stats.compiles
    for n, t in CALLS:
        a, b = runner(**raw(n, t, "cuda")), eager(**raw(n, t, "cuda"))
        torch.testing.assert_close(a.y, b.y, msg=f"n={n} t={t}")
        assert torch.equal(a.z, b.z)
    assert runner.stats.compiles == compiles            # calls replay graphs: nothing compiles


# ---------------------------------------------------------------- regional compilation

def _tiny_decode(n_layers=4):
    from padgraph.llm.models.llama import LlamaConfig, LlamaModel
    from padgraph.llm import SpecConfig, programs
    from padgraph.llm.bodies import decode_body
    from padgraph.llm.kv import FIRST, new_cache
    target = LlamaModel(LlamaConfig.tiny(n_layers=n_layers)).eval()
    kv = new_cache(target, n_layers, 8 * 32 + FIRST, 32, 8 + FIRST)
    for t in kv.k + kv.v:
        t.normal_()
    prog = programs(target.cfg, SpecConfig(), torch.float32, pg.Buckets([1, 2, 4, 8]))["decode"]
    state = {"k_cache": kv.k, "v_cache": kv.v, "req_to_token": kv.req_to_token}
    return target, kv, prog, decode_body(target), state


def _decode_raw(n, kv, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(2, 30, (n,), generator=g)
    from padgraph.llm.kv import FIRST      # slot and row 0: sinks; 1: canaries
    rows = torch.arange(FIRST, n + FIRST)
    kv.req_to_token[FIRST:n + FIRST] = (FIRST + (rows[:, None] - FIRST) * 32 + torch.arange(32)).int()
    return {"input_ids": torch.randint(1, 100, (n,), generator=g), "positions": ctx - 1,
            "seq_lens": ctx.int(), "req_pool_indices": rows.int(),
            "out_cache_loc": kv.req_to_token[rows, ctx - 1].long()}


def test_regional_compile_one_graph_serves_every_layer_and_bucket():
    target, kv, prog, body, state = _tiny_decode()
    runner = pg.compile(prog, body, backend="reference", state=state,
                        torch_compile={"regions": target.layers, "fullgraph": True})
    eager = pg.compile(prog, body, backend="reference", state=state)
    for i, n in enumerate([8, 3, 5, 2, 1, 7]):
        raw = _decode_raw(n, kv, i)
        snapshot = [t.clone() for t in kv.k + kv.v]
        a = runner(**raw)
        for t, s in zip(kv.k + kv.v, snapshot):   # the eager run starts from the same cache
            t.copy_(s)
        b = eager(**raw)
        torch.testing.assert_close(a.top2_gap, b.top2_gap, msg=f"n={n}")
        assert torch.equal(a.next_token, b.next_token), n
    # 4 layers, buckets 8/4/2/1: one graph for every layer at buckets >= 2, bucket 1 adds one
    assert runner.stats.compiles <= 2, runner.stats.table()
    assert all("forward" not in m.__dict__ for m in target.layers)   # modules left as found


def test_size_oblivious_regions_give_the_llama_decode_one_graph(no_compile_caches):
    """torch_compile={"size_oblivious": True} on the example Llama's decode: its layer lowers
    under it, so buckets 8, 4, 2 and 1 share one graph (the heads are unflattened before the
    q / k / v split; a view of a column slice guarded on the batch being 1)."""
    target, kv, prog, body, state = _tiny_decode()
    runner = pg.compile(prog, body, backend="reference", state=state,
                        torch_compile={"regions": target.layers, "fullgraph": True, "size_oblivious": True})
    eager = pg.compile(prog, body, backend="reference", state=state)
    for i, n in enumerate([8, 3, 2, 1, 5]):
        raw = _decode_raw(n, kv, i)
        snapshot = [t.clone() for t in kv.k + kv.v]
        a = runner(**raw)
        for t, s in zip(kv.k + kv.v, snapshot):
            t.copy_(s)
        assert torch.equal(a.next_token, eager(**raw).next_token), n
    assert runner.stats.compiles == 1, runner.stats.table()


def _logged(fn):
    """A decorator like transformers' deprecate_kwarg: every function it wraps runs one code object."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapped


class _Narrow(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width))

    @_logged
    def forward(self, h):
        return torch.tanh(h @ self.w)


class _Wide(_Narrow):
    @_logged
    def forward(self, h):
        return torch.relu(h @ self.w)


def test_regions_with_a_shared_decorator_compile_on_their_own_code_objects(no_compile_caches):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries
    torch._dynamo.reset()
    narrow, wide = _Narrow(8), _Wide(16)
    shared = type(narrow).forward.__code__
    assert type(wide).forward.__code__ is shared               # one `wrapped` for both classes
    prog = pg.Program("decorated", inputs={"h": pg.Input((bs, 8), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((bs, 16), torch.float32)}, buckets=pg.Buckets([1, 2, 4, 8]))
    pad = torch.zeros(8, 8)

    def body(x):
        return {"y": wide(torch.cat([narrow(x.h), x.h @ pad], 1))}

    runner = pg.compile(prog, body, backend="reference",
                        torch_compile={"regions": [narrow, wide], "fullgraph": True})
    with torch.no_grad():
        for n in (8, 3, 5, 2, 1, 7):
            h = torch.randn(n, 8)
            want = torch.relu(torch.cat([torch.tanh(h @ narrow.w), h @ pad], 1) @ wide.w)
            torch.testing.assert_close(runner(h=h).y, want)
    # each class: one graph for buckets >= 2 and one for bucket 1, cached on its own entry code
    # object; on the shared `wrapped` they would share guards, recompile limit and size history
    assert runner.stats.compiles == 4, runner.stats.table()
    assert not entries(shared), f"{len(entries(shared))} graphs cached on the decorator's shared code object"


@dataclasses.dataclass
class _Meta:
    """Per-call metadata a region reads through an object, as an attention batch."""
    scale: torch.Tensor             # [bs]

    def __post_init__(self):
        self.shift = self.scale * 2  # an attribute that is not a field


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, h, meta=None):
        return (h @ self.w) * meta.scale[:, None] + meta.shift[:, None]


def test_region_marks_the_tensors_of_a_dataclass_argument(no_compile_caches):
    """A region reading [bs] tensors through a dataclass argument: they are marked dynamic with
    the region's tensor arguments, so the ladder takes one size-oblivious graph, not one more
    after dynamo's automatic dynamic shapes notice them change."""
    torch._dynamo.reset()
    layer = _Scaled()
    prog = pg.Program("meta", inputs={"h": pg.Input((bs, 8), torch.float32, pad=0.0),
                                      "s": pg.Input((bs,), torch.float32, pad=0.0)},
                      outputs={"y": pg.Output((bs, 8), torch.float32)}, buckets=pg.Buckets([1, 2, 4, 8]))

    def body(x):
        return {"y": layer(x.h, meta=_Meta(x.s))}

    runner = pg.compile(prog, body, backend="reference",
                        torch_compile={"regions": [layer], "fullgraph": True, "size_oblivious": True})
    with torch.no_grad():
        for n in (8, 3, 1, 5):
            h, sc = torch.randn(n, 8), torch.randn(n)
            torch.testing.assert_close(runner(h=h, s=sc).y, (h @ layer.w) * sc[:, None] + 2 * sc[:, None])
    assert runner.stats.compiles == 1 and runner.stats.recompiles == 0, runner.stats.table()


def test_regions_must_be_modules():
    target, kv, prog, body, state = _tiny_decode(1)
    with pytest.raises(pg.ContractValueError, match="regions"):
        pg.compile(prog, body, backend="reference", state=state, torch_compile={"regions": [body]})


def _to(raw, device):
    return {k: v.to(device) for k, v in raw.items()}


@pytest.mark.cuda
def test_regional_compile_on_cuda_captures_every_bucket():
    target, kv, prog, body, state = _tiny_decode()
    target.cuda()
    for name in ("k", "v"):
        setattr(kv, name, [t.cuda() for t in getattr(kv, name)])
    kv.req_to_token = kv.req_to_token.cuda()
    state = {"k_cache": kv.k, "v_cache": kv.v, "req_to_token": kv.req_to_token}
    runner = pg.compile(prog, body, backend="cuda", state=state,
                        torch_compile={"regions": target.layers, "fullgraph": True})
    eager = pg.compile(prog, body, backend="reference", state=state)
    assert runner.stats.compiles <= 2, runner.capture_report()
    compiles = runner.stats.compiles
    for i, n in enumerate([8, 3, 1, 6]):
        raw = _to(_decode_raw(n, kv, i), "cuda")
        snapshot = [t.clone() for t in kv.k + kv.v]
        a = runner(**raw)
        a = {k: v.clone() for k, v in a.items()}
        for t, s in zip(kv.k + kv.v, snapshot):
            t.copy_(s)
        b = eager(**raw)
        torch.testing.assert_close(a["top2_gap"], b.top2_gap, atol=1e-4, rtol=1e-4)
        assert torch.equal(a["next_token"], b.next_token), n
    assert runner.stats.compiles == compiles            # replays compile nothing


@pytest.mark.cuda
def test_reduce_overhead_over_the_triton_kernels_keeps_its_cudagraphs():
    """The attention kernels are opaque custom ops under compile: no mutated graph input."""
    import logging

    from padgraph.llm.batch import Batch
    target, kv, prog, body, state = _tiny_decode(2)
    target.cuda()
    kv.k, kv.v = [t.cuda() for t in kv.k], [t.cuda() for t in kv.v]
    kv.req_to_token = kv.req_to_token.cuda()
    for t in kv.k + kv.v + [kv.req_to_token]:
        torch._dynamo.mark_static_address(t)

    def step(**r):
        batch = Batch(kv, kv.req_to_token, r["req_pool_indices"], r["seq_lens"],
                      r["out_cache_loc"])
        logits, _ = target.forward_decode(r["input_ids"], r["positions"], batch)
        return logits.argmax(-1)

    reasons = []

    class Keep(logging.Handler):
        def emit(self, record):
            if "skipping cudagraphs" in record.getMessage():
                reasons.append(record.getMessage())

    logger = logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")
    handler = Keep()
    logger.addHandler(handler)
    try:
        fn = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        raw = _to(_decode_raw(4, kv, 0), "cuda")
        with torch.inference_mode():
            ref = step(**raw)
            for _ in range(3):
                got = fn(**raw)
    finally:
        logger.removeHandler(handler)
    from torch._dynamo.utils import counters
    assert not reasons and not counters["inductor"]["cudagraph_skips"], reasons
    assert torch.equal(got, ref)
