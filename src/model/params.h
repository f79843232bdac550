// Parameter counts of a ModelConfig, total and active per token, by component (`deltamoe params`).
// They equal the element counts of the checkpoint tensors exactly (tests/test_config.cpp checks
// every golden checkpoint), except that K3 checkpoints also store zero padding of A_log.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/config.h"

namespace dm {

struct ParamCount {
  int64_t total = 0;
  // Parameters one token's forward pass multiplies with: all but the routed experts, plus top_k
  // routed experts per MoE layer; the input embedding table is a row lookup and does not count
  // (the convention behind the ≈104.2B active of the K3 shape, SPEC §1.8).
  int64_t active = 0;
  // Same component names in the same order in both lists; components with no parameters are left out.
  std::vector<std::pair<std::string, int64_t>> breakdown_total, breakdown_active;
};

// Throws dm::Error if a count does not fit in int64 (only possible for absurd configs).
ParamCount count_params(const ModelConfig& cfg);

// "2.78T", "104.2B", "19.9M", "1.5K", "512".
std::string format_param_count(int64_t n);

}  // namespace dm
