// Tensor: a non-owning, contiguous, row-major view (pointer + dtype + shape). Storage always
// belongs to an Arena or a memory-mapped file; a Tensor never frees anything.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace dm {

constexpr int kMaxDims = 6;

struct Shape {
  std::array<int64_t, kMaxDims> d{};
  int ndim = 0;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    for (int64_t v : dims) d[ndim++] = v;
  }
  static Shape of(const std::vector<int64_t>& dims) {
    Shape s;
    for (int64_t v : dims) s.d[s.ndim++] = v;
    return s;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= d[i];
    return n;
  }
  int64_t operator[](int i) const { return d[i < 0 ? ndim + i : i]; }
  bool operator==(const Shape& o) const {
    if (ndim != o.ndim) return false;
    for (int i = 0; i < ndim; ++i)
      if (d[i] != o.d[i]) return false;
    return true;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::vector<int64_t> vec() const { return {d.begin(), d.begin() + ndim}; }
  std::string str() const;
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
  float* f32() const { return as<float>(); }
};

}  // namespace dm
