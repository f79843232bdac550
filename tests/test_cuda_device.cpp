// CUDA backend basics: arena views, host bf16 rounding, round trips through device memory.
// Without a GPU (CI) the device tests skip; the bf16 rounding test runs everywhere it is built.
#include <gtest/gtest.h>

#if DELTAMOE_HAVE_CUDA
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/cuda/device.h"

namespace {

TEST(CudaDevice, Bf16RoundsToNearestEven) {
  using dm::cuda::bf16_to_float;
  using dm::cuda::float_to_bf16;
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 0x1.8p-8f)), 1.0f + 0x1p-7f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(INFINITY))));
}

TEST(CudaDevice, ArenaViewsRoundTrip) {
  if (!dm::cuda::device_available()) GTEST_SKIP() << dm::cuda::device_description();
  dm::cuda::DeviceArena arena(1 << 20);
  float* a = arena.alloc<float>(1000);
  float* b = arena.alloc<float>(3);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 256, 0u);
  std::vector<float> h(1000), back(1000);
  for (int i = 0; i < 1000; ++i) h[size_t(i)] = float(i) * 0.5f;
  dm::cuda::copy_to_device(a, h.data(), h.size() * 4);
  dm::cuda::copy_to_host(back.data(), a, h.size() * 4);
  EXPECT_EQ(h, back);
  EXPECT_THROW(arena.alloc<float>(1 << 20), dm::Error);
}

}  // namespace
#else
TEST(CudaDevice, NotBuilt) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif
