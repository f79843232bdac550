#!/usr/bin/env bash
# Quantile Balancing sweep on the demo schedule (docs/training.md, "What limits per-step
# MaxVio"): trains the demo config with the README's schedule once per QB setting and prints,
# per run, the per-step MaxVio (max over layers) over the last stage, MaxVio at the end of each
# stage on held-out rows (maxvio_global), the final loss and recall. Meant for a GPU
# (`--device cuda`, ~20 s per run on an H200); on a CPU each run takes the demo's ~7 minutes.
#
#   scripts/qb-sweep.sh [--device cuda|cpu] [--eval-rows N] [--eval-every N] [--batch B]
#                       "label:extra train flags" ...
# Evaluations (recall, held-out MaxVio) run the host model: --eval-every 0 skips them (a GPU
# sweep is then ~20 s per run). CONFIG and STAGES (environment) replace the demo's.
# e.g. scripts/qb-sweep.sh --device cuda "base:" "w4:--balance-window 4" "ema:--balance-ema 0.8"
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-./build/bin/deltamoe}
OUT=${OUT:-out/qb-sweep}
CONFIG=${CONFIG:-configs/demo.json}
STAGES=${STAGES:-128:150K,512:32K:0.5:0.5,1024:80K:0.3:0.5:16}
DEVICE=cpu EVAL_ROWS=64 EVAL_EVERY=50 BATCH=8
runs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --eval-rows) EVAL_ROWS=$2; shift 2 ;;
    --eval-every) EVAL_EVERY=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    *) runs+=("$1"); shift ;;
  esac
done
[ ${#runs[@]} -gt 0 ] || runs=("base:")
mkdir -p "$OUT"
echo "{\"eval_balance_rows\": $EVAL_ROWS, \"eval_every\": $EVAL_EVERY}" >"$OUT/train-config.json"
for r in "${runs[@]}"; do
  label=${r%%:*} flags=${r#*:}
  dir="$OUT/$label"
  rm -rf "$dir"
  # shellcheck disable=SC2086
  $BIN train --config "$CONFIG" --out "$dir" --batch "$BATCH" --warmup 20 --quiet \
    --stages "$STAGES" --device "$DEVICE" \
    --train-config "$OUT/train-config.json" $flags >"$dir.log" 2>&1 || { tail -5 "$dir.log"; continue; }
  python3 - "$dir/metrics.jsonl" "$label" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
last = max(r["stage"] for r in rows)
tail = [r["maxvio"] for r in rows if r["stage"] == last][1:] or [rows[-1]["maxvio"]]  # skip the stage change
glob = [(r["step"], r["maxvio_global"]) for r in rows if r.get("maxvio_global", -1) >= 0]
under = next((r["step"] for r in rows if r["maxvio"] < 0.1), None)
print(f"{sys.argv[2]:>10}: last-stage per-step MaxVio min {min(tail):.3f} median "
      f"{sorted(tail)[len(tail)//2]:.3f} max {max(tail):.3f} | held-out "
      + " ".join(f"{s}:{g:.3f}" for s, g in glob)
      + f" | first step < 0.1: {under} | loss {rows[-1]['loss']:.3f} | recall "
      + " ".join(f"{r['recall_acc']:.2f}" for r in rows if "recall_acc" in r))
win = [(r["step"], r["maxvio_window"]) for r in rows if "maxvio_window" in r]
wunder = next((s for s, w in win if w < 0.1), None)
print(" " * 12 + f"16K-token windows (first < 0.1 at step {wunder}): "
      + " ".join(f"{w:.2f}" for _, w in win))
med = lambda v: sorted(v)[len(v) // 2]
print(" " * 12 + "per-step MaxVio median per 20 steps: " + " ".join(
    f"{med([r['maxvio'] for r in rows[i:i + 20]]):.2f}" for i in range(0, len(rows), 20)))
PY
done
