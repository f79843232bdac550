// pdl.h's switch: DM_PDL read once, overridable by tests.
#include <atomic>

#include "core/env.h"
#include "ops/cuda/pdl.h"

namespace dm::cuda {
namespace {
std::atomic<int>& pdl_state() {  // -1: not read yet
  static std::atomic<int> state{-1};
  return state;
}
}  // namespace

bool pdl_enabled() {
  int s = pdl_state().load(std::memory_order_relaxed);
  if (s < 0) {
    s = env_flag("DM_PDL", true) ? 1 : 0;
    pdl_state().store(s, std::memory_order_relaxed);
  }
  return s == 1;
}

void set_pdl_enabled(bool on) { pdl_state().store(on ? 1 : 0, std::memory_order_relaxed); }

bool decode_l2_prefetch(int64_t rows) {
  static const int choice = env_choice("DM_DECODE_L2_PREFETCH", {"auto", "1", "0"});
  return choice == 1 || (choice == 0 && rows == 1);
}

}  // namespace dm::cuda
