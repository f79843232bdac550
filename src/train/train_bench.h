// Training-step throughput of a config on a device (`deltamoe bench train`,
// bench/bench_cuda_train.cpp): random init, random tokens, and per step zero_grads → `accum`
// micro-batches of forward + backward (gradients accumulated, as `deltamoe train --accum`) →
// global-norm clip at 1 → AdamW, through the same TrainEngine the trainer uses. The median over
// the timed steps after the warm-up ones; the model FLOPs come from model/plan.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/config.h"

namespace dm {

struct TrainBenchOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  int64_t batch = 1, seq = 256;
  int64_t accum = 1;  // micro-batches of batch × seq per optimizer step
  int steps = 5, warmup = 2;
  bool recompute = true;  // false: layers keep their forward internals (more memory, faster)
  uint64_t seed = 1;
};

struct TrainBenchResult {
  // Median wall times: a whole step (its start to the next one's; the host does not wait for
  // the update, as in `train`), and its forward + backward of all micro-batches (until their
  // losses are on the host: on the GPU that includes the previous step's update still running).
  double step_s = 0;
  double forward_backward_s = 0;
  double loss = 0;                // mean cross-entropy of the last step
  double flops_per_token = 0;     // model FLOPs (model/plan.h train_flops_per_token)
  int64_t tokens_per_step = 0;    // accum × batch × seq
  int64_t params = 0, active_params = 0;
  size_t optimizer_bytes = 0, activation_peak = 0;
  double tokens_per_s() const { return double(tokens_per_step) / step_s; }
  double model_tflops() const { return flops_per_token * tokens_per_s() / 1e12; }
};

// The model, engine and tokens set up once (the 1.4B gpu_1b init is ~30 s); measure() times
// warmup + steps steps and may run again, e.g. once per setting of an environment switch that
// the kernels read at each call, so that an A/B pays the set-up once and runs on one machine.
class TrainBench {
 public:
  // Throws dm::Error for a bad shape, an unknown device, or "cuda" without a GPU.
  TrainBench(const ModelConfig& cfg, const TrainBenchOptions& o);
  ~TrainBench();
  TrainBench(const TrainBench&) = delete;
  TrainBench& operator=(const TrainBench&) = delete;
  TrainBenchResult measure();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// TrainBench(cfg, o).measure().
TrainBenchResult run_train_bench(const ModelConfig& cfg, const TrainBenchOptions& o);

// An A/B of an environment switch that the kernels read at each call (docs/gpu.md's table):
// NAME=v1,v2,… measured value after value, round after round, on one TrainBench.
struct TrainBenchAb {
  std::string name;
  std::vector<std::string> values;
  std::vector<std::vector<double>> step_ms;  // [value][round]
  double median_ms(size_t value) const;
};
// Throws dm::Error unless spec is NAME=v1[,v2…] with a non-empty NAME.
TrainBenchAb parse_train_bench_ab(const std::string& spec);
// `rounds` rounds of: for each value, setenv(name, value), bench.measure(), then
// each(round, value index, result). Leaves the variable at the last value.
void run_train_bench_ab(TrainBench& bench, TrainBenchAb& ab, int rounds,
                        const std::function<void(int, size_t, const TrainBenchResult&)>& each);

}  // namespace dm
