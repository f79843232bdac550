// Cached-decode throughput of a model on a device (`deltamoe bench decode`): every one of
// `batch` slots is prefilled with `context` random tokens through the scheduler's DecodeBackend
// (infer/decode_backend.h: the CPU DecodeState or the GPU decoder), then `warmup` + `steps`
// batched decode steps of random next tokens run; the median step is reported. The floor it is
// compared with comes from model/plan.h decode_step_bytes.
#pragma once
#include <cstdint>
#include <string>

#include "model/model.h"

namespace dm {

struct DecodeBenchOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  int64_t batch = 1, context = 512;
  int steps = 16, warmup = 2;
  uint64_t seed = 1;
};

struct DecodeBenchResult {
  double prefill_s = 0;  // wall time of all the slots' prefills
  double step_s = 0;     // median wall time of a decode step (logits of every slot on the host)
  double tokens_per_s() const;  // batch / step_s
  double prefill_tokens_per_s() const;
  int64_t batch = 0, context = 0;
};

// Throws dm::Error for a bad shape, a context past the model's, or "cuda" without a GPU.
DecodeBenchResult run_decode_bench(Model& model, const DecodeBenchOptions& o);

}  // namespace dm
