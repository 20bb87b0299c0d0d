#!/usr/bin/env bash
# GPU validation in one call, on a machine with one NVIDIA or AMD GPU and its own torch (no internet).
#
#   usage: bash bench/device_check.sh OUT_DIR [check|bench|all]      (default: check)
#
#   check  build flashkern for this GPU's architecture only (no emulator modules, all cores), record
#          `flashkern info`, run the GPU tests (`pytest -m gpu`: every cuda-parametrized case and every
#          GPU-only test; pytest-xdist and pytest-timeout where importable), then compute-sanitizer
#          memcheck (torch's caching allocator off) and racecheck over a small subset that reaches
#          every kernel family, after a probe that the device accepts the sanitizer
#   bench  build only if this source tree is not the one installed, the quick benchmark set
#          (torch.compile rows last), then the report
#   all    both
#
# The whole run fits FLASHKERN_CHECK_BUDGET_S seconds (default 540: one 600 s call with margin). Each
# step gets what is left, up to its own cap, and is stopped with SIGINT, so pytest still prints its
# summary and writes its JUnit XML and pytest-benchmark its JSON; summary.txt is rewritten after every
# step. At most 8 files in OUT_DIR: summary.txt, build.log, check.log, tests.xml, bench.log, bench.json,
# bench.md, bench.png. Peers that are not installed are taken from wheels in ./.whl when present.
# docs/benchmarks.md says how to spend a GPU loan with it.
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: bash bench/device_check.sh OUT_DIR [check|bench|all]}" && cd "$1" && pwd)
MODE=${2:-check}
case $MODE in check | bench | all) ;; *) echo "device_check: mode must be check, bench or all, got '$MODE'" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${FLASHKERN_CHECK_BUDGET_S:-540}
GRACE=15  # seconds a step has between SIGINT and SIGKILL
T0=$(date +%s)
export PYTHONUNBUFFERED=1 FLASHKERN_BENCH_SET=${FLASHKERN_BENCH_SET:-quick}
export FLASHKERN_COMMIT=${FLASHKERN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
STEPS=$(mktemp)   # one line a step: name status seconds log first-byte end-byte
HEADER=""
NOTES=()

left() { echo $((BUDGET - ($(date +%s) - T0))); }

section() { tail -c +"$(($2 + 1))" "$1" | head -c "$(($3 - $2))"; }  # section LOG FROM TO: a step's output

summary() {  # summary.txt from what has run so far; rewritten after every step
  {
    echo "flashkern device check ($MODE): $HEADER"
    echo "commit $FLASHKERN_COMMIT | budget ${BUDGET}s, used $(($(date +%s) - T0))s"
    echo
    printf "%-10s %-12s %6s  %s\n" step status time result
    local name status secs log offset end result
    while read -r name status secs log offset end; do
      result=""
      if [ -f "$log" ]; then
        result=$(section "$log" "$offset" "$end" | grep -aE '^=+ .*[0-9]+ (passed|failed|error|errors|deselected|skipped).* =+$|^[0-9]+ (passed|failed|error|deselected)|no tests ran' | tail -1 | tr -d '=' | sed 's/^ *//')
      fi
      printf "%-10s %-12s %5ss  %s\n" "$name" "$status" "$secs" "$result"
    done <"$STEPS"
    for note in "${NOTES[@]+"${NOTES[@]}"}"; do echo "note: $note"; done
    # the failures, by step
    while read -r name status secs log offset end; do
      [ -f "$log" ] || continue
      local failed
      failed=$(section "$log" "$offset" "$end" | grep -aE '^(FAILED|ERROR) ' | cut -c1-220)
      if [ -n "$failed" ]; then
        echo
        echo "$name: $(echo "$failed" | wc -l) failed (first 25; all in $(basename "$log"))"
        echo "$failed" | head -25
      fi
    done <"$STEPS"
    if [ -f "$OUT/bench.md" ]; then
      echo
      echo "flashkern, GB/s (prefill: TFLOP/s) and % of peak, speedup over the baseline (all rows in bench.md):"
      awk -F'|' '/^## /{op=substr($0, 4)} /^\| shape/{unit=($0 ~ /TFLOP/) ? "TFLOP/s" : "GB/s"}
        $4 ~ /^ flashkern $/{printf "  %-24s %-16s %-9s %7s %-7s %4s%% peak %7s\n", op, $2, $3, $6, unit, $7,
                             $9}' "$OUT/bench.md" | head -40
    fi
  } >"$OUT/summary.txt"
}

step() {  # step NAME LOG CAP_S COMMAND...: runs COMMAND for min(CAP_S, what the budget has left)
  local name=$1 log=$2 cap=$3 limit offset start rc status
  shift 3
  limit=$(($(left) - ${KEEP:-0} - GRACE - 10))  # KEEP: seconds held back for the steps after this one
  [ "$cap" -lt "$limit" ] && limit=$cap
  offset=$(stat -c %s "$log" 2>/dev/null || echo 0)
  if [ "$limit" -lt 20 ]; then
    echo "$name skipped:budget 0 $log $offset $offset" >>"$STEPS"
    summary
    return 124
  fi
  echo "== $name (limit ${limit}s): $*" >>"$log"
  start=$(date +%s)
  timeout -s INT -k "$GRACE" "$limit" "$@" >>"$log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124 | 130 | 137) status=cut:${limit}s ;; *) status=FAIL:$rc ;; esac
  echo "$name $status $(($(date +%s) - start)) $log $offset $(stat -c %s "$log")" >>"$STEPS"
  summary
  return $rc
}

trap 'summary; exit 130' INT TERM

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/flashkern-peers .whl/*.whl \
    && export PYTHONPATH="/tmp/flashkern-peers${PYTHONPATH:+:$PYTHONPATH}"
fi

# ---- the device: "cuda 90" or "hip gfx90a", one line of plain words
read -r BACKEND ARCH < <($PY -c '
import torch
if not torch.cuda.is_available():
    print("none none")
else:
    p = torch.cuda.get_device_properties(0)
    print("hip", p.gcnArchName.split(":")[0]) if torch.version.hip else print("cuda", f"{p.major}{p.minor}")
' 2>/dev/null)
HEADER="$($PY -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "| torch", torch.__version__)' 2>/dev/null) | ${BACKEND:-none} ${ARCH:-none}"
if [ "${BACKEND:-none}" = none ]; then
  NOTES+=("torch sees no GPU: nothing to check")
  summary
  cat "$OUT/summary.txt"
  exit 1
fi

# ---- build, for this device only; skipped when this source tree is the one installed
if [ "$BACKEND" = hip ]; then ARCHS=$ARCH; else ARCHS=$ARCH-real; fi
SOURCE_HASH=$(cat setup.py CMakeLists.txt $(find csrc python -type f -not -name '*.pyc' -not -name '*.so' -not -path '*.egg-info/*' | sort) | sha1sum | cut -c1-16)
STAMP="$BACKEND $ARCHS $SOURCE_HASH"  # what build/device_check.stamp says was installed last
if [ "$(cat build/device_check.stamp 2>/dev/null)" = "$STAMP" ] && $PY -c 'import flashkern._C' 2>/dev/null; then
  NOTES+=("build skipped: this source tree is installed for $BACKEND $ARCHS")
else
  rm -rf build/kernels-* build/device_check.stamp
  step build "$OUT/build.log" 360 env MAX_JOBS="$(nproc)" FLASHKERN_BUILD_BACKEND="$BACKEND" FLASHKERN_BUILD_EMULATE=0 \
    "FLASHKERN_${BACKEND^^}_ARCHS=$ARCHS" $PY -m pip install -v --no-build-isolation --no-deps .
  if [ $? = 0 ] && $PY -c 'import flashkern._C' 2>/dev/null; then
    mkdir -p build && echo "$STAMP" >build/device_check.stamp
  else
    NOTES+=("no usable build: see build.log")
    summary
    cat "$OUT/summary.txt"
    exit 1
  fi
fi

# ---- check
if [ "$MODE" != bench ]; then
  $PY -m flashkern info >>"$OUT/check.log" 2>&1
  HEADER="$HEADER | built $($PY -c 'import flashkern; i = flashkern.info(); print(i["built_backend"], ",".join(i["built_archs"]))' 2>/dev/null)"
  PYTEST=(-m pytest -p no:cacheprovider -q -rfE)
  WORKERS=${FLASHKERN_CHECK_WORKERS:-8}
  PARALLEL=()
  if $PY -c 'import xdist' 2>/dev/null && [ "$WORKERS" -gt 1 ]; then PARALLEL=(-n "$WORKERS"); else NOTES+=("pytest-xdist missing: tests run in one process"); fi
  if $PY -c 'import pytest_timeout' 2>/dev/null; then PYTEST+=(--timeout 180); else NOTES+=("pytest-timeout missing: no per-test limit"); fi
  # FLASHKERN_TEST_EMULATE="": this build has no emulator modules; OMP: the workers share the cores
  export FLASHKERN_TEST_EMULATE="" OMP_NUM_THREADS=$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))
  step tests "$OUT/check.log" 330 $PY "${PYTEST[@]}" "${PARALLEL[@]}" --junitxml="$OUT/tests.xml" -m gpu tests
  export OMP_NUM_THREADS=$(nproc)

  # sanitizer: one or two small cases of every kernel family (norms, activations, RoPE, merge, decode, cascade,
  # prefill, sampling, speculative, optimizer, page append), torch's caching allocator off so memcheck sees each buffer's end
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  CASES=(  # test ids, joined below into one -k expression (pytest's -k takes no newlines)
    "test_rmsnorm[cuda-True-bfloat16-37-769]" "test_fused_add_rmsnorm[cuda-True-bfloat16-37-5125]"
    "test_rmsnorm_backward[cuda-True-True-bfloat16-37-769]" "test_act_and_mul[cuda-gelu-bfloat16-37-769]"
    "test_act_mul_two_tensors[cuda-silu-bfloat16-37-769]" "test_rope_pos_ids[cuda-bfloat16-True-128-64-37]"
    "test_rope_with_cos_sin_cache[cuda-bfloat16-True]" "test_merge_state_is_attention_over_the_union[cuda-bfloat16-3-7]"
    "test_merge_states[cuda-bfloat16-7]" "test_head_dims_and_layouts[cuda-False-4-NHD-128]"
    "test_head_dims_and_layouts[cuda-True-8-HND-256]" "test_large_groups_and_mqa[cuda-bfloat16-1-32]"
    "test_q_len_per_req[cuda-4-4]" "test_single_decode[cuda-bfloat16-37-HND]" "test_three_levels[cuda-16]"
    "test_many_query_tokens_per_request[cuda-5-True]" "test_ragged_prefill[cuda-bfloat16-5-True]"
    "test_paged_prefill[cuda-True-HND-16]" "test_custom_masks[cuda-True]" "test_sliding_window[cuda-True-17]"
    "test_single_prefill[cuda-NHD-bfloat16]" "test_only_kept_tokens[cuda-joint]" "test_renorm[cuda-bfloat16]"
    "test_chain_flashinfer_example[cuda]" "test_verify_tree_greedy[cuda-float32]"
    "test_matches_torch_adamw[cuda-active-0.1]" "test_nonfinite_gradient_skips_the_step[cuda]"
    "test_16_bit_parameters_and_master_weights[cuda]" "test_append_bitwise[cuda-16-HND-float8_e4m3fn-bfloat16]"
    "test_append_bitwise[cuda-1-NHD-float16-float16]")
  K=$(printf ' or %s' "${CASES[@]}")
  SUBSET=(tests/test_norm.py tests/test_act_and_mul.py tests/test_rope.py tests/test_attention_state.py tests/test_decode.py
          tests/test_cascade.py tests/test_prefill.py tests/test_sampling.py tests/test_speculative.py tests/test_optim.py
          tests/test_page.py -m gpu -k "${K# or }")
  if [ "$BACKEND" != cuda ] || [ -z "$SANITIZER" ]; then
    NOTES+=("sanitizer skipped: no compute-sanitizer for $BACKEND")
  elif ! timeout 120 "$SANITIZER" --tool memcheck --error-exitcode 1 $PY -c \
      'import torch; x = torch.ones(8, device="cuda"); torch.cuda.synchronize(); assert x.sum().item() == 8' \
      >>"$OUT/check.log" 2>&1; then
    NOTES+=("sanitizer skipped: this device refuses compute-sanitizer (its probe failed; see check.log)")
  else
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1
    step memcheck "$OUT/check.log" 150 "$SANITIZER" --tool memcheck --error-exitcode 1 $PY "${PYTEST[@]}" "${SUBSET[@]}"
    step racecheck "$OUT/check.log" 150 "$SANITIZER" --tool racecheck --error-exitcode 1 $PY "${PYTEST[@]}" "${SUBSET[@]}"
    unset PYTORCH_NO_CUDA_MEMORY_CACHING
  fi
fi

# ---- bench, then the report (kept 40 s for it)
if [ "$MODE" != check ]; then
  KEEP=40 step bench "$OUT/bench.log" 100000 $PY -m pytest -q -p no:cacheprovider bench \
    --benchmark-json="$OUT/bench.json"
  if [ -s "$OUT/bench.json" ]; then
    step report "$OUT/bench.log" 40 $PY -m bench.report "$OUT/bench.json" --out "$OUT"
  else
    NOTES+=("no bench.json: no report")
  fi
fi

summary
rm -f "$STEPS"
cat "$OUT/summary.txt"
