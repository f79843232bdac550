// Checked entry points of the GPU attention (attention.h): argument validation against the CPU
// op's AttnShape, the decode work plan, and dispatch to the kernel launchers in attention*.cu.
// Compiled as C++20 by the host compiler (the .cu files are C++17 and cannot see ops/cpu).
#include "ops/cuda/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "ops/cpu/attention.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/attention_kernels.h"
#include "ops/cuda/device.h"

namespace dm::cuda {

namespace {

using attention_detail::AttentionProblem;

AttentionProblem checked_problem(const char* who, const AttnShape& s, double scale,
                                 const int32_t* doc_start) {
  DM_CHECK(s.B >= 0 && s.T >= 0 && s.H >= 0 && s.Dqk > 0 && s.Dv > 0, who, ": bad shape B=", s.B,
           " T=", s.T, " H=", s.H, " Dqk=", s.Dqk, " Dv=", s.Dv);
  DM_CHECK(s.Dqk % 8 == 0 && s.Dv % 8 == 0, who, ": head dims must be multiples of 8 (16-byte ",
           "rows), got Dqk=", s.Dqk, " Dv=", s.Dv);
  const int64_t int_max = std::numeric_limits<int32_t>::max();
  DM_CHECK(s.T <= int_max && s.B * s.H <= int_max && s.Dqk <= 4096 && s.Dv <= 4096, who,
           ": shape too large (B·H and T must fit in int32)");
  DM_CHECK(std::isfinite(scale), who, ": scale must be finite, got ", scale);
  AttentionProblem p;
  p.B = int(s.B);
  p.T = int(s.T);
  p.H = int(s.H);
  p.Dqk = int(s.Dqk);
  p.Dv = int(s.Dv);
  p.scale = float(scale);
  p.doc_start = doc_start;
  return p;
}

void check_aligned(const char* who, const void* p, const char* name) {
  DM_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, who, ": ", name,
           " must be 16-byte aligned (vector loads)");
}

// DM_ATTENTION: "ours" pins Auto to our tiled kernel; "cudnn" makes Auto eager (a cuDNN plan on
// a shape's first call, our kernel still where cuDNN cannot go, e.g. packed documents).
enum class EnvAttention : uint8_t { Auto, Ours, CudnnEager };
EnvAttention env_attention() {
  static const EnvAttention choice = [] {
    const char* e = std::getenv("DM_ATTENTION");
    if (!e || !*e || !std::strcmp(e, "auto")) return EnvAttention::Auto;
    if (!std::strcmp(e, "ours")) return EnvAttention::Ours;
    if (!std::strcmp(e, "cudnn")) return EnvAttention::CudnnEager;
    throw Error(str_cat("DM_ATTENTION must be auto, ours or cudnn, got '", e, "'"));
  }();
  return choice;
}

AttentionKernel pinned(AttentionKernel kernel) {
  if (kernel != AttentionKernel::Auto) return kernel;
  return env_attention() == EnvAttention::Ours ? AttentionKernel::Tiled : AttentionKernel::Auto;
}

// Auto builds a cuDNN plan only for shapes that recur (attention_cudnn.h), unless DM_ATTENTION
// asks for eager plans; Cudnn builds at once.
int build_after(AttentionKernel kernel) {
  if (kernel == AttentionKernel::Cudnn || env_attention() == EnvAttention::CudnnEager) return 1;
  return kAttentionCudnnBuildAfter;
}

// Auto sends packed documents to cuDNN's ragged batch too (H200, 8 documents per row, H = 32:
// forward+backward 0.51 vs 1.04 ms at T = 4K, 11.5 vs 39.2 ms at T = 32K, the doc_start copy to
// the host included); DM_CUDNN_PACKED=0 keeps them on our kernel. The explicit Cudnn kernel
// always takes them.
bool packed_on_cudnn() {
  static const bool on = [] { return env_flag("DM_CUDNN_PACKED", true); }();
  return on;
}

// Runs the cuDNN path for Cudnn and Auto (true when it ran); Cudnn throws where Auto falls back.
// dense(why) runs one document per row, packed(why) the documents of doc_start.
template <class Dense, class Packed>
bool try_cudnn(const char* who, AttentionKernel kernel, const int32_t* doc_start, Dense&& dense,
               Packed&& packed) {
  if (kernel != AttentionKernel::Auto && kernel != AttentionKernel::Cudnn) return false;
  if (doc_start && kernel == AttentionKernel::Auto && !packed_on_cudnn()) return false;
  std::string why;
  if (doc_start ? packed(&why) : dense(&why)) return true;
  DM_CHECK(kernel == AttentionKernel::Auto, who, ": cuDNN cannot take this problem: ", why);
  return false;
}

}  // namespace

void attention_causal_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              uint16_t* o, float* lse, const AttnShape& s, double scale,
                              const int32_t* doc_start, CUstream_st* stream,
                              AttentionKernel kernel) {
  const AttentionProblem p = checked_problem("attention_causal_forward (cuda)", s, scale, doc_start);
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  for (auto [ptr, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {o, "o"}})
    check_aligned("attention_causal_forward (cuda)", ptr, name);
  kernel = pinned(kernel);
  if (try_cudnn(
          "attention_causal_forward (cuda)", kernel, doc_start,
          [&](std::string* why) {
            return cudnn_attention_forward(q, k, v, o, lse, s, scale, stream, why,
                                           build_after(kernel));
          },
          [&](std::string* why) {
            return cudnn_attention_forward_packed(q, k, v, o, lse, s, scale, doc_start, stream,
                                                  why, build_after(kernel));
          }))
    return;
  if (kernel != AttentionKernel::Simple)
    attention_detail::launch_attention_forward_tiled(p, q, k, v, o, lse, stream);
  else
    attention_detail::launch_attention_forward_simple(p, q, k, v, o, lse, stream);
}

void attention_causal_forward(const float* q, const float* k, const float* v, float* o, float* lse,
                              const AttnShape& s, double scale, const int32_t* doc_start,
                              CUstream_st* stream) {
  const char* who = "attention_causal_forward (cuda, fp32)";
  const AttentionProblem p = checked_problem(who, s, scale, doc_start);
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  // Scalar fp32 loads: no alignment beyond the element's own is needed.
  DM_CHECK(q && k && v && o, who, ": null argument");
  attention_detail::launch_attention_forward_simple(p, q, k, v, o, lse, stream);
}

size_t attention_causal_backward_workspace_bytes(const AttnShape& s) {
  return attention_detail::attention_backward_scratch_bytes(int(s.B), int(s.T), int(s.H));
}

void attention_causal_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               const uint16_t* o, const float* lse, const uint16_t* dout,
                               uint16_t* dq, uint16_t* dk, uint16_t* dv, const AttnShape& s,
                               double scale, void* workspace, const int32_t* doc_start,
                               CUstream_st* stream, AttentionKernel kernel) {
  const char* who = "attention_causal_backward (cuda)";
  const AttentionProblem p = checked_problem(who, s, scale, doc_start);
  if (p.B == 0 || p.T == 0 || p.H == 0) return;
  DM_CHECK(lse && workspace, who, ": lse and workspace are required");
  for (auto [ptr, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"},
                           {o, "o"}, {dout, "dout"}, {dq, "dq"}, {dk, "dk"}, {dv, "dv"},
                           {workspace, "workspace"}})
    check_aligned(who, ptr, name);
  kernel = pinned(kernel);
  if (try_cudnn(
          who, kernel, doc_start,
          [&](std::string* why) {
            return cudnn_attention_backward(q, k, v, o, lse, dout, dq, dk, dv, s, scale, stream,
                                            why, build_after(kernel));
          },
          [&](std::string* why) {
            return cudnn_attention_backward_packed(q, k, v, o, lse, dout, dq, dk, dv, s, scale,
                                                   doc_start, stream, why, build_after(kernel));
          }))
    return;
  // Our kernels accumulate into the gradients: start them at zero.
  fill_zero_async(dq, size_t(s.B * s.T * s.H * s.Dqk) * sizeof(uint16_t), stream);
  fill_zero_async(dk, size_t(s.B * s.T * s.H * s.Dqk) * sizeof(uint16_t), stream);
  fill_zero_async(dv, size_t(s.B * s.T * s.H * s.Dv) * sizeof(uint16_t), stream);
  if (kernel != AttentionKernel::Simple)
    attention_detail::launch_attention_backward_tiled(p, q, k, v, o, lse, dout, dq, dk, dv,
                                                      workspace, stream);
  else
    attention_detail::launch_attention_backward_simple(p, q, k, v, o, lse, dout, dq, dk, dv,
                                                       workspace, stream);
}

void attention_check_doc_start_device(const int32_t* doc_start, int64_t B, int64_t T) {
  if (!doc_start || B * T == 0) return;
  std::vector<int32_t> host(size_t(B * T));
  copy_to_host(host.data(), doc_start, host.size() * sizeof(int32_t));
  attention_check_doc_start(host.data(), B, T);
}

namespace {
std::atomic<bool>& decode_wgmma_setting() {
  static std::atomic<bool> on{env_flag("DM_MLA_DECODE_WGMMA", true)};
  return on;
}
}  // namespace

bool mla_decode_wgmma() { return decode_wgmma_setting().load(std::memory_order_relaxed); }
void mla_set_decode_wgmma(bool on) { decode_wgmma_setting().store(on, std::memory_order_relaxed); }
bool mla_decode_uses_wgmma(int Dk, int Dv) {
  return mla_decode_wgmma() && Dk == attention_detail::kDecodeMaxDk &&
         Dv == attention_detail::kDecodeMaxDv;
}

MlaSplitRule mla_split_rule_default() {
  static const MlaSplitRule rule = [] {
    const char* env = std::getenv("DM_MLA_DECODE_SPLITS");
    if (env == nullptr || env[0] == '\0' || std::strcmp(env, "waves") == 0)
      return MlaSplitRule::WholeWaves;
    DM_CHECK(std::strcmp(env, "fixed") == 0, "DM_MLA_DECODE_SPLITS must be 'waves' or 'fixed', ",
             "got '", env, "'");
    return MlaSplitRule::TwoCtasPerSm;
  }();
  return rule;
}

MlaDecodePlan mla_decode_plan(int S, int H, int max_pages, int num_sms, int max_splits,
                              MlaSplitRule rule) {
  DM_CHECK(S >= 0 && H >= 0 && max_pages >= 0, "mla_decode_plan: bad shape S=", S, " H=", H,
           " max_pages=", max_pages);
  DM_CHECK(max_splits >= 1 && max_splits <= 256, "mla_decode_plan: max_splits must be in [1, 256]",
           ", got ", max_splits);
  if (num_sms <= 0) num_sms = device_multiprocessors();
  MlaDecodePlan plan;
  plan.max_pages = max_pages;
  if (S == 0 || H == 0 || max_pages == 0) return plan;
  constexpr int kMinPagesPerSplit = 4;
  const int64_t heads_per_cta = attention_detail::decode_heads_per_cta(H);
  const int64_t ctas_per_split = int64_t(S) * ((H + heads_per_cta - 1) / heads_per_cta);
  // At least kMinPagesPerSplit pages per split; the split count follows from the page count
  // rounded that way (rounding the count first left 103 CTAs of 5 pages for 513 pages on 132
  // SMs, where 129 of 4 fill one wave).
  auto set_splits = [&](int64_t splits) {
    plan.pages_per_split =
        int(std::max<int64_t>(kMinPagesPerSplit, (max_pages + splits - 1) / splits));
    plan.num_splits = (max_pages + plan.pages_per_split - 1) / plan.pages_per_split;
  };
  if (rule == MlaSplitRule::TwoCtasPerSm) {
    const int64_t splits = (2 * int64_t(num_sms) + ctas_per_split - 1) / ctas_per_split;
    set_splits(std::clamp<int64_t>(splits, 1, max_splits));
    return plan;
  }
  // WholeWaves. The kernel holds one CTA per multiprocessor (its queries and two page tiles
  // take ~170–200 KB of shared memory at Dk = 576), so `num_sms` CTAs make a wave and s splits
  // of pps pages cost waves(s)·(pps + kCtaPages) page times, kCtaPages being a CTA's own traffic
  // in pages (a page is 64·576·2 = 74 KB; a CTA of 32 heads loads 37 KB of queries and writes a
  // 64 KB partial O that the combine reads back). The cheapest s, the fewest splits on ties.
  constexpr int64_t kCtaPages = 2;
  const int64_t most = std::max<int64_t>(
      1, std::min<int64_t>(max_splits, (max_pages + kMinPagesPerSplit - 1) / kMinPagesPerSplit));
  int64_t best_cost = std::numeric_limits<int64_t>::max(), best = 1;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t pps = std::max<int64_t>(kMinPagesPerSplit, (max_pages + s - 1) / s);
    const int64_t splits = (max_pages + pps - 1) / pps;
    const int64_t cost = (ctas_per_split * splits + num_sms - 1) / num_sms * (pps + kCtaPages);
    if (cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  set_splits(best);
  return plan;
}

size_t mla_decode_workspace_bytes(const MlaDecodePlan& plan, int S, int H, int Dv) {
  if (plan.num_splits <= 1) return 0;
  const size_t partials = size_t(S) * plan.num_splits * H;
  return ((partials * size_t(Dv) * sizeof(float) + 255) & ~size_t(255)) +
         partials * sizeof(float);
}

void mla_decode_absorbed(const MlaDecodeArgs& a, const MlaDecodePlan& plan, void* workspace,
                         CUstream_st* stream) {
  const char* who = "mla_decode_absorbed";
  DM_CHECK(a.S >= 0 && a.H >= 0 && a.Dk > 0 && a.Dv > 0, who, ": bad shape S=", a.S, " H=", a.H,
           " Dk=", a.Dk, " Dv=", a.Dv);
  DM_CHECK(a.Dk % 8 == 0 && a.Dv % 8 == 0 && a.Dv <= a.Dk, who,
           ": need Dk, Dv multiples of 8 and Dv ≤ Dk, got Dk=", a.Dk, " Dv=", a.Dv);
  DM_CHECK(plan.num_splits >= 1 && plan.pages_per_split >= 1 &&
               int64_t(plan.num_splits) * plan.pages_per_split >= plan.max_pages,
           who, ": plan does not cover the page table (", plan.num_splits, " × ",
           plan.pages_per_split, " < ", plan.max_pages, ")");
  if (a.S == 0 || a.H == 0) return;
  DM_CHECK(a.q && a.cache && a.page_table && a.seq_len && a.out, who, ": null argument");
  check_aligned(who, a.q, "q");
  check_aligned(who, a.cache, "cache");
  DM_CHECK(plan.num_splits == 1 || workspace, who, ": workspace required with ", plan.num_splits,
           " splits");
  attention_detail::DecodeProblem p;
  p.S = a.S;
  p.H = a.H;
  p.Dk = a.Dk;
  p.Dv = a.Dv;
  p.max_pages = plan.max_pages;
  p.num_splits = plan.num_splits;
  p.pages_per_split = plan.pages_per_split;
  p.scale = float(a.scale);
  float* partial_o = static_cast<float*>(workspace);
  float* partial_lse = nullptr;
  if (plan.num_splits > 1) {
    const size_t partials = size_t(a.S) * plan.num_splits * a.H;
    partial_lse = reinterpret_cast<float*>(
        static_cast<char*>(workspace) +
        ((partials * size_t(a.Dv) * sizeof(float) + 255) & ~size_t(255)));
  }
  attention_detail::launch_attention_decode(p, a.q, a.cache, a.page_table, a.seq_len, a.out, a.lse,
                                            partial_o, partial_lse, stream);
}

}  // namespace dm::cuda
