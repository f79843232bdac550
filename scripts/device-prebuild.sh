#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries on this machine (nvcc 13.0, no GPU needed) so that
# a call of the device tool can skip its own build (~110 s of a call's ~210 s on the H200):
#
#   scripts/device-prebuild.sh [TARGET ...]
#       default: deltamoe deltamoe_tests bench_cuda_kda bench_cuda_train bench_cuda_mla
#                bench_cuda_decode bench_cuda_moe_gemm bench_cuda_prefix bench_cuda_layer_ops
#   device tool: carry [".devbuild/prebuilt.tar.xz", ".goldens", ".whl"],
#                command `scripts/device-check.sh --prebuilt .devbuild/prebuilt.tar.xz`
# The stripped binaries are packed with xz -9e: its 64 MiB dictionary finds the CUDA kernels
# every binary links again, so four binaries of ~30 MB each pack into 11 MB (the default level,
# with an 8 MiB window, gave 35 MB) and fit the 64 MiB a call carries beside the goldens (28 MB).
#
# The binaries are configured to need only libraries the device image has (its notes: OpenBLAS,
# libstdc++, CUDA 13.0 with cuBLASLt; no PCRE2, no cpp-httplib): PCRE2 and the HTTP server are
# left out here, so the tokenizer uses its ASCII splitter and the tests that need either skip.
# They are stripped (the device tool carries at most 64 MiB, goldens included), and the script
# fails if one of them links a library outside that set.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(deltamoe deltamoe_tests bench_cuda_kda bench_cuda_train bench_cuda_mla bench_cuda_decode bench_cuda_moe_gemm bench_cuda_prefix bench_cuda_layer_ops)
cmake -S . -B .devbuild -DCMAKE_BUILD_TYPE=Release -DDELTAMOE_CUDA=ON -DDELTAMOE_BENCH=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a -DDELTAMOE_WITH_PCRE2=OFF -DDELTAMOE_WITH_HTTP=OFF >/dev/null
cmake --build .devbuild -j"$(nproc)" --target "${targets[@]}"
status=0
for t in "${targets[@]}"; do
  strip --strip-unneeded ".devbuild/bin/$t"
  if ldd ".devbuild/bin/$t" | grep -E "not found|pcre2|httplib|ssl|brotli"; then
    echo "device-prebuild: .devbuild/bin/$t links a library the device image lacks" >&2
    status=1
  fi
done
# The kernel timeline library (bench/kernel_trace.cpp) rides along when this CUDA has CUPTI.
packed=("${targets[@]}")
if cmake --build .devbuild --target dm_kernel_trace >/dev/null 2>&1; then
  strip --strip-unneeded .devbuild/bin/libdm_kernel_trace.so
  packed+=(libdm_kernel_trace.so)
fi
tar -cf - -C .devbuild/bin "${packed[@]}" | xz -9e -T0 > .devbuild/prebuilt.tar.xz
du -ch "${targets[@]/#/.devbuild/bin/}" | tail -1
du -h .devbuild/prebuilt.tar.xz
exit $status
