// `deltamoe chat`: an interactive chat in the terminal with the model's chat template, streaming
// the reply as it is generated. Reads lines from stdin (so it can be piped); /reset clears the
// conversation, /exit (or end of input) quits.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "command.h"
#include "device_generator.h"
#include "core/error.h"
#include "infer/generate.h"
#include "infer/openai_output.h"
#include "io/tokenizer.h"
#include "model/model.h"

namespace {

dm::cli::Registrar reg("chat", "Chat with a model in the terminal (stdin / stdout)", [](CLI::App* app) {
  static std::string model_dir, tokenizer_path, system_prompt, device = "cpu";
  static int64_t max_new = 512, prefix_cache_mib = 256;
  static dm::SamplingParams sp;
  sp.temperature = 0.7f;
  app->add_option("--model", model_dir, "Model directory")->required();
  app->add_option("--tokenizer", tokenizer_path, "tokenizer.json (default: MODEL/tokenizer.json)");
  app->add_option("--system", system_prompt, "System message");
  app->add_option("--max-new-tokens", max_new, "Longest reply")->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  app->add_option("--temperature", sp.temperature, "0 = greedy")->default_val(0.7f);
  app->add_option("--top-k", sp.top_k, "Keep the k most likely tokens (0 = off)");
  app->add_option("--top-p", sp.top_p, "Nucleus sampling mass (1 = off)");
  app->add_option("--min-p", sp.min_p, "Drop tokens below min_p × p_max (0 = off)");
  app->add_option("--repetition-penalty", sp.repetition_penalty, "> 1 discourages repeats");
  app->add_option("--seed", sp.seed, "Sampling seed");
  app->add_option("--device", device, "cpu (fp32) or cuda (bf16 compute on the GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app->add_option("--prefix-cache-mib", prefix_cache_mib,
                  "With --device cuda: prefix cache budget in MiB, so each turn prefills only the "
                  "part of the conversation it has not seen (0 = off)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
  app->callback([] {
    dm::cli::DeviceGenerator::require(device);
    auto model = dm::Model::load(model_dir);
    dm::cli::DeviceGenerator generator(*model, device, /*fp32=*/false,
                                       size_t(prefix_cache_mib) << 20);
    const std::string tp = tokenizer_path.empty() ? model_dir + "/tokenizer.json" : tokenizer_path;
    DM_CHECK(std::filesystem::exists(tp), tp, ": chat needs a tokenizer (use --tokenizer)");
    const dm::Tokenizer tok = dm::Tokenizer::load(tp);
    DM_CHECK(tok.has_special("<|im_end|>"), tp, ": the tokenizer has no chat tokens (<|im_end|>)");
    const int64_t max_context = model->config().max_context;
    const bool interactive = isatty(STDIN_FILENO);
    std::vector<dm::ChatMessage> history;
    auto reset = [&] {
      history.clear();
      if (!system_prompt.empty()) history.push_back({"system", system_prompt, {}});
    };
    reset();
    if (interactive)
      std::fprintf(stderr, "deltamoe chat: /reset clears the conversation, /exit quits.\n");
    dm::GenerateOptions go;
    go.sampling = sp;
    go.stop_ids = {tok.special_id("<|im_end|>")};
    if (tok.has_special("<|endoftext|>")) go.stop_ids.push_back(tok.special_id("<|endoftext|>"));
    std::string line;
    for (;;) {
      if (interactive) {
        std::fprintf(stderr, "> ");
        std::fflush(stderr);
      }
      if (!std::getline(std::cin, line)) break;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      if (line == "/exit" || line == "/quit") break;
      if (line == "/reset") {
        reset();
        std::printf("[conversation cleared]\n");
        std::fflush(stdout);
        continue;
      }
      history.push_back({"user", line, {}});
      const std::vector<int32_t> prompt = tok.encode_chat(history).ids;
      go.max_new_tokens = std::min<int64_t>(max_new, max_context - int64_t(prompt.size()));
      if (go.max_new_tokens < 1) {
        history.pop_back();
        std::printf("[the conversation fills the %lld-token context: /reset to start over]\n",
                    (long long)max_context);
        std::fflush(stdout);
        continue;
      }
      dm::ApiChoiceText reply(&tok, {}, /*parse_tool_calls=*/false);
      auto print_ready = [&] {
        const std::string ready = reply.take_ready();
        std::fwrite(ready.data(), 1, ready.size(), stdout);
        std::fflush(stdout);
      };
      generator.generate(prompt, go, [&](int32_t t) {
        reply.add(t);
        print_ready();
      });
      reply.finish();
      print_ready();
      std::printf("\n");
      std::fflush(stdout);
      history.push_back({"assistant", reply.content(), {}});
    }
  });
});

}  // namespace
