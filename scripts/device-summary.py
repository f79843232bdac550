#!/usr/bin/env python3
"""One table from the logs of scripts/device-check.sh: each benchmark of the CUDA issue against
its target and, where the same call ran one, its peer. Reads whatever logs exist in the folder
(steps skipped for lack of time simply have none) and never fails on a missing or partial log.

  scripts/device-summary.py LOGDIR
"""
import json
import re
import sys
from pathlib import Path


def read(d, name):
    p = d / name
    return p.read_text(errors="replace") if p.exists() else ""


def json_lines(text):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def table_rows(text):
    """Markdown table rows of a log as lists of stripped cells (header and rules skipped)."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def number(s):
    m = re.search(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?", s)
    return float(m.group(0)) if m else None


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "out/device-check")
    out = ["| what | measured | peer (same call) | target |", "|---|---|---|---|"]

    tests = read(d, "tests.log")
    passed = re.search(r"\[  PASSED  \] (\d+) tests?", tests)
    failed = sorted(set(re.findall(r"\[  FAILED  \] (\S+)", tests)))
    if tests:
        out.append(f"| GPU tests vs the CPU reference | {passed.group(1) if passed else 0} passed, "
                   f"{len(failed)} failed{(': ' + ', '.join(failed[:4])) if failed else ''} | | "
                   "all pass |")

    # Chunked KDA: ours (bf16, the faster stage-4 path) against fla's chunk_kda.
    fla = {}
    for r in table_rows(read(d, "kda_peers.log")):
        if len(r) >= 4 and r[1] == "fla":  # shape | impl | fwd ms | fwd+bwd ms | …
            fla[r[0]] = number(r[3])
    for r in table_rows(read(d, "bench_cuda_kda.log")):
        if len(r) >= 5 and r[1] == "bf16":
            # fwd+bwd columns: ref, tc and (newer logs) tc reusing the forward's workspace, and
            # (newest) the split stage 4 reusing it; the last two columns are TF/s.
            times = [t for t in (number(c) for c in r[3:len(r) - 2]) if t]
            if not times:
                continue
            ours = min(times)
            peer = fla.get(r[0])
            ratio = f" ({peer / ours:.2f}× fla's speed)" if peer else ""
            out.append(f"| KDA fwd+bwd {r[0]} | {ours:.2f} ms{ratio} | "
                       f"{f'fla {peer:.2f} ms' if peer else ''} | ≥ 2× faster than fla |")

    # MLA prefill: % of the measured bf16 GEMM peak, beside torch SDPA's cuDNN backend (the
    # peer of the same run, when mla_peers ran).
    torch_cudnn = {}
    for r in table_rows(read(d, "mla_peers.log")):
        m = re.match(r"torch sdpa (fwd|bwd) \(cudnn", r[0]) if r else None
        if m and len(r) >= 5:
            torch_cudnn[(m.group(1), r[1])] = f"torch cuDNN {r[3]} TF/s ({r[4]})"
    for r in table_rows(read(d, "bench_cuda_mla.log")):
        if len(r) >= 5 and r[0].startswith("mla prefill"):
            direction = "bwd" if " bwd" in r[0] else "fwd"
            peer = torch_cudnn.get((direction, r[1]), "")
            out.append(f"| {r[0]} {r[1]} | {r[3]} TF/s ({r[4]} of peak) | {peer} | ≥ 50% of peak |")
        elif len(r) >= 6 and r[0].startswith("mla decode"):
            out.append(f"| {r[0]} {r[1]} | {r[2]}, {r[5]} GB/s of cache read | | — |")

    # Decode, Kimi-Linear-48B shape: ms/step against the HBM floor.
    for line in read(d, "bench_cuda_decode.log").splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\|", line)
        if m:
            batch, ctx, ms, _, floor, ratio = m.groups()
            target = "≤ 1.3× the floor" if batch == "1" else "(reported)"
            c = int(ctx)
            context = f"{round(c / 2**20)}M" if c >= 2**20 - 1024 else f"{round(c / 1024)}K"
            out.append(f"| decode batch {batch}, context {context} | {float(ms):.2f} ms/step "
                       f"({ratio}× the {float(floor):.2f} ms floor) | | {target} |")

    # Decode variants (--ab-decode) against the default, batch 64 × 32K, each run twice.
    ab = {}
    for log in sorted(d.glob("decode_ab_*.log")):
        variant = log.stem[len("decode_ab_"):].rsplit("_", 1)[0]
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"\s*64\s+32768\s+([\d.]+)\s", line)
            if m:
                ab.setdefault(variant, []).append(float(m.group(1)))
    for variant, runs in ab.items():
        cells = " / ".join(f"{ms:.2f}" for ms in runs)
        out.append(f"| decode batch 64, 32K, variant `{variant}` | {cells} ms/step | | "
                   f"(A/B against `default`) |")

    # Training variants against the default (bench_cuda_train, --recompute off).
    tab = {}
    for log in sorted(d.glob("train_ab_*.log")):
        variant = log.stem[len("train_ab_"):].rsplit("_", 1)[0]
        for j in json_lines(log.read_text(errors="replace")):
            if j.get("impl") == "deltamoe":
                tab.setdefault(variant, []).append(j["step_ms"])
    for variant, runs in tab.items():
        name = variant
        cells = " / ".join(f"{ms:.1f}" for ms in runs)
        out.append(f"| training step, variant `{name}` | {cells} ms | | (A/B against `default`) |")

    # Training step: tokens/s and MFU against the PyTorch eager peer on the same GPU.
    # One row per run: with per-layer recompute, and with the KDA and MoE internals kept
    # (--recompute off).
    peer = [j for j in json_lines(read(d, "peer_torch_train.log")) if "tokens_per_s" in j]
    p = peer[-1]["tokens_per_s"] if peer else None
    for log, label in (("bench_cuda_train.log", "training step (1B config)"),
                       ("bench_cuda_train_kept.log",
                        "training step (1B config, KDA and MoE internals kept)"),
                       ("bench_cuda_train_b4.log",
                        "training step (1B config, internals kept, 4 × 4096 tokens)")):
        ours = [j for j in json_lines(read(d, log)) if j.get("impl") == "deltamoe"]
        if not ours:
            continue
        o = ours[-1]
        vs = f" ({o['tokens_per_s'] / p:.1f}× torch)" if p else ""
        peer_cell = f"torch eager {p:.0f} tokens/s" if p else ""
        out.append(f"| {label} | {o['tokens_per_s']:.0f} tokens/s, MFU "
                   f"{100 * o.get('mfu', 0):.1f}%{vs} | {peer_cell} | MFU ≥ 40% |")

    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
