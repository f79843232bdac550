// Internals of GpuDecoder shared by its two sources (decode_gpu.cpp: the cache, the step, its
// graphs and the prefill; decode_gpu_mixers.cpp: the KDA and MLA sub-layers of a step): the
// scratch carver, each mixer's step temporaries, and the device views of a step's rows.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "io/config.h"
#include "model/cuda/decode_gpu.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/device.h"

namespace dm::cuda {
namespace decode_detail {

constexpr int64_t kPageTokens = kMlaDecodePageTokens;  // the paged decode kernel's page size

// Carves views from an arena, or (arena == nullptr) only counts: sizes and layouts come from the
// same code, so they cannot disagree. Views round to the arena's 256-byte alignment; `bytes`
// starts with 256 of slack for an unaligned starting mark.
struct Carver {
  DeviceArena* arena = nullptr;
  size_t bytes = 256;
  void* take_bytes(size_t b) {
    b = std::max<size_t>(b, 1);
    bytes += (b + 255) / 256 * 256;
    return arena ? arena->alloc_bytes(b) : nullptr;
  }
  template <typename T>
  T* take(int64_t count) {
    return static_cast<T*>(take_bytes(size_t(std::max<int64_t>(count, 0)) * sizeof(T)));
  }
};

inline bool rope_on(const MlaConfig& m) { return m.use_rope && m.qk_rope_dim > 0; }

// KDA step temporaries. raw[0] later holds the gate input f (once the conv has read it).
struct KdaStepBuffers {
  uint16_t* raw[3] = {};  // [n, H·K] W_{q,k,v} x
  uint16_t* qkv[3] = {};  // [n, H·K] SiLU(conv)
  uint16_t* low = nullptr;          // [n, K]   W_f↓ x
  uint16_t* low_gate = nullptr;     // [n, K]   W_g↓ x (low-rank output gate)
  uint16_t* out_gate = nullptr;     // [n, H·K] the output gate's logits
  float* beta_logits = nullptr;     // [n, H]
  uint16_t* o = nullptr;            // [n, H·K]
};
KdaStepBuffers carve_kda(Carver& cv, const ModelConfig& c, int64_t n);

struct MlaStepBuffers {
  float* q_a = nullptr;          // [n, ql] fp32 (q LoRA only)
  uint16_t* q_a_normed = nullptr;  // [n, ql]
  uint16_t* q = nullptr;         // [n, H, dq]
  float* kv_a = nullptr;         // [n, Wd] fp32
  uint16_t* q_abs = nullptr;     // [n, H, Wd]
  uint16_t* latent = nullptr;    // [n, H, kvl]
  void* attention_ws = nullptr;  // split partials of the paged kernel
  uint16_t* o = nullptr;         // [n, H, dv]
  uint16_t* gate = nullptr;      // [n, H, dv] (output gate only)
};
MlaStepBuffers carve_mla(Carver& cv, const ModelConfig& c, int64_t n, size_t attention_ws);

// The paged MLA kernel's split plan for n rows (a function of n only, so a graph captured for n
// replays with it) and the bytes of its split partials.
MlaDecodePlan plan_for(const ModelConfig& c, int64_t n, int64_t P, int num_sms);
size_t attention_ws_bytes(const ModelConfig& c, int64_t n, int64_t P, int num_sms);

}  // namespace decode_detail

// Device views of one step's rows; every kernel reads slots and positions from here.
struct GpuDecoder::Rows {
  int64_t n = 0;
  const int32_t* slots = nullptr;      // device [n]
  const int32_t* positions = nullptr;  // device [n]
  const int32_t* seq_len = nullptr;    // device [n]
  const int32_t* row_table = nullptr;  // device [n, P]
};

}  // namespace dm::cuda
