#!/usr/bin/env bash
# The main job on an embedded default: train the demo model (KDA + gated MLA hybrid, Block AttnRes,
# latent SiTU MoE with Quantile Balancing; configs/demo.json, 19.9M parameters) from scratch on
# built-in data (synthetic English the project generates + long-context recall tasks) with a
# progressive context schedule 128 -> 512 -> 1024, then generate text from it. ~4-5 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./build/bin/deltamoe
OUT=${OUT:-out/demo}
rm -rf "$OUT"
$BIN params --config configs/demo.json
# Stages T:tokens:lr_mult:replay:batch. The last stage runs 16 rows (16K tokens) per step: a
# batch's expert loads vary with the documents it holds and QB sets the bias from the previous
# batch, so per-step MaxVio falls with more rows per step (docs/training.md).
$BIN train --config configs/demo.json --out "$OUT" --batch 8 --warmup 20 \
  --stages 128:150K,512:32K:0.5:0.5,1024:80K:0.3:0.5:16
$BIN plot "$OUT"
$BIN generate --model "$OUT/checkpoint" --prompt "Anna found the" --max-new-tokens 40 \
  --temperature 0.7 --top-k 20 --seed 1
