#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "core/gemm.h"
#include "io/safetensors.h"

namespace dm {

bool is_muon_matrix(const ParamEntry& e) {
  if (e.shape.ndim != 2 || !e.trainable) return false;
  const std::string& n = e.name;
  for (const char* skip : {"embed_tokens", "lm_head", "conv1d", "gate.weight", "res_proj"})
    if (n.find(skip) != std::string::npos) return false;
  return true;
}

// Rows per head for the per-head Newton–Schulz of Q/K/V blocks (0 = whole matrix).
int64_t muon_head_rows(const ParamEntry& e, const ModelConfig& c) {
  const std::string& n = e.name;
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("self_attn.q_proj") || has("self_attn.k_proj") || has("self_attn.v_proj")) {
    if (e.shape[0] == int64_t(c.kda.num_heads) * c.kda.head_dim && c.kda.num_heads > 0)
      return c.kda.head_dim;
    return c.mla.qk_nope_dim + c.mla.qk_rope_dim;  // MLA q_proj
  }
  if (has("self_attn.q_b_proj")) return c.mla.qk_nope_dim + c.mla.qk_rope_dim;
  if (has("self_attn.kv_b_proj")) return c.mla.qk_nope_dim + c.mla.v_head_dim;
  return 0;
}

namespace {

// X ← NS5(X): quintic Newton–Schulz iteration towards the nearest semi-orthogonal matrix.
// X [r, c] row-major with r ≤ c (callers transpose otherwise). scratch: 2·r² + r·c floats.
void newton_schulz(float* X, int64_t r, int64_t c, int steps, float* scratch) {
  const float a = 3.4445f, b = -4.7750f, cc = 2.0315f;
  double nrm = 0;
  for (int64_t i = 0; i < r * c; ++i) nrm += double(X[i]) * X[i];
  const float inv = float(1.0 / (std::sqrt(nrm) + 1e-7));
  for (int64_t i = 0; i < r * c; ++i) X[i] *= inv;
  float* A = scratch;          // [r, r]
  float* B = A + r * r;        // [r, r]
  float* Y = B + r * r;        // [r, c]
  for (int s = 0; s < steps; ++s) {
    gemm(false, true, r, r, c, 1.0f, X, c, X, c, 0.0f, A, r);        // A = X Xᵀ
    gemm(false, false, r, r, r, cc, A, r, A, r, 0.0f, B, r);         // B = c·A²
    for (int64_t i = 0; i < r * r; ++i) B[i] += b * A[i];            //   + b·A
    std::memcpy(Y, X, size_t(r * c) * sizeof(float));
    gemm(false, false, r, c, r, 1.0f, B, r, X, c, a, Y, c);          // Y = a·X + B X
    std::memcpy(X, Y, size_t(r * c) * sizeof(float));
  }
}

}  // namespace

Optimizer::Optimizer(const ModelConfig& cfg, const OptimizerConfig& oc) : oc_(oc) {
  m_ = weights_allocate<float>(cfg);
  v_ = weights_allocate<float>(cfg);
  int64_t need = 0;
  for (const ParamEntry& e : m_->params)
    if (oc_.kind == OptimizerKind::Muon && is_muon_matrix(e)) {
      const int64_t hr = muon_head_rows(e, cfg);
      const int64_t r0 = hr > 0 ? hr : e.shape[0], c0 = e.shape[1];
      const int64_t r = std::min(r0, c0), c = std::max(r0, c0);
      need = std::max(need, 2 * r * r + 2 * r * c);
    }
  ns_scratch_.assign(size_t(need), 0.0f);
  cfg_ = cfg;
}

void Optimizer::adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr,
                             bool decay) {
  const float b1 = oc_.beta1, b2 = oc_.beta2;
  const float c1 = 1.0f - float(std::pow(double(b1), double(step_)));
  const float c2 = 1.0f - float(std::pow(double(b2), double(step_)));
  const float wd = decay ? lr * oc_.weight_decay : 0.0f, eps = oc_.eps;
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    const float mh = m[i] / c1, vh = v[i] / c2;
    p[i] -= lr * mh / (std::sqrt(vh) + eps) + wd * p[i];
  }
}

void Optimizer::muon_update(float* p, const float* g, float* m, int64_t rows, int64_t cols,
                            int64_t head_rows, float lr, bool decay) {
  const float mu = oc_.muon_momentum;
  const int64_t n = rows * cols;
  for (int64_t i = 0; i < n; ++i) m[i] = mu * m[i] + g[i];
  const int64_t hr = head_rows > 0 && rows % head_rows == 0 ? head_rows : rows;
  float* X = ns_scratch_.data();
  float* rest = X + hr * cols;
  for (int64_t h0 = 0; h0 < rows; h0 += hr) {
    // Nesterov-style look-ahead: orthogonalise g + μ·m.
    const bool transpose = hr > cols;
    const int64_t r = transpose ? cols : hr, c = transpose ? hr : cols;
    for (int64_t i = 0; i < hr; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const float u = g[(h0 + i) * cols + j] + mu * m[(h0 + i) * cols + j];
        if (transpose) X[j * hr + i] = u;
        else X[i * cols + j] = u;
      }
    newton_schulz(X, r, c, oc_.muon_ns_steps, rest);
    // Match AdamW's update RMS (≈0.2) so the same LR works for both (Moonlight's rule).
    const float scale = 0.2f * std::sqrt(float(std::max(hr, cols)));
    const float wd = decay ? lr * oc_.weight_decay : 0.0f;
    for (int64_t i = 0; i < hr; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        float& w = p[(h0 + i) * cols + j];
        const float o = transpose ? X[j * hr + i] : X[i * cols + j];
        w -= lr * scale * o + wd * w;
      }
  }
}

void Optimizer::step(ModelWeights& w, const ModelWeights& grad, float lr) {
  ++step_;
  for (size_t i = 0; i < w.params.size(); ++i) {
    ParamEntry& e = w.params[i];
    if (!e.trainable) continue;
    const float* g = grad.params[i].data;
    float* m = m_->params[i].data;
    float* v = v_->params[i].data;
    if (oc_.kind == OptimizerKind::Muon && is_muon_matrix(e))
      muon_update(e.data, g, m, e.shape[0], e.shape[1], muon_head_rows(e, cfg_), lr, e.decay);
    else
      adamw_update(e.data, g, m, v, e.numel(), lr, e.decay);
  }
}

size_t Optimizer::state_bytes() const { return m_->arena.capacity() + v_->arena.capacity(); }

void Optimizer::save(const std::string& path) const {
  SafetensorsWriter wr;
  for (size_t i = 0; i < m_->params.size(); ++i) {
    wr.add_f32("m." + m_->params[i].name, m_->params[i].data, m_->params[i].shape);
    wr.add_f32("v." + v_->params[i].name, v_->params[i].data, v_->params[i].shape);
  }
  wr.set_metadata("step", std::to_string(step_));
  wr.set_metadata("kind", oc_.kind == OptimizerKind::Muon ? "muon" : "adamw");
  wr.write(path);
}

void Optimizer::load(const std::string& path) {
  const SafetensorsReader r = SafetensorsReader::open(path);
  for (size_t i = 0; i < m_->params.size(); ++i) {
    for (auto* buf : {m_.get(), v_.get()}) {
      const ParamEntry& e = buf->params[i];
      const std::string name = (buf == m_.get() ? "m." : "v.") + e.name;
      const Tensor& t = r.get_checked(name, e.shape);
      DM_CHECK(t.dtype == DType::F32, path, ": tensor '", name, "' must be F32");
      std::memcpy(e.data, t.data, size_t(e.numel()) * sizeof(float));
    }
  }
  const auto& md = r.metadata();
  DM_CHECK(md.count("step"), path, ": missing metadata 'step'");
  step_ = std::stoll(md.at("step"));
}

// Σ g² in fixed blocks of elements, each summed in order, then the blocks in order: the same bits
// for any thread count (OpenMP's reduction clause adds the threads' partials in whatever order
// they finish, so a run resumed on a many-core machine could clip differently in the last bit).
double grad_global_norm(const ModelWeights& grad) {
  constexpr int64_t kBlock = 16384;
  std::vector<double> partial;
  double s = 0;
  for (const ParamEntry& e : grad.params) {
    const float* g = e.data;
    const int64_t n = e.numel(), blocks = (n + kBlock - 1) / kBlock;
    partial.assign(size_t(blocks), 0.0);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t b = 0; b < blocks; ++b) {
      double local = 0;
      for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
        local += double(g[i]) * g[i];
      partial[size_t(b)] = local;
    }
    for (const double p : partial) s += p;
  }
  return std::sqrt(s);
}

void grad_scale(ModelWeights& grad, float s) {
  float* g = grad.params.front().data;
  const int64_t n = int64_t(grad.arena.used() / sizeof(float));
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) g[i] *= s;
}

void grad_zero(ModelWeights& grad) {
  std::memset(grad.params.front().data, 0, grad.arena.used());
}

float lr_schedule(int64_t step, int64_t warmup, int64_t total, float peak, float min_ratio) {
  if (warmup > 0 && step < warmup) return peak * float(step + 1) / float(warmup);
  const double span = double(std::max<int64_t>(1, total - warmup));
  const double t = std::clamp(double(step - warmup) / span, 0.0, 1.0);
  const double cosv = 0.5 * (1.0 + std::cos(M_PI * t));
  return float(peak * (min_ratio + (1.0 - min_ratio) * cosv));
}

}  // namespace dm
