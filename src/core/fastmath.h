// Elementwise transcendental functions that GCC vectorises (no libm calls in hot loops, no
// -ffast-math): exp by range reduction + polynomial, and σ, SiLU, tanh built on it. Used by every
// op so the float engine and the double reference compute the same formulas.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace dm {

// exp(x) that GCC vectorises without -ffast-math (libm's exp is a call and blocks it; the chunked
// form spends most of its non-GEMM time in exp). Cody–Waite reduction x = n·ln2 + r, Taylor
// polynomial in r, then ·2ⁿ by building the exponent bits. Within ~1 ulp of std::exp for
// |x| ≤ 87 (float) / 708 (double); x below −limit returns 0 (true value is below the normal
// range), x above +limit is clamped (never happens here: every exponent formed is ≤ 0).
// Clamping and the underflow test are integer mask arithmetic, no compares: GCC does not
// if-convert a float compare-and-select under the default -ftrapping-math, and even integer
// selects stayed branches inside the larger loops here, which kept those loops scalar.
inline float fast_exp(float x) {
  const int32_t x_bits = std::bit_cast<int32_t>(x);
  const int32_t sign_bit = x_bits & int32_t(0x80000000u);
  const int32_t magnitude_bits = x_bits & 0x7fffffff;
  const int32_t limit_bits = std::bit_cast<int32_t>(87.0f);
  // All-ones masks from arithmetic shifts (C++20: >> of a negative value is arithmetic).
  const int32_t excess_bits = magnitude_bits - limit_bits;  // > 0: |x| beyond the limit
  const int32_t within_limit_mask = excess_bits >> 31;
  const int32_t negative_mask = x_bits >> 31;
  const float x_clamped =
      std::bit_cast<float>(sign_bit | (limit_bits + (excess_bits & within_limit_mask)));
  // Adding 1.5·2²³ rounds x·log2(e) to an integer n and leaves n in the low mantissa bits.
  const float shifter = 0x1.8p23f;
  const float shifted = x_clamped * 1.44269504f + shifter;
  const float n = shifted - shifter;
  const float r = (x_clamped - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 = hi + lo
  float poly = 1.f / 5040.f;
  poly = poly * r + 1.f / 720.f;
  poly = poly * r + 1.f / 120.f;
  poly = poly * r + 1.f / 24.f;
  poly = poly * r + 1.f / 6.f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  const int32_t underflow_mask = negative_mask & ~within_limit_mask;
  const int32_t two_to_n_bits =
      ((std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(shifter) + 127) << 23) &
      ~underflow_mask;
  return poly * std::bit_cast<float>(two_to_n_bits);
}

inline double fast_exp(double x) {
  const int64_t x_bits = std::bit_cast<int64_t>(x);
  const int64_t sign_bit = x_bits & int64_t(0x8000000000000000ull);
  const int64_t magnitude_bits = x_bits & int64_t(0x7fffffffffffffffll);
  const int64_t limit_bits = std::bit_cast<int64_t>(708.0);
  const int64_t excess_bits = magnitude_bits - limit_bits;
  const int64_t within_limit_mask = excess_bits >> 63;
  const int64_t negative_mask = x_bits >> 63;
  const double x_clamped =
      std::bit_cast<double>(sign_bit | (limit_bits + (excess_bits & within_limit_mask)));
  const double shifter = 0x1.8p52;
  const double shifted = x_clamped * 1.4426950408889634 + shifter;
  const double n = shifted - shifter;
  const double r = (x_clamped - n * 0x1.62e42fefa39efp-1) - n * 0x1.abc9e3b39803fp-56;
  // Taylor to r¹³: |r| ≤ ln2/2 leaves a truncation error below 1e-17.
  double poly = 1.0 / 6227020800.0;
  poly = poly * r + 1.0 / 479001600.0;
  poly = poly * r + 1.0 / 39916800.0;
  poly = poly * r + 1.0 / 3628800.0;
  poly = poly * r + 1.0 / 362880.0;
  poly = poly * r + 1.0 / 40320.0;
  poly = poly * r + 1.0 / 5040.0;
  poly = poly * r + 1.0 / 720.0;
  poly = poly * r + 1.0 / 120.0;
  poly = poly * r + 1.0 / 24.0;
  poly = poly * r + 1.0 / 6.0;
  poly = poly * r + 0.5;
  poly = poly * r + 1.0;
  poly = poly * r + 1.0;
  const int64_t underflow_mask = negative_mask & ~within_limit_mask;
  const int64_t two_to_n_bits =
      ((std::bit_cast<int64_t>(shifted) - std::bit_cast<int64_t>(shifter) + 1023) << 52) &
      ~underflow_mask;
  return poly * std::bit_cast<double>(two_to_n_bits);
}

// fast_exp for arguments that are finite unless something upstream already failed (softmax
// scores minus their row max or log-sum-exp): fast_exp maps NaN and ±∞ to finite values, and
// x − x (exactly 0 for finite x, NaN otherwise) puts the NaN back, so non-finite guards further
// down still see it. Vectorises like fast_exp.
template <typename Real>
inline Real fast_exp_keep_nan(Real x) {
  return fast_exp(x) + (x - x);
}

// σ(x) = 1/(1 + e^{−x}): full relative precision on both sides (for x < 0, e^{−x} ≥ 1 and the
// sum is exact to rounding). fast_exp clamps its argument, so below −limit σ is set to exactly 0
// (the true value is below the smallest normal number), and ±1e4 never gives NaN.
// Integer type of a float's bits, and the all-ones / all-zeros select on it: GCC keeps a float
// compare-and-select as a branch under the default -ftrapping-math, and one branch keeps the
// whole surrounding loop scalar (ffn.cpp's GLU loops were, at 14% of a CPU training step).
template <typename Real>
using FloatBits = std::conditional_t<sizeof(Real) == 4, int32_t, int64_t>;
// mask ? a : b, with mask all ones or all zeros.
template <typename Real>
inline Real select_bits(FloatBits<Real> mask, Real a, Real b) {
  using Bits = FloatBits<Real>;
  return std::bit_cast<Real>((std::bit_cast<Bits>(a) & mask) | (std::bit_cast<Bits>(b) & ~mask));
}
// All ones where x < y, for x, y ≥ +0 (their bit patterns then order like the values).
template <typename Real>
inline FloatBits<Real> less_mask_nonnegative(Real x, Real y) {
  using Bits = FloatBits<Real>;
  return (std::bit_cast<Bits>(x) - std::bit_cast<Bits>(y)) >> (8 * sizeof(Bits) - 1);
}

template <typename Real>
inline Real sigmoid(Real x) {
  using Bits = FloatBits<Real>;
  constexpr Real limit = sizeof(Real) == 4 ? Real(87) : Real(708);
  const Real s = Real(1) / (Real(1) + fast_exp(-x));
  // x < −limit ⟺ x negative and |x| > limit.
  const Bits negative = std::bit_cast<Bits>(x) >> (8 * sizeof(Bits) - 1);
  return select_bits<Real>(negative & less_mask_nonnegative(limit, std::fabs(x)), Real(0), s);
}
template <typename Real>
inline Real silu(Real x) {
  return x * sigmoid(x);
}
// tanh: (1 − e)/(1 + e) with e = e^{−2|x|}, and its odd Taylor series below |x| = 0.0625, where
// 1 − e would cancel (series truncation error < 1e-12 relative there). Exact limits ±1.
template <typename Real>
inline Real tanh_fast(Real x) {
  const Real a = std::fabs(x);
  const Real e = fast_exp(Real(-2) * a);
  const Real big = (Real(1) - e) / (Real(1) + e);
  const Real x2 = x * x;
  const Real small = a * (Real(1) + x2 * (Real(-1) / 3 + x2 * (Real(2) / 15 + x2 * (Real(-17) / 315 +
                                                                  x2 * (Real(62) / 2835)))));
  const Real t = select_bits<Real>(less_mask_nonnegative(a, Real(0.0625)), small, big);
  return std::copysign(t, x);
}
// log(1 + e^x), linear above PyTorch's threshold 20.
template <typename Real>
inline Real softplus(Real x) {
  return x > Real(20) ? x : std::log1p(std::exp(x));
}

}  // namespace dm
