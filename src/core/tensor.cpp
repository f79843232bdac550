#include "core/tensor.h"

namespace dm {

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? "," : "") + std::to_string(d[i]);
  return s + "]";
}

}  // namespace dm
