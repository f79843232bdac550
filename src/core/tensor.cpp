#include "core/tensor.h"

namespace dm {

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    // Appended piece by piece: GCC 12's -Wrestrict misfires on `const char* + std::string&&`.
    if (i) s += ',';
    s += std::to_string(d[i]);
  }
  return s + "]";
}

}  // namespace dm
