// Cached decoding on the GPU (model/cuda/decode_gpu.h, generate_gpu.h) against the CPU model:
// random weights rounded to bf16 on the host (both sides see the same model); three slots with
// prompts of different lengths decoded in lockstep (slots drop out as they finish, so steps see
// all, some and non-adjacent slots; the longest crosses the 64-token page boundary), each step's
// logits compared with the CPU full forward at that position; a released slot reused; greedy
// generation compared with the CPU's, teacher-forced per step. The lockstep runs both ways a
// step can execute (CUDA graphs + the gathered MoE kernels, the default; and direct launches +
// the grouped MoE GEMMs); a graphed decoder against direct ones step by step over changing
// active sets, a chunked prefill and a released slot (the gathered MoE kernels alone:
// test_cuda_moe_decode.cpp). Skips without a GPU.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "core/error.h"
#include "cuda_decode_test_util.h"
#include "cuda_golden_util.h"
#include "cuda_mla_test_util.h"
#include "cuda_test_util.h"
#include "infer/generate.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/cuda/decode_gpu.h"
#include "model/cuda/generate_gpu.h"
#include "model/model.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/device.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/pdl.h"
#include "test_util.h"

using namespace dm;
using test::argmax;
using test::bf16_model;
using test::cpu_logits;
using test::random_tokens;
using test::RowStats;

namespace {

using DecodeMoe = cuda::GpuDecodeOptions::Moe;

cuda::GpuDecodeOptions decode_options(bool graphs, DecodeMoe moe) {
  cuda::GpuDecodeOptions o;
  o.graphs = graphs;
  o.moe = moe;
  return o;
}

// The two ways a step runs: what serve/generate use by default, and the pre-graph path.
struct DecodeMode {
  const char* name;
  cuda::GpuDecodeOptions options;
};
const DecodeMode kDecodeModes[] = {{"graphs+gathered", decode_options(true, DecodeMoe::Auto)},
                                   {"direct+grouped", decode_options(false, DecodeMoe::Grouped)}};

void check_lockstep(const ModelConfig& c, const char* config_name,
                    const cuda::GpuDecodeOptions& options, const char* mode_name) {
  const std::string label = std::string(config_name) + " [" + mode_name + "]";
  const char* what = label.c_str();
  auto model = bf16_model(c, 11);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, S = 3, extra = 10;
  // The middle slot finishes first, so later steps see slots {0, 2} (two KDA state runs).
  const int64_t prompt[S] = {40, 5, 70};
  std::vector<std::vector<int32_t>> seq(S);
  std::vector<std::vector<float>> ref(S);
  int64_t longest = 0;
  for (int64_t s = 0; s < S; ++s) {
    seq[size_t(s)] = random_tokens(prompt[s] + extra, V, 100 + uint64_t(s));
    ref[size_t(s)] = cpu_logits(*model, seq[size_t(s)]);
    longest = std::max<int64_t>(longest, int64_t(seq[size_t(s)].size()));
  }
  cuda::GpuDecoder dec(dw, S, longest, options);
  std::vector<float> logits(size_t(S * V));
  std::vector<int32_t> tokens(static_cast<size_t>(S));
  std::vector<int> active(static_cast<size_t>(S));
  RowStats all;
  std::vector<RowStats> per_slot(static_cast<size_t>(S));
  for (int64_t t = 0; t < longest; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      active[size_t(s)] = t < int64_t(seq[size_t(s)].size());
      tokens[size_t(s)] = active[size_t(s)] ? seq[size_t(s)][size_t(t)] : -1;  // unread
    }
    dec.step(tokens.data(), logits.data(), active.data());
    for (int64_t s = 0; s < S; ++s) {
      if (!active[size_t(s)]) continue;
      const float* gpu = logits.data() + s * V;
      const float* cpu = ref[size_t(s)].data() + t * V;
      ASSERT_TRUE(std::all_of(gpu, gpu + V, [](float x) { return std::isfinite(x); }))
          << what << ": slot " << s << " position " << t;
      all.add(gpu, cpu, V);
      per_slot[size_t(s)].add(gpu, cpu, V);
      EXPECT_LE(test::rel_rms(gpu, cpu, size_t(V)), 2e-2)
          << what << ": slot " << s << " position " << t;
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    EXPECT_EQ(dec.length(s), int64_t(seq[size_t(s)].size()));
    const RowStats& r = per_slot[size_t(s)];
    std::printf("[          ] %s slot %lld (%lld tokens): rel RMS mean %.2e max %.2e, argmax %.4f\n",
                what, (long long)s, (long long)r.rows, r.sum / double(r.rows), r.worst,
                r.agreement());
  }
  std::printf("[          ] %s all %lld steps×slots: rel RMS max %.2e, argmax agreement %.4f\n",
              what, (long long)all.rows, all.worst, all.agreement());
  EXPECT_GE(all.agreement(), 0.95) << what;

  // Reuse: slot 1 released (state, tails, length) and prefilled with a new 30-token sequence
  // while the other slots keep their caches.
  const std::vector<int32_t> fresh = random_tokens(30, V, 999);
  const std::vector<float> fresh_ref = cpu_logits(*model, fresh);
  std::vector<float> last(static_cast<size_t>(V));
  dec.prefill(1, fresh.data(), int64_t(fresh.size()), last.data());
  const double e = test::rel_rms(last.data(), fresh_ref.data() + (fresh.size() - 1) * size_t(V),
                                 size_t(V));
  std::printf("[          ] %s reused slot, prefill of 30: last logits rel RMS %.2e\n", what, e);
  EXPECT_LE(e, 2e-2) << what;
  EXPECT_EQ(dec.length(1), 30);
  if (options.graphs) EXPECT_GT(dec.graph_replays(), 0) << what << ": " << dec.mode();
  else EXPECT_EQ(dec.graphs_captured(), 0) << what;
}

void check_lockstep_all_modes(const ModelConfig& c, const char* config_name) {
  for (const DecodeMode& m : kDecodeModes) check_lockstep(c, config_name, m.options, m.name);
}

// The ids of `{"output_ids": [a, b, …]}` in CLI output.
std::vector<int32_t> parse_output_ids(const std::string& out) {
  std::vector<int32_t> ids;
  const size_t open = out.find('['), close = out.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return ids;
  std::string item;
  for (size_t i = open + 1; i <= close; ++i) {
    if (out[i] == ',' || out[i] == ']') {
      if (!item.empty()) ids.push_back(int32_t(std::stol(item)));
      item.clear();
    } else if (out[i] != ' ') {
      item += out[i];
    }
  }
  return ids;
}

}  // namespace

TEST(CudaDecode, LockstepMatchesCpuForwardOnTestConfig) {
  DM_SKIP_WITHOUT_GPU();
  check_lockstep_all_modes(load_config(test::source_dir() + "/configs/test.json"), "test config");
}

// step_rows (the server's call: logits left in the decoder's pinned rows, active slots in order)
// gives step's logits bit for bit, graphed, with the active set changing; no active slot: null.
TEST(CudaDecode, StepRowsAreTheStepsLogits) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto model = bf16_model(c, 47);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, S = 3, Lmax = 32;
  cuda::GpuDecoder copied(dw, S, Lmax, decode_options(true, DecodeMoe::Auto));
  cuda::GpuDecoder rows(dw, S, Lmax, decode_options(true, DecodeMoe::Auto));
  std::vector<float> logits(size_t(S * V));
  std::vector<int32_t> tokens = {1, 2, 3};
  const std::vector<int> none = {0, 0, 0};
  EXPECT_EQ(rows.step_rows(tokens.data(), none.data()), nullptr);
  for (int step = 0; step < 12; ++step) {
    std::vector<int> active = {1, 1, 1};
    if (step >= 4 && step < 8) active = {1, 0, 1};
    if (step >= 8) active = {0, 1, 0};
    copied.step(tokens.data(), logits.data(), active.data());
    const float* r = rows.step_rows(tokens.data(), active.data());
    ASSERT_NE(r, nullptr);
    int64_t row = 0;
    for (int64_t s = 0; s < S; ++s) {
      if (!active[size_t(s)]) continue;
      const float* a = logits.data() + s * V;
      const float* b = r + (row++) * V;
      EXPECT_TRUE(std::equal(a, a + V, b)) << "step " << step << " slot " << s;
      tokens[size_t(s)] = int32_t(argmax(a, V));
      EXPECT_EQ(copied.length(s), rows.length(s));
    }
  }
}

// The absorbed MLA step's per-head products: our kernels (the default up to 4 rows, which the
// lockstep tests above run) and the strided-batched cuBLAS GEMMs, each against the CPU, with
// RoPE/YaRN on (the absorption kernel writes the rotated half too).
TEST(CudaDecode, MlaPerHeadProductsOursAndCublasMatchCpu) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  c.mixers = {MixerKind::KDA, MixerKind::MLA, MixerKind::KDA, MixerKind::MLA};
  c.mla.use_rope = true;
  c.mla.yarn.enabled = true;
  c.mla.yarn.factor = 4.0;
  c.mla.yarn.original_max_position = 32;
  for (bool ours : {true, false}) {
    cuda::GpuDecodeOptions options = decode_options(true, DecodeMoe::Auto);
    options.mla_own_products = ours;
    {
      auto model = bf16_model(c, 11);
      const cuda::DeviceWeights dw(model->weights());
      const std::string mode = cuda::GpuDecoder(dw, 1, 8, options).mode();
      EXPECT_NE(mode.find(ours ? "products: ours" : "products: cuBLAS"), std::string::npos) << mode;
    }
    check_lockstep(c, "rope/yarn, two MLA layers", options, ours ? "own products" : "cuBLAS");
  }
}

// The fused KDA decode step (decode_ops.h decode_kda_fused_step) takes head dim 128 only, which
// the test config's 32 does not reach: the same config at 128 with both output gates and both
// decay gates, fused and five-kernel, each against the CPU forward.
TEST(CudaDecode, FusedKdaStepMatchesCpuAtHeadDim128) {
  DM_SKIP_WITHOUT_GPU();
  for (bool full_gate : {true, false}) {
    ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
    c.kda.head_dim = 128;
    c.kda.full_rank_output_gate = full_gate;
    c.kda.gate = full_gate ? KdaGateKind::Safe : KdaGateKind::Softplus;
    const char* name = full_gate ? "K=128 full-rank output gate, safe gate"
                                 : "K=128 low-rank output gate, softplus gate";
    cuda::GpuDecodeOptions fused = decode_options(true, DecodeMoe::Auto);
    cuda::GpuDecodeOptions five = fused;
    five.fused_kda = false;
    {
      auto model = bf16_model(c, 11);
      const cuda::DeviceWeights dw(model->weights());
      EXPECT_NE(cuda::GpuDecoder(dw, 1, 8, fused).mode().find("KDA: one fused kernel"),
                std::string::npos);
      EXPECT_NE(cuda::GpuDecoder(dw, 1, 8, five).mode().find("KDA: five kernels"),
                std::string::npos);
    }
    check_lockstep(c, name, fused, "fused KDA");
    check_lockstep(c, name, five, "five KDA kernels");
  }
}

// RoPE with YaRN (amplitude ≠ 1, mscale² in the softmax scale), no q LoRA, two MLA layers,
// low-rank softplus KDA gate, plain residual.
TEST(CudaDecode, LockstepMatchesCpuForwardWithRopeYarnVariant) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  c.mixers = {MixerKind::KDA, MixerKind::MLA, MixerKind::KDA, MixerKind::MLA};
  c.mla.use_rope = true;
  c.mla.q_lora_rank = 0;
  c.mla.yarn.enabled = true;
  c.mla.yarn.factor = 4.0;
  c.mla.yarn.original_max_position = 32;
  c.mla.yarn.mscale = 0.707;
  c.mla.yarn.mscale_all_dim = 1.0;
  c.kda.full_rank_output_gate = false;
  c.kda.gate = KdaGateKind::Softplus;
  c.residual = ResidualKind::Plain;
  c.attn_res_block = 0;
  validate_config(c, "rope/yarn variant");
  check_lockstep_all_modes(c, "rope/yarn variant");
}

// Kimi-Linear's layer shapes: the plain residual (the walk's fused add + norm) and routed experts
// on the full width with a shared expert of their width, which the gathered MoE decode kernels
// fold in as one more pair per token.
TEST(CudaDecode, LockstepMatchesCpuForwardOnKimiLinearVariant) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  c.residual = ResidualKind::Plain;
  c.attn_res_block = 0;
  c.moe.latent_dim = 0;
  c.moe.latent_norm = false;
  c.moe.shared_ffn = c.moe.expert_ffn;
  validate_config(c, "kimi-linear variant");
  check_lockstep_all_modes(c, "kimi-linear variant");
}

TEST(CudaDecode, GreedyGenerateMatchesCpu) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto model = bf16_model(c, 23);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, steps = 20;
  const std::vector<int32_t> prompt = random_tokens(12, V, 7);
  GenerateOptions opt;
  opt.max_new_tokens = steps;
  opt.sampling.temperature = 0.0f;
  const std::vector<int32_t> cpu = dm::generate(*model, prompt, opt);
  std::vector<int32_t> streamed;
  const std::vector<int32_t> gpu =
      cuda::generate_gpu(dw, prompt, opt, [&](int32_t t) { streamed.push_back(t); });
  ASSERT_EQ(int64_t(cpu.size()), steps);
  ASSERT_EQ(int64_t(gpu.size()), steps);
  EXPECT_EQ(streamed, gpu);

  // Teacher-forced: the GPU's greedy choice after each prefix of the CPU's continuation.
  cuda::GpuDecoder dec(dw, 1, int64_t(prompt.size()) + steps);
  std::vector<float> logits(static_cast<size_t>(V));
  dec.prefill(0, prompt.data(), int64_t(prompt.size()), logits.data());
  std::vector<int32_t> forced(static_cast<size_t>(steps));
  int64_t agree = 0;
  for (int64_t i = 0; i < steps; ++i) {
    forced[size_t(i)] = int32_t(argmax(logits.data(), V));
    agree += forced[size_t(i)] == cpu[size_t(i)];
    if (i + 1 < steps) dec.step(&cpu[size_t(i)], logits.data());
  }
  int64_t same_prefix = 0;
  while (same_prefix < steps && gpu[size_t(same_prefix)] == cpu[size_t(same_prefix)]) ++same_prefix;
  std::printf("[          ] greedy %lld tokens: teacher-forced agreement %lld/%lld, GPU generate "
              "equals CPU for the first %lld\n",
              (long long)steps, (long long)agree, (long long)steps, (long long)same_prefix);
  EXPECT_GE(double(agree) / double(steps), 0.9);
  // Until (and including) its first departure from the CPU's tokens, free-running generate
  // computed exactly what the teacher-forced run did.
  for (int64_t i = 0; i <= std::min(same_prefix, steps - 1); ++i)
    EXPECT_EQ(gpu[size_t(i)], forced[size_t(i)]) << "step " << i;
}

// The chunked prefill (one forward pass over the prompt, leaving KDA states, conv tails and the
// latent pages behind) against feeding the same prompt one decode step at a time, and both
// against the CPU forward: the prompt's last logits and the next 8 decode steps. Prompt lengths
// cover one token short of the conv tail, a page boundary and several KDA chunks.
namespace {
void check_chunked_prefill(const ModelConfig& c, const char* what) {
  auto model = bf16_model(c, 21);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, extra = 8;
  for (int64_t n : {int64_t(2), int64_t(65), int64_t(200)}) {
    const std::vector<int32_t> prompt = random_tokens(n, V, uint64_t(n));
    const std::vector<int32_t> cont = random_tokens(extra, V, uint64_t(n) + 7);
    std::vector<int32_t> seq = prompt;
    seq.insert(seq.end(), cont.begin(), cont.end());
    const std::vector<float> cpu = cpu_logits(*model, seq);
    cuda::GpuDecoder chunked(dw, 1, n + extra), stepped(dw, 1, n + extra);
    std::vector<float> a(static_cast<size_t>(V)), b(static_cast<size_t>(V));
    chunked.prefill(0, prompt.data(), n, a.data());
    stepped.prefill(0, prompt.data(), n, b.data(), /*token_by_token=*/true);
    EXPECT_EQ(chunked.length(0), n);
    RowStats vs_stepped, vs_cpu;
    vs_stepped.add(a.data(), b.data(), V);
    vs_cpu.add(a.data(), cpu.data() + (n - 1) * V, V);
    for (int64_t s = 0; s < extra; ++s) {
      chunked.step(&cont[size_t(s)], a.data());
      stepped.step(&cont[size_t(s)], b.data());
      vs_stepped.add(a.data(), b.data(), V);
      vs_cpu.add(a.data(), cpu.data() + (n + s) * V, V);
    }
    std::printf("[          ] %s chunked prefill of %lld: vs token-by-token rel RMS max %.2e, vs CPU "
                "max %.2e, argmax agreement %.3f / %.3f\n", what, (long long)n, vs_stepped.worst,
                vs_cpu.worst, vs_stepped.agreement(), vs_cpu.agreement());
    EXPECT_LE(vs_stepped.worst, 2e-2) << what << " n=" << n;
    EXPECT_LE(vs_cpu.worst, 2.5e-2) << what << " n=" << n;
    EXPECT_GE(vs_cpu.agreement(), 0.85) << what << " n=" << n;
  }
}

}  // namespace

TEST(CudaDecode, ChunkedPrefillMatchesTokenByTokenAndCpu) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  check_chunked_prefill(c, "test config");
  c.mla.use_rope = true;
  c.mla.yarn.enabled = true;
  c.mla.yarn.factor = 4;
  c.mla.yarn.original_max_position = 32;
  validate_config(c, "chunked prefill rope variant");
  check_chunked_prefill(c, "rope/yarn variant");
}

// extend(): a prompt fed in pieces (the first by prefill, the rest continuing the slot: KDA from
// its carried state and conv tails, MLA through its pages) against one prefill of the whole
// prompt and the CPU forward, on the prompt's last logits and the next 8 decode steps. Pieces
// shorter than the conv tail, one across a page boundary and one over several KDA chunks.
// Written 2026-11-30 without a GPU to run it on.
namespace {
void check_extend(const ModelConfig& c, const char* what) {
  auto model = bf16_model(c, 21);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, n = 200, extra = 8;
  const std::vector<int32_t> prompt = random_tokens(n, V, 77);
  const std::vector<int32_t> cont = random_tokens(extra, V, 78);
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), cont.begin(), cont.end());
  const std::vector<float> cpu = cpu_logits(*model, seq);
  for (const std::vector<int64_t>& pieces :
       {std::vector<int64_t>{70, 130}, std::vector<int64_t>{2, 1, 64, 133}}) {
    cuda::GpuDecoder whole(dw, 1, n + extra), pieced(dw, 2, n + extra);
    std::vector<float> a(static_cast<size_t>(V)), b(static_cast<size_t>(V));
    whole.prefill(0, prompt.data(), n, a.data());
    // Slot 1 of two, so the slot's pages and states are not the first ones.
    int64_t at = 0;
    for (int64_t piece : pieces) {
      pieced.extend(1, prompt.data() + at, piece, b.data());
      at += piece;
      EXPECT_EQ(pieced.length(1), at);
    }
    ASSERT_EQ(at, n);
    RowStats vs_whole, vs_cpu;
    vs_whole.add(b.data(), a.data(), V);
    vs_cpu.add(b.data(), cpu.data() + (n - 1) * V, V);
    const int active[2] = {0, 1};
    std::vector<float> two(size_t(2 * V));
    for (int64_t s = 0; s < extra; ++s) {
      whole.step(&cont[size_t(s)], a.data());
      const int32_t tokens[2] = {0, cont[size_t(s)]};
      pieced.step(tokens, two.data(), active);
      vs_whole.add(two.data() + V, a.data(), V);
      vs_cpu.add(two.data() + V, cpu.data() + (n + s) * V, V);
    }
    std::printf(
        "[          ] %s extend in %zu pieces: vs one prefill rel RMS max %.2e, vs CPU "
        "max %.2e, argmax agreement %.3f / %.3f\n",
        what, pieces.size(), vs_whole.worst, vs_cpu.worst, vs_whole.agreement(),
        vs_cpu.agreement());
    EXPECT_LE(vs_whole.worst, 2e-2) << what << " pieces " << pieces.size();
    EXPECT_LE(vs_cpu.worst, 2.5e-2) << what << " pieces " << pieces.size();
    EXPECT_GE(vs_cpu.agreement(), 0.85) << what << " pieces " << pieces.size();
  }
}
}  // namespace

TEST(CudaDecode, ExtendMatchesOnePrefill) {
  DM_SKIP_WITHOUT_GPU();
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  check_extend(c, "test config");
  c.mla.use_rope = true;
  c.mla.yarn.enabled = true;
  c.mla.yarn.factor = 4;
  c.mla.yarn.original_max_position = 32;
  validate_config(c, "extend rope variant");
  check_extend(c, "rope/yarn variant");
}

// The reference goldens' greedy continuations, teacher-forced through the GPU decoder (prompt
// fed by the chunked prefill), and `deltamoe generate --device cuda` equal to generate_gpu
// in-process.
class CudaDecodeGoldens : public ::testing::TestWithParam<const char*> {};

TEST_P(CudaDecodeGoldens, GreedyReproducesAndCliMatches) {
  DM_SKIP_WITHOUT_GPU();
  if (!test::goldens_available()) GTEST_SKIP() << "goldens not found";
  const std::string dir = test::goldens_dir() + "/" + GetParam();
  auto model = Model::load(dir);
  const int64_t V = model->config().vocab_size;
  const cuda::DeviceWeights dw(model->weights());
  const SafetensorsReader golden = SafetensorsReader::open(dir + "/golden.safetensors");
  const Tensor& prompt = golden.get("greedy_prompt");
  const Tensor& want = golden.get("greedy_output");
  const int64_t rows = prompt.shape[0], P = prompt.shape[1], O = want.shape[1];
  int64_t matched = 0, total = 0;
  std::vector<float> logits(static_cast<size_t>(V));
  for (int64_t b = 0; b < rows; ++b) {
    const std::vector<int32_t> ids(prompt.as<int64_t>() + b * P, prompt.as<int64_t>() + (b + 1) * P);
    cuda::GpuDecoder dec(dw, 1, O);
    dec.prefill(0, ids.data(), P, logits.data());
    for (int64_t s = P; s < O; ++s) {
      const int32_t expected = int32_t(want.as<int64_t>()[b * O + s]);
      matched += argmax(logits.data(), V) == expected;
      ++total;
      if (s + 1 < O) dec.step(&expected, logits.data());  // teacher-forced
    }
  }
  const test::Bf16GoldenReference cpu = test::bf16_golden_reference(dir);
  std::printf("[          ] %s decode on the GPU: greedy (teacher-forced) tokens matched %lld / %lld "
              "(CPU with bf16 weights: %lld)\n", GetParam(), (long long)matched, (long long)total,
              (long long)cpu.greedy_matched);
  EXPECT_GE(double(matched),
            std::min(0.9 * double(total), double(cpu.greedy_matched) - 0.15 * double(total)));

  const std::vector<int32_t> ids(prompt.as<int64_t>(), prompt.as<int64_t>() + P);
  GenerateOptions opt;
  opt.max_new_tokens = O - P;
  opt.sampling.temperature = 0.0f;
  const std::vector<int32_t> in_process = cuda::generate_gpu(dw, ids, opt);
  std::string csv;
  for (size_t i = 0; i < ids.size(); ++i) csv += (i ? "," : "") + std::to_string(ids[i]);
  const test::CliResult r =
      test::run_cli("generate --model " + dir + " --prompt-ids " + csv + " --max-new-tokens " +
                    std::to_string(O - P) + " --temperature 0 --json --device cuda");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(parse_output_ids(r.output), in_process) << r.output;
}

INSTANTIATE_TEST_SUITE_P(CudaDecode, CudaDecodeGoldens,
                         ::testing::Values("kimi_linear_tiny", "deepseek_v3_tiny", "kimi_k3_tiny"));

TEST(CudaDecode, RejectsBadInput) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto model = bf16_model(c, 3);
  cuda::GpuDecoder dec(model->weights(), 2, 4);
  const int32_t bad[2] = {int32_t(c.vocab_size), 0};
  EXPECT_THROW(dec.step(bad, nullptr), Error);
  const int32_t ok[2] = {1, 2};
  for (int i = 0; i < 4; ++i) dec.step(ok, nullptr);
  EXPECT_EQ(dec.length(0), 4);
  EXPECT_THROW(dec.step(ok, nullptr), Error);  // full
  dec.release(0);
  const int only_first[2] = {1, 0};
  dec.step(ok, nullptr, only_first);
  EXPECT_EQ(dec.length(0), 1);
  EXPECT_EQ(dec.length(1), 4);
}

// A decoder replaying CUDA graphs with the gathered MoE kernels against one launching every
// kernel directly (same kernels: greedy tokens identical, logits equal to fp32 noise) and one on
// the old path (direct launches, grouped MoE GEMMs: logits within bf16 tolerance). 32 steps,
// teacher-forced with the graphed decoder's greedy tokens, active sets changing between steps
// (new graphs for n = 4, 3, 1 and a logits-free step), non-adjacent slots, a chunked prefill into
// a busy decoder and a released slot restarting at position 0.
TEST(CudaDecode, GraphsAndGatheredMoeMatchDirectSteps) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto model = bf16_model(c, 31);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, S = 4, Lmax = 64;
  cuda::GpuDecoder graphed(dw, S, Lmax, decode_options(true, DecodeMoe::Gathered));
  cuda::GpuDecoder direct(dw, S, Lmax, decode_options(false, DecodeMoe::Gathered));
  cuda::GpuDecoder grouped(dw, S, Lmax, decode_options(false, DecodeMoe::Grouped));
  // Our grouped expert GEMMs read the dispatch plan on the device, so that path is captured too.
  cuda::GpuDecoder graphed_grouped(dw, S, Lmax, decode_options(true, DecodeMoe::Grouped));
  cuda::GpuDecoder* decoders[4] = {&graphed, &direct, &grouped, &graphed_grouped};
  std::vector<std::vector<float>> logits(4, std::vector<float>(size_t(S * V)));
  std::vector<int32_t> tokens(static_cast<size_t>(S));
  std::mt19937_64 rng(5);
  auto random_token = [&] { return int32_t(rng() % uint64_t(V)); };

  // Prompts of 5, 9, 3, 12 tokens by chunked prefill; the first tokens are the graphed
  // decoder's greedy picks.
  const int64_t prompt_length[S] = {5, 9, 3, 12};
  std::vector<float> last(static_cast<size_t>(V));
  for (int64_t s = 0; s < S; ++s) {
    const std::vector<int32_t> prompt = random_tokens(prompt_length[s], V, 50 + uint64_t(s));
    for (cuda::GpuDecoder* d : decoders) {
      d->prefill(s, prompt.data(), prompt_length[s], last.data());
      if (d == &graphed) tokens[size_t(s)] = int32_t(argmax(last.data(), V));
    }
  }

  RowStats vs_direct, vs_grouped;
  int64_t identical_rows = 0;
  for (int step = 0; step < 32; ++step) {
    std::vector<int> active(static_cast<size_t>(S), 1);
    if (step >= 7 && step <= 12) active = {1, 0, 1, 1};
    if (step >= 13 && step <= 18) active = {0, 1, 0, 0};
    if (step >= 27) active = {1, 1, 0, 1};
    if (step == 13) {  // slot 1 takes a new prompt while the others keep their caches
      const std::vector<int32_t> prompt = random_tokens(10, V, 77);
      for (cuda::GpuDecoder* d : decoders) {
        d->prefill(1, prompt.data(), 10, last.data());
        if (d == &graphed) tokens[1] = int32_t(argmax(last.data(), V));
      }
    }
    if (step == 19) {  // slot 3 released: a new sequence from position 0
      for (cuda::GpuDecoder* d : decoders) d->release(3);
      tokens[3] = random_token();
    }
    const bool want_logits = step != 25 && step != 26;  // (4 rows, no logits): its own graph
    for (int i = 0; i < 4; ++i)
      decoders[i]->step(tokens.data(), want_logits ? logits[size_t(i)].data() : nullptr,
                        active.data());
    for (int64_t s = 0; s < S; ++s) {
      if (!active[size_t(s)]) continue;
      if (!want_logits) {
        tokens[size_t(s)] = random_token();
        continue;
      }
      const float* a = logits[0].data() + s * V;
      const float* b = logits[1].data() + s * V;
      const float* g = logits[2].data() + s * V;
      const float* gg = logits[3].data() + s * V;
      ASSERT_TRUE(std::all_of(a, a + V, [](float x) { return std::isfinite(x); }))
          << "step " << step << " slot " << s;
      vs_direct.add(a, b, V);
      vs_grouped.add(a, g, V);
      identical_rows += std::equal(a, a + V, b);
      EXPECT_EQ(argmax(a, V), argmax(b, V)) << "step " << step << " slot " << s;
      EXPECT_LE(test::rel_rms(a, b, size_t(V)), 1e-5) << "step " << step << " slot " << s;
      EXPECT_LE(test::rel_rms(a, g, size_t(V)), 2e-2) << "step " << step << " slot " << s;
      EXPECT_EQ(argmax(g, V), argmax(gg, V)) << "step " << step << " slot " << s;
      EXPECT_LE(test::rel_rms(gg, g, size_t(V)), 1e-5) << "step " << step << " slot " << s;
      tokens[size_t(s)] = int32_t(argmax(a, V));
    }
  }
  for (int64_t s = 0; s < S; ++s) {
    EXPECT_EQ(graphed.length(s), direct.length(s));
    EXPECT_EQ(graphed.length(s), grouped.length(s));
  }
  std::printf("[          ] graphed vs direct: %lld rows, %lld bit-identical, rel RMS max %.2e; vs "
              "grouped MoE: rel RMS max %.2e, argmax agreement %.3f\n",
              (long long)vs_direct.rows, (long long)identical_rows, vs_direct.worst,
              vs_grouped.worst, vs_grouped.agreement());
  std::printf("[          ] graphed: %s\n", graphed.mode().c_str());
  EXPECT_EQ(vs_direct.agreement(), 1.0);
  EXPECT_GE(vs_grouped.agreement(), 0.9);
  // Graphs for (n, logits) = (4, yes), (3, yes), (1, yes), (4, no); replayed every step after
  // a key's first two.
  EXPECT_EQ(graphed.graphs_captured(), 4) << graphed.mode();
  EXPECT_GE(graphed.graph_replays(), 20) << graphed.mode();
  EXPECT_EQ(direct.graphs_captured(), 0);
  EXPECT_EQ(grouped.graphs_captured(), 0);
  EXPECT_EQ(graphed_grouped.graphs_captured(), 4) << graphed_grouped.mode();
  EXPECT_GE(graphed_grouped.graph_replays(), 20) << graphed_grouped.mode();
}

// Programmatic dependent launch (ops/cuda/pdl.h) only lets a kernel start early; every kernel
// waits for its inputs, so decoders with it and without it give the same bits, graphed and
// direct: 24 steps of 4 slots (3 and 1 active in between), teacher-forced with the greedy tokens
// of the decoder without PDL.
TEST(CudaDecode, ProgrammaticLaunchesGiveTheSameBits) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto model = bf16_model(c, 43);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, S = 4, Lmax = 64;
  const bool pdl_before = cuda::pdl_enabled();
  struct Run {
    std::unique_ptr<cuda::GpuDecoder> decoder;
    bool pdl;
    std::vector<float> logits;
  };
  std::vector<Run> runs;
  for (bool graphs : {true, false})
    for (bool pdl : {false, true})
      runs.push_back(
          {std::make_unique<cuda::GpuDecoder>(dw, S, Lmax, decode_options(graphs, DecodeMoe::Auto)),
           pdl, std::vector<float>(size_t(S * V))});
  std::vector<int32_t> tokens(static_cast<size_t>(S));
  std::vector<float> last(static_cast<size_t>(V));
  for (int64_t s = 0; s < S; ++s) {
    const std::vector<int32_t> prompt = random_tokens(4 + 3 * s, V, 90 + uint64_t(s));
    for (Run& r : runs) {
      cuda::set_pdl_enabled(r.pdl);
      r.decoder->prefill(s, prompt.data(), 4 + 3 * s, last.data());
      if (&r == &runs[0]) tokens[size_t(s)] = int32_t(argmax(last.data(), V));
    }
  }
  int64_t rows = 0;
  for (int step = 0; step < 24; ++step) {
    std::vector<int> active(static_cast<size_t>(S), 1);
    if (step >= 8 && step < 14) active = {1, 0, 1, 1};
    if (step >= 14 && step < 18) active = {0, 0, 1, 0};
    for (Run& r : runs) {
      cuda::set_pdl_enabled(r.pdl);
      r.decoder->step(tokens.data(), r.logits.data(), active.data());
    }
    for (int64_t s = 0; s < S; ++s) {
      if (!active[size_t(s)]) continue;
      for (int pair = 0; pair < 2; ++pair) {  // graphed, then direct: without vs with PDL
        const float* off = runs[size_t(2 * pair)].logits.data() + s * V;
        const float* on = runs[size_t(2 * pair + 1)].logits.data() + s * V;
        ASSERT_TRUE(std::all_of(off, off + V, [](float x) { return std::isfinite(x); }));
        ASSERT_TRUE(std::equal(off, off + V, on))
            << (pair == 0 ? "graphed" : "direct") << " step " << step << " slot " << s
            << ": rel RMS " << test::rel_rms(off, on, size_t(V));
      }
      ++rows;
      tokens[size_t(s)] = int32_t(argmax(runs[0].logits.data() + s * V, V));
    }
  }
  cuda::set_pdl_enabled(pdl_before);
  std::printf("[          ] %lld rows bit-identical with and without PDL (graphed: %s)\n",
              (long long)rows, runs[1].decoder->mode().c_str());
  EXPECT_GT(runs[1].decoder->graph_replays(), 10);
}

// DM_DECODE_PROFILE=1 (read when a decoder is built): the timed phases of graphed and direct
// steps are positive, add up to no more than the step, and the report resets; off, it is empty.
TEST(CudaDecode, ProfileReportsThePhasesOfGraphedSteps) {
  DM_SKIP_WITHOUT_GPU();
  const ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto model = bf16_model(c, 41);
  const cuda::DeviceWeights dw(model->weights());
  const int64_t V = c.vocab_size, S = 2, Lmax = 32;
  std::vector<int32_t> tokens = {3, 5};
  std::vector<float> logits(static_cast<size_t>(S * V));
  {
    cuda::GpuDecoder off(dw, S, Lmax, decode_options(true, DecodeMoe::Auto));
    off.step(tokens.data(), logits.data());
    EXPECT_TRUE(off.profile_report().empty());
  }
  const test::ScopedEnv profile("DM_DECODE_PROFILE", "1");
  for (bool graphs : {true, false}) {
    SCOPED_TRACE(graphs ? "graphs" : "direct");
    cuda::GpuDecoder dec(dw, S, Lmax, decode_options(graphs, DecodeMoe::Auto));
    for (int step = 0; step < 5; ++step) dec.step(tokens.data(), logits.data());
    if (graphs) EXPECT_GT(dec.graph_replays(), 0);
    const std::string report = dec.profile_report();
    std::printf("[          ] %s\n", report.c_str());
    double kda = -1, mla = -1, moe = -1, dense = -1, rest = 0, step = -1;
    long long steps = 0;
    ASSERT_EQ(std::sscanf(report.c_str(),
                          "decode profile (µs per step, %lld steps): KDA mixers %lf, MLA mixers "
                          "%lf, MoE FFNs %lf, dense FFNs %lf, the rest %lf, step %lf",
                          &steps, &kda, &mla, &moe, &dense, &rest, &step),
              7)
        << report;
    EXPECT_EQ(steps, 5);
    EXPECT_GT(kda, 0.0);
    EXPECT_GT(mla, 0.0);
    EXPECT_GT(moe, 0.0);
    EXPECT_GE(dense, 0.0);
    EXPECT_GT(step, kda + mla + moe + dense - 1.0);  // the events' resolution is ~0.5 µs
    EXPECT_TRUE(dec.profile_report().empty()) << "the report resets";
  }
}

// The decoder's routed-expert path by batch rows (host arithmetic: runs without a GPU). Kimi-
// Linear-48B's experts (E = 256, k = 8): the gathered kernels up to one row per expert (n ≤ 32),
// our few-rows grouped kernel up to two (n ≤ 64), cuBLAS' grouped GEMM below 64 (n < 2048), our
// 128-row tiles from there; forced modes as asked.
TEST(CudaDecode, MoePathByRowsPerExpert) {
  using Path = cuda::MoeExpertsPath;
  const cuda::ExpertWeightsBf16 ew{nullptr, nullptr, nullptr, 256, 2304, 1024};
  auto path = [&](int64_t n) { return cuda::decode_moe_path(DecodeMoe::Auto, n, 8, ew); };
  EXPECT_EQ(path(1), Path::Gathered);
  EXPECT_EQ(path(32), Path::Gathered);
  EXPECT_EQ(path(33), Path::Grouped);
  EXPECT_EQ(path(64), Path::Grouped);
  EXPECT_EQ(path(65), Path::GroupedCublas);
  EXPECT_EQ(path(2047), Path::GroupedCublas);
  EXPECT_EQ(path(2048), Path::Grouped);
  EXPECT_EQ(cuda::decode_moe_path(DecodeMoe::Grouped, 1, 8, ew), Path::Grouped);
  EXPECT_EQ(cuda::decode_moe_path(DecodeMoe::Gathered, 4096, 8, ew), Path::Gathered);
  // Shapes the gathered kernels do not take (Din not a multiple of 8) skip them.
  const cuda::ExpertWeightsBf16 odd{nullptr, nullptr, nullptr, 256, 2300, 1024};
  EXPECT_EQ(cuda::decode_moe_path(DecodeMoe::Auto, 1, 8, odd), Path::Grouped);
}

#else
TEST(CudaDecode, SkippedWithoutCuda) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
