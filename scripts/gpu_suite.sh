#!/usr/bin/env bash
# The GPU suite and the benchmarks in ONE call (the device tool runs this on the H200):
#   bash scripts/gpu_suite.sh [STAGE ...]      with no stage: all of them
# stages:
#   tests            the cuda tests (pytest -m cuda), TEST_PROCS pytest-xdist workers on the one GPU (default 4;
#                    an H100 ran them in 160 s at 15, work-stealing, where 14 by file had not finished in 390 s)
#   spec             the cuda conformance suite (python -m padgraph.spec --backend cuda)
#   generated        the generated conformance cases on each cuda variant: the three pack strategies
#                    (GEN_N programs each, default 5000) and torch_compile (GEN_COMPILE_N, default 300),
#                    GEN_SEED seed, GEN_VARIANTS to run fewer; one summary line per variant in generated.txt
#   eagle            the main job, Llama 1B-shaped target: examples/eagle.py --model llama
#   eagle-deepseek   the main job, DeepSeek-V2-Lite widths: examples/eagle.py --model deepseek
#   eagle-fused      the Llama main job with the target's decode and small verifies in the fused kernels
#   bench-host       host time per call (bench/bench_host.py)
#   bench-runner     decode step time per batch size against its peers (bench/bench_runner.py)
#   bench-runner-fused  the step with the fused per-layer kernels and inductor's PDL against the
#                    compiled body, same weights, kernels by class of the fused+pdl step
#   bench-runner-crossover  the fused kernels with PDL against inductor's code with PDL at 1-64 rows:
#                    up to which row count the fused path is the faster one
#   bench-runner-rows-as-m  the greedy fused step at 32 and 64 rows, the default (the 64-row dots
#                    with the rows as their M side) against tc_rows_as_m=false (the weights as M)
#   bench-runner-handoff  the greedy fused step with the layers compiled and max_rows 32 (33-64 rows
#                    to inductor, as the engine runs it) against the fused and compiled steps
#   bench-fused-sweep  the fused step at 16 rows over its tensor-core policy fields, one at a time
#                    (bench/bench_fused_decode.py variants; FUSED_SWEEP_SIZES, default 16)
#   bench-attention  the paged-attention kernels against SDPA (bench/bench_attention.py)
#   bench-attention-step  the decode attention at the 1B step's own shape (d 64, contexts 256-1022),
#                    and at bench_attention's bs 8 ctx 512 (d 128), launch policies swept
#                    (bench/sweep_decode_attention.py; 128-key tiles and one split at d 128 are
#                    what cuDNN's SDPA runs there; stages 2-4), and bs 1 at ctx 32768 and 16384
#                    (d 128: the double-buffered loop against the single-buffered one at 512 and
#                    256 tokens a split, PREFETCH_MAX_SPLIT_TOKENS' two sides)
#   bench-attention-tree  tree verify's launch policy swept at d 128 (8 drafts, contexts 512 and
#                    4096; 128-key tiles, splits within 2 programs an SM) and at d 64 (the
#                    EAGLE-1B verify: 64-key tiles)
#   bench-mla        the MLA kernels against SDPA (bench/bench_mla.py)
#   bench-eagle      EAGLE against greedy at several batch sizes (bench/bench_eagle.py;
#                    EAGLE_MODEL=deepseek for the MTP head)
#   hf, hf-compile   the Hugging Face client (examples/hf_generate.py), eager and compiled bodies
#   bench-hf, bench-hf-qwen3   padgraph.hf against HF's own paths (bench/bench_hf.py)
#   bench-hf-eagle   EAGLE on the HF Llama-1B shape against padgraph.hf's greedy (bench/bench_hf_eagle.py)
#   bench-hf-bamba   padgraph.hf on a hybrid (Bamba at Llama-1B widths) against HF's own paths
#                    (needs a transformers with the linear-attention cache interface)
#   bench-hybrid     the hybrid reference model's step against its floor, and EAGLE on it, with the Mamba updates as
#                    opaque kernel ops (the default) and as inductor's code (bench/bench_hybrid.py --recurrent-ops)
#   bench-eagle-sampling  EAGLE with sampling against plain sampling (bench/bench_eagle_sampling.py)
#   bench-moe        the DeepSeek-like MoE, routed against dense, eager body against compiled layers, and each
#                    step by kernel class (bench/bench_moe.py)
#   bench-sampling   the sampler against argmax at bs 1/16/64, and sharp top-p by row groups (bench/bench_sampling.py)
#   bench-sampling-sweep  the sampler's select-pass launch grid (row groups, warps, the draw in the gather, PDL,
#                    chunk, register cap)
#   bench-sampling-passes  each sampler launch's own GPU time (bench/bench_sampling.py --passes)
#   bench-fused-tc   the fused tensor-core kernels one by one against cuBLAS (bench/sweep_fused_tc.py)
# Results and logs go under $OUT (default results/local).
# PACK=name: write them under a scratch directory instead and leave one $OUT/name.tgz at the end
# (for a caller that fetches only a few files from $OUT; $OUT itself is never written otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # `bench` importable from every stage
FINAL_OUT=${OUT:-results/local}
if [ -n "${PACK:-}" ]; then
  OUT=$(mktemp -d)/"$PACK"
  trap 'mkdir -p "$FINAL_OUT"; tar czf "$FINAL_OUT/$PACK.tgz" -C "$(dirname "$OUT")" "$PACK"' EXIT
else
  OUT=$FINAL_OUT
fi
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests spec eagle eagle-deepseek bench-host bench-runner bench-attention bench-mla bench-eagle hf hf-compile bench-hf bench-hf-qwen3 bench-hf-eagle)
LIMIT=${STAGE_TIMEOUT:-900}   # seconds per stage
want() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$OUT/install.log"; exit 1; }
python3 - <<'PY' | tee "$OUT/env.txt"
import datetime, torch, triton
print(f"date={datetime.date.today()} gpu={torch.cuda.get_device_name()} torch={torch.__version__} "
      f"triton={triton.__version__} cuda={torch.version.cuda}")
PY
rc=0
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  timeout "$LIMIT" "$@" 2>&1 | tee "$OUT/$name.log"; local r=${PIPESTATUS[0]}
  echo "=== $name: exit $r in $((SECONDS - t0)) s"; [ "$r" = 0 ] || rc=1; }
want tests && run pytest_cuda python3 -m pytest -m cuda tests -q -p no:cacheprovider --timeout=300 -o addopts="" \
  -n "${TEST_PROCS:-4}" --dist worksteal --durations=15
want spec && run spec_cuda python3 -m padgraph.spec --backend cuda -q
if want generated; then
  for v in ${GEN_VARIANTS:-in-graph eager torch compile}; do
    if [ "$v" = compile ]; then opts=(--torch-compile --generated "${GEN_COMPILE_N:-300}"); else opts=(--pack "$v" --generated "${GEN_N:-5000}"); fi
    run "generated_$v" python3 -m padgraph.spec --backend cuda -q -p no:cacheprovider -k "generated or regressions" \
      --seed "${GEN_SEED:-1}" --no-shrink -n "${GEN_PROCS:-16}" "${opts[@]}"
    grep -h "padgraph.spec generated:" "$OUT/generated_$v.log" >> "$OUT/generated.txt"
  done
fi
want eagle && run eagle python3 examples/eagle.py --model llama
want eagle-fused && run eagle_fused python3 examples/eagle.py --model llama --fused
want eagle-deepseek && run eagle_deepseek python3 examples/eagle.py --model deepseek
want bench-host && run bench_host python3 -m bench.bench_host --calls 1000
want bench-runner && run bench_runner python3 -m bench.bench_runner
want bench-runner-fused && run bench_runner_fused python3 -m bench.bench_runner \
  --variants padgraph+compile,padgraph+compile+pdl,padgraph+fused,padgraph+fused+pdl --sizes 1,16,64 \
  --profile padgraph+fused+pdl
want bench-runner-crossover && run bench_runner_crossover python3 -m bench.bench_runner \
  --variants padgraph+compile+pdl,padgraph+fused+pdl --sizes 1,2,4,8,16,32,64 --iters 30
want bench-runner-rows-as-m && run bench_runner_rows_as_m python3 -m bench.bench_runner \
  --variants padgraph+compile,padgraph+fused+greedy,padgraph+fused+greedy+policy \
  --fused-policy tc_rows_as_m=false --sizes 32,64 --iters 20 --profile padgraph+fused+greedy+policy
want bench-runner-handoff && run bench_runner_handoff python3 -m bench.bench_runner \
  --variants padgraph+compile,padgraph+fused+greedy,padgraph+fused+greedy+compile \
  --fused-policy max_rows=32 --sizes 1,16,32,40,64 --iters 20
want bench-fused-sweep && run bench_fused_sweep python3 -m bench.bench_fused_decode --sizes "${FUSED_SWEEP_SIZES:-16}" \
  --iters 30 --check --variants fused,fused+tcffn16,fused+tcffn64,fused+tcprojk128,fused+tcstages4,fused+tcstages8,fused+tcwarps8,fused+tchalf4,fused+tchalf16,fused+tck64
want bench-attention && run bench_attention python3 -m bench.bench_attention
want bench-attention-step && run bench_attention_step python3 -m bench.sweep_decode_attention \
  --sizes 1,16,32,64
want bench-attention-step && run bench_attention_step_d128 python3 -m bench.sweep_decode_attention \
  --head-dim 128 --layout random --sizes 8 --ctx 512 --splits 1,2,4 --block-n 64,128 --warps 4,8 \
  --stages 2,3,4
want bench-attention-step && run bench_attention_step_d128_long python3 -m bench.sweep_decode_attention \
  --head-dim 128 --layout random --sizes 1 --ctx 32768 --splits 16,32,64 --block-n 32,64,128
want bench-attention-step && run bench_attention_step_d128_16k python3 -m bench.sweep_decode_attention \
  --head-dim 128 --layout random --sizes 1 --ctx 16384 --splits 32,64 --block-n 32,64,128
want bench-attention-tree && run bench_attention_tree_512 python3 -m bench.sweep_decode_attention \
  --head-dim 128 --sizes 1,8,32 --ctx 512 --tree 8 --splits 1,2,4 --block-n 64,128
want bench-attention-tree && run bench_attention_tree_4096 python3 -m bench.sweep_decode_attention \
  --head-dim 128 --sizes 1,8,32 --ctx 4096 --tree 8 --splits 1,4,32 --block-n 64,128
want bench-attention-tree && run bench_attention_tree_d64 python3 -m bench.sweep_decode_attention \
  --sizes 1,16 --tree 8 --splits 2,8 --block-n 64,128
want bench-mla && run bench_mla python3 -m bench.bench_mla
want bench-eagle && run bench_eagle python3 -m bench.bench_eagle
want hf && run hf_generate python3 examples/hf_generate.py
want hf-compile && run hf_generate_compile python3 examples/hf_generate.py --torch-compile
want bench-hf && run bench_hf python3 bench/bench_hf.py --model llama1b
want bench-hf-qwen3 && run bench_hf_qwen3 python3 bench/bench_hf.py --model qwen3
want bench-hf-eagle && run bench_hf_eagle python3 bench/bench_hf_eagle.py --model llama1b
want bench-hf-bamba && run bench_hf_bamba python3 bench/bench_hf.py --model bamba1b
want bench-hybrid && run bench_hybrid python3 -m bench.bench_hybrid --check --recurrent-ops opaque,inductor
want bench-eagle-sampling && run bench_eagle_sampling python3 -m bench.bench_eagle_sampling
want bench-sampling && run bench_sampling python3 -m bench.bench_sampling
want bench-sampling-sweep && run bench_sampling_sweep python3 -m bench.bench_sampling --sweep
want bench-sampling-passes && run bench_sampling_passes python3 -m bench.bench_sampling --passes
want bench-fused-tc && run bench_fused_tc python3 -m bench.sweep_fused_tc --rows 16,4 --grid
want bench-moe && run bench_moe python3 -m bench.bench_moe --sizes 1,16 --profile --bodies eager,compiled
echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/pytest_cuda*.log "$OUT"/spec_cuda.log 2>/dev/null | tail -6
exit $rc
