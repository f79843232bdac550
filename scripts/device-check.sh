#!/usr/bin/env bash
# GPU check in one call (made for one 10-minute run of the device tool, or any machine with an
# NVIDIA GPU): build with the CUDA backend for Hopper, run every CPU-vs-GPU op test, then the GPU
# benchmarks and the peers (PyTorch, flash-linear-attention) side by side. Logs go to $OUT (or
# out/device-check) so they come back even when a step fails.
#
#   scripts/device-check.sh [--no-bench] [--no-peers]
# Wheels for missing Python peers (fla-core) are installed from .whl/ when that folder exists.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-out/device-check}
mkdir -p "$LOG"
BENCH=1 PEERS=1
for a in "$@"; do
  case "$a" in
    --no-bench) BENCH=0 ;;
    --no-peers) PEERS=0 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
JOBS=$(nproc)
step() { echo; echo "=== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader || true

step "configure + build (CUDA, sm_90a)"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDELTAMOE_CUDA=ON -DDELTAMOE_BENCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a >"$LOG/configure.log" 2>&1 || { tail -30 "$LOG/configure.log"; exit 1; }
targets=(deltamoe deltamoe_tests)
for b in bench/bench_cuda_*.cpp; do [ -e "$b" ] && targets+=("$(basename "$b" .cpp)"); done
cmake --build build-gpu -j"$JOBS" --target "${targets[@]}" >"$LOG/build.log" 2>&1 || {
  grep -E "error|Error" "$LOG/build.log" | head -40; exit 1; }
echo "built: ${targets[*]}"

step "GPU op tests vs the CPU reference"
./build-gpu/bin/deltamoe_tests --gtest_filter='Cuda*' --gtest_brief=1 2>&1 | tee "$LOG/tests.log" | \
  grep -vE "^\[ +(RUN|OK) +\]" | tail -60

if [ "$BENCH" = 1 ]; then
  for b in build-gpu/bin/bench_cuda_*; do
    step "$(basename "$b")"
    timeout 240 "$b" 2>&1 | tee "$LOG/$(basename "$b").log"
  done
fi

if [ "$PEERS" = 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  for p in bench/peers/*_peers.py; do
    step "peer $(basename "$p")"
    PYTHONUNBUFFERED=1 timeout 240 python3 "$p" 2>&1 | tee "$LOG/$(basename "$p" .py).log"
  done
fi
step "done"
