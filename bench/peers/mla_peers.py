#!/usr/bin/env python3
"""PyTorch peer of bench/bench_cuda_mla.cpp: the same shapes, FLOP formulas and table format.

  python3 bench/peers/mla_peers.py [--reps 15] [--quick]

Rows (CUDA-event timing, warm-up then the median of --reps runs):
  gemm            torch.matmul bf16 8192^3: the peak the other rows are compared to.
  sdpa fwd / bwd  torch.nn.functional.scaled_dot_product_attention, causal, B = 1,
                  q/k head dim 192, v head dim 128, once per backend that accepts the shape:
                    flash      needs equal head dims: v is ZERO-PADDED to 192 (output sliced);
                               the FLOP count stays the useful one (Dv = 128), so its TFLOP/s
                               is comparable with ours;
                    efficient  (mem-efficient) and cudnn take v = 128 natively where they can.
                  bwd = torch.autograd.grad of (q, k, v) with a random upstream gradient, timed
                  on its own after an untimed forward.
                  forward FLOP = 2*H*P*(192 + 128), backward = 2*H*P*(3*192 + 2*128),
                  P = T(T+1)/2 causal pairs per head (the formulas of the C++ bench).
  decode          absorbed MLA decode with plain batched matmuls over a contiguous (unpaged)
                  latent cache [S, L, 576]: softmax(q . cache^T * scale) . cache[..., :512],
                  fp32 softmax; FLOP = 2*S*H*L*(576 + 512).
  moe experts     gather, gate/up GEMMs, SiTU-GLU, down GEMM, weighted combine at Din 3584,
                  F 3072, 64 experts, top-16; torch._grouped_mm when present, else a loop of
                  per-expert matmuls (the row says which). FLOP = 2*rows*3*Din*F.
"""
import argparse
import math

import torch
import torch.nn.functional as F


def median_ms(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def print_table(rows, peak):
    print("\n| item | shape | time | TFLOP/s | % of GEMM peak | GB/s |")
    print("|---|---|---:|---:|---:|---:|")
    for item, shape, ms, flop, nbytes in rows:
        tflops = flop / (ms * 1e-3) / 1e12
        time = f"{ms * 1e3:.1f} us" if ms < 1.0 else f"{ms:.3f} ms"
        gbs = f"{nbytes / (ms * 1e-3) / 1e9:.0f}" if nbytes > 0 else "-"
        pct = 100.0 * tflops / peak if peak > 0 else 0.0
        print(f"| {item} | {shape} | {time} | {tflops:.1f} | {pct:.1f}% | {gbs} |")


def sdpa_rows(T, H, reps, rows):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dqk, dv = 192, 128
    dev = "cuda"
    q = torch.randn(1, H, T, dqk, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, H, T, dqk, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, H, T, dv, device=dev, dtype=torch.bfloat16)
    dout = torch.randn(1, H, T, dv, device=dev, dtype=torch.bfloat16)
    pairs = T * (T + 1) / 2
    fwd_flop = 2 * H * pairs * (dqk + dv)
    bwd_flop = 2 * H * pairs * (3 * dqk + 2 * dv)
    scale = 1.0 / math.sqrt(dqk)
    variants = [
        ("flash", SDPBackend.FLASH_ATTENTION, True),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION, False),
        ("cudnn", SDPBackend.CUDNN_ATTENTION, False),
    ]
    for name, backend, pad_v in variants:
        vv = F.pad(v, (0, dqk - dv)) if pad_v else v
        label = f"{name}, v padded to {dqk}" if pad_v else f"{name}, v {dv}"
        qq, kk, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, vv))
        gout = F.pad(dout, (0, dqk - dv)) if pad_v else dout

        def forward():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qq, kk, vr, is_causal=True, scale=scale)

        try:
            with torch.no_grad():
                fwd_ms = median_ms(forward, reps)
            out = forward()
            torch.autograd.grad(out, (qq, kk, vr), gout)
        except RuntimeError as e:  # backend rejects the shape / dtype / head dims
            print(f"sdpa {label} T={T} H={H}: skipped ({str(e).splitlines()[0][:100]})")
            continue
        rows.append((f"torch sdpa fwd ({label})", f"T={T} H={H}", fwd_ms, fwd_flop, 0))

        bwd_times = []
        for i in range(reps + 2):
            out = forward()
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(out, (qq, kk, vr), gout)
            stop.record()
            stop.synchronize()
            if i >= 2:
                bwd_times.append(start.elapsed_time(stop))
        bwd_times.sort()
        rows.append((f"torch sdpa bwd ({label})", f"T={T} H={H}", bwd_times[len(bwd_times) // 2],
                     bwd_flop, 0))
        del qq, kk, vr, out
        torch.cuda.empty_cache()


def decode_rows(reps, rows):
    dk, dvl, L = 576, 512, 32768
    scale = 1.0 / math.sqrt(192.0)
    for H in (16, 32):
        for S in (1, 64):
            cache = torch.randn(S, L, dk, device="cuda", dtype=torch.bfloat16)
            q = 0.05 * torch.randn(S, H, dk, device="cuda", dtype=torch.bfloat16)

            def step():
                scores = torch.bmm(q, cache.transpose(1, 2)).float() * scale  # [S, H, L]
                p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
                return torch.bmm(p, cache[:, :, :dvl])  # [S, H, 512]

            with torch.no_grad():
                ms = median_ms(step, reps)
            rows.append(("torch decode (bmm, unpaged)", f"S={S} H={H} L=32K", ms,
                         2.0 * S * H * L * (dk + dvl), S * L * dk * 2.0))
            del cache
            torch.cuda.empty_cache()


def situ(g, u, b1=4.0, b2=25.0):
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(u / b2))


def moe_rows(reps, rows):
    E, Din, Fd, k = 64, 3584, 3072, 16
    dev = "cuda"
    gate = 0.02 * torch.randn(E, Fd, Din, device=dev, dtype=torch.bfloat16)
    up = 0.02 * torch.randn(E, Fd, Din, device=dev, dtype=torch.bfloat16)
    down = 0.02 * torch.randn(E, Din, Fd, device=dev, dtype=torch.bfloat16)
    grouped = hasattr(torch, "_grouped_mm")
    for N in (64, 512):
        gen = torch.Generator(device="cpu").manual_seed(12)
        idx = torch.stack([torch.randperm(E, generator=gen)[:k].sort().values for _ in range(N)])
        idx = idx.to(dev)
        w = torch.full((N, k), 1.0 / k, device=dev)
        x = torch.randn(N, Din, device=dev, dtype=torch.bfloat16)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        token = order // k
        counts_host = counts.tolist()

        def run_grouped():
            xs = x[token]
            g = torch._grouped_mm(xs, gate.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(xs, up.transpose(-2, -1), offs=offs)
            out = torch._grouped_mm(situ(g, u), down.transpose(-2, -1), offs=offs)
            y = torch.zeros(N, Din, device=dev, dtype=torch.float32)
            y.index_add_(0, token, out.float() * w.reshape(-1)[order, None])
            return y

        def run_loop():
            xs = x[token]
            outs, begin = [], 0
            for e in range(E):
                n = counts_host[e]
                if n == 0:
                    continue
                xe = xs[begin:begin + n]
                h = situ(xe @ gate[e].t(), xe @ up[e].t())
                outs.append(h @ down[e].t())
                begin += n
            out = torch.cat(outs)
            y = torch.zeros(N, Din, device=dev, dtype=torch.float32)
            y.index_add_(0, token, out.float() * w.reshape(-1)[order, None])
            return y

        fn, label = (run_grouped, "torch._grouped_mm") if grouped else (run_loop, "loop")
        try:
            with torch.no_grad():
                ms = median_ms(fn, reps)
        except RuntimeError as e:
            print(f"grouped mm failed ({str(e).splitlines()[0][:100]}); using the loop")
            fn, label = run_loop, "loop"
            with torch.no_grad():
                ms = median_ms(fn, reps)
        rows.append((f"torch moe experts ({label})", f"E=64 k=16 N={N} rows/expert={N * k // E}",
                     ms, 2.0 * N * k * 3.0 * Din * Fd, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = max(10, args.reps)
    if not torch.cuda.is_available():
        print("mla_peers: skipped, no CUDA device")
        return
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    rows = []
    n = 4096 if args.quick else 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, reps)
    peak = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
    rows.append(("torch gemm bf16", f"{n}^3", ms, 2.0 * n ** 3, 0))
    del a, b
    for T in ([4096] if args.quick else [4096, 32768]):
        for H in (16, 32):
            sdpa_rows(T, H, reps, rows)
    decode_rows(reps, rows)
    moe_rows(reps, rows)
    print_table(rows, peak)


if __name__ == "__main__":
    main()
