// Vector loads and stores for the element kernels: V consecutive elements of fp32 or bf16
// storage in one 2- to 16-byte access, converted element by element (elementwise_storage.cuh),
// and the alignment check their launches make. Included only by nvcc-compiled files.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <utility>

#include "ops/cuda/elementwise_storage.cuh"

namespace dm::cuda {

// Whether p sits on a multiple of `bytes` (the vector paths' launch check).
__host__ __device__ inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether a launch can take V elements a thread: n splits into whole vectors and every tensor,
// given as (pointer, element bytes), sits on a multiple of V·element bytes (its rows then stay
// aligned too, as the row lengths the callers pass are multiples of V).
inline bool vectors_fit(int64_t n, int V,
                        std::initializer_list<std::pair<const void*, size_t>> tensors) {
  if (n % V != 0) return false;
  for (const auto& [p, element_bytes] : tensors)
    if (!aligned_to(p, size_t(V) * element_bytes)) return false;
  return true;
}

// V consecutive elements [i, i + V) in one load or store (p + i aligned to V·sizeof(T): the
// callers check it), converted to or from fp32 element by element, so the values are those of V
// scalar load_as_float / store_from_float calls. V·sizeof(T) ∈ {2, 4, 8, 16} bytes.
template <int kBytes>
struct RawVector;
template <>
struct RawVector<2> {
  using type = uint16_t;
};
template <>
struct RawVector<4> {
  using type = uint32_t;
};
template <>
struct RawVector<8> {
  using type = uint2;
};
template <>
struct RawVector<16> {
  using type = uint4;
};

template <int V, typename T>
__device__ __forceinline__ void load_vector_as_float(const T* __restrict__ p, int64_t i,
                                                     float (&out)[V]) {
  using Raw = typename RawVector<V* int(sizeof(T))>::type;
  const Raw raw = *reinterpret_cast<const Raw*>(p + i);
  T elements[V];
  memcpy(elements, &raw, sizeof raw);
#pragma unroll
  for (int v = 0; v < V; ++v) out[v] = load_as_float(elements, v);
}
template <int V, typename T>
__device__ __forceinline__ void store_vector_from_float(T* __restrict__ p, int64_t i,
                                                        const float (&in)[V]) {
  using Raw = typename RawVector<V* int(sizeof(T))>::type;
  T elements[V];
#pragma unroll
  for (int v = 0; v < V; ++v) store_from_float(elements, v, in[v]);
  Raw raw;
  memcpy(&raw, elements, sizeof raw);
  *reinterpret_cast<Raw*>(p + i) = raw;
}

}  // namespace dm::cuda
