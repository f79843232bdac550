#!/usr/bin/env bash
# The main job on an embedded default: build a demo-shaped model of the full architecture
# (KDA + gated MLA, Block AttnRes, latent SiTU MoE), count its parameters, and run it.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./build/bin/deltamoe
OUT=${OUT:-out/demo}
mkdir -p "$(dirname "$OUT")"
$BIN params --config configs/demo.json
$BIN init --config configs/demo.json --out "$OUT" --seed 1
./build/bin/bench_forward --config configs/demo.json --tokens 512
