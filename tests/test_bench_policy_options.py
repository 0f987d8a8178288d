"""The benchmarks' ways of naming a FusedDecodePolicy: bench_runner's `--fused-policy
field=value,..` and bench_fused_decode's "fused+option" variants. A candidate default runs only
as what the option names; a typo must stop the run, not time the default under its name."""
from types import SimpleNamespace

import pytest

from bench import bench_fused_decode as bfd
from bench import bench_runner
from padgraph.backends.triton.fused_decode import FusedDecodePolicy


def test_fused_policy_fields_parse_to_ints_and_bools():
    fields = bench_runner.parse_policy("tc_qkv_splits=2,attn_pdl=true,tc_fold=False,half_n=4")
    assert fields == {"tc_qkv_splits": 2, "attn_pdl": True, "tc_fold": False, "half_n": 4}
    policy = FusedDecodePolicy(**fields)
    assert policy.tc_qkv_splits == 2 and policy.attn_pdl and not policy.tc_fold
    assert bench_runner.parse_policy("") == {}


@pytest.mark.parametrize("text", ["tc_qkv_split=2", "attn_pdl", "half_n=", "half_n=four"])
def test_a_misnamed_or_malformed_field_stops_the_run(text):
    with pytest.raises((SystemExit, ValueError)):
        bench_runner.parse_policy(text)


def test_variant_options_name_policy_fields():
    p = bfd.policy_of("fused+pdl+apdl+tcqkvs2+tcds4+nofold")
    assert p.pdl and p.tc_pdl and p.attn_pdl and not p.tc_fold
    assert (p.tc_qkv_splits, p.tc_down_splits) == (2, 4)
    assert bfd.policy_of("fused") == FusedDecodePolicy(pdl=False, attn_pdl=False)
    assert bfd.policy_of("fused+apdl").attn_pdl and not bfd.policy_of("fused+apdl").pdl
    with pytest.raises(SystemExit):
        bfd.policy_of("fused+apdll")


def test_the_fused_variants_compile_the_layers_only_where_named(monkeypatch):
    """padgraph+fused+greedy+compile: the candidate policy, its steps past max_rows in the
    layers padgraph+compile compiles (the engine's setup with the fused kernels); the other fused
    variants capture the model's own body uncompiled. The runner is recorded, not built."""
    calls = {}

    def fake_compile(program, body, backend, **opts):
        runner = SimpleNamespace(pool_bytes=lambda: 0,
                                 stats=SimpleNamespace(compiles=0, compile_seconds=0.0))
        calls[body.__self__] = opts.get("torch_compile")
        return runner
    monkeypatch.setattr(bench_runner.pg, "compile", fake_compile)
    model = SimpleNamespace(fused=None)
    step = SimpleNamespace(model=model, kv=None)
    regions = {"regions": ["layer"], "fullgraph": True}
    names = ["padgraph+fused+greedy", "padgraph+fused+greedy+policy", "padgraph+fused+greedy+compile"]
    variants, setup = bench_runner.build_variants(names, step, None, "cpu", regions,
                                                  fused_policy={"max_rows": 32})
    assert set(variants) == set(names)
    by_policy = {(s.model.fused.max_rows, opts is not None): opts for s, opts in calls.items()}
    assert by_policy == {(64, False): None, (32, False): None, (32, True): regions}
    assert setup["padgraph+fused+greedy+compile"]["policy"] == {"max_rows": 32}
    assert "compiles" in setup["padgraph+fused+greedy+compile"]
    assert "compiles" not in setup["padgraph+fused+greedy+policy"]
    assert model.fused is None          # each variant binds a copy of the model


def test_attn64_variants_are_captured_with_the_wide_head_tiles(monkeypatch):
    """<variant>+attn64: the same variant, its graphs captured while the decode attention takes
    the tiles of heads wider than 64 (NARROW_HEAD_DIM 0), restored once it is built; the base
    variant, built beside it, captures with today's tiles. A variant without captured graphs
    cannot take the suffix."""
    from padgraph.backends.triton import attention_decode as ad
    seen = []

    def fake_compile(program, body, backend, **opts):
        seen.append((body, ad.NARROW_HEAD_DIM, ad.decode_block_n(64, 64, 1, False)))
        return SimpleNamespace(pool_bytes=lambda: 0,
                               stats=SimpleNamespace(compiles=0, recompiles=0, compile_seconds=0.0))
    monkeypatch.setattr(bench_runner.pg, "compile", fake_compile)
    step = SimpleNamespace(model=SimpleNamespace(fused=None), kv=None, body="body")
    names = ["padgraph+compile", "padgraph+compile+attn64"]
    variants, setup = bench_runner.build_variants(names, step, None, "cpu", True)
    assert set(variants) == set(names)
    assert sorted(s[1:] for s in seen) == [(0, None), (ad.NARROW_HEAD_DIM, 128)]
    assert ad.NARROW_HEAD_DIM == 64
    assert setup["padgraph+compile+attn64"]["attention_tiles"] == "heads wider than 64's"
    with pytest.raises(SystemExit):
        bench_runner.build_variants(["eager+attn64"], step, None, "cpu", True)
