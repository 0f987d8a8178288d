"""bench.common's profile summaries: kernels by class and the GPU span, on stand-in profiler
events (the benchmarks run them on real ones)."""
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.common import gpu_span_us, kernel_class, kernel_classes

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, start, dur, device=CUDA):
    return SimpleNamespace(name=name, device_type=device, device_time=dur,
                           time_range=SimpleNamespace(start=start, end=start + dur))


@pytest.mark.parametrize("name,cls", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "gemm/gemv"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "gemm/gemv"),
    ("_paged_decode_attention_kernel", "attention"),
    ("_norm_qkv_tc_kernel", "fused layer"),
    ("_down_partials_kernel", "fused layer"),
    ("_lm_head_kernel", "lm_head tail"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>", "sampling"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_poi_fused_mul_silu_1", "elementwise"),
    ("triton_poi_fused__to_copy_add_mul_silu_3", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#3}, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, std::array<char*, 1ul> >",
     "copy"),
    ("_store_kv_kernel", "kv store"),
    ("_canary_kernel", "canary"),
    ("_conv_decode_kernel", "recurrent"),
    ("_ssm_tree_kernel", "recurrent"),
    ("_delta_decode_kernel", "recurrent"),
    ("_gate_up_kernel", "moe"),
    ("_down_kernel", "moe"),
    ("_combine_kernel", "moe"),
    ("_mla_keys_major_kernel", "attention"),
    ("_split_kv_kernel", "attention"),
    ("some_unknown_kernel_name", "other"),
])
def test_kernel_names_fall_in_their_class(name, cls):
    assert kernel_class(name) == cls


def test_classes_count_per_call_and_rank_by_time_ignoring_host_events():
    events = [_event("nvjet_gemm", 0, 10.0), _event("nvjet_gemm", 20, 10.0), _event("_norm_qkv_kernel", 12, 4.0),
              _event("cudaGraphLaunch", 0, 50.0, device=CPU)]
    rows = kernel_classes(events, n_calls=2)
    assert [r["class"] for r in rows] == ["gemm/gemv", "fused layer"]
    assert rows[0]["kernels"] == 1.0 and rows[0]["us"] == 10.0 and rows[0]["names"] == ["nvjet_gemm"]
    assert rows[1]["kernels"] == 0.5 and rows[1]["us"] == 2.0


def test_gpu_span_runs_from_the_first_kernel_start_to_the_last_kernel_end_per_call():
    events = [_event("a", 100, 5), _event("b", 130, 10), _event("host", 0, 1000, device=CPU)]
    assert gpu_span_us(events, n_calls=2) == pytest.approx(20.0)
    assert math.isnan(gpu_span_us([_event("host", 0, 5, device=CPU)], 1))      # no kernel: no span


def test_the_recorded_command_is_one_to_type_at_the_root_with_no_machine_path(monkeypatch):
    from bench.common import ROOT, command_line
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
    assert command_line([str(ROOT / "bench" / "bench_hf.py"), "--tiny"]) == "python bench/bench_hf.py --tiny"
    assert command_line([str(ROOT / "examples" / "eagle.py")]) == "python examples/eagle.py"
    assert command_line(["/elsewhere/x.py", "-v"]) == "python x.py -v"
    spec = SimpleNamespace(name="bench.bench_sampling")
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", spec, raising=False)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "bench_sampling.py"), "--sweep"])
    assert command_line() == "python -m bench.bench_sampling --sweep"


def test_git_commit_outside_a_checkout(monkeypatch):
    """A copy without .git (a `git archive` run elsewhere) records PADGRAPH_COMMIT, else 'unknown'."""
    from bench import common

    def no_git(*a, **k):
        raise OSError("no git")
    monkeypatch.setattr(common.subprocess, "run", no_git)
    monkeypatch.setenv("PADGRAPH_COMMIT", "abc1234\n")
    assert common.git_commit() == "abc1234"
    assert common.env_info("x")["commit"] == "abc1234"
    monkeypatch.delenv("PADGRAPH_COMMIT")
    assert common.git_commit() == "unknown"


def test_git_commit_prefers_padgraph_commit_over_the_checkouts_git(monkeypatch):
    """A tree copied onto another machine may carry older git data than the tree itself: the
    PADGRAPH_COMMIT its runner sets wins over what git says there."""
    from bench import common
    monkeypatch.delenv("PADGRAPH_COMMIT", raising=False)
    here = common.git_commit()
    monkeypatch.setenv("PADGRAPH_COMMIT", "f00dcafe")
    assert common.git_commit() == "f00dcafe" != here


def test_module_at_imports_an_older_module_beside_todays(tmp_path):
    """`module_at` loads a module's other version (a .py file here; a git revision in the
    benchmarks) as a separate module whose relative imports resolve to today's package, once
    per text; a revision git does not know stops the run with its message."""
    from bench import common
    from padgraph.backends.triton import sampling as today
    text = (common.ROOT / "backends" / "triton" / "sampling.py").read_text()
    old = tmp_path / "old_sampling.py"
    old.write_text(text.replace("PASSES = 12 ", "PASSES = 13 "))
    other = common.module_at(str(old), "backends/triton/sampling.py", "padgraph.backends.triton")
    assert other is not today and other.PASSES == 13 and today.PASSES == 12
    assert other.__name__.startswith("padgraph.backends.triton._at_")
    assert other._pdl is today._pdl                       # `from . import pdl`: today's package
    assert common.module_at(str(old), "backends/triton/sampling.py",
                            "padgraph.backends.triton") is other
    with pytest.raises(SystemExit, match="--ab no-such-revision"):
        common.module_at("no-such-revision", "backends/triton/sampling.py",
                         "padgraph.backends.triton")
