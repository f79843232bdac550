// Element types the engine stores and converts between. Compute on CPU is f32 (f64 for reference
// checks); bf16/f16 are storage formats for checkpoints and GPU activations.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace dm {

enum class DType : uint8_t { F32, F64, BF16, F16, I64, I32, U8, BOOL };

size_t dtype_size(DType t);
const char* dtype_name(DType t);              // safetensors spelling: "F32", "BF16", ...
bool dtype_from_name(const std::string& s, DType* out);  // false for an unknown spelling

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// Converts n elements of type `src_t` at `src` into f32 at `dst` (F32, F64, BF16, F16 supported).
void convert_to_f32(const void* src, DType src_t, float* dst, size_t n);

}  // namespace dm
