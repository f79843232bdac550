// `deltamoe generate`: continue a prompt (text through the model's tokenizer, or token ids).
#include <cstdio>
#include <filesystem>
#include <functional>
#include <sstream>

#include "command.h"
#include "core/error.h"
#include "infer/generate.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "device_generator.h"

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      DM_CHECK(used == item.size(), "--prompt-ids: '", item, "' is not an integer");
      ids.push_back(int32_t(v));
    } catch (const std::logic_error&) {
      throw dm::Error(dm::str_cat("--prompt-ids: '", item, "' is not an integer"));
    }
  }
  return ids;
}

dm::cli::Registrar reg("generate", "Generate a continuation of a prompt", [](CLI::App* app) {
  static std::string model_dir, prompt, prompt_ids, tokenizer_path;
  static int64_t max_new = 32;
  static dm::SamplingParams sp;
  static bool json_out = false;
  static std::string device = "cpu", precision = "bf16";
  sp.temperature = 0.0f;
  auto* grp = app->add_option_group("prompt");
  grp->add_option("--prompt", prompt, "Prompt text (needs a tokenizer)");
  grp->add_option("--prompt-ids", prompt_ids, "Prompt token ids, comma separated");
  grp->require_option(1);
  app->add_option("--model", model_dir, "Model directory")->required();
  app->add_option("--tokenizer", tokenizer_path, "tokenizer.json (default: MODEL/tokenizer.json)");
  app->add_option("--max-new-tokens", max_new, "Tokens to generate")->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  app->add_option("--temperature", sp.temperature, "0 = greedy");
  app->add_option("--top-k", sp.top_k, "Keep the k most likely tokens (0 = off)");
  app->add_option("--top-p", sp.top_p, "Nucleus sampling mass (1 = off)");
  app->add_option("--min-p", sp.min_p, "Drop tokens below min_p × p_max (0 = off)");
  app->add_option("--repetition-penalty", sp.repetition_penalty, "> 1 discourages repeats");
  app->add_option("--seed", sp.seed, "Sampling seed");
  app->add_flag("--json", json_out, "Print {\"output_ids\": [...]} (the new tokens only)");
  app->add_option("--device", device, "cpu (fp32) or cuda (bf16 compute on the GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--precision", precision,
                  "With --device cuda: bf16 (the fast decoder) or fp32 (fp32 weights and compute, "
                  "no decode cache: each token re-runs the sequence; for checking against the CPU)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app->callback([] {
    dm::cli::DeviceGenerator::require(device);
    auto model = dm::Model::load(model_dir);
    const std::string tp = tokenizer_path.empty() ? model_dir + "/tokenizer.json" : tokenizer_path;
    std::unique_ptr<dm::Tokenizer> tok;
    if (std::filesystem::exists(tp)) tok = std::make_unique<dm::Tokenizer>(dm::Tokenizer::load(tp));
    std::vector<int32_t> ids;
    if (!prompt_ids.empty()) {
      ids = parse_ids(prompt_ids);
    } else {
      DM_CHECK(tok, tp, ": no tokenizer for a text prompt (use --prompt-ids or --tokenizer)");
      ids = tok->encode(prompt, /*allow_special=*/true);
    }
    std::vector<int64_t> ids64(ids.begin(), ids.end());
    dm::check_token_ids(ids64.data(), int64_t(ids64.size()), model->config().vocab_size, "prompt");
    dm::GenerateOptions go;
    go.max_new_tokens = max_new;
    go.sampling = sp;
    if (tok && !json_out) {
      go.stop_ids.push_back(tok->special_id("<|endoftext|>"));
      std::printf("%s", prompt.c_str());
      std::fflush(stdout);
    }
    const std::function<void(int32_t)> on_token = [&](int32_t t) {
      if (json_out) return;
      if (tok) std::printf("%s", tok->decode(std::vector<int32_t>{t}).c_str());
      else std::printf("%d ", t);
      std::fflush(stdout);
    };
    dm::cli::DeviceGenerator generator(*model, device, precision == "fp32");
    const auto out = generator.generate(ids, go, on_token);
    if (json_out) {
      std::printf("{\"output_ids\": [");
      for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? ", " : "", out[i]);
      std::printf("]}\n");
    } else {
      std::printf("\n");
    }
  });
});

}  // namespace
