#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <type_traits>
#include <sys/mman.h>
#include <unistd.h>
#include <cstdlib>

#include "core/error.h"
#include "io/safetensors.h"

namespace dm {
namespace fs = std::filesystem;

namespace {

// Checkpoint tensor names of one model family (SPEC §4: released names load without conversion).
struct NameTable {
  std::string model;       // "model." or "language_model.model."
  std::string lm_head;     // "lm_head.weight"
  std::string dense;       // module of dense FFN layers: "mlp." / "block_sparse_moe."
  std::string moe;         // module of MoE layers: "mlp." / "block_sparse_moe."
  std::string e_gate, e_up, e_down;  // expert projection names
  int64_t a_log_pad_to = 0;          // K3 stores A_log zero-padded to a multiple of 128
  bool a_log_4d = false;             // Kimi-Linear stores A_log as [1,1,H,1]
};

NameTable name_table(WeightNaming n) {
  switch (n) {
    case WeightNaming::KimiLinear:
      return {"model.", "lm_head.weight", "block_sparse_moe.", "block_sparse_moe.", "w1", "w3",
              "w2", 0, true};
    case WeightNaming::DeepseekV3:
      return {"model.", "lm_head.weight", "mlp.", "mlp.", "gate_proj", "up_proj", "down_proj", 0,
              false};
    case WeightNaming::K3:
      return {"language_model.model.", "language_model.lm_head.weight", "mlp.",
              "block_sparse_moe.", "w1", "w3", "w2", 128, false};
  }
  return {};
}

// Builds the table; with `arena == nullptr` only counts (data stays null), unless `raw` is given:
// then views are placed at raw + the same offsets an Arena would give (ReservedWeights).
template <typename Real>
class TableBuilder {
 public:
  TableBuilder(ModelWeightsT<Real>& w, Arena* arena, uint8_t* raw = nullptr)
      : w_(w), arena_(arena), raw_(raw) {}
  Real* add(const std::string& name, Shape shape, ParamInit init, bool decay = true,
             Shape file_shape = {}, int64_t file_pad = 0) {
    ParamEntryT<Real> e;
    e.name = name;
    e.shape = shape;
    e.file_shape = file_shape.ndim ? file_shape : shape;
    e.file_pad = file_pad;
    e.init = init;
    e.decay = decay;
    const size_t at = bytes_;
    bytes_ += Arena::round_up(size_t(shape.numel()) * sizeof(Real));
    if (arena_) e.data = arena_->alloc<Real>(size_t(shape.numel()));
    else if (raw_) e.data = reinterpret_cast<Real*>(raw_ + at);
    w_.params.push_back(e);
    return e.data;
  }
  // One contiguous block of `count` slices of `slice` shape (stacked experts), each slice its
  // own entry (checkpoint tensor) viewing part of the block. Returns the block.
  Real* add_stacked(const std::vector<std::string>& names, Shape slice, ParamInit init) {
    const int64_t n = slice.numel();
    Real* block = nullptr;
    const size_t at = bytes_;
    bytes_ += Arena::round_up(size_t(n) * names.size() * sizeof(Real));
    if (arena_) block = arena_->alloc<Real>(size_t(n) * names.size());
    else if (raw_) block = reinterpret_cast<Real*>(raw_ + at);
    for (size_t j = 0; j < names.size(); ++j) {
      ParamEntryT<Real> e;
      e.name = names[j];
      e.shape = e.file_shape = slice;
      e.init = init;
      e.data = block ? block + j * n : nullptr;
      w_.params.push_back(e);
    }
    return block;
  }
  size_t bytes() const { return bytes_; }

 private:
  ModelWeightsT<Real>& w_;
  Arena* arena_;
  uint8_t* raw_ = nullptr;
  size_t bytes_ = 0;
};

template <typename Real>
size_t build_table(ModelWeightsT<Real>& w, Arena* arena, uint8_t* raw = nullptr) {
  const ModelConfig& c = w.cfg;
  const NameTable nt = name_table(c.naming);
  const int64_t d = c.hidden, V = c.vocab_size;
  TableBuilder<Real> tb(w, arena, raw);
  w.params.clear();
  w.layers.assign(c.num_layers, LayerWeightsT<Real>{});
  const std::string m = nt.model;
  w.embed = tb.add(m + "embed_tokens.weight", {V, d}, ParamInit::Normal);
  for (int i = 0; i < c.num_layers; ++i) {
    LayerWeightsT<Real>& L = w.layers[i];
    const std::string p = m + "layers." + std::to_string(i) + ".";
    L.input_norm = tb.add(p + "input_layernorm.weight", {d}, ParamInit::Ones, false);
    L.post_norm = tb.add(p + "post_attention_layernorm.weight", {d}, ParamInit::Ones, false);
    if (c.residual == ResidualKind::AttnRes) {
      L.attn_site.query = tb.add(p + "self_attention_res_proj.weight", {d}, ParamInit::Zeros, false,
                                 {1, d});
      L.attn_site.norm = tb.add(p + "self_attention_res_norm.weight", {d}, ParamInit::Ones, false);
      L.ffn_site.query = tb.add(p + "mlp_res_proj.weight", {d}, ParamInit::Zeros, false, {1, d});
      L.ffn_site.norm = tb.add(p + "mlp_res_norm.weight", {d}, ParamInit::Ones, false);
    }
    const std::string a = p + "self_attn.";
    if (c.mixers[i] == MixerKind::KDA) {
      const int64_t H = c.kda.num_heads, K = c.kda.head_dim, HK = H * K, Kc = c.kda.conv_kernel;
      KdaWeightsT<Real>& k = L.kda;
      // q, k, v, then (full-rank gate) g, β and f_a: six [·, d] matrices one after another, so
      // the GPU backward's input gradient is one product over their stacked rows
      // (kda_gpu_backward.cpp) and their gradients one product into adjacent slots.
      k.q_proj = tb.add(a + "q_proj.weight", {HK, d}, ParamInit::Normal);
      k.k_proj = tb.add(a + "k_proj.weight", {HK, d}, ParamInit::Normal);
      k.v_proj = tb.add(a + "v_proj.weight", {HK, d}, ParamInit::Normal);
      if (c.kda.full_rank_output_gate) {
        k.g_full = tb.add(a + "g_proj.weight", {HK, d}, ParamInit::Normal);
        k.b_proj = tb.add(a + "b_proj.weight", {H, d}, ParamInit::Normal);
        k.f_a = tb.add(a + "f_a_proj.weight", {K, d}, ParamInit::Normal);
      }
      k.q_conv = tb.add(a + "q_conv1d.weight", {HK, Kc}, ParamInit::ConvNormal, true, {HK, 1, Kc});
      k.k_conv = tb.add(a + "k_conv1d.weight", {HK, Kc}, ParamInit::ConvNormal, true, {HK, 1, Kc});
      k.v_conv = tb.add(a + "v_conv1d.weight", {HK, Kc}, ParamInit::ConvNormal, true, {HK, 1, Kc});
      const int64_t pad = nt.a_log_pad_to ? (H + nt.a_log_pad_to - 1) / nt.a_log_pad_to * nt.a_log_pad_to - H : 0;
      k.A_log = tb.add(a + "A_log", {H}, ParamInit::KdaALog, false,
                       nt.a_log_4d ? Shape{1, 1, H, 1} : Shape{H + pad}, pad);
      if (!c.kda.full_rank_output_gate)
        k.f_a = tb.add(a + "f_a_proj.weight", {K, d}, ParamInit::Normal);
      k.f_b = tb.add(a + "f_b_proj.weight", {HK, K}, ParamInit::Normal);
      k.dt_bias = tb.add(a + "dt_bias", {HK}, ParamInit::KdaDtBias, false);
      if (!c.kda.full_rank_output_gate) {
        k.b_proj = tb.add(a + "b_proj.weight", {H, d}, ParamInit::Normal);
        k.g_a = tb.add(a + "g_a_proj.weight", {K, d}, ParamInit::Normal);
        k.g_b = tb.add(a + "g_b_proj.weight", {HK, K}, ParamInit::Normal);
      }
      k.o_norm = tb.add(a + "o_norm.weight", {K}, ParamInit::Ones, false);
      k.o_proj = tb.add(a + "o_proj.weight", {d, HK}, ParamInit::NormalOut);
    } else {
      const MlaConfig& ml = c.mla;
      const int64_t H = ml.num_heads, dq = ml.qk_nope_dim + ml.qk_rope_dim;
      MlaWeightsT<Real>& q = L.mla;
      if (ml.q_lora_rank > 0) {
        q.q_a = tb.add(a + "q_a_proj.weight", {ml.q_lora_rank, d}, ParamInit::Normal);
        q.q_a_norm = tb.add(a + "q_a_layernorm.weight", {ml.q_lora_rank}, ParamInit::Ones, false);
        q.q_b = tb.add(a + "q_b_proj.weight", {H * dq, ml.q_lora_rank}, ParamInit::Normal);
      } else {
        q.q_proj = tb.add(a + "q_proj.weight", {H * dq, d}, ParamInit::Normal);
      }
      q.kv_a = tb.add(a + "kv_a_proj_with_mqa.weight", {ml.kv_lora_rank + ml.qk_rope_dim, d},
                      ParamInit::Normal);
      q.kv_a_norm = tb.add(a + "kv_a_layernorm.weight", {ml.kv_lora_rank}, ParamInit::Ones, false);
      q.kv_b = tb.add(a + "kv_b_proj.weight", {H * (ml.qk_nope_dim + ml.v_head_dim), ml.kv_lora_rank},
                      ParamInit::Normal);
      if (ml.output_gate) q.gate = tb.add(a + "g_proj.weight", {H * ml.v_head_dim, d}, ParamInit::Normal);
      q.o_proj = tb.add(a + "o_proj.weight", {d, H * ml.v_head_dim}, ParamInit::NormalOut);
    }
    if (c.ffns[i] == FfnKind::Dense) {
      const std::string f = p + nt.dense;
      const int64_t F = c.dense_ffn;
      L.dense.gate = tb.add(f + "gate_proj.weight", {F, d}, ParamInit::Normal);
      L.dense.up = tb.add(f + "up_proj.weight", {F, d}, ParamInit::Normal);
      L.dense.down = tb.add(f + "down_proj.weight", {d, F}, ParamInit::NormalOut);
    } else {
      const MoeConfig& mo = c.moe;
      const std::string f = p + nt.moe;
      const int64_t E = mo.num_experts, F = mo.expert_ffn, l = mo.latent_dim ? mo.latent_dim : d;
      MoeWeightsT<Real>& e = L.moe;
      // The shared experts' gate and up, the latent down-projection and the router: four
      // [·, d] matrices in a row, so that the GPU backward's input gradient is one product over
      // their stacked rows (moe_gpu_backward.cpp one_dx_product).
      if (mo.num_shared > 0) {
        const int64_t Fs = int64_t(mo.num_shared) * mo.shared_ffn;
        e.shared.gate = tb.add(f + "shared_experts.gate_proj.weight", {Fs, d}, ParamInit::Normal);
        e.shared.up = tb.add(f + "shared_experts.up_proj.weight", {Fs, d}, ParamInit::Normal);
      }
      if (mo.latent_dim > 0)
        e.latent_down = tb.add(f + "routed_expert_down_proj.weight", {l, d}, ParamInit::Normal);
      e.router = tb.add(f + "gate.weight", {E, d}, ParamInit::Router);
      e.router_bias = tb.add(f + "gate.e_score_correction_bias", {E}, ParamInit::Zeros, false);
      w.params.back().trainable = false;
      // Experts are stacked [E, F, ℓ] in the arena; each checkpoint tensor views one slice.
      auto names = [&](const std::string& proj) {
        std::vector<std::string> v;
        for (int64_t j = 0; j < E; ++j)
          v.push_back(f + "experts." + std::to_string(j) + "." + proj + ".weight");
        return v;
      };
      e.expert_gate = tb.add_stacked(names(nt.e_gate), {F, l}, ParamInit::Normal);
      e.expert_up = tb.add_stacked(names(nt.e_up), {F, l}, ParamInit::Normal);
      e.expert_down = tb.add_stacked(names(nt.e_down), {l, F}, ParamInit::NormalOut);
      if (mo.num_shared > 0) {
        const int64_t Fs = int64_t(mo.num_shared) * mo.shared_ffn;
        e.shared.down = tb.add(f + "shared_experts.down_proj.weight", {d, Fs}, ParamInit::NormalOut);
      }
      if (mo.latent_dim > 0) {
        if (mo.latent_norm)
          e.latent_norm = tb.add(f + "routed_expert_norm.weight", {l}, ParamInit::Ones, false);
        e.latent_up = tb.add(f + "routed_expert_up_proj.weight", {d, l}, ParamInit::NormalOut);
      }
    }
  }
  w.final_norm = tb.add(m + "norm.weight", {d}, ParamInit::Ones, false);
  if (c.residual == ResidualKind::AttnRes) {
    w.output_site.query = tb.add(m + "output_attn_res_proj.weight", {d}, ParamInit::Zeros, false, {1, d});
    w.output_site.norm = tb.add(m + "output_attn_res_norm.weight", {d}, ParamInit::Ones, false);
  }
  w.lm_head = tb.add(nt.lm_head, {V, d}, ParamInit::Normal);
  return tb.bytes();
}

}  // namespace

template <typename Real>
std::unique_ptr<ModelWeightsT<Real>> weights_allocate(const ModelConfig& cfg) {
  auto w = std::make_unique<ModelWeightsT<Real>>();
  w->cfg = cfg;
  // Pass 1 counts bytes, pass 2 assigns views into one arena.
  w->arena.reserve(build_table(*w, nullptr), "weights");
  build_table(*w, &w->arena);
  return w;
}

}  // namespace dm

namespace dm {

namespace {
// Tensors a checkpoint may carry that this engine does not build (yet): multi-token-prediction
// layers past num_layers and the vision tower / projector of multimodal checkpoints.
bool ignorable_tensor(const std::string& name, const ModelConfig& cfg) {
  if (name.find("vision_tower.") != std::string::npos ||
      name.find("multi_modal_projector.") != std::string::npos || name.find("mm_projector.") != std::string::npos)
    return true;
  const auto p = name.find("layers.");
  if (p != std::string::npos) {
    const int idx = std::atoi(name.c_str() + p + 7);
    if (idx >= cfg.num_layers) return true;
  }
  return false;
}
}  // namespace

template <typename Real>
std::unique_ptr<ModelWeightsT<Real>> weights_load(const std::string& dir) {
  ModelConfig cfg = load_config(dir);
  auto w = weights_allocate<Real>(cfg);
  const SafetensorsReader r = SafetensorsReader::open(dir);
  std::set<std::string> used;
  std::vector<float> staging;
  for (ParamEntryT<Real>& e : w->params) {
    DM_CHECK(r.has(e.name), r.path(), ": missing tensor '", e.name, "' (required by config)");
    const Tensor& t = r.get(e.name);
    const std::string& file = r.file_of(e.name);
    DM_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16 ||
                 t.dtype == DType::F64,
             file, ": tensor '", e.name, "' has dtype ", dtype_name(t.dtype), ", expected a float type");
    // A_log is accepted in any stored form holding at least H values (K3 pads with zeros).
    const bool shape_ok = t.shape == e.file_shape ||
                          (e.file_pad > 0 && t.shape.ndim == 1 && t.shape[0] >= e.numel());
    DM_CHECK(shape_ok, file, ": tensor '", e.name, "' has shape ", t.shape.str(), ", expected ",
             e.file_shape.str());
    if constexpr (std::is_same_v<Real, float>) {
      convert_to_f32(t.data, t.dtype, e.data, size_t(e.numel()));
    } else if (t.dtype == DType::F64) {
      std::copy(t.as<double>(), t.as<double>() + e.numel(), e.data);
    } else {
      staging.resize(size_t(e.numel()));
      convert_to_f32(t.data, t.dtype, staging.data(), staging.size());
      std::copy(staging.begin(), staging.end(), e.data);
    }
    used.insert(e.name);
  }
  for (const std::string& n : r.names())
    DM_CHECK(used.count(n) || ignorable_tensor(n, cfg), r.file_of(n), ": unexpected tensor '", n,
             "' (not part of the model described by config.json)");
  return w;
}

float param_init_std(const ModelConfig& c, ParamInit init, const Shape& shape) {
  switch (init) {
    case ParamInit::Normal: return c.init_std;
    case ParamInit::NormalOut: return c.init_std / std::sqrt(2.0f * float(std::max(1, c.num_layers)));
    case ParamInit::Router: return c.moe.router_init_std;
    case ParamInit::ConvNormal: return 1.0f / std::sqrt(float(shape[-1]));
    default: return 0.0f;
  }
}

namespace {

// One parameter's values (or a chunk of them) by its rule (SPEC init), drawing from rng. Draws
// are made in float so a double model starts from exactly the float values.
template <typename Real>
void init_param_values(Real* x, int64_t n, ParamInit init, float std, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  switch (init) {
    case ParamInit::Normal:
    case ParamInit::NormalOut:
    case ParamInit::Router:
    case ParamInit::ConvNormal: {
      std::normal_distribution<float> nd(0.0f, std);
      for (int64_t i = 0; i < n; ++i) x[i] = Real(nd(rng));
      break;
    }
    case ParamInit::Ones: std::fill(x, x + n, Real(1)); break;
    case ParamInit::Zeros: std::fill(x, x + n, Real(0)); break;
    case ParamInit::KdaALog:  // A = U(1, 16), stored as log A
      for (int64_t i = 0; i < n; ++i) x[i] = Real(float(std::log(1.0 + 15.0 * u01(rng))));
      break;
    case ParamInit::KdaDtBias:  // dt ~ logU(1e-3, 0.1); bias = softplus⁻¹(dt) = dt + log(−expm1(−dt))
      for (int64_t i = 0; i < n; ++i) {
        const double dt = std::exp(std::log(1e-3) + u01(rng) * (std::log(0.1) - std::log(1e-3)));
        x[i] = Real(float(dt + std::log(-std::expm1(-dt))));
      }
      break;
  }
}

// Values come in chunks of kInitChunk, each drawn from its own generator seeded by (seed,
// parameter index, chunk index): the same values whatever the thread count or the parameters
// skipped, and a 1.4B-parameter model initialises on every core (one stream through all of it
// took ~30 s, most of a GPU bench's start-up).
constexpr int64_t kInitChunk = int64_t(1) << 20;

uint64_t init_stream_seed(uint64_t seed, uint64_t param, uint64_t chunk) {  // splitmix64 rounds
  uint64_t z = seed;
  for (const uint64_t v : {param, chunk}) {
    z ^= 0x9E3779B97F4A7C15ull * (v + 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
  }
  return z;
}

template <typename Real>
void init_params(ModelWeightsT<Real>& w, uint64_t seed, bool matrices) {
  struct Chunk {
    size_t param;
    int64_t index;
  };
  std::vector<Chunk> chunks;
  for (size_t j = 0; j < w.params.size(); ++j) {
    const ParamEntryT<Real>& e = w.params[j];
    if (!matrices && param_init_is_matrix(e.init)) continue;
    for (int64_t c = 0; c * kInitChunk < e.numel(); ++c) chunks.push_back({j, c});
  }
#pragma omp parallel for schedule(dynamic)
  for (int64_t t = 0; t < int64_t(chunks.size()); ++t) {
    ParamEntryT<Real>& e = w.params[chunks[size_t(t)].param];
    const int64_t begin = chunks[size_t(t)].index * kInitChunk;
    std::mt19937_64 rng(init_stream_seed(seed, chunks[size_t(t)].param, uint64_t(chunks[size_t(t)].index)));
    init_param_values(e.data + begin, std::min(kInitChunk, e.numel() - begin), e.init,
                      param_init_std(w.cfg, e.init, e.shape), rng);
  }
}

}  // namespace

template <typename Real>
void weights_init(ModelWeightsT<Real>& w, uint64_t seed) {
  init_params(w, seed, /*matrices=*/true);
}

template <typename Real>
void weights_init_elementwise(ModelWeightsT<Real>& w, uint64_t seed) {
  init_params(w, seed, /*matrices=*/false);
}

ReservedWeights::ReservedWeights(const ModelConfig& cfg) : w_(std::make_unique<ModelWeightsT<float>>()) {
  w_->cfg = cfg;
  bytes_ = std::max<size_t>(build_table(*w_, nullptr), Arena::kAlign);
  // MAP_NORESERVE: no swap/commit accounting for the untouched matrices (the kernel's default
  // heuristic overcommit would refuse one mapping larger than RAM + swap otherwise).
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
  DM_CHECK(p != MAP_FAILED, "ReservedWeights: cannot reserve ", bytes_,
           " bytes of address space for the weights layout");
  base_ = p;
  build_table(*w_, nullptr, static_cast<uint8_t*>(base_));
}

ReservedWeights::~ReservedWeights() {
  w_.reset();
  if (base_) ::munmap(base_, bytes_);
}

template <typename To, typename From>
void weights_copy(const ModelWeightsT<From>& src, ModelWeightsT<To>& dst) {
  DM_CHECK(src.params.size() == dst.params.size(), "weights_copy: layouts differ");
  for (size_t i = 0; i < src.params.size(); ++i) {
    const auto& a = src.params[i];
    DM_CHECK(a.numel() == dst.params[i].numel(), "weights_copy: ", a.name, " differs in size");
    std::copy(a.data, a.data + a.numel(), dst.params[i].data);
  }
}

template <typename Real>
void weights_save(const ModelWeightsT<Real>& w, const std::string& dir) {
  // Our own format: K3 schema and K3 tensor names, whatever the source checkpoint used; f32.
  ModelWeightsT<Real> names;
  names.cfg = w.cfg;
  names.cfg.naming = WeightNaming::K3;
  build_table(names, nullptr);
  DM_CHECK(names.params.size() == w.params.size(), "internal: parameter tables differ in size");

  const fs::path target(dir);
  const fs::path tmp = target.string() + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  DM_CHECK(!ec, tmp.string(), ": cannot create directory (", ec.message(), ")");

  std::vector<std::vector<float>> staged;  // f32 copies (double models) and A_log with its padding
  staged.reserve(w.params.size());
  SafetensorsWriter wr;
  wr.set_metadata("format", "pt");
  for (size_t i = 0; i < w.params.size(); ++i) {
    const ParamEntryT<Real>& src = w.params[i];
    const ParamEntryT<Real>& dst = names.params[i];
    if (dst.file_pad > 0 || !std::is_same_v<Real, float>) {
      staged.emplace_back(size_t(dst.file_shape.numel()), 0.0f);
      std::copy(src.data, src.data + src.numel(), staged.back().begin());
      wr.add_f32(dst.name, staged.back().data(), dst.file_shape);
    } else {
      wr.add_f32(dst.name, reinterpret_cast<const float*>(src.data), dst.file_shape);
    }
  }
  wr.write((tmp / "model.safetensors").string());
  const std::string cfg_json = config_to_k3_json(names.cfg);
  write_file_atomic((tmp / "config.json").string(), cfg_json.data(), cfg_json.size());
  // Swap the finished folder into place: a crash leaves either the old or the new checkpoint.
  const fs::path old = target.string() + ".old." + std::to_string(::getpid());
  const bool had = fs::exists(target);
  if (had) fs::rename(target, old, ec);
  DM_CHECK(!ec, target.string(), ": cannot move the previous checkpoint aside (", ec.message(), ")");
  fs::rename(tmp, target, ec);
  DM_CHECK(!ec, target.string(), ": cannot move the new checkpoint into place (", ec.message(), ")");
  if (had) fs::remove_all(old, ec);
}

template std::unique_ptr<ModelWeightsT<float>> weights_allocate<float>(const ModelConfig&);
template std::unique_ptr<ModelWeightsT<double>> weights_allocate<double>(const ModelConfig&);
template std::unique_ptr<ModelWeightsT<float>> weights_load<float>(const std::string&);
template std::unique_ptr<ModelWeightsT<double>> weights_load<double>(const std::string&);
template void weights_init<float>(ModelWeightsT<float>&, uint64_t);
template void weights_init<double>(ModelWeightsT<double>&, uint64_t);
template void weights_init_elementwise<float>(ModelWeightsT<float>&, uint64_t);
template void weights_init_elementwise<double>(ModelWeightsT<double>&, uint64_t);
template void weights_copy<float, float>(const ModelWeightsT<float>&, ModelWeightsT<float>&);
template void weights_copy<double, float>(const ModelWeightsT<float>&, ModelWeightsT<double>&);
template void weights_copy<float, double>(const ModelWeightsT<double>&, ModelWeightsT<float>&);
template void weights_save<float>(const ModelWeightsT<float>&, const std::string&);
template void weights_save<double>(const ModelWeightsT<double>&, const std::string&);

}  // namespace dm
