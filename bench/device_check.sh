#!/usr/bin/env bash
# One-call GPU validation: on a machine with one NVIDIA or AMD GPU and its own torch (no internet),
#   1 build     flashkern from source for this GPU's architecture only
#   2 tests     the whole test suite, on the GPU (correctness, opcheck, torch.compile, graph capture)
#   3 sanitizer compute-sanitizer memcheck and racecheck on a short subset (NVIDIA, where installed)
#   4 bench     the benchmark suite (FLASHKERN_BENCH_SET, default quick) -> bench.json
#   5 report    bench.md and bench.png
# and prints a summary table last. Logs and results go to OUT_DIR (8 files at most).
# Peers that are not installed can be supplied as wheels in ./.whl (see docs/benchmarks.md).
#
#   usage: bash bench/device_check.sh OUT_DIR
set -uo pipefail
OUT=$(mkdir -p "${1:?usage: bash bench/device_check.sh OUT_DIR}" && cd "$1" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 FLASHKERN_BENCH_SET=${FLASHKERN_BENCH_SET:-quick}
export FLASHKERN_COMMIT=${FLASHKERN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY.steps"

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/flashkern-peers .whl/*.whl \
    && export PYTHONPATH="/tmp/flashkern-peers${PYTHONPATH:+:$PYTHONPATH}"
fi

step() {  # step NAME LOG TIMEOUT_S COMMAND...
  local name=$1 log=$2 limit=$3 start rc
  shift 3
  start=$(date +%s)
  echo "== $name: $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  printf "%-10s %-6s %5ss  %s\n" "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" "$(( $(date +%s) - start ))" \
    "$(basename "$log")" >>"$SUMMARY.steps"
  return $rc
}

# ---- 1 build, for this device only
read -r BACKEND ARCH < <($PY -c "
import torch
p = torch.cuda.get_device_properties(0)
print(('hip', p.gcnArchName.split(':')[0]) if torch.version.hip else ('cuda', f'{p.major}{p.minor}'))")
if [ "$BACKEND" = hip ]; then export FLASHKERN_HIP_ARCHS=$ARCH; else export FLASHKERN_CUDA_ARCHS=$ARCH; fi
export MAX_JOBS=$(nproc) FLASHKERN_BUILD_BACKEND=$BACKEND
rm -rf build/kernels-*
step build "$OUT/build.log" 300 $PY -m pip install -v --no-build-isolation --no-deps .

# ---- 2 tests
step tests "$OUT/tests.log" 300 $PY -m pytest -q -p no:cacheprovider tests

# ---- 3 sanitizer: small shapes of every kernel
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
SUBSET=(tests/test_norm.py tests/test_act_and_mul.py tests/test_decode.py tests/test_cascade.py tests/test_prefill.py
        tests/test_sampling.py tests/test_speculative.py tests/test_optim.py
        -q -p no:cacheprovider -k "cuda and (((1-1 or 37-7 or 37-769) and not float32) or head_dims_and_layouts or
        large_groups or three_levels or ragged_prefill or custom_masks or sliding_window or only_kept_tokens or
        renorm or verify_tree_greedy or chain_flashinfer_example or nonfinite_gradient or eps_trap)")
if [ "$BACKEND" = cuda ] && [ -n "$SANITIZER" ]; then
  step memcheck "$OUT/sanitizer.log" 150 "$SANITIZER" --tool memcheck --error-exitcode 1 $PY -m pytest "${SUBSET[@]}"
  step racecheck "$OUT/sanitizer.log" 150 "$SANITIZER" --tool racecheck --error-exitcode 1 $PY -m pytest "${SUBSET[@]}"
else
  echo "sanitizer  skip        -  (no compute-sanitizer for $BACKEND)" >>"$SUMMARY.steps"
fi

# ---- 4 bench, 5 report
step bench "$OUT/bench.log" 300 $PY -m pytest -q -p no:cacheprovider bench --benchmark-json="$OUT/bench.json"
step report "$OUT/bench.log" 60 $PY -m bench.report "$OUT/bench.json" --out "$OUT"

# ---- summary, last
{
  echo "flashkern device check: $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__)') | $BACKEND $ARCH | commit $FLASHKERN_COMMIT"
  echo
  echo "step       status   time  log"
  cat "$SUMMARY.steps"
  echo
  echo "tests: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/tests.log" | tail -1)"
  if [ -f "$OUT/bench.md" ]; then
    echo
    echo "flashkern, GB/s (prefill: TFLOP/s) and % of peak, speedup over the baseline (all rows in bench.md):"
    awk -F'|' '/^## /{op=substr($0, 4)} /^\| shape/{unit=($0 ~ /TFLOP/) ? "TFLOP/s" : "GB/s"}
      $4 ~ /^ flashkern $/{printf "  %-24s %-16s %-9s %7s %-7s %4s%% peak %7s\n", op, $2, $3, $6, unit, $7,
                           $9}' "$OUT/bench.md" | head -40
  fi
} >"$SUMMARY"
rm -f "$SUMMARY.steps"
cat "$SUMMARY"
