// Whole-model properties that need no reference file: AttnRes with zero pseudo-queries equals the
// plain pre-norm network, the residual walk fused (add + norm in one op) equals the plain walk,
// init → save → load round trips, and malformed checkpoints / inputs are
// rejected with exit code 1 and a line naming the culprit (never a crash).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/residual.h"
#include "test_util.h"

using namespace dm;
namespace fs = std::filesystem;

namespace {

std::vector<float> run_logits(Model& m, const std::vector<int64_t>& ids, int64_t B) {
  const int64_t T = int64_t(ids.size()) / B;
  std::vector<float> logits(size_t(B * T * m.config().vocab_size));
  m.forward(ids.data(), B, T, logits.data());
  return logits;
}

std::vector<int64_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  uint64_t s = seed;
  for (auto& t : ids) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    t = int64_t((s >> 33) % uint64_t(vocab));
  }
  return ids;
}

}  // namespace

TEST(Model, AttnResWithZeroQueriesEqualsPlainResidual) {
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  ASSERT_EQ(c.residual, ResidualKind::AttnRes);
  c.rms_eps = 1e-12f;  // the two networks differ only through eps (sources are averaged, not summed)
  auto wa = weights_allocate(c);
  weights_init(*wa, 3);
  ModelConfig cp = c;
  cp.residual = ResidualKind::Plain;
  auto wp = weights_allocate(cp);
  int copied = 0;
  for (const ParamEntry& e : wp->params) {
    const ParamEntry* src = wa->find(e.name);
    ASSERT_NE(src, nullptr) << e.name;
    std::copy(src->data, src->data + e.numel(), e.data);
    ++copied;
  }
  EXPECT_EQ(copied + 4 * c.num_layers + 2, int(wa->params.size()));  // 2 sites × (query, norm) + output site
  Model attnres(std::move(wa)), plain(std::move(wp));
  const auto ids = random_ids(2 * 37, c.vocab_size, 5);
  const auto la = run_logits(attnres, ids, 2), lp = run_logits(plain, ids, 2);
  EXPECT_LE(test::rel_rms(la.data(), lp.data(), la.size()), 1e-5);
  // Non-zero queries change the network (the test can fail).
  Model attnres2(weights_allocate(c));
  for (size_t i = 0; i < attnres.weights().params.size(); ++i) {
    const ParamEntry& s = attnres.weights().params[i];
    std::copy(s.data, s.data + s.numel(), attnres2.weights().params[i].data);
  }
  attnres2.weights().layers[2].attn_site.query[0] = 5.0f;
  const auto l2 = run_logits(attnres2, ids, 2);
  EXPECT_GT(test::rel_rms(l2.data(), lp.data(), l2.size()), 1e-4);
}

namespace {

// CpuResidualOps plus the optional fused add + norm (as the GPU ops have it), counting calls.
struct FusedCountingOps : CpuResidualOps<float> {
  mutable int fused = 0, norms = 0;
  void rmsnorm(const float* x, const float* w, float* y, int64_t N, int64_t d, float eps) const {
    ++norms;
    CpuResidualOps<float>::rmsnorm(x, w, y, N, d, eps);
  }
  void add_rmsnorm(float* p, const float* out, const float* w, float* xn, int64_t N, int64_t d,
                   float eps) const {
    ++fused;
    add(p, out, N * d);
    CpuResidualOps<float>::rmsnorm(p, w, xn, N, d, eps);
  }
};

struct WalkRecord {
  std::vector<std::string> names;
  std::vector<std::vector<float>> rows;
  std::vector<float> final_hidden;
};

// The residual walk over fake sub-layers (out = a smooth function of the normed rows and the
// layer) with `ops`; every emitted intermediate recorded.
template <typename Ops>
WalkRecord walk(const ModelConfig& c, const ModelWeights& W, const Ops& ops) {
  const int64_t N = 5, d = c.hidden;
  std::vector<float> p(size_t(N * d)), x(p.size()), xn(p.size()), out(p.size());
  std::vector<float> blocks(p.size() * size_t(std::max(1, residual_num_blocks(c))));
  for (size_t k = 0; k < p.size(); ++k) p[k] = std::sin(0.37f * float(k) + 0.1f);
  auto sub_layer = [&](int i, const float* in, float* o, float scale) {
    for (int64_t k = 0; k < N * d; ++k)
      o[k] = 0.5f * std::tanh(scale * float(i + 1) * in[k] + 0.01f * float(k % 7));
  };
  auto mixer = [&](int i, const float* in, float* o) { sub_layer(i, in, o, 0.8f); };
  auto ffn = [&](int i, const float* in, float* o) { sub_layer(i, in, o, -1.3f); };
  WalkRecord r;
  auto emit = [&](const char* name, int i, const float* rows) {
    r.names.push_back(std::string(name) + std::to_string(i));
    r.rows.emplace_back(rows, rows + N * d);
  };
  const float* final_hidden = residual_stack_forward<float>(
      c, W, N, p.data(), x.data(), xn.data(), out.data(), blocks.data(), mixer, ffn, emit, ops);
  r.final_hidden.assign(final_hidden, final_hidden + N * d);
  return r;
}

}  // namespace

// Ops with add_rmsnorm (the GPU's) take the fused walk without AttnRes: the same emitted
// intermediates and final rows bit for bit, one plain norm (layer 0's input) and one fused
// add + norm per sub-layer; with AttnRes the fused op is never used.
TEST(Model, FusedAddNormWalkEqualsPlainWalk) {
  for (ResidualKind kind : {ResidualKind::Plain, ResidualKind::AttnRes}) {
    SCOPED_TRACE(kind == ResidualKind::Plain ? "plain" : "attnres");
    ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
    c.residual = kind;
    auto w = weights_allocate(c);
    weights_init(*w, 11);
    const WalkRecord plain = walk(c, *w, CpuResidualOps<float>{});
    FusedCountingOps ops;
    const WalkRecord fused = walk(c, *w, ops);
    EXPECT_EQ(plain.names, fused.names);
    ASSERT_EQ(plain.rows.size(), fused.rows.size());
    for (size_t k = 0; k < plain.rows.size(); ++k)
      EXPECT_EQ(plain.rows[k], fused.rows[k]) << plain.names[k];
    EXPECT_EQ(plain.final_hidden, fused.final_hidden);
    if (kind == ResidualKind::Plain) {
      EXPECT_EQ(ops.fused, 2 * c.num_layers);
      EXPECT_EQ(ops.norms, 1);
    } else {
      EXPECT_EQ(ops.fused, 0);
      EXPECT_EQ(ops.norms, 2 * c.num_layers + 1);
    }
  }
}

TEST(Model, InitSaveLoadRoundTrip) {
  const std::string dir = test::temp_dir("init");
  const auto r = test::run_cli("init --config " + test::source_dir() + "/configs/test.json --out " +
                               dir + "/m --seed 7");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto m = Model::load(dir + "/m");
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  auto w = weights_allocate(c);
  weights_init(*w, 7);
  Model fresh(std::move(w));
  const auto ids = random_ids(50, c.vocab_size, 1);
  const auto a = run_logits(*m, ids, 1), b = run_logits(fresh, ids, 1);
  EXPECT_EQ(a, b);  // bitwise: f32 written and read back
  // Init rules: zero pseudo-queries and routing bias, A_log in [0, log 16], dt in [1e-3, 0.1].
  const ModelWeights& W = m->weights();
  for (const ParamEntry& e : W.params) {
    if (e.name.find("res_proj") != std::string::npos || e.name.find("e_score_correction_bias") != std::string::npos)
      for (int64_t i = 0; i < e.numel(); ++i) ASSERT_EQ(e.data[i], 0.0f) << e.name;
    if (e.name.find("A_log") != std::string::npos)
      for (int64_t i = 0; i < e.numel(); ++i) ASSERT_TRUE(e.data[i] >= 0 && e.data[i] <= std::log(16.0f)) << e.name;
    if (e.name.find("dt_bias") != std::string::npos)
      for (int64_t i = 0; i < e.numel(); ++i) {
        const double dt = std::log1p(std::exp(double(e.data[i])));
        ASSERT_TRUE(dt > 0.99e-3 && dt < 0.101) << e.name << " dt=" << dt;
      }
  }
}

// weights_init draws each 2^20-value chunk of a parameter from its own generator: the values are
// the same with one thread or many, the element-wise init gives the small parameters exactly
// those values (and no matrix), and the matrices have the SPEC σ.
TEST(Model, InitIsThreadCountFreeAndMatchesTheElementwiseInit) {
  ModelConfig c = load_config(test::source_dir() + "/configs/test.json");
  c.vocab_size = 40000;  // an embedding of several chunks (40000 × 64 values)
  auto many = weights_allocate(c), one = weights_allocate(c), small = weights_allocate(c);
  weights_init(*many, 13);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  weights_init(*one, 13);
  omp_set_num_threads(std::max(2, threads));
  weights_init_elementwise(*small, 13);
  for (size_t j = 0; j < many->params.size(); ++j) {
    const ParamEntry &a = many->params[j], &b = one->params[j], &e = small->params[j];
    ASSERT_TRUE(std::equal(a.data, a.data + a.numel(), b.data)) << a.name;
    if (!param_init_is_matrix(a.init)) {
      ASSERT_TRUE(std::equal(a.data, a.data + a.numel(), e.data)) << a.name;
      continue;
    }
    ASSERT_TRUE(std::all_of(e.data, e.data + e.numel(), [](float x) { return x == 0.0f; }))
        << a.name << ": the element-wise init wrote a matrix";
    double sum_squares = 0;
    for (int64_t i = 0; i < a.numel(); ++i) sum_squares += double(a.data[i]) * a.data[i];
    const double sigma = param_init_std(c, a.init, a.shape), got = std::sqrt(sum_squares / a.numel());
    EXPECT_NEAR(got, sigma, sigma * (0.02 + 5.0 / std::sqrt(double(a.numel())))) << a.name;
  }
  // Chunks of one parameter are different streams, not one stream restarted.
  const ParamEntry& embed = *std::find_if(many->params.begin(), many->params.end(),
                                          [](const ParamEntry& e) { return e.name.find("embed_tokens") != std::string::npos; });
  ASSERT_GT(embed.numel(), int64_t(2) << 20) << embed.name;
  EXPECT_FALSE(std::equal(embed.data, embed.data + 64, embed.data + (int64_t(1) << 20)));
}

TEST(Model, KimiCheckpointResavedInK3NamesGivesSameLogits) {
  if (!test::goldens_available()) GTEST_SKIP();
  auto m = Model::load(test::goldens_dir() + "/kimi_linear_tiny");
  const std::string dir = test::temp_dir("resave") + "/m";
  weights_save(m->weights(), dir);
  auto m2 = Model::load(dir);
  EXPECT_EQ(m2->config().naming, WeightNaming::K3);
  const auto ids = random_ids(40, 512, 9);
  EXPECT_EQ(run_logits(*m, ids, 1), run_logits(*m2, ids, 1));
}

// ---- malformed checkpoints and inputs through the CLI ----

namespace {

// Copies the golden Kimi-Linear checkpoint with `edit` applied to its tensors.
std::string corrupted_copy(const std::string& tag,
                           const std::function<void(SafetensorsWriter&, const SafetensorsReader&,
                                                    const std::string&)>& edit) {
  const std::string src = test::goldens_dir() + "/kimi_linear_tiny";
  const std::string dir = test::temp_dir(tag);
  fs::copy_file(src + "/config.json", dir + "/config.json");
  const SafetensorsReader r = SafetensorsReader::open(src);
  SafetensorsWriter w;
  for (const std::string& n : r.names()) edit(w, r, n);
  w.write(dir + "/model.safetensors");
  return dir;
}

std::string ids_file(const std::vector<int64_t>& ids) {
  static std::vector<int64_t> keep;
  keep = ids;
  const std::string path = test::temp_dir("ids") + "/ids.safetensors";
  SafetensorsWriter w;
  w.add("input_ids", Tensor{keep.data(), DType::I64, {1, int64_t(keep.size())}});
  w.write(path);
  return path;
}

void expect_clean_failure(const std::string& args, const std::string& needle) {
  const auto r = test::run_cli(args);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

}  // namespace

TEST(ModelErrors, MalformedCheckpointsExitOneNamingTheTensor) {
  if (!test::goldens_available()) GTEST_SKIP();
  const std::string ids = ids_file({1, 2, 3});
  const std::string out = test::temp_dir("out") + "/o.safetensors";
  const std::string victim = "model.layers.1.self_attn.q_proj.weight";
  // Missing tensor.
  std::string d = corrupted_copy("missing", [&](SafetensorsWriter& w, const SafetensorsReader& r, const std::string& n) {
    if (n != victim) w.add(n, r.get(n));
  });
  expect_clean_failure("forward --model " + d + " --input " + ids + " --output " + out, victim);
  // Wrong shape.
  static std::vector<float> small(64 * 64);
  d = corrupted_copy("shape", [&](SafetensorsWriter& w, const SafetensorsReader& r, const std::string& n) {
    if (n == victim) w.add_f32(n, small.data(), {64, 64});
    else w.add(n, r.get(n));
  });
  expect_clean_failure("forward --model " + d + " --input " + ids + " --output " + out, victim);
  // Wrong dtype.
  static std::vector<int64_t> ints(64 * 128);
  d = corrupted_copy("dtype", [&](SafetensorsWriter& w, const SafetensorsReader& r, const std::string& n) {
    if (n == victim) w.add(n, Tensor{ints.data(), DType::I64, {64, 128}});
    else w.add(n, r.get(n));
  });
  expect_clean_failure("forward --model " + d + " --input " + ids + " --output " + out, victim);
  // Unexpected extra tensor.
  static std::vector<float> extra(4);
  d = corrupted_copy("extra", [&](SafetensorsWriter& w, const SafetensorsReader& r, const std::string& n) {
    w.add(n, r.get(n));
    if (n == victim) w.add_f32("model.layers.1.self_attn.surprise", extra.data(), {4});
  });
  expect_clean_failure("forward --model " + d + " --input " + ids + " --output " + out, "surprise");
  // Truncated file.
  const std::string t = test::temp_dir("trunc");
  fs::copy_file(test::goldens_dir() + "/kimi_linear_tiny/config.json", t + "/config.json");
  fs::copy_file(test::goldens_dir() + "/kimi_linear_tiny/model.safetensors", t + "/model.safetensors");
  fs::resize_file(t + "/model.safetensors", fs::file_size(t + "/model.safetensors") / 2);
  expect_clean_failure("forward --model " + t + " --input " + ids + " --output " + out, "model.safetensors");
  // Config with an unknown field.
  std::ifstream cin(test::goldens_dir() + "/kimi_linear_tiny/config.json");
  std::string cfg((std::istreambuf_iterator<char>(cin)), std::istreambuf_iterator<char>());
  cfg.insert(cfg.find('{') + 1, "\"bogus_field\": 3,");
  std::ofstream(t + "/config.json") << cfg;
  expect_clean_failure("forward --model " + t + " --input " + ids + " --output " + out, "bogus_field");
}

TEST(ModelErrors, BadInputIdsExitOne) {
  if (!test::goldens_available()) GTEST_SKIP();
  const std::string model = test::goldens_dir() + "/kimi_linear_tiny";
  const std::string out = test::temp_dir("out") + "/o.safetensors";
  expect_clean_failure("forward --model " + model + " --input " + ids_file({1, 600, 3}) + " --output " + out, "600");
  expect_clean_failure("forward --model " + model + " --input " + ids_file({-4}) + " --output " + out, "-4");
  // Wrong dtype of input_ids.
  static std::vector<float> f = {1, 2};
  const std::string p = test::temp_dir("ids") + "/f.safetensors";
  SafetensorsWriter w;
  w.add_f32("input_ids", f.data(), {1, 2});
  w.write(p);
  expect_clean_failure("forward --model " + model + " --input " + p + " --output " + out, "input_ids");
}

TEST(ModelErrors, ForwardCliMatchesGolden) {
  if (!test::goldens_available()) GTEST_SKIP();
  const std::string dir = test::goldens_dir() + "/deepseek_v3_tiny";
  const std::string out = test::temp_dir("fwd") + "/o.safetensors";
  const auto r = test::run_cli("forward --model " + dir + " --input " + dir + "/golden.safetensors --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto o = SafetensorsReader::open(out);
  const auto g = SafetensorsReader::open(dir + "/golden.safetensors");
  for (const char* n : {"logits", "hidden_0", "hidden_1", "hidden_2", "hidden_3"}) {
    const auto a = test::to_f32(o.get(n)), b = test::to_f32(g.get(n));
    ASSERT_EQ(a.size(), b.size()) << n;
    EXPECT_LE(test::rel_rms(a.data(), b.data(), a.size()), 1e-4) << n;
  }
}
