// GPU MLA attention (ops/cuda/attention.h) against the CPU references of ops/cpu/attention.h:
// tiled (tensor-core) and simple (one warp per row) kernels and cuDNN's fused engines, forward
// output and lse, backward gradients (overwriting; tiled deterministic), packed documents, and
// the absorbed decode over a paged latent cache against the expanded attention of the same
// positions. bf16 inputs: the CPU
// computes in double on the same bf16 values, tolerance relative RMS ≤ 1e-2, never NaN.
// Without a GPU every test skips (CI compiles them).
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "cuda_mla_test_util.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/device.h"

namespace dm {
namespace {

using test::mla::Bf16Host;
using test::mla::download;
using test::mla::random_bf16;
using test::mla::rel_rms_vs;
using test::mla::to_double;
using test::mla::upload;

const char* kernel_name(cuda::AttentionKernel kernel) {
  switch (kernel) {
    case cuda::AttentionKernel::Tiled: return "tiled";
    case cuda::AttentionKernel::Simple: return "simple";
    case cuda::AttentionKernel::Cudnn: return "cudnn";
    default: return "auto";
  }
}

// Packed documents: starts at 0, at random positions and right at / after a 64-token block edge,
// so masks cross tile boundaries. doc_start[b·T + t] = start of t's document.
std::vector<int32_t> make_doc_start(int64_t B, int64_t T, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> coin(0, 39);
  std::vector<int32_t> doc(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (t > 0 && (coin(rng) == 0 || t == 64 + b || t == 129)) start = int32_t(t);
      doc[size_t(b * T + t)] = start;
    }
  }
  return doc;
}

struct AttentionCase {
  int64_t Dqk, Dv, H, T;
  bool docs;
};

std::vector<AttentionCase> attention_cases() {
  std::vector<AttentionCase> cases;
  // Test-config dims (24 = 16 nope + 8 rope, v 16) and the full-size MLA dims (192, 128).
  for (auto [Dqk, Dv, H] : {std::tuple<int64_t, int64_t, int64_t>{24, 16, 3}, {192, 128, 2}})
    for (int64_t T : {1, 63, 64, 130, 300})
      for (bool docs : {false, true}) cases.push_back({Dqk, Dv, H, T, docs});
  return cases;
}

// Our two kernels on every case, and cuDNN's fused engines where this build and GPU have cuDNN
// (packed documents through its ragged batch).
std::vector<cuda::AttentionKernel> kernels_for(const AttentionCase&) {
  std::vector<cuda::AttentionKernel> kernels{cuda::AttentionKernel::Tiled,
                                             cuda::AttentionKernel::Simple};
  if (cuda::cudnn_attention_available()) kernels.push_back(cuda::AttentionKernel::Cudnn);
  return kernels;
}

std::string describe(const AttentionCase& c, cuda::AttentionKernel kernel) {
  return str_cat("Dqk=", c.Dqk, " Dv=", c.Dv, " H=", c.H, " T=", c.T, " docs=", c.docs, " ",
                 kernel_name(kernel));
}

struct DeviceAttentionInputs {
  AttnShape shape;
  Bf16Host q, k, v;
  std::vector<int32_t> doc;
  const uint16_t *q_dev = nullptr, *k_dev = nullptr, *v_dev = nullptr;
  const int32_t* doc_dev = nullptr;
  double scale = 1.0;
};

DeviceAttentionInputs make_inputs(const AttentionCase& c, int64_t B, uint32_t seed,
                                  cuda::DeviceArena& arena) {
  DeviceAttentionInputs in;
  in.shape = AttnShape{B, c.T, c.H, c.Dqk, c.Dv};
  const size_t qk = size_t(B * c.T * c.H * c.Dqk), vo = size_t(B * c.T * c.H * c.Dv);
  in.q = random_bf16(qk, seed);
  in.k = random_bf16(qk, seed + 1);
  in.v = random_bf16(vo, seed + 2);
  in.q_dev = upload(arena, in.q.bits);
  in.k_dev = upload(arena, in.k.bits);
  in.v_dev = upload(arena, in.v.bits);
  if (c.docs) {
    in.doc = make_doc_start(B, c.T, seed + 3);
    in.doc_dev = upload(arena, in.doc);
  }
  in.scale = 1.0 / std::sqrt(double(c.Dqk));
  return in;
}

TEST(CudaMlaAttention, ForwardMatchesCpuReference) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t B = 2;
  uint32_t seed = 100;
  for (const AttentionCase& c : attention_cases()) {
    for (auto kernel : kernels_for(c)) {
      SCOPED_TRACE(describe(c, kernel));
      cuda::DeviceArena arena(size_t(64) << 20);
      const DeviceAttentionInputs in = make_inputs(c, B, seed += 10, arena);
      const size_t vo = size_t(B * c.T * c.H * c.Dv), rows = size_t(B * c.H * c.T);
      uint16_t* o_dev = test::mla::alloc_poisoned<uint16_t>(arena, vo);
      float* lse_dev = test::mla::alloc_poisoned<float>(arena, rows);
      cuda::attention_causal_forward(in.q_dev, in.k_dev, in.v_dev, o_dev, lse_dev, in.shape,
                                     in.scale, in.doc_dev, nullptr, kernel);
      cuda::synchronize();
      const std::vector<float> o = test::mla::bf16_bits_to_floats(download(o_dev, vo));
      const std::vector<float> lse = download(lse_dev, rows);

      // CPU: double reference output, and the double flash forward for lse.
      const std::vector<double> q = to_double(in.q.values), k = to_double(in.k.values),
                                v = to_double(in.v.values);
      std::vector<double> o_ref(vo), o_flash(vo), lse_ref(rows);
      const int32_t* doc = c.docs ? in.doc.data() : nullptr;
      attention_causal_reference<double>(q.data(), k.data(), v.data(), o_ref.data(), in.shape,
                                         in.scale, doc);
      Arena ws(attention_causal_workspace_bytes(in.shape, 64, sizeof(double)));
      attention_causal_forward<double>(q.data(), k.data(), v.data(), o_flash.data(),
                                       lse_ref.data(), in.shape, in.scale, ws, 64, doc);

      EXPECT_TRUE(test::mla::all_finite(o)) << "NaN/inf (or unwritten) output";
      EXPECT_TRUE(test::mla::all_finite(lse)) << "NaN/inf (or unwritten) lse";
      EXPECT_LE(rel_rms_vs(o, o_ref), 1e-2);
      double lse_error = 0;
      for (size_t i = 0; i < rows; ++i)
        lse_error = std::max(lse_error, std::fabs(double(lse[i]) - lse_ref[i]));
      EXPECT_LE(lse_error, 1e-3);
    }
  }
}

struct BackwardResult {
  std::vector<float> dq, dk, dv;
};

// GPU forward then backward with `kernel`; the gradients start from `initial_dq` / zero and are
// overwritten.
BackwardResult run_gpu_backward(const DeviceAttentionInputs& in, const Bf16Host& dout,
                                const Bf16Host* initial_dq, cuda::AttentionKernel kernel,
                                cuda::DeviceArena& arena) {
  const AttnShape& s = in.shape;
  const size_t qk = size_t(s.B * s.T * s.H * s.Dqk), vo = size_t(s.B * s.T * s.H * s.Dv);
  uint16_t* o_dev = arena.alloc<uint16_t>(vo);
  float* lse_dev = arena.alloc<float>(size_t(s.B * s.H * s.T));
  cuda::attention_causal_forward(in.q_dev, in.k_dev, in.v_dev, o_dev, lse_dev, s, in.scale,
                                 in.doc_dev, nullptr, kernel);
  const uint16_t* dout_dev = upload(arena, dout.bits);
  uint16_t* dq_dev = initial_dq ? upload(arena, initial_dq->bits)
                                : test::mla::alloc_zeroed<uint16_t>(arena, qk);
  uint16_t* dk_dev = test::mla::alloc_zeroed<uint16_t>(arena, qk);
  uint16_t* dv_dev = test::mla::alloc_zeroed<uint16_t>(arena, vo);
  void* workspace = arena.alloc_bytes(cuda::attention_causal_backward_workspace_bytes(s));
  cuda::attention_causal_backward(in.q_dev, in.k_dev, in.v_dev, o_dev, lse_dev, dout_dev, dq_dev,
                                  dk_dev, dv_dev, s, in.scale, workspace, in.doc_dev, nullptr,
                                  kernel);
  cuda::synchronize();
  return {test::mla::bf16_bits_to_floats(download(dq_dev, qk)),
          test::mla::bf16_bits_to_floats(download(dk_dev, qk)),
          test::mla::bf16_bits_to_floats(download(dv_dev, vo))};
}

TEST(CudaMlaAttention, BackwardMatchesCpuReference) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const int64_t B = 2;
  uint32_t seed = 500;
  for (const AttentionCase& c : attention_cases()) {
    for (auto kernel : kernels_for(c)) {
      SCOPED_TRACE(describe(c, kernel));
      cuda::DeviceArena arena(size_t(64) << 20);
      const DeviceAttentionInputs in = make_inputs(c, B, seed += 10, arena);
      const size_t qk = size_t(B * c.T * c.H * c.Dqk), vo = size_t(B * c.T * c.H * c.Dv);
      const Bf16Host dout = random_bf16(vo, seed + 7);
      const BackwardResult gpu = run_gpu_backward(in, dout, nullptr, kernel, arena);

      const std::vector<double> q = to_double(in.q.values), k = to_double(in.k.values),
                                v = to_double(in.v.values), g = to_double(dout.values);
      std::vector<double> dq(qk, 0.0), dk(qk, 0.0), dv(vo, 0.0);
      attention_causal_reference_backward<double>(q.data(), k.data(), v.data(), g.data(),
                                                  dq.data(), dk.data(), dv.data(), in.shape,
                                                  in.scale, c.docs ? in.doc.data() : nullptr);
      EXPECT_TRUE(test::mla::all_finite(gpu.dq) && test::mla::all_finite(gpu.dk) &&
                  test::mla::all_finite(gpu.dv));
      EXPECT_LE(rel_rms_vs(gpu.dq, dq), 1e-2);
      EXPECT_LE(rel_rms_vs(gpu.dk, dk), 1e-2);
      EXPECT_LE(rel_rms_vs(gpu.dv, dv), 1e-2);
    }
  }
}

// The backward overwrites whatever the gradient buffers held; our tiled kernel gives
// bit-identical results run to run (cuDNN's dQ accumulation order is its own: overwrite only).
TEST(CudaMlaAttention, BackwardOverwritesAndTiledIsDeterministic) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  for (bool docs : {true, false}) {
    const AttentionCase c{192, 128, 2, 130, docs};
    cuda::DeviceArena arena(size_t(64) << 20);
    const DeviceAttentionInputs in = make_inputs(c, 1, 900, arena);
    const size_t qk = size_t(c.T * c.H * c.Dqk), vo = size_t(c.T * c.H * c.Dv);
    const Bf16Host dout = random_bf16(vo, 901);
    const Bf16Host initial = random_bf16(qk, 902, 0.1f);
    const std::vector<double> q = to_double(in.q.values), k = to_double(in.k.values),
                              v = to_double(in.v.values), g = to_double(dout.values);
    std::vector<double> dq(qk, 0.0), dk(qk, 0.0), dv(vo, 0.0);
    attention_causal_reference_backward<double>(q.data(), k.data(), v.data(), g.data(),
                                                dq.data(), dk.data(), dv.data(), in.shape,
                                                in.scale, docs ? in.doc.data() : nullptr);
    for (auto kernel : kernels_for(c)) {
      SCOPED_TRACE(describe(c, kernel));
      const BackwardResult first = run_gpu_backward(in, dout, &initial, kernel, arena);
      EXPECT_LE(rel_rms_vs(first.dq, dq), 1e-2);
      EXPECT_LE(rel_rms_vs(first.dk, dk), 1e-2);
      if (kernel != cuda::AttentionKernel::Tiled) continue;
      const BackwardResult second = run_gpu_backward(in, dout, &initial, kernel, arena);
      EXPECT_EQ(first.dq, second.dq);
      EXPECT_EQ(first.dk, second.dk);
      EXPECT_EQ(first.dv, second.dv);
    }
  }
}

// Built with cuDNN, a GPU machine must be able to use it (else the fused path silently vanishes).
TEST(CudaMlaAttention, CudnnAvailableWhenBuiltWithIt) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const std::string status = cuda::cudnn_attention_status();
  if (status == "built without cuDNN") GTEST_SKIP() << status;
  EXPECT_TRUE(cuda::cudnn_attention_available()) << status;
}

// Argument checks run before any device work, so this part needs no GPU.
TEST(CudaMlaAttention, RejectsBadArguments) {
  auto* fake = reinterpret_cast<uint16_t*>(uintptr_t(1) << 12);  // aligned, never dereferenced
  // Head dims must be multiples of 8 (16-byte rows).
  EXPECT_THROW(cuda::attention_causal_forward(fake, fake, fake, fake, nullptr,
                                              AttnShape{1, 4, 1, 20, 16}, 0.2),
               Error);
  // Wider than the tiled kernels are instantiated for.
  EXPECT_THROW(cuda::attention_causal_forward(fake, fake, fake, fake, nullptr,
                                              AttnShape{1, 4, 1, 256, 128}, 0.2, nullptr,
                                              nullptr, cuda::AttentionKernel::Tiled),
               Error);
  // Misaligned tensors and a missing lse in the backward.
  EXPECT_THROW(cuda::attention_causal_forward(fake + 1, fake, fake, fake, nullptr,
                                              AttnShape{1, 4, 1, 16, 16}, 0.2),
               Error);
  EXPECT_THROW(cuda::attention_causal_backward(fake, fake, fake, fake, nullptr, fake, fake, fake,
                                               fake, AttnShape{1, 4, 1, 16, 16}, 0.2, fake),
               Error);
  if (!cuda::device_available()) return;
  // A document start after its token.
  cuda::DeviceArena arena(1 << 20);
  const std::vector<int32_t> doc = {0, 0, 3, 1};
  EXPECT_THROW(cuda::attention_check_doc_start_device(upload(arena, doc), 1, 4), Error);
}

// ---- absorbed decode ---------------------------------------------------------------------------

struct DecodeDims {
  int64_t H, nope, rope, v, kv_lora;
};

// One decode step for S sequences: latent cache rows [c | kr] in shuffled pages, absorbed queries
// built from W_kvb's key rows; the reference expands k = [W_k c | kr], v = W_v c and runs the CPU
// causal attention, whose last row is the decode query's output.
void check_absorbed_decode(const DecodeDims& dims, const std::vector<int32_t>& seq_len,
                           int forced_pages_per_split, uint32_t seed) {
  const int64_t H = dims.H, Dqk = dims.nope + dims.rope, Dk = dims.kv_lora + dims.rope;
  const int64_t S = int64_t(seq_len.size());
  const int64_t max_len = *std::max_element(seq_len.begin(), seq_len.end());
  const int max_pages = int((max_len + 63) / 64);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random_vector = [&](size_t n, float stddev) {
    std::vector<float> x(n);
    for (auto& value : x) value = stddev * normal(rng);
    return x;
  };
  // W_kvb [H·(nope + v), kv_lora]: per head, nope key rows then v value rows.
  const std::vector<float> w_kvb =
      random_vector(size_t(H * (dims.nope + dims.v) * dims.kv_lora),
                    1.0f / std::sqrt(float(dims.kv_lora)));
  auto w_key = [&](int64_t h, int64_t i, int64_t c) {
    return double(w_kvb[size_t((h * (dims.nope + dims.v) + i) * dims.kv_lora + c)]);
  };
  auto w_value = [&](int64_t h, int64_t i, int64_t c) {
    return double(w_kvb[size_t((h * (dims.nope + dims.v) + dims.nope + i) * dims.kv_lora + c)]);
  };
  const double scale = 1.0 / std::sqrt(double(Dqk));

  // Page pool: every sequence's pages at shuffled positions among spare pages of noise.
  int total_pages = 0;
  for (int32_t len : seq_len) total_pages += (len + 63) / 64;
  const int pool_pages = total_pages + 3;
  std::vector<int32_t> page_ids(static_cast<size_t>(pool_pages));
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);
  const Bf16Host pool = test::mla::bf16_from_floats(random_vector(size_t(pool_pages * 64 * Dk), 1.0f));
  std::vector<int32_t> page_table(static_cast<size_t>(S * max_pages), -1);
  int next_page = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int p = 0; p < (seq_len[size_t(s)] + 63) / 64; ++p)
      page_table[size_t(s * max_pages + p)] = page_ids[size_t(next_page++)];
  auto cache_row = [&](int64_t s, int64_t j) {
    const int64_t page = page_table[size_t(s * max_pages + j / 64)];
    return pool.values.data() + (page * 64 + j % 64) * Dk;
  };

  // Queries: q_nope, q_rope per head; absorbed q = [W_keysᵀ q_nope | q_rope] rounded to bf16.
  const std::vector<float> q_nope = random_vector(static_cast<size_t>(S * H * dims.nope), 1.0f);
  const std::vector<float> q_rope = random_vector(static_cast<size_t>(S * H * dims.rope), 1.0f);
  std::vector<float> q_absorbed(static_cast<size_t>(S * H * Dk));
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < H; ++h) {
      float* row = q_absorbed.data() + (s * H + h) * Dk;
      for (int64_t c = 0; c < dims.kv_lora; ++c) {
        double acc = 0;
        for (int64_t i = 0; i < dims.nope; ++i)
          acc += w_key(h, i, c) * q_nope[size_t((s * H + h) * dims.nope + i)];
        row[c] = float(acc);
      }
      for (int64_t r = 0; r < dims.rope; ++r)
        row[dims.kv_lora + r] = q_rope[size_t((s * H + h) * dims.rope + r)];
    }
  const Bf16Host q_abs = test::mla::bf16_from_floats(q_absorbed);

  cuda::DeviceArena arena(size_t(64) << 20);
  cuda::MlaDecodeArgs args;
  args.q = upload(arena, q_abs.bits);
  args.cache = upload(arena, pool.bits);
  args.page_table = upload(arena, page_table);
  args.seq_len = upload(arena, seq_len);
  args.out = test::mla::alloc_poisoned<uint16_t>(arena, size_t(S * H * dims.kv_lora));
  args.lse = test::mla::alloc_poisoned<float>(arena, size_t(S * H));
  args.S = int(S);
  args.H = int(H);
  args.Dk = int(Dk);
  args.Dv = int(dims.kv_lora);
  args.scale = scale;
  cuda::MlaDecodePlan plan = cuda::mla_decode_plan(int(S), int(H), max_pages);
  if (forced_pages_per_split > 0) {
    plan.pages_per_split = forced_pages_per_split;
    plan.num_splits = (max_pages + forced_pages_per_split - 1) / forced_pages_per_split;
  }
  void* workspace =
      arena.alloc_bytes(std::max<size_t>(1, cuda::mla_decode_workspace_bytes(
                                                plan, int(S), int(H), int(dims.kv_lora))));
  cuda::mla_decode_absorbed(args, plan, workspace);
  cuda::synchronize();
  const std::vector<float> latent =
      test::mla::bf16_bits_to_floats(download(args.out, size_t(S * H * dims.kv_lora)));
  const std::vector<float> lse = download(args.lse, size_t(S * H));
  ASSERT_TRUE(test::mla::all_finite(latent)) << "NaN/inf (or unwritten) decode output";

  for (int64_t s = 0; s < S; ++s) {
    const int64_t L = seq_len[size_t(s)];
    SCOPED_TRACE(str_cat("sequence ", s, " of ", L, " tokens, ", plan.num_splits, " splits"));
    if (L == 0) {  // empty sequence: zero output, lse −inf
      for (int64_t i = 0; i < H * dims.kv_lora; ++i)
        EXPECT_EQ(latent[size_t(s * H * dims.kv_lora + i)], 0.0f);
      continue;
    }
    // Expanded q, k, v for positions 0..L−1 (q only matters at L−1; earlier rows are zero).
    const AttnShape shape{1, L, H, Dqk, dims.v};
    std::vector<double> q(static_cast<size_t>(L * H * Dqk), 0.0), k(static_cast<size_t>(L * H * Dqk)), v(static_cast<size_t>(L * H * dims.v));
    for (int64_t h = 0; h < H; ++h) {
      double* q_row = q.data() + ((L - 1) * H + h) * Dqk;
      for (int64_t i = 0; i < dims.nope; ++i) q_row[i] = q_nope[size_t((s * H + h) * dims.nope + i)];
      for (int64_t r = 0; r < dims.rope; ++r)
        q_row[dims.nope + r] = q_rope[size_t((s * H + h) * dims.rope + r)];
    }
    for (int64_t j = 0; j < L; ++j) {
      const float* row = cache_row(s, j);
      for (int64_t h = 0; h < H; ++h) {
        double* k_row = k.data() + (j * H + h) * Dqk;
        double* v_row = v.data() + (j * H + h) * dims.v;
        for (int64_t i = 0; i < dims.nope; ++i) {
          double acc = 0;
          for (int64_t c = 0; c < dims.kv_lora; ++c) acc += w_key(h, i, c) * row[c];
          k_row[i] = acc;
        }
        for (int64_t r = 0; r < dims.rope; ++r) k_row[dims.nope + r] = row[dims.kv_lora + r];
        for (int64_t i = 0; i < dims.v; ++i) {
          double acc = 0;
          for (int64_t c = 0; c < dims.kv_lora; ++c) acc += w_value(h, i, c) * row[c];
          v_row[i] = acc;
        }
      }
    }
    std::vector<double> o(static_cast<size_t>(L * H * dims.v)), lse_ref(static_cast<size_t>(H * L));
    Arena ws(attention_causal_workspace_bytes(shape, 64, sizeof(double)));
    attention_causal_forward<double>(q.data(), k.data(), v.data(), o.data(), lse_ref.data(),
                                     shape, scale, ws);
    // GPU: o_h = W_value_h · latent_h; compare the last row.
    std::vector<float> o_gpu(static_cast<size_t>(H * dims.v));
    std::vector<double> o_ref(static_cast<size_t>(H * dims.v));
    for (int64_t h = 0; h < H; ++h) {
      const float* lat = latent.data() + (s * H + h) * dims.kv_lora;
      for (int64_t i = 0; i < dims.v; ++i) {
        double acc = 0;
        for (int64_t c = 0; c < dims.kv_lora; ++c) acc += w_value(h, i, c) * lat[c];
        o_gpu[size_t(h * dims.v + i)] = float(acc);
        o_ref[size_t(h * dims.v + i)] = o[size_t(((L - 1) * H + h) * dims.v + i)];
      }
      EXPECT_NEAR(lse[size_t(s * H + h)], lse_ref[size_t(h * L + L - 1)], 2e-2);
    }
    EXPECT_LE(rel_rms_vs(o_gpu, o_ref), 1e-2);
  }
}

TEST(CudaMlaDecode, AbsorbedMatchesExpandedTestDims) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  const DecodeDims dims{4, 16, 8, 16, 32};  // configs/test.json
  const std::vector<int32_t> lengths = {1, 63, 64, 130, 300};
  check_absorbed_decode(dims, lengths, 0, 11);  // the plan's own split
  check_absorbed_decode(dims, lengths, 1, 12);  // one page per split: 5 splits, combine kernel
  check_absorbed_decode(dims, {300, 0, 65}, 2, 13);  // empty splits and an empty sequence
  // 33 splits: the combine kernel's unrolled steps over splits and their remainder.
  check_absorbed_decode(dims, {2100, 1000, 7}, 1, 14);
  // 17 heads: two 16-head groups per CTA, the second holding one head.
  check_absorbed_decode(DecodeDims{17, 16, 8, 16, 32}, {1, 130, 300}, 0, 15);
  check_absorbed_decode(DecodeDims{17, 16, 8, 16, 32}, {1, 130, 300}, 1, 16);
}

TEST(CudaMlaDecode, AbsorbedMatchesExpandedFullDims) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  // K3 / Kimi-Linear MLA: nope 128, rope 64, v 128, kv_lora 512 (576-wide cache rows); 20 heads
  // = one CTA of two 16-head groups, the second partial.
  const DecodeDims dims{20, 128, 64, 128, 512};
  check_absorbed_decode(dims, {1, 130, 300}, 0, 21);
  check_absorbed_decode(dims, {1, 130, 300}, 1, 22);
  // 40 heads: two CTAs of 32, the second with 8 heads in its first group and none in its second.
  check_absorbed_decode(DecodeDims{40, 128, 64, 128, 512}, {1, 300}, 1, 23);
}

TEST(CudaMlaDecode, WgmmaAndMmaSyncKernelsMatchExpanded) {
  if (!cuda::device_available()) GTEST_SKIP() << cuda::device_description();
  // Both kernels at the MLA shape (576-wide rows, 512 values): 32 heads (one CTA, m64n32) with
  // one split walking all five pages (out / lse written directly) and with 2 pages a split (the
  // partials and the combine); 16 heads (m64n16) with 2 pages a split. Lengths: one token, a
  // page and one, a partial last page.
  const bool saved = cuda::mla_decode_wgmma();
  for (bool wgmma : {true, false}) {
    cuda::mla_set_decode_wgmma(wgmma);
    SCOPED_TRACE(wgmma ? "warpgroup-MMA kernel" : "mma.sync kernel");
    check_absorbed_decode(DecodeDims{32, 128, 64, 128, 512}, {1, 65, 300}, 8, 31);
    check_absorbed_decode(DecodeDims{32, 128, 64, 128, 512}, {300, 1, 65}, 2, 32);
    check_absorbed_decode(DecodeDims{16, 128, 64, 128, 512}, {65, 300, 1}, 2, 33);
  }
  cuda::mla_set_decode_wgmma(saved);
}

TEST(CudaMlaDecode, PlanCoversThePageTable) {
  // Pure host arithmetic (num_sms given): no device needed beyond the build. First the rule of
  // at least two CTAs per multiprocessor (DM_MLA_DECODE_SPLITS=fixed).
  const auto fixed = cuda::MlaSplitRule::TwoCtasPerSm;
  for (int S : {1, 8, 64})
    for (int max_pages : {1, 5, 512}) {
      const cuda::MlaDecodePlan plan = cuda::mla_decode_plan(S, 32, max_pages, 132, 128, fixed);
      EXPECT_GE(int64_t(plan.num_splits) * plan.pages_per_split, max_pages);
      EXPECT_LT(int64_t(plan.num_splits - 1) * plan.pages_per_split, max_pages);
      EXPECT_GE(plan.num_splits, 1);
    }
  // Batch 1 with a 32K context is split to fill the machine; batch 64 much less.
  EXPECT_GT(cuda::mla_decode_plan(1, 16, 512, 132, 128, fixed).num_splits, 32);
  EXPECT_LE(cuda::mla_decode_plan(64, 16, 512, 132, 128, fixed).num_splits, 8);
  // Whole waves of one CTA per multiprocessor (the default): batch 1 at 32K, 128 splits of 4 pages
  // (one wave); batch 64 (32 heads: one CTA per sequence and split), 2 splits of 256 pages (128
  // CTAs, one wave) rather than 5 of 103 (320 CTAs: three waves); batch 8, 16 splits of 32.
  const auto waves = cuda::MlaSplitRule::WholeWaves;
  for (int S : {1, 8, 64})
    for (int max_pages : {1, 5, 512, 16384}) {
      const cuda::MlaDecodePlan plan = cuda::mla_decode_plan(S, 32, max_pages, 132, 128, waves);
      EXPECT_GE(int64_t(plan.num_splits) * plan.pages_per_split, max_pages);
      EXPECT_LT(int64_t(plan.num_splits - 1) * plan.pages_per_split, max_pages);
      EXPECT_GE(plan.pages_per_split, 4);
    }
  const cuda::MlaDecodePlan one = cuda::mla_decode_plan(1, 32, 512, 132, 128, waves);
  EXPECT_EQ(one.num_splits, 128);
  EXPECT_EQ(one.pages_per_split, 4);
  const cuda::MlaDecodePlan sixty_four = cuda::mla_decode_plan(64, 32, 512, 132, 128, waves);
  EXPECT_EQ(sixty_four.num_splits, 2);
  EXPECT_EQ(sixty_four.pages_per_split, 256);
  EXPECT_EQ(cuda::mla_decode_plan(8, 32, 512, 132, 128, waves).num_splits, 16);
  EXPECT_EQ(cuda::mla_decode_plan(64, 32, 512, 132, 128, fixed).num_splits, 5);
  // Batch 1 × 1M (16384 pages): 132 splits of 125 pages (one whole wave) under the default limit
  // of 256 splits; 128 of 128 pages (four multiprocessors idle) under the old 128.
  const cuda::MlaDecodePlan million = cuda::mla_decode_plan(1, 32, 16384, 132, 256, waves);
  EXPECT_EQ(million.num_splits, 132);
  EXPECT_EQ(million.pages_per_split, 125);
  EXPECT_EQ(cuda::mla_decode_plan(1, 32, 16384, 132, 128, waves).num_splits, 128);
}

}  // namespace
}  // namespace dm
#else
TEST(CudaMlaAttention, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
