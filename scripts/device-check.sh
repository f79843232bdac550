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

# Goldens: ../shared/goldens beside a checkout, or a copy carried in .goldens (the device tool
# sends only the repository).
if [ -z "${DM_GOLDENS:-}" ] && [ -d .goldens ]; then export DM_GOLDENS=$PWD/.goldens; fi

step "GPU op, layer and model tests vs the CPU reference (+ goldens on the GPU)"
./build-gpu/bin/deltamoe_tests --gtest_filter='Cuda*:*/Cuda*' --gtest_brief=1 2>&1 | tee "$LOG/tests.log" | \
  grep -vE "^\[ +(RUN|OK) +\]" | tail -60

step "deltamoe forward --device cuda vs --device cpu (golden K3 tiny)"
if [ -n "${DM_GOLDENS:-}" ] && [ -d "$DM_GOLDENS/kimi_k3_tiny" ]; then
  ./build-gpu/bin/deltamoe forward --model "$DM_GOLDENS/kimi_k3_tiny" \
    --input "$DM_GOLDENS/kimi_k3_tiny/golden.safetensors" --output "$LOG/fwd_gpu.safetensors" --device cuda &&
  ./build-gpu/bin/deltamoe forward --model "$DM_GOLDENS/kimi_k3_tiny" \
    --input "$DM_GOLDENS/kimi_k3_tiny/golden.safetensors" --output "$LOG/fwd_cpu.safetensors" &&
  ls -la "$LOG"/fwd_*.safetensors
fi

if [ "$BENCH" = 1 ]; then
  for b in build-gpu/bin/bench_cuda_*; do
    [ "$(basename "$b")" = bench_cuda_model ] && continue
    step "$(basename "$b")"
    timeout 240 "$b" 2>&1 | tee "$LOG/$(basename "$b").log"
  done
  # Whole model, prefill + decode, against the PyTorch eager peer on the same GPU (bf16).
  MODEL_CFG=${MODEL_CFG:-configs/gpu_1b.json}
  step "bench_cuda_model $MODEL_CFG"
  timeout 300 build-gpu/bin/bench_cuda_model --config "$MODEL_CFG" --tokens 2048,8192 \
    --slots 1,64 --context 1024 2>&1 | tee "$LOG/bench_cuda_model.log"
  if [ "$PEERS" = 1 ]; then
    step "peer: PyTorch eager training step, same config and shape as bench_cuda_train, cuda bf16"
    timeout 300 python3 bench/peers/deltamoe_torch.py train-bench --config "$MODEL_CFG" \
      --batch 1 --seq 4096 --steps 3 --warmup 1 --device cuda --dtype bfloat16 2>&1 | tail -2 |
      tee "$LOG/peer_torch_train.log"
    step "peer: PyTorch eager forward, same config, cuda bf16"
    for T in 2048 8192; do
      timeout 240 python3 bench/peers/deltamoe_torch.py forward-bench --config "$MODEL_CFG" \
        --seq "$T" --steps 3 --warmup 1 --device cuda --dtype bfloat16 2>&1 | tail -2 |
        tee -a "$LOG/peer_torch_model.log"
    done
  fi
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
