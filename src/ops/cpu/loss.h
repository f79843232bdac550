// Next-token cross-entropy fused with its softmax backward (CPU).
//   logits [N, V], targets [N] (−1 = no loss at this position)
//   returns Σ over counted rows of (logsumexp(z) − z_target) (in double) and the row count;
//   if dlogits != nullptr it receives (softmax(z) − onehot(target)) · scale for counted rows and 0
//   for the others (written, not accumulated: the caller owns this scratch).
#pragma once
#include <cstdint>

namespace dm {

struct CrossEntropyResult {
  double loss_sum = 0;
  int64_t count = 0;
  int64_t correct = 0;  // rows whose argmax equals the target
};

template <typename Real>
CrossEntropyResult cross_entropy_forward_backward(const Real* logits, const int64_t* targets,
                                                  Real* dlogits, int64_t N, int64_t V, double scale);

}  // namespace dm
