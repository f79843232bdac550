#!/usr/bin/env python3
"""Sorted per-kernel table from an Nsight Compute per-kernel summary.

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --print-summary per-kernel PROGRAM ... > ncu.log
    scripts/ncu-kernels.py ncu.log [--skip random_fill] [--top 40]

One row per kernel name and launch shape: total time (invocations × mean), invocations, mean
time, mean DRAM bytes read and the bandwidth those give, so the kernels worth a look sort first.
ncu runs each kernel alone with the caches flushed (its default cache control): small kernels
look slower than they run inside a step, and the sum exceeds the step's wall time. Used for the
decode step's split in docs/benchmarks.md (ninth session).
"""
import argparse
import re
import sys

HEADER = re.compile(r"^\s\s(\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), "
                    r"Device \d+, CC [\d.]+, Invocations (\d+)")
METRIC = re.compile(r"^\s+(dram__bytes_read\.sum|gpu__time_duration\.sum)\s+(\S+)\s+"
                    r"(\S+)\s+(\S+)\s+(\S+)")
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "ns": 1e-9, "nsecond": 1e-9,
         "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0, "second": 1.0}


def parse(lines):
    kernels, current = [], None
    for line in lines:
        m = HEADER.match(line)
        if m:
            current = {"name": m.group(1), "grid": "x".join(m.group(2, 3, 4)),
                       "block": "x".join(m.group(5, 6, 7)), "calls": int(m.group(8))}
            kernels.append(current)
            continue
        m = METRIC.match(line)
        if m and current is not None:
            unit = m.group(2)
            if unit not in UNITS:
                sys.exit(f"ncu-kernels: unknown unit '{unit}' in: {line.rstrip()}")
            current[m.group(1)] = float(m.group(5).replace(",", "")) * UNITS[unit]
    return kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--skip", action="append", default=[],
                    help="leave out kernels whose name contains this (repeatable)")
    ap.add_argument("--top", type=int, default=0, help="print only the first N rows")
    ap.add_argument("--width", type=int, default=60, help="characters of the kernel name")
    ap.add_argument("--by-name", action="store_true",
                    help="one row per kernel name over all its launch shapes (a training step "
                         "launches the same kernel at many shapes)")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        kernels = [k for k in parse(f) if not any(s in k["name"] for s in args.skip)]
    if not kernels:
        sys.exit("ncu-kernels: no per-kernel summary found (was --print-summary per-kernel on?)")
    for k in kernels:
        k["total"] = k["calls"] * k.get("gpu__time_duration.sum", 0.0)
        k["read"] = k["calls"] * k.get("dram__bytes_read.sum", 0.0)
    if args.by_name:
        merged = {}
        for k in kernels:
            m = merged.setdefault(k["name"], {"name": k["name"], "grid": "*", "block": "*",
                                              "calls": 0, "total": 0.0, "read": 0.0})
            m["calls"] += k["calls"]
            m["total"] += k["total"]
            m["read"] += k["read"]
        kernels = list(merged.values())
        for k in kernels:  # the means over every launch
            k["gpu__time_duration.sum"] = k["total"] / k["calls"]
            k["dram__bytes_read.sum"] = k["read"] / k["calls"]
    kernels.sort(key=lambda k: -k["total"])
    print("| total µs | calls | µs each | MB read each | GB/s | grid | block | kernel |")
    print("|---:|---:|---:|---:|---:|---|---|---|")
    shown = kernels[:args.top] if args.top > 0 else kernels
    for k in shown:
        t = k.get("gpu__time_duration.sum", 0.0)
        b = k.get("dram__bytes_read.sum", 0.0)
        bw = f"{b / t / 1e9:.0f}" if t > 0 else "-"
        name = k["name"] if len(k["name"]) <= args.width else k["name"][:args.width - 1] + "…"
        print(f"| {k['total'] * 1e6:.1f} | {k['calls']} | {t * 1e6:.2f} | {b / 1e6:.2f} | {bw} | "
              f"{k['grid']} | {k['block']} | {name} |")
    total = sum(k["total"] for k in kernels)
    calls = sum(k["calls"] for k in kernels)
    print(f"\n{calls} kernel launches, {total * 1e3:.3f} ms summed ({len(kernels)} kernels)")


if __name__ == "__main__":
    main()
