// Shared by the serving tests (scheduler, OpenAI API, HTTP server): a tiny random model from
// configs/test.json and a byte-level tokenizer with the chat special tokens.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "model/weights.h"
#include "test_util.h"

namespace dm::test {

// configs/test.json with random weights (deterministic for a seed). Two calls with one seed give
// two independent models with identical weights (one for the engine, one for references).
inline std::unique_ptr<Model> serve_test_model(uint64_t seed = 11) {
  const ModelConfig cfg = load_config(source_dir() + "/configs/test.json");
  auto w = weights_allocate(cfg);
  weights_init(*w, seed);
  return std::make_unique<Model>(std::move(w));
}

// The 256 single bytes (id = byte value), a few longer tokens that encode() never produces but
// the model may emit (so one token can carry several characters of a stop string), then the
// default chat / tool special tokens. 256 + 4 + 16 ids, inside the test model's 512.
inline std::vector<std::string> serve_test_extra_tokens() {
  return {"Hello", " world", "sto", "p!"};
}

inline Tokenizer serve_test_tokenizer() {
  std::vector<std::string> ranks;
  for (int b = 0; b < 256; ++b) ranks.push_back(std::string(1, char(b)));
  for (const auto& t : serve_test_extra_tokens()) ranks.push_back(t);
  return Tokenizer::from_ranks(std::move(ranks), "kimi", tokenizer_default_special_tokens(),
                               "serve test tokenizer");
}

}  // namespace dm::test
