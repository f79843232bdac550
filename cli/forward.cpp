// `deltamoe forward`: one full forward pass over input_ids from a safetensors file.
#include <cstdio>

#include "command.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/model.h"
#if DELTAMOE_HAVE_CUDA
#include "model/cuda/model_gpu.h"
#include "ops/cuda/device.h"
#endif

namespace {

// input_ids [B,T] int64 of the --input file (checked).
const dm::Tensor& input_ids(const dm::SafetensorsReader& in, const std::string& path) {
  const dm::Tensor& ids = in.get("input_ids");
  DM_CHECK(ids.dtype == dm::DType::I64 && ids.shape.ndim == 2, path,
           ": tensor 'input_ids' must be I64 [B,T], got ", dm::dtype_name(ids.dtype), " ",
           ids.shape.str());
  return ids;
}

// --device cuda: the GPU forward (bf16 compute, or fp32 with --precision fp32); writes logits
// (and router choices with --all).
void run_forward_cuda(const std::string& model_dir, const std::string& input,
                      const std::string& output, bool all, bool fp32) {
#if DELTAMOE_HAVE_CUDA
  DM_CHECK(dm::cuda::device_available(), "--device cuda: ", dm::cuda::device_description());
  auto model = dm::Model::load(model_dir);
  const dm::ModelConfig& c = model->config();
  const auto in = dm::SafetensorsReader::open(input);
  const dm::Tensor& ids = input_ids(in, input);
  const int64_t B = ids.shape[0], T = ids.shape[1], V = c.vocab_size;
  DM_CHECK(B > 0 && T > 0, input, ": tensor 'input_ids' is empty");
  dm::cuda::GpuModel gpu(model->weights(),
                         fp32 ? dm::cuda::WeightPrecision::F32 : dm::cuda::WeightPrecision::Bf16);
  std::vector<float> logits(size_t(B * T * V));
  std::vector<dm::cuda::GpuForwardRouting> routing;
  gpu.forward(ids.as<int64_t>(), B, T, logits.data(), nullptr, all ? &routing : nullptr);
  dm::SafetensorsWriter w;
  w.add_f32("logits", logits.data(), {B, T, V});
  std::vector<std::vector<int64_t>> idx64;
  idx64.reserve(routing.size());
  for (const auto& r : routing) {
    idx64.emplace_back(r.idx.begin(), r.idx.end());
    w.add("router_idx_" + std::to_string(r.layer),
          dm::Tensor{idx64.back().data(), dm::DType::I64, {B * T, int64_t(c.moe.top_k)}});
  }
  w.write(output);
#else
  (void)model_dir, (void)input, (void)output, (void)all, (void)fp32;
  throw dm::Error("--device cuda: this build has no CUDA backend (configure with -DDELTAMOE_CUDA=ON)");
#endif
}

void run_forward(const std::string& model_dir, const std::string& input, const std::string& output,
                 bool all, int chunk) {
  auto model = dm::Model::load(model_dir);
  const dm::ModelConfig& c = model->config();
  const auto in = dm::SafetensorsReader::open(input);
  const dm::Tensor& ids = input_ids(in, input);
  const int64_t B = ids.shape[0], T = ids.shape[1], N = B * T, d = c.hidden, V = c.vocab_size;
  DM_CHECK(B > 0 && T > 0, input, ": tensor 'input_ids' is empty");
  std::vector<float> logits(size_t(N * V));
  dm::ForwardCollector col;
  dm::ForwardOptions opt;
  opt.kda_chunk = chunk;
  model->forward(ids.as<int64_t>(), B, T, logits.data(), &col, opt);

  // hidden_0 = embeddings, hidden_i = output of layer i (1-based) for i < L, hidden_L = after
  // the final RMSNorm (../shared/goldens/README.md).
  dm::SafetensorsWriter w;
  w.add_f32("logits", logits.data(), {B, T, V});
  std::vector<std::string> names = {"embeddings"};
  for (int i = 0; i + 1 < c.num_layers; ++i) names.push_back("layer_out_" + std::to_string(i));
  names.push_back("final_hidden");
  for (size_t i = 0; i < names.size(); ++i)
    w.add_f32("hidden_" + std::to_string(i), col.tensors.at(names[i]).data(), {B, T, d});
  std::vector<std::vector<int64_t>> idx64;
  idx64.reserve(col.routers.size());
  if (all) {
    for (const auto& [name, t] : col.tensors)
      if (name.rfind("layer_out_", 0) != 0) w.add_f32(name, t.data(), {B, T, d});
    for (const auto& [layer, r] : col.routers) {
      idx64.emplace_back(r.idx.begin(), r.idx.end());
      w.add("router_idx_" + std::to_string(layer),
            dm::Tensor{idx64.back().data(), dm::DType::I64, {N, r.k}});
      w.add_f32("router_w_" + std::to_string(layer), r.weight.data(), {N, r.k});
    }
  }
  w.write(output);
}

dm::cli::Registrar reg("forward", "Run one forward pass: input_ids [B,T] -> logits and hidden states",
                       [](CLI::App* app) {
  static std::string model, input, output;
  static bool all = false;
  static int chunk = 64;
  static std::string device = "cpu", precision = "bf16";
  app->add_option("--model", model, "Model directory (config.json + safetensors)")->required();
  app->add_option("--input", input, "safetensors file with input_ids [B,T] int64")->required();
  app->add_option("--output", output, "Output safetensors (logits, hidden_0..hidden_L)")->required();
  app->add_flag("--all", all, "Also write every sub-layer input/output and router choices");
  app->add_option("--kda-chunk", chunk, "KDA chunk size (16/32/64; 0 = recurrent)")
      ->check(CLI::IsMember({0, 16, 32, 64}));
  app->add_option("--device", device,
                  "cpu (fp32; writes hidden states) or cuda (bf16 compute on the GPU; writes logits, "
                  "router choices with --all)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--precision", precision,
                  "With --device cuda: bf16 (fast; bf16 weights and activations) or fp32 (every "
                  "weight, activation and GEMM in fp32: the CPU's numbers to ~1e-6)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app->callback([] {
    if (device == "cuda")
      run_forward_cuda(model, input, output, all, precision == "fp32");
    else
      run_forward(model, input, output, all, chunk);
  });
});

}  // namespace
