// The GluActivation overloads of the CUDA GLU ops (C++20: ffn.h / config.h cannot be included by
// nvcc's C++17 translation units, so the kernels take the plain GluKernelParams).
#include "ops/cpu/ffn.h"
#include "ops/cuda/elementwise.h"

namespace dm::cuda {
GluKernelParams glu_kernel_params(const GluActivation& a) {
  GluKernelParams p;
  p.situ = a.kind == Activation::SiTU;
  p.beta1 = a.beta1;
  p.beta2 = a.beta2;
  return p;
}

void glu_forward(const float* g, const float* u, float* h, int64_t n, const GluActivation& a,
                 Stream stream) {
  glu_forward(g, u, h, n, glu_kernel_params(a), stream);
}
void glu_forward(const uint16_t* g, const uint16_t* u, uint16_t* h, int64_t n,
                 const GluActivation& a, Stream stream, GluRows rows) {
  glu_forward(g, u, h, n, glu_kernel_params(a), stream, rows);
}
void glu_backward(const float* g, const float* u, const float* dh, float* dg, float* du,
                  int64_t n, const GluActivation& a, Stream stream) {
  glu_backward(g, u, dh, dg, du, n, glu_kernel_params(a), stream);
}
void glu_backward(const uint16_t* g, const uint16_t* u, const uint16_t* dh, uint16_t* dg,
                  uint16_t* du, int64_t n, const GluActivation& a, Stream stream, GluRows rows) {
  glu_backward(g, u, dh, dg, du, n, glu_kernel_params(a), stream, rows);
}

}  // namespace dm::cuda
