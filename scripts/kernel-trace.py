#!/usr/bin/env python3
"""Where a step's time goes, from a kernel timeline (bench/kernel_trace.cpp's CSV).

    DM_KERNEL_TRACE=trace.csv CUDA_INJECTION64_PATH=.../libdm_kernel_trace.so PROGRAM ...
    scripts/kernel-trace.py trace.csv --step-start prepare_rows_kernel [--steps 3] [--top 30]

The last --steps steps (a step begins at each launch of the --step-start kernel) are split per
kernel name and grid: calls a step, mean duration (first block's start to the end, PDL waiting
included) and mean EXPOSED time: how far the kernel moved the latest end seen so far in the
step (max(0, end - latest end before it)), which sums to the step's span. A kernel overlapped by
the ones around it exposes little; a kernel on the critical path exposes its whole tail.
"""
import argparse
import collections
import csv
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--step-start", required=True, help="name (substring) of a step's first kernel")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    with open(a.trace, newline="") as f:
        rows = [r for r in csv.DictReader(f)]
    for r in rows:
        r["start"], r["end"] = int(r["start_ns"]), int(r["end_ns"])
    rows.sort(key=lambda r: r["start"])
    starts = [i for i, r in enumerate(rows) if a.step_start in r["name"]]
    if len(starts) < a.steps + 1:
        sys.exit(f"kernel-trace: {len(starts)} launches of {a.step_start}, need {a.steps + 1}")
    steps = [rows[starts[i]:starts[i + 1]] for i in range(len(starts) - a.steps - 1,
                                                          len(starts) - 1)]
    total = collections.defaultdict(lambda: [0, 0.0, 0.0])  # calls, duration, exposed
    spans = []
    for step in steps:
        latest = step[0]["start"]
        first = latest
        for r in step:
            key = (r["name"][:90], r["grid"], r["block"])
            exposed = max(0, r["end"] - latest)
            latest = max(latest, r["end"])
            t = total[key]
            t[0] += 1
            t[1] += (r["end"] - r["start"]) / 1e3
            t[2] += exposed / 1e3
        spans.append((latest - first) / 1e3)
    n = len(steps)
    span = sum(spans) / n
    print(f"{n} steps, span {span:.1f} us a step (" +
          ", ".join(f"{s:.1f}" for s in spans) + ")")
    print("| exposed us/step | share | calls/step | exposed each | duration each | grid | block "
          "| kernel |")
    print("|---:|---:|---:|---:|---:|---|---|---|")
    ordered = sorted(total.items(), key=lambda kv: -kv[1][2])
    for (name, grid, block), (calls, duration, exposed) in ordered[:a.top]:
        print(f"| {exposed / n:.1f} | {100 * exposed / n / span:.1f}% | {calls / n:g} | "
              f"{exposed / calls:.2f} | {duration / calls:.2f} | {grid} | {block} | {name} |")


if __name__ == "__main__":
    main()
