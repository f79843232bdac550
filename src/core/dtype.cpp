#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace dm {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I64: return 8;
    case DType::I32: return 4;
    case DType::U8: return 1;
    case DType::BOOL: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

bool dtype_from_name(const std::string& s, DType* out) {
  static const struct { const char* n; DType t; } table[] = {
      {"F32", DType::F32}, {"F64", DType::F64}, {"BF16", DType::BF16}, {"F16", DType::F16},
      {"I64", DType::I64}, {"I32", DType::I32}, {"U8", DType::U8},     {"BOOL", DType::BOOL}};
  for (const auto& e : table)
    if (s == e.n) { *out = e.t; return true; }
  return false;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(mant), -24);  // subnormal (or zero)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= sign;
    std::memcpy(&f, &u, 4);
    return f;
  }
  uint32_t u;
  if (exp == 31) u = sign | 0x7f800000u | (mant << 13);
  else u = sign | (uint32_t(exp - 15 + 127) << 23) | (mant << 13);
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;            // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;           // overflow -> inf
  if (a < 0x38800000u) {                                // subnormal half
    const float af = std::fabs(f);
    return sign | uint16_t(std::nearbyint(af * 16777216.0f));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias, round to nearest even
  return sign | uint16_t(r >> 13);
}

void convert_to_f32(const void* src, DType t, float* dst, size_t n) {
  switch (t) {
    case DType::F32: std::memcpy(dst, src, n * 4); return;
    case DType::F64: {
      const double* s = static_cast<const double*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]);
      return;
    }
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
      return;
    }
    default: throw Error(str_cat("cannot convert ", dtype_name(t), " to F32"));
  }
}

}  // namespace dm
