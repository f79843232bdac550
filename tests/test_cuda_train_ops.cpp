// GPU ops of the whole-model training step around the layers (ops/cuda/residual_ops.h training
// side, ops/cuda/muon.h) against their CPU twins:
//   - attnres_forward vs dm::attnres_forward<float> (ops/cpu/attnres.h), relative RMS ≤ 1e-5:
//     float4 rows of one tile and wider (two passes), scalar rows (D % 4 ≠ 0, or rows not
//     16-byte aligned), S = 1 … kAttnResCudaMaxSources, row counts that leave warps of the last
//     block idle, the widest D, out aliasing a source, the training shape;
//   - attnres_backward vs dm::attnres_backward<float>: S = 1, 3, 5 … kAttnResCudaMaxSources, the
//     same row shapes, warps that own several rows, some dsrc nullptr, accumulation onto
//     non-zero gradients; increments compared, relative RMS ≤ 1e-5; parameter grads
//     bit-identical on a rerun (determinism);
//   - attnres_forward_norm vs attnres_forward then rmsnorm_to_bf16: the mix bit for bit, the
//     normed bf16 rows within one rounding step, fused and two-op shapes;
//   - attnres_norm_backward_deferred + attnres_flush vs attnres_norm_backward site by site;
//   - attnres_norm_backward vs rmsnorm_backward<float> then attnres_backward<float>: the same
//     row shapes up to kAttnResNormInMaxWidth, with and without parameter gradients;
//   - embedding_backward vs a host scatter-add with repeated ids (fp64 sums), untouched rows
//     exact, bit-identical reruns, out-of-range ids skipped; the atomic variant ≤ 1e-5;
//   - sum_squares vs a host fp64 sum (relative 1e-12), deterministic; scale_inplace exact;
//   - muon_update vs a host replica of Optimizer::muon_update (same float GEMMs, core/gemm.h) on
//     wide / tall / per-head shapes over two steps, and vs the real Optimizer (Muon) on every
//     Muon matrix of configs/test.json; update relative RMS ≤ 1e-5, bf16 copy exact.
// Without a GPU every test skips (GTEST_SKIP), so CI only checks that this compiles.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/gemm.h"
#include "cuda_test_util.h"
#include "io/config.h"
#include "model/weights.h"
#include "ops/cpu/attnres.h"
#include "ops/cpu/rmsnorm.h"
#include "ops/cuda/device.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/muon.h"
#include "ops/cuda/residual_ops.h"
#include "test_util.h"
#include "train/optimizer.h"

namespace {

namespace cu = dm::cuda;

using dm::test::all_finite;
using dm::test::DeviceScratch;
using dm::test::random_normal;

double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  return dm::test::rel_rms(a.data(), b.data(), a.size());
}

// Relative RMS of the increments (got − before) vs (want − before), in fp64: checks that the op
// accumulated (an overwrite would be off by `before`) without letting `before` hide the change.
double rel_rms_increment(const std::vector<float>& got, const std::vector<float>& want,
                         const std::vector<float>& before) {
  EXPECT_EQ(got.size(), want.size());
  EXPECT_EQ(got.size(), before.size());
  std::vector<double> a(got.size()), b(got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    a[i] = double(got[i]) - double(before[i]);
    b[i] = double(want[i]) - double(before[i]);
  }
  return dm::test::rel_rms(a.data(), b.data(), a.size());
}

// ---------------------------------------------------------------------------------------------
// AttnRes backward

struct AttnResCase {
  int S;
  int64_t N, D;
};

// A device copy of `host` that starts `offset` floats into its allocation: offset 1 leaves the
// rows off 16-byte alignment, so the AttnRes kernels take their scalar path even when D % 4 == 0.
float* upload_at_offset(DeviceScratch& dev, const std::vector<float>& host, size_t offset) {
  std::vector<float> padded(offset, 0.0f);
  padded.insert(padded.end(), host.begin(), host.end());
  return dev.upload(padded) + offset;
}

// S random sources of nd floats (source j at scale 0.5 + 0.4·j, so the r_j path matters), from
// seeds `seed` + j; dsrc0 (if given): their gradients' starting values, from seeds `seed` + 100 + j.
std::vector<std::vector<float>> random_sources(int S, size_t nd, uint64_t seed,
                                               std::vector<std::vector<float>>* dsrc0 = nullptr) {
  std::vector<std::vector<float>> src(static_cast<size_t>(S));
  if (dsrc0) dsrc0->assign(static_cast<size_t>(S), {});
  for (int j = 0; j < S; ++j) {
    src[size_t(j)] = random_normal(nd, seed + uint64_t(j), 0.5f + 0.4f * float(j));
    if (dsrc0) (*dsrc0)[size_t(j)] = random_normal(nd, seed + 100 + uint64_t(j), 0.1f);
  }
  return src;
}

// The gradients' starting values uploaded `offset` floats in; nullptr where skipped(j).
template <typename Skip>
std::vector<float*> upload_gradients(DeviceScratch& dev, const std::vector<std::vector<float>>& dsrc0,
                                     Skip skipped, size_t offset) {
  std::vector<float*> out(dsrc0.size(), nullptr);
  for (size_t j = 0; j < dsrc0.size(); ++j)
    if (!skipped(int(j))) out[j] = upload_at_offset(dev, dsrc0[j], offset);
  return out;
}

// Every uploaded gradient (non-null dsrc_d[j]) finite and its increment over dsrc0 within 1e-5
// of the reference's.
void expect_gradients_match(const std::vector<float*>& dsrc_d,
                            const std::vector<std::vector<float>>& dsrc_ref,
                            const std::vector<std::vector<float>>& dsrc0, size_t nd,
                            const std::string& where) {
  for (size_t j = 0; j < dsrc_d.size(); ++j) {
    if (dsrc_d[j] == nullptr) continue;
    const auto got = DeviceScratch::download(dsrc_d[j], nd);
    EXPECT_TRUE(all_finite(got)) << where;
    EXPECT_LE(rel_rms_increment(got, dsrc_ref[j], dsrc0[j]), 1e-5) << where << " dsrc[" << j << "]";
  }
}

// The CPU reference of the backward tests: attnres_backward<float> onto dsrc (sources with
// skipped(j) get no gradient) and dquery / dnorm (nullptr: not wanted).
template <typename Skip>
void cpu_attnres_backward(const std::vector<std::vector<float>>& src,
                          std::vector<std::vector<float>>& dsrc, Skip skipped,
                          const std::vector<float>& query, const std::vector<float>& norm_w,
                          const std::vector<float>& dout, float* dquery, float* dnorm, int64_t N,
                          int64_t D, float eps) {
  const size_t S = src.size();
  std::vector<const float*> src_h(S);
  std::vector<float*> dsrc_h(S);
  for (size_t j = 0; j < S; ++j) {
    src_h[j] = src[j].data();
    dsrc_h[j] = skipped(int(j)) ? nullptr : dsrc[j].data();
  }
  dm::Arena ws(dm::attnres_backward_workspace_bytes(D, sizeof(float)) + 4096);
  dm::attnres_backward<float>(src_h.data(), int(S), query.data(), norm_w.data(), dout.data(),
                              dsrc_h.data(), dquery, dnorm, N, D, eps, ws);
}

// The sources uploaded `offset` floats into their allocations.
std::vector<const float*> upload_sources(DeviceScratch& dev,
                                         const std::vector<std::vector<float>>& src,
                                         size_t offset) {
  std::vector<const float*> out;
  for (const auto& v : src) out.push_back(upload_at_offset(dev, v, offset));
  return out;
}

// out_alias ≥ 0: the output overwrites src[out_alias] (allowed by residual_ops.h).
void check_attnres_forward_rows(const AttnResCase& c, int out_alias, size_t offset) {
  const int S = c.S;
  const int64_t N = c.N, D = c.D;
  const size_t nd = size_t(N * D);
  const float eps = 1e-6f;
  std::vector<std::vector<float>> src(static_cast<size_t>(S));
  std::vector<const float*> src_h(static_cast<size_t>(S));
  for (int j = 0; j < S; ++j) {
    src[size_t(j)] = random_normal(nd, 300 + uint64_t(j), 0.5f + 0.4f * float(j));
    src_h[size_t(j)] = src[size_t(j)].data();
  }
  const std::vector<float> query = random_normal(size_t(D), 17, 0.3f);
  std::vector<float> norm_w = random_normal(size_t(D), 18, 0.2f);
  for (float& e : norm_w) e += 1.0f;
  std::vector<float> ref(nd);
  dm::attnres_forward<float>(src_h.data(), S, query.data(), norm_w.data(), ref.data(), nullptr, N,
                             D, eps);

  DeviceScratch dev(size_t(S + 1) * (nd + 64) * 4 + 4 * size_t(D + 64) * 4 + (1 << 20));
  const std::vector<const float*> src_d = upload_sources(dev, src, offset);
  const float* query_d = dev.upload(query);
  const float* norm_d = dev.upload(norm_w);
  // NaN everywhere a missed write would show.
  float* out_d = out_alias >= 0
                     ? const_cast<float*>(src_d[size_t(out_alias)])
                     : upload_at_offset(dev, std::vector<float>(nd, std::nanf("")), offset);
  cu::attnres_forward(src_d.data(), S, query_d, norm_d, out_d, N, D, eps);
  const auto got = DeviceScratch::download(out_d, nd);
  const std::string where = "S=" + std::to_string(S) + " N=" + std::to_string(N) +
                            " D=" + std::to_string(D) + " alias=" + std::to_string(out_alias) +
                            " offset=" + std::to_string(offset);
  EXPECT_TRUE(all_finite(got)) << where;
  EXPECT_LE(rel_rms(got, ref), 1e-5) << where;
}

// Each case at its own N and, below the warp-per-row threshold (residual_ops.cu: 1024 rows, the
// block-per-row kernel for decode-sized batches), again with 1024 more rows: both kernels.
void check_attnres_forward(const AttnResCase& c, int out_alias = -1, size_t offset = 0) {
  check_attnres_forward_rows(c, out_alias, offset);
  if (c.N < 1024) check_attnres_forward_rows({c.S, c.N + 1024, c.D}, out_alias, offset);
}

TEST(CudaTrainOpsAttnRes, ForwardMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  // float4 rows of one tile; 37 rows leave warps of the last block idle.
  for (int S : {1, 3, 5})
    for (int64_t D : {64, 256}) check_attnres_forward({S, 37, D});
  check_attnres_forward({5, 1300, 300});
  check_attnres_forward({3, 37, 37});   // D % 4 ≠ 0: scalar chunks
  check_attnres_forward({33, 9, 64});   // one source in the lanes' second slot
  check_attnres_forward({cu::kAttnResCudaMaxSources, 21, 128});
}

TEST(CudaTrainOpsAttnRes, ForwardWideUnalignedAndAliasedRows) {
  DM_SKIP_WITHOUT_GPU();
  check_attnres_forward({4, 19, 2052});   // float4, wider than a tile: two passes, ragged tail
  check_attnres_forward({3, 9, 1031});    // scalar, several tiles
  check_attnres_forward({3, 13, 16384});  // the widest row (64 KiB of shared memory)
  check_attnres_forward({2, 13, 256}, -1, 1);  // D % 4 == 0 but rows off 16 bytes: scalar
  check_attnres_forward({3, 37, 256}, 0);
  check_attnres_forward({3, 37, 256}, 2);
  check_attnres_forward({3, 9, 2052}, 1);
  check_attnres_forward({2, 9, 1031}, 0);
  check_attnres_forward({2, 9, 300}, 1, 1);
}

TEST(CudaTrainOpsAttnRes, ForwardTrainingShape) {
  DM_SKIP_WITHOUT_GPU();
  check_attnres_forward({5, 4096, 2048});
  check_attnres_forward({8, 4096, 2048}, 7);
}

// attnres_forward_norm against attnres_forward then rmsnorm_to_bf16 on the GPU: the mix bit for
// bit, the normed rows within one bf16 rounding step (the fused norm sums squares per warp).
void check_attnres_forward_norm(const AttnResCase& c, size_t offset = 0) {
  const int S = c.S;
  const int64_t N = c.N, D = c.D;
  const size_t nd = size_t(N * D);
  const float eps = 1e-6f, norm_eps = 1e-5f;
  const std::vector<std::vector<float>> src = random_sources(S, nd, 500);
  const std::vector<float> query = random_normal(size_t(D), 27, 0.3f);
  std::vector<float> norm_w = random_normal(size_t(D), 28, 0.2f),
                     out_w = random_normal(size_t(D), 29, 0.3f);
  for (float& e : norm_w) e += 1.0f;
  for (float& e : out_w) e += 1.0f;
  DeviceScratch dev(size_t(S + 2) * (nd + 64) * 4 + 2 * (nd + 64) * 2 + 4 * size_t(D + 64) * 4 +
                    (1 << 20));
  const std::vector<const float*> src_d = upload_sources(dev, src, offset);
  const float* query_d = dev.upload(query);
  const float* norm_d = dev.upload(norm_w);
  const float* out_w_d = dev.upload(out_w);
  float* mixed_fused = upload_at_offset(dev, std::vector<float>(nd, std::nanf("")), offset);
  float* mixed_ref = upload_at_offset(dev, std::vector<float>(nd, std::nanf("")), offset);
  uint16_t* normed_fused = dev.upload(std::vector<uint16_t>(nd, 0x7fc0));  // bf16 NaN
  uint16_t* normed_ref = dev.upload(std::vector<uint16_t>(nd, 0x7fc0));
  cu::attnres_forward_norm(src_d.data(), S, query_d, norm_d, mixed_fused, out_w_d, normed_fused, N,
                           D, eps, norm_eps);
  cu::attnres_forward(src_d.data(), S, query_d, norm_d, mixed_ref, N, D, eps);
  cu::rmsnorm_to_bf16(mixed_ref, out_w_d, normed_ref, N, D, norm_eps);
  const std::string where = "S=" + std::to_string(S) + " N=" + std::to_string(N) +
                            " D=" + std::to_string(D) + " offset=" + std::to_string(offset);
  EXPECT_EQ(DeviceScratch::download(mixed_fused, nd), DeviceScratch::download(mixed_ref, nd))
      << where;
  const auto got = DeviceScratch::download(normed_fused, nd);
  const auto want = DeviceScratch::download(normed_ref, nd);
  auto value = [](uint16_t bits) {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  size_t off_by_one = 0, worse = 0;
  for (size_t i = 0; i < nd; ++i) {
    if (got[i] == want[i]) continue;
    const float a = value(got[i]), b = value(want[i]);
    if (std::isfinite(a) && std::abs(a - b) <= std::abs(b) * (1.0f / 128.0f))
      ++off_by_one;
    else
      ++worse;
  }
  EXPECT_EQ(worse, 0u) << where;
  EXPECT_LE(off_by_one, nd / 100 + 1) << where << ": bf16 values one rounding step apart";
}

TEST(CudaTrainOpsAttnRes, ForwardNormMatchesMixThenNorm) {
  DM_SKIP_WITHOUT_GPU();
  check_attnres_forward_norm({5, 4096, 2048});  // fused: the training shape
  check_attnres_forward_norm({3, 1300, 256});   // fused, the last block's warps idle
  check_attnres_forward_norm({1, 1030, 64});
  check_attnres_forward_norm({3, 37, 256});       // block-per-row rows: two ops
  check_attnres_forward_norm({4, 1100, 2052});    // wider than a tile: two ops
  check_attnres_forward_norm({3, 1030, 256}, 1);  // rows off 16 bytes: two ops
}

void check_attnres_backward(const AttnResCase& c, bool with_dquery, bool with_dnorm,
                            size_t offset = 0) {
  const int S = c.S;
  const int64_t N = c.N, D = c.D;
  const size_t nd = size_t(N * D);
  const float eps = 1e-6f;
  std::vector<std::vector<float>> dsrc0;
  const std::vector<std::vector<float>> src = random_sources(S, nd, 100, &dsrc0);
  // A non-zero pseudo-query so the softmax is not uniform, scaled down for wide rows (the logits
  // grow like √D): at D = 16384 an unscaled one saturated the softmax, G fell to ~1e-12 and the
  // parameter increments vanished below the fp32 ulp of their starting values.
  const std::vector<float> query =
      random_normal(size_t(D), 7, 0.3f * std::min(1.0f, 16.0f / std::sqrt(float(D))));
  std::vector<float> norm_w = random_normal(size_t(D), 8, 0.2f);
  for (float& e : norm_w) e += 1.0f;
  const std::vector<float> dout = random_normal(nd, 9);
  const std::vector<float> dquery0 = random_normal(size_t(D), 10, 0.1f);
  const std::vector<float> dnorm0 = random_normal(size_t(D), 11, 0.1f);
  // Sources 1 and 4 (when present) get no gradient.
  auto skipped = [](int j) { return j == 1 || j == 4; };

  // CPU reference.
  std::vector<std::vector<float>> dsrc_ref = dsrc0;
  std::vector<float> dquery_ref = dquery0, dnorm_ref = dnorm0;
  cpu_attnres_backward(src, dsrc_ref, skipped, query, norm_w, dout,
                       with_dquery ? dquery_ref.data() : nullptr,
                       with_dnorm ? dnorm_ref.data() : nullptr, N, D, eps);

  // GPU, twice from the same start (determinism).
  const size_t ws_bytes = cu::attnres_backward_workspace_bytes(N, D, S);
  // Sources, dout, and the dsrc of two runs; each upload padded by `offset` and aligned.
  DeviceScratch dev(size_t(3 * S + 1) * (nd + 64) * 4 + 8 * size_t(D + 64) * 4 + 2 * ws_bytes +
                    (1 << 20));
  const std::vector<const float*> src_d = upload_sources(dev, src, offset);
  const float* query_d = dev.upload(query);
  const float* norm_d = dev.upload(norm_w);
  const float* dout_d = upload_at_offset(dev, dout, offset);
  void* ws_d = dev.raw(ws_bytes);
  std::vector<float> first_dquery, first_dnorm;
  for (int run = 0; run < 2; ++run) {
    const std::vector<float*> dsrc_d = upload_gradients(dev, dsrc0, skipped, offset);
    float* dquery_d = dev.upload(dquery0);
    float* dnorm_d = dev.upload(dnorm0);
    cu::attnres_backward(src_d.data(), S, query_d, norm_d, dout_d, dsrc_d.data(),
                         with_dquery ? dquery_d : nullptr, with_dnorm ? dnorm_d : nullptr, N, D,
                         eps, ws_d);
    const std::string where = "S=" + std::to_string(S) + " N=" + std::to_string(N) +
                              " D=" + std::to_string(D) + " offset=" + std::to_string(offset);
    expect_gradients_match(dsrc_d, dsrc_ref, dsrc0, nd, where);
    const auto dquery = DeviceScratch::download(dquery_d, size_t(D));
    const auto dnorm = DeviceScratch::download(dnorm_d, size_t(D));
    if (with_dquery)
      EXPECT_LE(rel_rms_increment(dquery, dquery_ref, dquery0), 1e-5) << where << " dquery";
    else
      EXPECT_EQ(dquery, dquery0) << where << " dquery must stay untouched";
    if (with_dnorm)
      EXPECT_LE(rel_rms_increment(dnorm, dnorm_ref, dnorm0), 1e-5) << where << " dnorm_w";
    else
      EXPECT_EQ(dnorm, dnorm0) << where << " dnorm_w must stay untouched";
    if (run == 0) {
      first_dquery = dquery;
      first_dnorm = dnorm;
    } else {
      EXPECT_EQ(dquery, first_dquery) << where << " dquery not bit-identical on a rerun";
      EXPECT_EQ(dnorm, first_dnorm) << where << " dnorm_w not bit-identical on a rerun";
    }
  }
}

TEST(CudaTrainOpsAttnRes, BackwardMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  for (int S : {1, 3, 5})
    for (int64_t D : {64, 256}) check_attnres_backward({S, 37, D}, true, true);
}

TEST(CudaTrainOpsAttnRes, BackwardGridStrideRowsAndOptionalParams) {
  DM_SKIP_WITHOUT_GPU();
  // 1300 rows: 163 blocks of 8 warps, the last with 4 idle; 300 = 75 float4 per row.
  check_attnres_backward({4, 1300, 300}, true, true);
  check_attnres_backward({3, 37, 64}, false, true);
  check_attnres_backward({2, 37, 64}, true, false);
  check_attnres_backward({3, 37, 64}, false, false);
}

TEST(CudaTrainOpsAttnRes, BackwardScalarWideAndManySources) {
  DM_SKIP_WITHOUT_GPU();
  check_attnres_backward({3, 37, 37}, true, true);    // D % 4 ≠ 0: scalar chunks
  check_attnres_backward({2, 9, 1031}, true, true);   // scalar, several tiles
  check_attnres_backward({3, 19, 2052}, true, true);  // float4, wider than a tile, ragged tail
  check_attnres_backward({3, 11, 7168}, true, true);  // 3 warps per block (shared memory)
  check_attnres_backward({2, 5, 16384}, true, true);  // the widest row: 1 warp, 128 KiB
  check_attnres_backward({3, 13, 256}, true, true, 1);  // rows off 16 bytes: scalar
  check_attnres_backward({33, 9, 64}, true, true);      // one source in the second lane slot
  check_attnres_backward({cu::kAttnResCudaMaxSources, 21, 64}, true, true);
  check_attnres_backward({1, 1300, 300}, true, true);
}

TEST(CudaTrainOpsAttnRes, BackwardWarpsOwningSeveralRows) {
  DM_SKIP_WITHOUT_GPU();
  // 9001 rows over ≤ 512 blocks of 8 warps: 3 rows per warp (376 blocks), 23 warps idle on
  // their last row.
  check_attnres_backward({3, 9001, 64}, true, true);
  check_attnres_backward({4, 9001, 64}, false, true);
}

TEST(CudaTrainOpsAttnRes, BackwardTrainingShape) {
  DM_SKIP_WITHOUT_GPU();
  check_attnres_backward({5, 4096, 2048}, true, true);
}

// attnres_norm_backward against the CPU's two steps: rmsnorm_backward<float> of the mix's output
// into a zeroed dout, then attnres_backward<float> with it; every gradient an increment onto a
// non-zero start, relative RMS ≤ 1e-5, the parameter gradients bit-identical on a rerun.
void check_attnres_norm_backward(const AttnResCase& c, bool with_params, size_t offset = 0) {
  const int S = c.S;
  const int64_t N = c.N, D = c.D;
  const size_t nd = size_t(N * D);
  const float eps = 1e-6f, norm_eps = 1e-5f;
  std::vector<std::vector<float>> dsrc0;
  const std::vector<std::vector<float>> src = random_sources(S, nd, 300, &dsrc0);
  const std::vector<float> query =
      random_normal(size_t(D), 17, 0.3f * std::min(1.0f, 16.0f / std::sqrt(float(D))));
  std::vector<float> norm_w = random_normal(size_t(D), 18, 0.2f),
                     out_w = random_normal(size_t(D), 19, 0.3f);
  for (float& e : norm_w) e += 1.0f;
  for (float& e : out_w) e += 1.0f;
  const std::vector<float> mixed = random_normal(nd, 20, 0.7f), dy = random_normal(nd, 21);
  const std::vector<float> dquery0 = random_normal(size_t(D), 22, 0.1f);
  const std::vector<float> dnorm0 = random_normal(size_t(D), 23, 0.1f);
  const std::vector<float> dout_w0 = random_normal(size_t(D), 24, 0.1f);
  auto skipped = [](int j) { return j == 1; };

  std::vector<std::vector<float>> dsrc_ref = dsrc0;
  std::vector<float> dquery_ref = dquery0, dnorm_ref = dnorm0, dout_w_ref = dout_w0;
  std::vector<float> dout(nd, 0.0f), unused_dw(size_t(D), 0.0f);  // the CPU op always forms dw
  dm::rmsnorm_backward<float>(mixed.data(), out_w.data(), dy.data(), dout.data(),
                              with_params ? dout_w_ref.data() : unused_dw.data(), N, D, norm_eps);
  cpu_attnres_backward(src, dsrc_ref, skipped, query, norm_w, dout,
                       with_params ? dquery_ref.data() : nullptr,
                       with_params ? dnorm_ref.data() : nullptr, N, D, eps);

  const size_t ws_bytes = cu::attnres_norm_backward_workspace_bytes(N, D, S);
  DeviceScratch dev(size_t(3 * S + 2) * (nd + 64) * 4 + 16 * size_t(D + 64) * 4 + ws_bytes +
                    (1 << 20));
  const std::vector<const float*> src_d = upload_sources(dev, src, offset);
  const float* query_d = dev.upload(query);
  const float* norm_d = dev.upload(norm_w);
  const float* out_w_d = dev.upload(out_w);
  const float* mixed_d = upload_at_offset(dev, mixed, offset);
  const float* dy_d = upload_at_offset(dev, dy, offset);
  void* ws_d = dev.raw(ws_bytes);
  const std::string where = "S=" + std::to_string(S) + " N=" + std::to_string(N) +
                            " D=" + std::to_string(D) + " offset=" + std::to_string(offset);
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    const std::vector<float*> dsrc_d = upload_gradients(dev, dsrc0, skipped, offset);
    float* dquery_d = dev.upload(dquery0);
    float* dnorm_d = dev.upload(dnorm0);
    float* dout_w_d = dev.upload(dout_w0);
    cu::attnres_norm_backward(src_d.data(), S, query_d, norm_d, mixed_d, out_w_d, dy_d,
                              dsrc_d.data(), with_params ? dquery_d : nullptr,
                              with_params ? dnorm_d : nullptr, with_params ? dout_w_d : nullptr, N,
                              D, eps, norm_eps, ws_d);
    expect_gradients_match(dsrc_d, dsrc_ref, dsrc0, nd, where);
    std::vector<std::vector<float>> params = {DeviceScratch::download(dquery_d, size_t(D)),
                                              DeviceScratch::download(dnorm_d, size_t(D)),
                                              DeviceScratch::download(dout_w_d, size_t(D))};
    const std::vector<float>* want[3] = {&dquery_ref, &dnorm_ref, &dout_w_ref};
    const std::vector<float>* start[3] = {&dquery0, &dnorm0, &dout_w0};
    const char* names[3] = {"dquery", "dnorm_w", "d_out_w"};
    for (int k = 0; k < 3; ++k) {
      if (with_params)
        EXPECT_LE(rel_rms_increment(params[size_t(k)], *want[k], *start[k]), 1e-5)
            << where << " " << names[k];
      else
        EXPECT_EQ(params[size_t(k)], *start[k]) << where << " " << names[k] << " touched";
    }
    if (run == 0)
      first = params;
    else
      EXPECT_EQ(params, first) << where << " parameter gradients not bit-identical on a rerun";
  }
}

TEST(CudaTrainOpsAttnRes, NormBackwardMatchesCpuNormThenMix) {
  DM_SKIP_WITHOUT_GPU();
  for (int S : {1, 3, 5})
    for (int64_t D : {64, 256}) check_attnres_norm_backward({S, 37, D}, true);
  check_attnres_norm_backward({3, 37, 64}, false);    // no parameter gradients
  check_attnres_norm_backward({4, 1300, 300}, true);  // several blocks, idle warps
  check_attnres_norm_backward({3, 9001, 64}, true);   // warps owning several rows
  check_attnres_norm_backward({3, 37, 37}, true);     // scalar chunks
  check_attnres_norm_backward({3, 19, 2052}, true);   // wider than a tile, ragged tail
  check_attnres_norm_backward({2, 5, cu::kAttnResNormInMaxWidth}, true);  // one warp a block
  check_attnres_norm_backward({3, 13, 256}, true, 1);  // rows off 16 bytes: scalar
  check_attnres_norm_backward({5, 4096, 2048}, true);  // the training shape
}

// The fused-norm entry points refuse missing inputs, rows wider than the fused kernel takes and
// a deferred count outside 1..S−1 with an error naming the function, before touching the device
// (so this runs without a GPU too).
TEST(CudaTrainOpsAttnRes, FusedNormRejectsBadArguments) {
  float row[4] = {}, keep[4] = {};
  const float* src[3] = {row, row, row};
  float* dsrc[3] = {row, row, row};
  const std::string no_dy = dm::test::error_message([&] {
    cu::attnres_norm_backward(src, 3, row, row, row, row, nullptr, dsrc, nullptr, nullptr, nullptr,
                              1, 4, 1e-6f, 1e-5f, nullptr);
  });
  EXPECT_NE(no_dy.find("attnres_norm_backward (CUDA): mixed, out_w and dy are needed"),
            std::string::npos)
      << no_dy;
  const std::string wide = dm::test::error_message([&] {
    cu::attnres_norm_backward_deferred(src, 3, 1, row, row, row, row, row, dsrc, nullptr, nullptr,
                                       nullptr, 1, cu::kAttnResNormInMaxWidth + 4, 1e-6f, 1e-5f,
                                       keep, keep, nullptr);
  });
  EXPECT_NE(wide.find("attnres_norm_backward_deferred (CUDA): D="), std::string::npos) << wide;
  EXPECT_NE(wide.find("exceeds"), std::string::npos) << wide;
  const std::string all_deferred = dm::test::error_message([&] {
    cu::attnres_norm_backward_deferred(src, 3, 3, row, row, row, row, row, dsrc, nullptr, nullptr,
                                       nullptr, 1, 4, 1e-6f, 1e-5f, keep, keep, nullptr);
  });
  EXPECT_NE(all_deferred.find("3 deferred of 3 sources"), std::string::npos) << all_deferred;
}

// P sites sharing J sealed sources, each with its own p, mixed rows, dy and weights: the
// deferred calls plus one attnres_flush against P immediate attnres_norm_backward calls. The
// sealed sources' gradients and every site's dquery / dnorm_w within 1e-5 (the flush sums in
// another order); p's gradients and d_out_w bit for bit (the same kernel computes them); the
// flush bit-identical on a rerun.
void check_attnres_flush(int P, int J, int64_t N, int64_t D) {
  const size_t nd = size_t(N * D);
  const float eps = 1e-6f, norm_eps = 1e-5f;
  const std::string where = "P=" + std::to_string(P) + " J=" + std::to_string(J) +
                            " N=" + std::to_string(N) + " D=" + std::to_string(D);
  std::vector<std::vector<float>> dblocks0;
  const auto blocks = random_sources(J, nd, 600, &dblocks0);
  struct Site {
    std::vector<float> p, dp0, mixed, dy, query, norm_w, out_w;
  };
  std::vector<Site> sites(static_cast<size_t>(P));
  for (int k = 0; k < P; ++k) {
    Site& t = sites[size_t(k)];
    const uint64_t seed = 700 + 20 * uint64_t(k);
    t.p = random_normal(nd, seed, 0.8f);
    t.dp0 = random_normal(nd, seed + 1, 0.1f);
    t.mixed = random_normal(nd, seed + 2, 0.7f);
    t.dy = random_normal(nd, seed + 3);
    t.query =
        random_normal(size_t(D), seed + 4, 0.3f * std::min(1.0f, 16.0f / std::sqrt(float(D))));
    t.norm_w = random_normal(size_t(D), seed + 5, 0.2f);
    t.out_w = random_normal(size_t(D), seed + 6, 0.3f);
    for (float& e : t.norm_w) e += 1.0f;
    for (float& e : t.out_w) e += 1.0f;
  }
  const size_t site_ws = cu::attnres_norm_backward_workspace_bytes(N, D, J + 1);
  const size_t flush_ws = cu::attnres_flush_workspace_bytes(N, D, P);
  // Blocks, three copies of their gradients; per site and upload (three) p, mixed, dy, dp; the
  // two runs' kept douts and coefficients; the vectors; the workspaces.
  DeviceScratch dev(size_t(4 * J + 14 * P) * (nd + 64) * 4 + 2 * size_t(3 * J * N * P + 64) * 4 +
                    size_t(18 * P) * size_t(D + 64) * 4 + site_ws + flush_ws + (1 << 20));
  const std::vector<const float*> blocks_d = upload_sources(dev, blocks, 0);
  auto no_skip = [](int) { return false; };
  struct SiteDev {
    const float *p, *mixed, *dy, *query, *norm_w, *out_w;
    float *dp, *dquery, *dnorm, *dout_w, *keep_dout, *keep_coef;
  };
  auto upload_sites = [&]() {
    std::vector<SiteDev> out;
    for (const Site& t : sites) {
      SiteDev sd{};
      sd.p = dev.upload(t.p);
      sd.mixed = dev.upload(t.mixed);
      sd.dy = dev.upload(t.dy);
      sd.query = dev.upload(t.query);
      sd.norm_w = dev.upload(t.norm_w);
      sd.out_w = dev.upload(t.out_w);
      sd.dp = dev.upload(t.dp0);
      sd.dquery = dev.zeros<float>(size_t(D));
      sd.dnorm = dev.zeros<float>(size_t(D));
      sd.dout_w = dev.zeros<float>(size_t(D));
      out.push_back(sd);
    }
    return out;
  };
  void* ws = dev.raw(site_ws);
  // Immediate.
  const std::vector<float*> dblocks_a = upload_gradients(dev, dblocks0, no_skip, 0);
  const std::vector<SiteDev> a = upload_sites();
  for (int k = 0; k < P; ++k) {
    std::vector<const float*> src(blocks_d.begin(), blocks_d.end());
    std::vector<float*> dsrc(dblocks_a.begin(), dblocks_a.end());
    src.push_back(a[size_t(k)].p);
    dsrc.push_back(a[size_t(k)].dp);
    cu::attnres_norm_backward(src.data(), J + 1, a[size_t(k)].query, a[size_t(k)].norm_w,
                              a[size_t(k)].mixed, a[size_t(k)].out_w, a[size_t(k)].dy, dsrc.data(),
                              a[size_t(k)].dquery, a[size_t(k)].dnorm, a[size_t(k)].dout_w, N, D,
                              eps, norm_eps, ws);
  }
  // Deferred, then flushed (twice from the same start: determinism).
  void* fws = dev.raw(flush_ws);
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    const std::vector<float*> dblocks_b = upload_gradients(dev, dblocks0, no_skip, 0);
    std::vector<SiteDev> b = upload_sites();
    std::vector<cu::AttnResFlushSite> pending;
    for (int k = 0; k < P; ++k) {
      SiteDev& sd = b[size_t(k)];
      sd.keep_dout = dev.zeros<float>(nd);
      sd.keep_coef = dev.zeros<float>(size_t(3 * J * N));
      std::vector<const float*> src(blocks_d.begin(), blocks_d.end());
      std::vector<float*> dsrc(dblocks_b.begin(), dblocks_b.end());
      src.push_back(sd.p);
      dsrc.push_back(sd.dp);
      cu::attnres_norm_backward_deferred(
          src.data(), J + 1, J, sd.query, sd.norm_w, sd.mixed, sd.out_w, sd.dy, dsrc.data(),
          sd.dquery, sd.dnorm, sd.dout_w, N, D, eps, norm_eps, sd.keep_dout, sd.keep_coef, ws);
      cu::AttnResFlushSite f;
      f.dout = sd.keep_dout;
      f.coef = sd.keep_coef;
      f.deferred = J;
      f.query = sd.query;
      f.norm_w = sd.norm_w;
      f.dquery = sd.dquery;
      f.dnorm_w = sd.dnorm;
      pending.push_back(f);
    }
    std::vector<float*> dblocks_mut(dblocks_b.begin(), dblocks_b.end());
    cu::attnres_flush(pending.data(), P, blocks_d.data(), dblocks_mut.data(), J, N, D, fws);
    std::vector<std::vector<float>> got;
    for (int j = 0; j < J; ++j) {
      const auto want = DeviceScratch::download(dblocks_a[size_t(j)], nd);
      const auto have = DeviceScratch::download(dblocks_b[size_t(j)], nd);
      EXPECT_TRUE(all_finite(have)) << where;
      EXPECT_LE(rel_rms_increment(have, want, dblocks0[size_t(j)]), 1e-5)
          << where << " dblocks[" << j << "]";
      got.push_back(have);
    }
    for (int k = 0; k < P; ++k) {
      const SiteDev &sa = a[size_t(k)], &sb = b[size_t(k)];
      EXPECT_EQ(DeviceScratch::download(sb.dp, nd), DeviceScratch::download(sa.dp, nd))
          << where << " site " << k << " dp";
      EXPECT_EQ(DeviceScratch::download(sb.dout_w, size_t(D)),
                DeviceScratch::download(sa.dout_w, size_t(D)))
          << where << " site " << k << " d_out_w";
      const auto zero = std::vector<float>(size_t(D), 0.0f);
      for (auto [mine, theirs, name] : {std::tuple{sb.dquery, sa.dquery, "dquery"},
                                        std::tuple{sb.dnorm, sa.dnorm, "dnorm_w"}}) {
        const auto have = DeviceScratch::download(mine, size_t(D));
        EXPECT_LE(rel_rms_increment(have, DeviceScratch::download(theirs, size_t(D)), zero), 1e-5)
            << where << " site " << k << " " << name;
        got.push_back(have);
      }
    }
    if (run == 0)
      first = got;
    else
      EXPECT_EQ(got, first) << where << " the flush is not bit-identical on a rerun";
  }
}

TEST(CudaTrainOpsAttnRes, DeferredSitesAndFlushMatchImmediateSites) {
  DM_SKIP_WITHOUT_GPU();
  check_attnres_flush(1, 1, 37, 64);     // fewer rows than a stage
  check_attnres_flush(3, 2, 1300, 256);  // a ragged last stage
  check_attnres_flush(2, 3, 9001, 520);  // several stages a tile; a partial column block
  check_attnres_flush(cu::kAttnResFlushMaxSites, 4, 4096, 2048);  // the training shape
}

// ---------------------------------------------------------------------------------------------
// Embedding backward

void check_embedding_backward(int64_t N, int64_t D, int64_t V, const std::vector<int64_t>& tokens) {
  const size_t nd = size_t(N * D), vd = size_t(V * D);
  const std::vector<float> dp = random_normal(nd, 31);
  const std::vector<float> table0 = random_normal(vd, 32, 0.1f);
  // Host reference: per table row, the fp64 sum of its rows in ascending n, added once.
  std::vector<double> acc(vd, 0.0);
  std::vector<char> touched(size_t(V), 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = tokens[size_t(n)];
    if (t < 0 || t >= V) continue;
    touched[size_t(t)] = 1;
    for (int64_t d = 0; d < D; ++d) acc[size_t(t * D + d)] += double(dp[size_t(n * D + d)]);
  }
  std::vector<float> ref = table0;
  for (size_t i = 0; i < vd; ++i) ref[i] = float(double(table0[i]) + acc[i]);

  const size_t ws_bytes = cu::embedding_backward_workspace_bytes(N, V);
  DeviceScratch dev(nd * 4 + 3 * vd * 4 + size_t(N) * 8 + ws_bytes + (1 << 20));
  const int64_t* tokens_d = dev.upload(tokens);
  const float* dp_d = dev.upload(dp);
  void* ws_d = ws_bytes ? dev.raw(ws_bytes) : nullptr;
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    float* table_d = dev.upload(table0);
    cu::embedding_backward(tokens_d, dp_d, N, D, V, table_d, ws_d);
    const auto got = DeviceScratch::download(table_d, vd);
    EXPECT_LE(rel_rms_increment(got, ref, table0), 1e-6) << "N=" << N << " D=" << D << " V=" << V;
    for (int64_t t = 0; t < V; ++t) {
      if (touched[size_t(t)]) continue;
      for (int64_t d = 0; d < D; ++d)
        ASSERT_EQ(got[size_t(t * D + d)], table0[size_t(t * D + d)]) << "row " << t << " changed";
    }
    if (run == 0) first = got;
    else EXPECT_EQ(got, first) << "not bit-identical on a rerun";
  }
  // The atomic variant (in-range ids only): same sums up to fp32 summation order.
  bool in_range = true;
  for (int64_t t : tokens) in_range = in_range && t >= 0 && t < V;
  if (in_range) {
    float* table_d = dev.upload(table0);
    cu::embedding_backward(tokens_d, dp_d, N, D, table_d);
    EXPECT_LE(rel_rms_increment(DeviceScratch::download(table_d, vd), ref, table0), 1e-5)
        << "atomic variant, N=" << N << " D=" << D << " V=" << V;
  }
}

TEST(CudaTrainOpsEmbedding, BackwardMatchesHostWithRepeatedIds) {
  DM_SKIP_WITHOUT_GPU();
  {
    // 300 tokens over 50 ids (heavy repetition; one id 100 times), D not a multiple of 32.
    const int64_t N = 300, D = 70, V = 50;
    std::mt19937_64 rng(5);
    std::vector<int64_t> tokens(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) tokens[size_t(n)] = n % 3 == 0 ? 17 : int64_t(rng() % 40);
    check_embedding_backward(N, D, V, tokens);
  }
  {
    // A vocabulary of the full model's size (18 key bits) and a single token; ids at both ends.
    check_embedding_backward(1, 8, 163840, {163839});
    check_embedding_backward(3, 8, 163840, {0, 163839, 0});
  }
  {
    // Out-of-range ids are skipped; V a power of two (the invalid key V needs one more bit).
    check_embedding_backward(6, 16, 64, {3, -1, 64, 3, 63, 1000});
  }
}

// ---------------------------------------------------------------------------------------------
// Sum of squares, scale

TEST(CudaTrainOpsReduce, SumSquaresMatchesHostDouble) {
  DM_SKIP_WITHOUT_GPU();
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(1000), int64_t(4097), (int64_t(1) << 20) + 7,
                    int64_t(5000011)}) {
    const std::vector<float> x = random_normal(size_t(n), 40 + uint64_t(n), 0.01f);
    double want = 0;
    for (float e : x) want += double(e) * double(e);
    const size_t ws_bytes = cu::sum_squares_workspace_bytes(n);
    DeviceScratch dev(size_t(n) * 4 + ws_bytes + 4096);
    const float* x_d = dev.upload(x);
    void* ws_d = dev.raw(ws_bytes);
    double* result_d = dev.zeros<double>(2);
    cu::sum_squares(x_d, n, result_d, ws_d);
    cu::sum_squares(x_d, n, result_d + 1, ws_d);
    const auto got = DeviceScratch::download(result_d, 2);
    if (n == 0) {
      EXPECT_EQ(got[0], 0.0);
    } else {
      EXPECT_LE(std::fabs(got[0] - want) / want, 1e-12) << "n=" << n;
    }
    EXPECT_EQ(got[0], got[1]) << "n=" << n << " not deterministic";
  }
}

TEST(CudaTrainOpsReduce, ScaleInplaceIsExact) {
  DM_SKIP_WITHOUT_GPU();
  const int64_t n = 100003;
  const float s = 0.37f;
  std::vector<float> x = random_normal(size_t(n), 50);
  DeviceScratch dev(size_t(n) * 4 + 4096);
  float* x_d = dev.upload(x);
  cu::scale_inplace(x_d, n, s);
  for (float& e : x) e *= s;
  EXPECT_EQ(DeviceScratch::download(x_d, size_t(n)), x);
}

// ---------------------------------------------------------------------------------------------
// Muon

// Host replica of Optimizer::muon_update + newton_schulz (train/optimizer.cpp), same float
// arithmetic and the same float GEMMs.
void newton_schulz_reference(float* X, int64_t r, int64_t c, int steps) {
  const float a = 3.4445f, b = -4.7750f, cc = 2.0315f;
  double nrm = 0;
  for (int64_t i = 0; i < r * c; ++i) nrm += double(X[i]) * X[i];
  const float inv = float(1.0 / (std::sqrt(nrm) + 1e-7));
  for (int64_t i = 0; i < r * c; ++i) X[i] *= inv;
  std::vector<float> A(size_t(r * r)), B(size_t(r * r)), Y(size_t(r * c));
  for (int s = 0; s < steps; ++s) {
    dm::gemm(false, true, r, r, c, 1.0f, X, c, X, c, 0.0f, A.data(), r);
    dm::gemm(false, false, r, r, r, cc, A.data(), r, A.data(), r, 0.0f, B.data(), r);
    for (int64_t i = 0; i < r * r; ++i) B[size_t(i)] += b * A[size_t(i)];
    std::memcpy(Y.data(), X, size_t(r * c) * sizeof(float));
    dm::gemm(false, false, r, c, r, 1.0f, B.data(), r, X, c, a, Y.data(), c);
    std::memcpy(X, Y.data(), size_t(r * c) * sizeof(float));
  }
}

void muon_reference(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m,
                    int64_t rows, int64_t cols, int64_t head_rows, float lr, bool decay,
                    const cu::MuonStep& mp) {
  const float mu = mp.momentum;
  for (size_t i = 0; i < p.size(); ++i) m[i] = mu * m[i] + g[i];
  const int64_t hr = head_rows > 0 && rows % head_rows == 0 ? head_rows : rows;
  std::vector<float> X(size_t(hr * cols));
  for (int64_t h0 = 0; h0 < rows; h0 += hr) {
    const bool transpose = hr > cols;
    const int64_t r = transpose ? cols : hr, c = transpose ? hr : cols;
    for (int64_t i = 0; i < hr; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const size_t k = size_t((h0 + i) * cols + j);
        const float u = g[k] + mu * m[k];
        if (transpose) X[size_t(j * hr + i)] = u;
        else X[size_t(i * cols + j)] = u;
      }
    newton_schulz_reference(X.data(), r, c, mp.ns_steps);
    const float scale = 0.2f * std::sqrt(float(std::max(hr, cols)));
    const float wd = decay ? lr * mp.weight_decay : 0.0f;
    for (int64_t i = 0; i < hr; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float& w = p[size_t((h0 + i) * cols + j)];
        const float o = transpose ? X[size_t(j * hr + i)] : X[size_t(i * cols + j)];
        w -= lr * scale * o + wd * w;
      }
  }
}

struct MuonCase {
  int64_t rows, cols, head_rows;
};

TEST(CudaTrainOpsMuon, MatchesHostReplicaOfCpuRule) {
  DM_SKIP_WITHOUT_GPU();
  const MuonCase cases[] = {
      {48, 32, 0},     // tall whole matrix (the CPU transposes)
      {32, 96, 0},     // wide whole matrix
      {48, 32, 16},    // 3 heads of 16×32 (wide blocks)
      {144, 32, 48},   // 3 heads of 48×32 (tall blocks, transposed per head)
      {96, 32, 32},    // 3 square heads
      {50, 40, 16},    // head_rows does not divide rows: whole matrix
      {1, 7, 0},       // a single row
  };
  cu::GemmContext gemm;
  const float lr = 0.02f;
  cu::MuonStep mp;
  mp.lr = lr;
  mp.momentum = 0.95f;
  mp.ns_steps = 5;
  for (const MuonCase& c : cases) {
    for (bool decay : {true, false}) {
      mp.weight_decay = decay ? 0.1f : 0.0f;
      const size_t n = size_t(c.rows * c.cols);
      std::vector<float> p = random_normal(n, 60, 0.05f), m(n, 0.0f);
      const std::vector<float> p_start = p;
      const size_t ws_bytes = cu::muon_workspace_bytes(c.rows, c.cols, c.head_rows);
      DeviceScratch dev(n * 4 * 4 + n * 2 + ws_bytes + (1 << 16));
      float* p_d = dev.upload(p);
      float* m_d = dev.upload(m);
      float* g_d = dev.zeros<float>(n);
      uint16_t* p16_d = dev.zeros<uint16_t>(n);
      void* ws_d = dev.raw(ws_bytes);
      for (int step = 0; step < 2; ++step) {
        const std::vector<float> g = random_normal(n, 70 + uint64_t(step), 0.1f);
        cu::copy_to_device(g_d, g.data(), n * 4);
        cu::muon_update(gemm, p_d, g_d, m_d, p16_d, c.rows, c.cols, c.head_rows, mp, ws_d);
        cu::MuonStep ref = mp;
        ref.weight_decay = 0.1f;  // the CPU rule: decay ? lr·weight_decay : 0
        muon_reference(p, g, m, c.rows, c.cols, c.head_rows, lr, decay, ref);
      }
      const auto p_gpu = DeviceScratch::download(p_d, n);
      const std::string where = std::to_string(c.rows) + "x" + std::to_string(c.cols) +
                                " head_rows=" + std::to_string(c.head_rows) +
                                (decay ? " decay" : " no decay");
      EXPECT_TRUE(all_finite(p_gpu)) << where;
      EXPECT_LE(rel_rms_increment(p_gpu, p, p_start), 1e-5) << where << " update";
      EXPECT_LE(rel_rms(DeviceScratch::download(m_d, n), m), 1e-6) << where << " momentum";
      const auto p16 = DeviceScratch::download(p16_d, n);
      int64_t mismatches = 0;
      for (size_t i = 0; i < n; ++i) mismatches += p16[i] != cu::float_to_bf16(p_gpu[i]);
      EXPECT_EQ(mismatches, 0) << where << " bf16 copy";
    }
  }
}

// The real CPU Optimizer (Muon) on configs/test.json: one step, then the GPU update of every
// matrix the CPU sends to Muon (dm::is_muon_matrix, per-head rows from dm::muon_head_rows),
// compared per matrix.
TEST(CudaTrainOpsMuon, MatchesCpuOptimizerOnTestConfig) {
  DM_SKIP_WITHOUT_GPU();
  const dm::ModelConfig cfg = dm::load_config(dm::test::source_dir() + "/configs/test.json");
  auto w = dm::weights_allocate<float>(cfg), g = dm::weights_allocate<float>(cfg);
  dm::weights_init(*w, 1);
  auto before = dm::weights_allocate<float>(cfg);
  dm::weights_copy<float, float>(*w, *before);
  for (size_t i = 0; i < g->params.size(); ++i) {
    const auto noise = random_normal(size_t(g->params[i].numel()), 300 + i, 0.01f);
    std::copy(noise.begin(), noise.end(), g->params[i].data);
  }
  dm::OptimizerConfig oc;
  oc.kind = dm::OptimizerKind::Muon;
  dm::Optimizer opt(cfg, oc);
  const float lr = 0.01f;
  opt.step(*w, *g, lr);

  cu::GemmContext gemm;
  cu::MuonStep mp;
  mp.lr = lr;
  mp.momentum = oc.muon_momentum;
  mp.ns_steps = oc.muon_ns_steps;
  int matrices = 0;
  for (size_t i = 0; i < w->params.size(); ++i) {
    const dm::ParamEntry& e = w->params[i];
    if (!dm::is_muon_matrix(e)) continue;
    ++matrices;
    const int64_t rows = e.shape[0], cols = e.shape[1], head_rows = dm::muon_head_rows(e, cfg);
    const size_t n = size_t(rows * cols);
    const std::vector<float> p0(before->params[i].data, before->params[i].data + n);
    const std::vector<float> gr(g->params[i].data, g->params[i].data + n);
    const std::vector<float> p_cpu(e.data, e.data + n);
    const size_t ws_bytes = cu::muon_workspace_bytes(rows, cols, head_rows);
    DeviceScratch dev(n * 4 * 3 + ws_bytes + (1 << 16));
    float* p_d = dev.upload(p0);
    float* m_d = dev.zeros<float>(n);
    const float* g_d = dev.upload(gr);
    mp.weight_decay = e.decay ? oc.weight_decay : 0.0f;
    cu::muon_update(gemm, p_d, g_d, m_d, nullptr, rows, cols, head_rows, mp, dev.raw(ws_bytes));
    EXPECT_LE(rel_rms_increment(DeviceScratch::download(p_d, n), p_cpu, p0), 1e-5)
        << e.name << " [" << rows << ", " << cols << "] head_rows=" << head_rows;
  }
  EXPECT_GT(matrices, 0);
}

TEST(CudaTrainOpsMuon, RejectsBadArguments) {
  DM_SKIP_WITHOUT_GPU();
  cu::GemmContext gemm;
  cu::MuonStep mp;
  EXPECT_THROW(cu::muon_workspace_bytes(0, 4, 0), dm::Error);
  mp.ns_steps = -1;
  EXPECT_THROW(cu::muon_update(gemm, nullptr, nullptr, nullptr, nullptr, 4, 4, 0, mp,
                               reinterpret_cast<void*>(256)),
               dm::Error);
}

}  // namespace
#else
TEST(CudaTrainOps, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
