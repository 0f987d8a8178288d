#!/usr/bin/env bash
# The GPU suite and the benchmarks in ONE call (the device tool runs this on the H200):
#   bash scripts/gpu_suite.sh [tests] [spec] [spec-compile] [eagle] [eagle-deepseek] [bench-host] [bench-runner]
#                             [bench-attention] [bench-mla] [bench-eagle] [bench-eagle-deepseek] [hf] [hf-compile]
#                             [bench-hf] [bench-hf-qwen3] [bench-runner-compile: the two compiled variants only; same file names as bench-runner]
#                             [bench-runner-oblivious: bench-runner-compile with size-oblivious tracing]
#                             [bench-topk: the draft top-k kernel against torch, alone and behind the lm_head]
#                             [eagle-fused: the main job with the fused fp8 lm_head + top-k draft kernel]
#                             [eagle-eager-prefill: both main jobs and bench_eagle (eagle_eager_prefill.{md,json}) with the prompts' prefill as plain torch calls (the default: the prefill program)]
#                             [eagle-regions: the main job with only the head's layer compiled in the draft bodies]
#                             [eagle-profile: the main job, then its kernels per round under torch.profiler]
#                             [sweep-eagle, sweep-eagle-deepseek: EAGLE over several draft trees (steps, topk, k) against greedy]
#                             [bench-runner-profile: bench_runner at bs 1 and 16 (padgraph, padgraph+compile) with the compiled variant's kernels per step (bench_runner_profile.json)]
#                             [bench-gemv: the small-batch linear kernel against F.linear at the 1B decode shapes, and the step's GEMM chain (gemv.{md,json,png})]
#                             [bench-attention-in-graph: decode (also timed as calls inside a graph of 20), verify and extend; no sweep, no cold capture (attention.{md,json})]
#                             [bench-mla-slots: MLA decode, the sweep with a tile's slot indices loaded one tile ahead and in the loop (mla.{md,json})]
#                             [bench-mla-keys: MLA decode / verify / extend (the policy's kernel) with the row-major and keys-major kernels side by side, no sweep (mla.{md,json})]
#                             [bench-mla-r256: MLA decode on a 256-wide latent (mla_r256.{md,json}): the accumulator's register cost, beside bench-mla]
#                             [bench-eagle-draft-prefill: bench_eagle (eagle.{md,json}) with a second EAGLE worker whose draft prefill is eager (torch calls), same process]
#                             [eagle-variants: the main job once per argument list of EAGLE_VARIANTS="--model deepseek --steps 3;..." (logs eagle_v1, eagle_v2, ...)]
#                             [ncu: Nsight Compute reports (details + SASS stall samples) of the MLA and GQA decode kernels and SDPA's (ncu_*.log, ncu_*_sass.csv); NCU_CASES="name|regex|args;..." overrides the cases]
#                             [tests-attention: the MLA, attention and DeepSeek GPU tests as three processes at once]
#                             [bench-attention-decode: decode only, also timed as calls inside a graph of 20 (attention.{md,json})]
#                             [tests-parallel: the cuda tests as six pytest processes and the cuda conformance suite, at once]
#                             [bench-mla-sweep: MLA decode, both kernels side by side, and the graph-timed tile / split sweep incl. keys-major and split-c tiles (mla.{md,json})]
#                             [bench-kernels: #12's benchmarks in full - bench_mla --keys-major (decode, verify, extend, both MLA kernels, sweep) and bench_attention --in-graph 20 (decode, verify, extend, sweep, cold capture)]
#                             [bench-attention-sweep: decode (also inside a graph of 20) and the graph-timed tile / split sweep; no verify / extend, no cold capture (attention.{md,json})]
# With no arguments, everything. Results and logs go under $OUT (default results/local).
# PACK=name: write them under a scratch directory instead and leave one $OUT/name.tgz at the end
# (for a caller that fetches only a few files from $OUT; $OUT itself is never written otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
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
[ ${#stages[@]} -gt 0 ] || stages=(tests spec spec-compile eagle eagle-deepseek bench-host bench-runner bench-attention bench-mla bench-eagle bench-eagle-deepseek hf hf-compile bench-hf bench-hf-qwen3)
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
if want tests-parallel; then  # the cuda tests and the cuda conformance suite as seven processes at once on the one GPU
  echo "=== tests-parallel"; t0=$SECONDS
  P="python3 -m pytest -m cuda -q -p no:cacheprovider --timeout=400 -o addopts= --durations=5"
  timeout "$LIMIT" $P tests/test_cuda_deepseek.py -k "lite and whole" >"$OUT/pytest_cuda_lite.log" 2>&1 & p1=$!
  timeout "$LIMIT" $P tests/test_cuda_deepseek.py -k "not (lite and whole)" >"$OUT/pytest_cuda_deepseek.log" 2>&1 & p2=$!
  timeout "$LIMIT" $P tests/test_cuda_eagle.py >"$OUT/pytest_cuda_eagle_a.log" 2>&1 & p3=$!
  timeout "$LIMIT" $P tests/test_prefill_runner.py >"$OUT/pytest_cuda_prefill.log" 2>&1 & p7=$!
  timeout "$LIMIT" $P tests/test_spec_overlap.py tests/test_compiled_body.py >"$OUT/pytest_cuda_eagle_b.log" 2>&1 & p4=$!
  timeout "$LIMIT" $P tests/test_cuda_attention.py tests/test_cuda_mla.py tests/test_cuda_backend.py tests/test_cuda_contract.py tests/test_cuda_topk.py tests/test_tp.py tests/test_triton_seq_len_zero.py >"$OUT/pytest_cuda_kernels.log" 2>&1 & p5=$!
  timeout "$LIMIT" python3 -m padgraph.spec --backend cuda -q >"$OUT/spec_cuda.log" 2>&1 & p6=$!
  for p in $p1 $p2 $p3 $p4 $p5 $p6 $p7; do wait $p || rc=1; done
  for f in pytest_cuda_lite pytest_cuda_deepseek pytest_cuda_eagle_a pytest_cuda_prefill pytest_cuda_eagle_b pytest_cuda_kernels spec_cuda; do echo "$f: $(tail -1 "$OUT/$f.log")"; done
  echo "=== tests-parallel: $((SECONDS - t0)) s"
fi
if want ncu; then  # hardware counters of single kernel launches (scripts/ncu_kernels.py runs the case)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  default_cases="mla_bs8_8192|_mla_kernel|mla 8 8192;mla_bs32_32768|_mla_kernel|mla 32 32768"
  default_cases+=";mla_bs32_32768_narrow|_mla_kernel|mla 32 32768 --knobs block_n=32,num_warps=4,num_splits=9"
  default_cases+=";decode_bs8_4096|_split|decode 8 4096;decode_sdpa_bs8_4096|.|decode-sdpa 8 4096"
  default_cases+=";decode_bs128_4096|_split|decode 128 4096;decode_sdpa_bs128_4096|.|decode-sdpa 128 4096"
  IFS=';' read -ra ncu_cases <<<"${NCU_CASES:-$default_cases}"
  for c in "${ncu_cases[@]}"; do
    IFS='|' read -r name regex case_args <<<"$c"; t0=$SECONDS
    timeout 300 "$NCU" --clock-control none --set full --nvtx --nvtx-include "prof/" \
      -k "regex:$regex" --launch-skip 1 --launch-count 1 -f -o "$OUT/ncu_$name" \
      python3 scripts/ncu_kernels.py $case_args >"$OUT/ncu_$name.log" 2>&1 || rc=1
    "$NCU" -i "$OUT/ncu_$name.ncu-rep" --page details >>"$OUT/ncu_$name.log" 2>&1
    "$NCU" -i "$OUT/ncu_$name.ncu-rep" --page source --csv --print-source sass \
      >"$OUT/ncu_${name}_sass.csv" 2>&1
    rm -f "$OUT/ncu_$name.ncu-rep"
    echo "=== ncu $name: $((SECONDS - t0)) s"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit" "$OUT/ncu_$name.log" | head -12
  done
fi
if want tests-attention; then  # the attention / MLA kernels' GPU tests and DeepSeek's, as three processes at once
  echo "=== tests-attention"; t0=$SECONDS
  P="python3 -m pytest -m cuda -q -p no:cacheprovider --timeout=400 -o addopts= --durations=5"
  timeout "$LIMIT" $P tests/test_cuda_mla.py >"$OUT/pytest_cuda_mla.log" 2>&1 & p1=$!
  timeout "$LIMIT" $P tests/test_cuda_attention.py tests/test_cuda_backend.py tests/test_cuda_contract.py tests/test_triton_seq_len_zero.py >"$OUT/pytest_cuda_attention.log" 2>&1 & p2=$!
  timeout "$LIMIT" $P tests/test_cuda_deepseek.py -k "not (lite and whole)" >"$OUT/pytest_cuda_deepseek.log" 2>&1 & p3=$!
  for p in $p1 $p2 $p3; do wait $p || rc=1; done
  for f in pytest_cuda_mla pytest_cuda_attention pytest_cuda_deepseek; do echo "$f: $(tail -1 "$OUT/$f.log")"; done
  echo "=== tests-attention: $((SECONDS - t0)) s"
fi
want tests && run pytest_cuda python3 -m pytest -m cuda tests -q -p no:cacheprovider --timeout=300 -o addopts=""
want spec && run spec_cuda python3 -m padgraph.spec --backend cuda -q
want spec-compile && run spec_cuda_compile python3 -m padgraph.spec --backend cuda --torch-compile -q
want eagle && run eagle python3 examples/eagle.py --model llama
want eagle-deepseek && run eagle_deepseek python3 examples/eagle.py --model deepseek
want eagle-regions && run eagle_regions python3 examples/eagle.py --model llama --draft-compile regions
want eagle-profile && run eagle_profile python3 examples/eagle.py --model llama --profile
want eagle-eager-prefill && run eagle_eager_prefill python3 examples/eagle.py --model llama --prefill eager
want eagle-eager-prefill && run eagle_deepseek_eager_prefill python3 examples/eagle.py --model deepseek --prefill eager
want eagle-eager-prefill && EAGLE_PREFILL=eager run bench_eagle_eager_prefill python3 examples/bench_eagle.py
want eagle-fused && run eagle_fused python3 examples/eagle.py --model llama --profile --draft-lm-head fp8-fused
if want eagle-variants; then  # the main job once per ';'-separated argument list in EAGLE_VARIANTS
  i=0; IFS=';' read -ra variants <<<"${EAGLE_VARIANTS:-}"
  [ ${#variants[@]} -gt 0 ] || { echo "eagle-variants: set EAGLE_VARIANTS=\"ARGS;ARGS;...\""; rc=1; }
  for v in "${variants[@]}"; do i=$((i + 1)); run "eagle_v$i" python3 examples/eagle.py $v; done
fi
want bench-host && run bench_host python3 examples/bench_host.py --calls 1000
want bench-runner && run bench_runner python3 examples/bench_runner.py
want bench-runner-profile && run bench_runner_profile python3 examples/bench_runner.py --variants padgraph,padgraph+compile --sizes 1,16 --profile padgraph+compile
want bench-attention && run bench_attention python3 examples/bench_attention.py
want bench-attention-decode && run bench_attention python3 examples/bench_attention.py --no-sweep --no-spec --no-cold --in-graph 20
want bench-attention-sweep && run bench_attention_sweep python3 examples/bench_attention.py --no-spec --no-cold --in-graph 20
want bench-attention-in-graph && run bench_attention python3 examples/bench_attention.py --no-sweep --no-cold --in-graph 20
want bench-mla && run bench_mla python3 examples/bench_mla.py
want bench-mla-slots && run bench_mla_slots python3 examples/bench_mla.py --decode-only --slots 1,0
want bench-kernels && run bench_mla python3 examples/bench_mla.py --keys-major
want bench-kernels && run bench_attention python3 examples/bench_attention.py --in-graph 20
want bench-mla-sweep && run bench_mla_sweep python3 examples/bench_mla.py --decode-only --keys-major
want bench-mla-keys && run bench_mla_keys python3 examples/bench_mla.py --keys-major --no-sweep
want bench-mla-r256 && run bench_mla_r256 python3 examples/bench_mla.py --kv-lora-rank 256 --decode-only --no-sweep
want bench-eagle && run bench_eagle python3 examples/bench_eagle.py
want bench-eagle-deepseek && EAGLE_MODEL=deepseek run bench_eagle_deepseek python3 examples/bench_eagle.py
want bench-eagle-draft-prefill && EAGLE_DRAFT_PREFILL=runner,eager run bench_eagle python3 examples/bench_eagle.py
want hf && run hf_generate python3 examples/hf_generate.py
want hf-compile && run hf_generate_compile python3 examples/hf_generate.py --torch-compile
want bench-runner-compile && run bench_runner_compile python3 examples/bench_runner.py --variants padgraph+compile,compile-ro --iters 30
want bench-runner-oblivious && run bench_runner_oblivious python3 examples/bench_runner.py --variants padgraph+compile,compile-ro --iters 30 --size-oblivious
want bench-hf && run bench_hf python3 bench/bench_hf.py --model llama1b
want bench-hf-qwen3 && run bench_hf_qwen3 python3 bench/bench_hf.py --model qwen3
want sweep-eagle && run sweep_eagle python3 examples/sweep_eagle.py
want sweep-eagle-deepseek && EAGLE_MODEL=deepseek run sweep_eagle_deepseek python3 examples/sweep_eagle.py
want bench-topk && run bench_topk python3 examples/bench_topk.py
want bench-gemv && run bench_gemv python3 examples/bench_gemv.py
echo "=== summary"; grep -h "passed\|failed\|error" "$OUT"/pytest_cuda*.log "$OUT"/spec_cuda.log "$OUT"/spec_cuda_compile.log 2>/dev/null | tail -6
exit $rc
