#!/usr/bin/env bash
# Issue #15 on a 2-GPU machine (nvidia-h200-x2) in one device call: the NCCL self-check (an
# all-reduce inside a captured CUDA graph), the multi-GPU tests (TP=2 == TP=1 on Qwen3 and
# Qwen3.5, EP=2 == EP=1 on Kimi-K2 and DeepSeek-V4 shapes) and the three benchmarks
# (Qwen3-8B TP=1 vs TP=2, Moonlight EP=1 vs EP=2, the whole DeepSeek-V4-Flash shape at EP=2).
#
#   bash benchmarks/gpu_multi_gpu_all.sh                      # every phase, in the order below
#   PHASES="moonlight tp" bash benchmarks/gpu_multi_gpu_all.sh  # some of them
#   MULTI_GPU_DRY_RUN=1 OUT=/tmp/x bash benchmarks/gpu_multi_gpu_all.sh   # CPU dry run (tiny shapes)
#
# Run from the repository root. A device call lasts at most 600 s, so the phases run in priority
# order against DEADLINE_S (default 570 s from the start): a phase gets at most its own cap and
# what is left, and one that would start with less than 60 s left is skipped and named in the log
# (the next call runs it with PHASES=...). Writes under $OUT only: run.log (everything, tee'd),
# tensor_parallel.{json,png}, expert_parallel_moonlight.{json,png},
# expert_parallel_dsv4_flash.{json,png} (8 files at most come back).
# NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0): it can take the shared host's
# GPUs out of service.
set -u -o pipefail
: "${OUT:?set OUT to the folder for results}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
DEADLINE_S=${DEADLINE_S:-570}
PHASES=${PHASES:-"install selftest tests dsv4 tp moonlight"}
PY=${PYTHON:-python3}
DRY=${MULTI_GPU_DRY_RUN:-0}
START=$(date +%s)
LOG="$OUT/run.log"
: >"$LOG"

say() { echo "[multi-gpu $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# run_phase NAME CAP_S COMMAND...: under `timeout`, its cap or the time left, whichever is less
run_phase() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE_S - ($(date +%s) - START)))
  if [ "$left" -lt 60 ]; then
    say "SKIPPED $name: ${left}s left of ${DEADLINE_S}s (run it next call: PHASES=\"$name\")"
    return 0
  fi
  local limit=$((cap < left ? cap : left))
  say "START $name (limit ${limit}s): $*"
  # timeout signals the command's whole process group: rank processes it spawned go with it
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local status=${PIPESTATUS[0]}
  say "END $name: exit $status$([ "$status" = 124 ] && echo ' (timed out)')"
  if [ "$DRY" != 1 ]; then  # anything still holding a GPU would starve the next phase
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1 | sed 's/^/  gpu process: /' | tee -a "$LOG"
  fi
}

keep() {  # copy a benchmark's JSON + PNG from the results folder into $OUT
  for f in "$@"; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  return 0
}

RESULTS=$(mktemp -d)
TINY=""
[ "$DRY" = 1 ] && TINY="--tiny --device cpu"
say "phases: $PHASES; deadline ${DEADLINE_S}s; dry run: $DRY"
[ "$DRY" = 1 ] || nvidia-smi -L 2>&1 | tee -a "$LOG"

for phase in $PHASES; do
  case $phase in
    install)
      if [ "$DRY" = 1 ]; then say "install: skipped (dry run)"; continue; fi
      if [ -d .whl ]; then  # the engine's own dependencies (FastAPI, msgspec, pyzmq, llguidance...)
        run_phase install-wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      fi
      run_phase install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . -e plugins/openinfer-qwen3 \
        -e plugins/openinfer-qwen35 -e plugins/openinfer-kimi-k2 -e plugins/openinfer-deepseek-v4 \
        -e plugins/openinfer-llama
      ;;
    selftest)  # every collective, eager and replayed from a captured CUDA graph
      if [ "$DRY" = 1 ]; then say "selftest: skipped (dry run: no GPU)"; continue; fi
      run_phase selftest 120 "$PY" -m openinfer.parallel.selftest --world-size 2
      ;;
    tests)  # pytest-timeout (in the GPU image): a hung test fails alone, the others still run
      PER_TEST=""
      "$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout=150"
      # shellcheck disable=SC2086
      run_phase tests 300 "$PY" -m pytest -m gpu -v -rs $PER_TEST tests/gpu/test_parallel.py
      ;;
    dsv4)  # the whole DeepSeek-V4-Flash shape at EP=2 (EP=1 cannot hold it: its plan is in the JSON)
      # shellcheck disable=SC2086
      run_phase dsv4 330 "$PY" benchmarks/gpu_expert_parallel.py dsv4-flash $TINY --out "$RESULTS"
      keep "$RESULTS"/expert_parallel_dsv4_flash*.json "$RESULTS"/expert_parallel_dsv4_flash*.png
      ;;
    tp)
      # shellcheck disable=SC2086
      run_phase tp 240 "$PY" benchmarks/gpu_tensor_parallel.py $TINY --out "$RESULTS"
      keep "$RESULTS"/tensor_parallel*.json "$RESULTS"/tensor_parallel*.png
      ;;
    moonlight)
      # shellcheck disable=SC2086
      run_phase moonlight 240 "$PY" benchmarks/gpu_expert_parallel.py moonlight $TINY --out "$RESULTS"
      keep "$RESULTS"/expert_parallel_moonlight*.json "$RESULTS"/expert_parallel_moonlight*.png
      ;;
    *)
      say "unknown phase $phase (phases: install selftest tests dsv4 tp moonlight)"
      ;;
  esac
done
rm -rf "$RESULTS"
say "done; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
