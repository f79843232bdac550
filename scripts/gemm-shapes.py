#!/usr/bin/env python3
"""Time and TFLOP/s of each cuBLASLt product shape in a run.

Run the program with both the kernel trace and the GEMM shape log on:
  DM_GEMM_SHAPES=shapes.txt DM_KERNEL_TRACE=trace.csv \
    CUDA_INJECTION64_PATH=.../libdm_kernel_trace.so bench_cuda_train ...
then
  scripts/gemm-shapes.py trace.csv shapes.txt [--steps N]

The shape log has one line per cuBLASLt call in call order (ops/cuda/gemm.cu); the trace has
every kernel in launch order. The cuBLASLt kernels of the trace (nvjet/cutlass/xmma/gemm names;
a split-K reduction counts with the product before it) are matched to the calls one for one.
--steps divides the totals (the run's steps, warm-up included, when the trace holds them all).
"""
import argparse
import csv
import sys
from collections import defaultdict


def is_product(name):
    if name.startswith("dm::") or name.startswith("cudnn"):
        return False
    low = name.lower()
    return low.startswith("nvjet") or "cutlass" in low or "xmma" in low or "gemm" in low


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("shapes")
    ap.add_argument("--steps", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()

    kernels = []  # [duration_us, name] per product, split-K reductions folded in
    with open(args.trace) as f:
        for row in csv.DictReader(f):
            name = row["name"]
            dur = (int(row["end_ns"]) - int(row["start_ns"])) / 1e3
            if "splitKreduce" in name:
                if kernels:
                    kernels[-1][0] += dur
                continue
            if is_product(name):
                kernels.append([dur, name.split("<")[0]])
    with open(args.shapes) as f:
        header = f.readline().split()
        shapes = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    if len(kernels) != len(shapes):
        sys.exit(f"gemm-shapes: {len(kernels)} cuBLASLt kernels in the trace but {len(shapes)} "
                 "logged products: not the same run, or a product ran more than one kernel")

    totals = defaultdict(lambda: [0, 0.0, set()])
    all_us = 0.0
    for (dur, name), shape in zip(kernels, shapes):
        t = totals[shape]
        t[0] += 1
        t[1] += dur
        t[2].add(name)
        all_us += dur
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    print(f"{len(shapes)} products, {all_us / 1e3 / args.steps:.2f} ms a step "
          f"({args.steps:g} steps)")
    print("| ms a step | share | calls a step | µs each | TFLOP/s | " +
          " | ".join(header) + " | kernel |")
    print("|---:|---:|---:|---:|---:|" + "---:|" * len(header) + "---|")
    for shape, (calls, us, names) in rows[: args.top]:
        d = dict(zip(header, shape))
        flops = 2.0 * d["M"] * d["N"] * d["K"] * d["batch"]
        print(f"| {us / 1e3 / args.steps:.3f} | {100 * us / all_us:.1f}% | "
              f"{calls / args.steps:g} | {us / calls:.1f} | {flops * calls / (us * 1e-6) / 1e12:.0f} | "
              + " | ".join(str(x) for x in shape) + " | " + ", ".join(sorted(names)) + " |")


if __name__ == "__main__":
    main()
