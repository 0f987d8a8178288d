"""The Triton kernels changed after their last GPU run compile for an H100/H200 (sm_90) with
Triton's real compiler (TTIR -> TTGIR -> LLVM -> PTX -> cubin), with no GPU: the interpreter the
other CPU tests use runs the kernels' Python and would not catch code the compiler rejects.
Runs in a subprocess (TRITON_INTERPRET must be unset before triton is imported) with a fresh
cache; skipped where this Triton has no NVIDIA backend or ptxas. The kernels are built in groups
(`GROUPS`), one subprocess each, so that pytest-xdist spreads the compiler time over its workers.
A group leaves once its kernels have run in the cuda tests on a GPU (the MLA kernels' did:
tests/test_cuda_mla.py)."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import inspect
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from padgraph.backends.triton import attention_decode as ad
    from padgraph.backends.triton import topk as tk

    def build(kernel, types, constexprs, num_warps=4):
        params = inspect.signature(kernel.fn).parameters
        sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
        out = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
        assert "cubin" in out.asm, sorted(out.asm)
        print("compiled", kernel.fn.__name__, sorted(constexprs.items()))
        return out

    GROUP = sys.argv[1]
    # (head dim, queries a request, q heads a kv head): tree verify of 8 and 4 drafts at d 128
    # (128-token tiles) and of 8 at group 8 (64 rows: 64-token tiles)
    SPLIT_SHAPES = [(128, 8, 4), (128, 4, 4), (128, 8, 8)]
    dec = {n: "*bf16" for n in ("Q", "K", "V", "Out")}
    dec.update({"ReqToToken": "*i32", "ReqPoolIdx": "*i32", "SeqLens": "*i32", "TreeMask": "*u8",
                "MidO": "*fp32", "MidLse": "*fp32", "Counters": "*i32", "sm_scale": "fp32"})
    # the tiles the launcher gives head dim 64: decode's (decode_block_n), tree verify's
    tile = lambda tree, prefetch: 64 if tree else ad.decode_block_n(64, 64, 1, prefetch)
    if GROUP == "attention-gemv-topk":
        for tree, prefetch in ((False, False), (True, False), (False, True)):
            build(ad._split_kv_kernel, dec, dict(GROUP=4, NUM_Q=8 if tree else 1, HAS_TREE=tree,
                  UPCAST=False, BLOCK_M=32 if tree else 16, BLOCK_N=tile(tree, prefetch),
                  BLOCK_D=64, BLOCK_DV=64, MERGE_UNROLL=2, PREFETCH=prefetch, PDL=False))
        # PDL (SplitPolicy.pdl): one wait, then the release; metadata (and with the
        # double-buffered loop the first tile's past K / V) requested before the wait; and no
        # register spills (a K / V tile carried across the single-buffered loop's steps, as a
        # first tile read before its wait would be, spilled 408 bytes)
        import os, subprocess, tempfile
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                 "cuobjdump")
        assert os.path.exists(cuobjdump), f"no {cuobjdump} beside this Triton's ptxas"
        for tree, prefetch in ((False, False), (False, True), (True, False)):
            out = build(ad._split_kv_kernel, dec, dict(GROUP=4, NUM_Q=8 if tree else 1,
                        HAS_TREE=tree, UPCAST=False, BLOCK_M=32 if tree else 16,
                        BLOCK_N=tile(tree, prefetch), BLOCK_D=64, BLOCK_DV=64,
                        MERGE_UNROLL=2, PREFETCH=prefetch, PDL=True))
            ptx = out.asm["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            assert ptx.count("griddepcontrol.wait") == 1, ptx.count("griddepcontrol.wait")
            assert ptx.count("griddepcontrol.launch_dependents") == 1
            assert wait < ptx.find("griddepcontrol.launch_dependents")
            before = ptx[:wait].count("ld.global")
            assert before >= (3 if prefetch else 2), before   # seq_len, row, slots (+ K, V)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(out.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                                       capture_output=True, text=True, check=True).stdout
            assert "STACK:0 " in usage + " ", usage
        # extend: packed row tiles found by a prefix sum over qo_indptr (attention_extend.tile_owner)
        from padgraph.backends.triton import attention_extend as ae
        ext = dict(dec, QoIndptr="*i32")
        build(ae._extend_kernel, ext, dict(GROUP=4, UPCAST=False, BLOCK_M=64, BLOCK_N=64,
              BLOCK_D=128, BLOCK_DV=128, MERGE_UNROLL=2, BLOCK_B=64), num_warps=8)
        from padgraph.backends.triton import gemv as gv
        for split_k, pdl in ((1, False), (4, False), (1, True)):   # PDL: griddepcontrol on sm_90
            build(gv._gemv_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                  "ws_ptr": "*fp32"}, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=split_k,
                  UPCAST=False, PREFETCH=pdl, PDL=pdl))
        build(tk._merge_kernel, {"cand_v_ptr": "*fp32", "cand_i_ptr": "*i64", "part_m_ptr": "*fp32",
              "part_s_ptr": "*fp32", "out_v_ptr": "*fp32", "out_i_ptr": "*i64",
              "out_lse_ptr": "*fp32"}, dict(K=4, CK=1024, CP=256))
    if GROUP == "split-defaults":
        # the split kernel as `split_kv_attention` launches it when the policy names nothing
        # (`plan_split`: tile and warps), bf16, with and without PDL. No spill check: tree
        # verify's 128-token tiles at d 128 spill on sm_90 and still ran fastest there
        for d, num_q, group in SPLIT_SHAPES:
            plan = ad.plan_split(8, 8, group, num_q, d, d, 4096, 132)
            blocks, warps = plan.blocks, plan.num_warps
            for pdl in (False, True):
                build(ad._split_kv_kernel, dec, dict(blocks, GROUP=group, NUM_Q=num_q,
                      HAS_TREE=num_q > 1, UPCAST=False, PREFETCH=plan.prefetch, PDL=pdl,
                      MERGE_UNROLL=ad.merge_unroll(blocks["BLOCK_M"], blocks["BLOCK_DV"], warps)),
                      num_warps=warps)
    if GROUP == "moe":   # the routed MoE experts (moe_routed.py), bf16 and fp32 activations
        from padgraph.backends.triton import moe_routed as mr
        t = mr.TILES
        for dt in ("*bf16", "*fp32"):
            build(mr._gate_up_kernel, {"X": dt, "Ids": "*i64", "W": dt, "Act": dt},
                  dict(BLOCK_F=t.block_f, BLOCK_K=t.block_k), t.num_warps)
            build(mr._down_kernel, {"Act": dt, "Ids": "*i64", "W": dt, "Y": dt},
                  dict(BLOCK_H=t.block_h, BLOCK_K=t.block_k), t.num_warps)
            build(mr._combine_kernel, {"Y": dt, "Wt": "*fp32", "Out": dt},
                  dict(BLOCK_H=t.combine_h), t.num_warps)
    if GROUP == "pdl":   # a user's kernel written with backends/triton/pdl.py: test_triton_pdl.py
        sys.path.insert(0, sys.argv[2])
        import test_triton_pdl as tp
        for on in (False, True):
            ptx = build(tp._toy_linear_kernel, {a: "*fp32" for a in "X W B Y".split()},
                        dict(BLOCK_N=16, BLOCK_K=1024, PDL=on)).asm["ptx"]
            # one wait, then the release; the weight tile and bias are requested before the wait
            assert ptx.count("griddepcontrol.wait") == on, ptx.count("griddepcontrol.wait")
            assert ptx.count("griddepcontrol.launch_dependents") == on
            if on:
                assert ptx.find("griddepcontrol.wait") < ptx.find("griddepcontrol.launch_dependents")
                assert "ld.global" in ptx[:ptx.find("griddepcontrol.wait")]
''')


def run_compiler(args, tmp_path) -> str:
    """Run `python args...` with Triton's real compiler (TRITON_INTERPRET unset, a fresh cache);
    its stdout. Skips where this Triton has no NVIDIA backend or no ptxas for sm_90."""
    try:
        import triton.backends.nvidia  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        pytest.skip(f"no NVIDIA backend in this Triton: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    p = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)  # no timeout: slow is not wrong
    if p.returncode and "ptxas" in p.stderr and "not found" in p.stderr.lower():
        pytest.skip("no ptxas for sm_90 in this Triton")
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


# group -> kernels built
GROUPS = {"attention-gemv-topk": 11, "split-defaults": 6, "moe": 6, "pdl": 2}


@pytest.mark.parametrize("group", list(GROUPS))
def test_changed_kernels_compile_for_sm90(group, tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))   # the "pdl" group imports a test's kernel
    out = run_compiler(["-c", SCRIPT, group, tests], tmp_path)
    assert out.count("compiled") == GROUPS[group], out
