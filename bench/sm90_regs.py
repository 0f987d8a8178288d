"""Registers, spills and shared memory of the MLA kernel compiled for sm_90, without a GPU.

Triton's real compiler (TTIR -> cubin, ptxas included in the wheel) with the divisibility hints
the JIT would give at DeepSeek-V2-Lite sizes (16-byte aligned pointers, strides and widths
that are multiples of 16), then `cuobjdump -res-usage` and the SASS: local-memory loads and
stores (spills), overall and inside loops. A proxy for what a GPU run would show, to choose
which tiles are worth a GPU sweep (`bench/bench_mla.py`); compare within one Triton version
(the device has 3.6: `pip install triton==3.6.0` in a separate venv).

    python -m bench.sm90_regs '[{"BLOCK_N": 32, "warps": 4, "MERGE_UNROLL": 1}, ...]'
    python -m bench.sm90_regs '[{"kernel": "keys", "BLOCK_N": 64, "warps": 4}]'

kernel: "rows" (`_mla_kernel`, the default) or "keys" (`_mla_keys_major_kernel`); HGMMA counts
the Hopper warp-group MMA instructions, HMMA the register ones.
"""
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from padgraph.backends.triton.attention_mla_decode import _mla_kernel, _mla_keys_major_kernel
from padgraph.backends.triton.attention_split import merge_unroll

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = dict(Q="*bf16", KV="*bf16", ReqToToken="*i32", ReqPoolIdx="*i64", SeqLens="*i32",
            QoIndptr="*i64", TreeMask="*i64", Out="*bf16", MidO="*fp32", MidLse="*fp32",
            Counters="*i32")
# integer arguments the JIT would see as multiples of 16 at 16 heads, 512 + 64 latent columns
# (the do_not_specialize ones are never specialized)
DIV16 = {"stride_q_t", "stride_q_h", "stride_kv_s", "stride_rt", "stride_o_t", "stride_o_h",
         "n_heads", "kv_lora_rank", "rope_dim"}


KERNELS = dict(rows=_mla_kernel, keys=_mla_keys_major_kernel)


def compile_mla(warps=4, stages=2, kernel="rows", **cx):
    kernel = KERNELS[kernel]
    const = dict(NUM_Q=1, MODE=0, UPCAST=False, BLOCK_H=16, BLOCK_N=32, BLOCK_C=512,
                 BLOCK_R=64, SLOTS_AHEAD=1)
    if kernel is _mla_kernel:
        const["SPLIT_C"] = False  # the JIT's default; a config may set it
    const.update(cx)
    const.setdefault("MERGE_UNROLL", merge_unroll(const["BLOCK_H"], const["BLOCK_C"], warps))
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in const else PTRS.get(n, "fp32" if n == "sm_scale" else "i32")
           for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in PTRS or n in DIV16}
    k = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True,
                         text=True).stdout
    sass = subprocess.run([f"{BIN}/nvdisasm", "-c", f.name], capture_output=True,
                          text=True).stdout.splitlines()
    os.unlink(f.name)
    labels = {m.group(1): i for i, ln in enumerate(sass)
              if (m := re.match(r"\.(L_x_\d+):", ln.strip()))}
    in_loop = set()
    for i, ln in enumerate(sass):  # a branch back to an earlier label closes a loop
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            in_loop.update(range(labels[m.group(1)], i + 1))
    ldl = [i for i, ln in enumerate(sass) if re.search(r"\bLDL", ln)]
    stl = [i for i, ln in enumerate(sass) if re.search(r"\bSTL", ln)]
    use = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return dict(regs=int(use.group(1)), stack_bytes=int(use.group(2)),
                shared=k.metadata.shared, ldl=len(ldl), stl=len(stl),
                ldl_in_loops=sum(i in in_loop for i in ldl),
                stl_in_loops=sum(i in in_loop for i in stl),
                hmma=sum("HMMA" in ln for ln in sass),
                hgmma=sum("HGMMA" in ln for ln in sass), merge_unroll=const["MERGE_UNROLL"],
                # global loads straight to registers, and asynchronous copies to shared memory
                # (cp.async: what Triton's pipeliner emits for a load it runs ahead)
                ldg_in_loops=sum(i in in_loop for i, ln in enumerate(sass)
                                 if re.search(r"\bLDG\.", ln)),
                ldgsts_in_loops=sum(i in in_loop for i, ln in enumerate(sass)
                                    if "LDGSTS" in ln))


def main() -> None:
    configs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else [
        dict(BLOCK_N=32, warps=4), dict(BLOCK_N=64, warps=8)]
    print(f"triton {triton.__version__}")
    for c in configs:
        t0 = time.time()
        report = compile_mla(**c)
        print(json.dumps(dict(config=c, report=report, seconds=round(time.time() - t0, 1))),
              flush=True)


if __name__ == "__main__":
    main()
