// `deltamoe tokenizer train|convert|encode|decode`: train a byte-level BPE vocabulary, convert a
// tiktoken file to our JSON, and encode / decode text from the command line.
#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "command.h"
#include "core/error.h"
#include "data/corpus.h"
#include "io/tokenizer.h"

namespace {

struct TokenizerTrainOptions {
  std::vector<std::string> inputs;
  std::string out;
  int64_t vocab_size = 4096;
  std::string pattern = "kimi";
  std::string doc_separator;
  int64_t max_bytes = int64_t(256) << 20;
};

struct TokenizerConvertOptions {
  std::string tiktoken, pattern = "kimi", out;
};

struct TokenizerCodecOptions {
  std::string tokenizer, pattern = "kimi", text, file, ids;
  bool allow_special = false, json = false;
};

void tokenizer_train_command(const TokenizerTrainOptions& o) {
  auto stream = dm::make_file_document_stream(dm::corpus_collect_files(o.inputs), o.doc_separator);
  const std::vector<std::string> texts = dm::corpus_sample_documents(*stream, o.max_bytes);
  int64_t bytes = 0;
  for (const auto& t : texts) bytes += int64_t(t.size());
  const auto t0 = std::chrono::steady_clock::now();
  const dm::Tokenizer tok = dm::Tokenizer::train(texts, o.vocab_size, dm::tokenizer_default_special_tokens(),
                                                 dm::tokenizer_pattern_by_name(o.pattern));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  tok.save(o.out);
  std::printf("trained %lld tokens (%lld ranks + %zu special) on %.1f MB in %.2f s -> %s\n",
              static_cast<long long>(tok.vocab_size()), static_cast<long long>(tok.num_ranks()),
              tok.special_tokens().size(), double(bytes) / 1e6, seconds, o.out.c_str());
}

std::string read_text_argument(const TokenizerCodecOptions& o) {
  if (o.file.empty()) return o.text;
  std::ifstream f(o.file, std::ios::binary);
  DM_CHECK(f.good(), o.file, ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  return std::move(ss).str();
}

std::vector<int32_t> parse_id_list(const std::string& text) {
  std::vector<int32_t> ids;
  std::string item;
  std::istringstream ss(text);
  while (std::getline(ss, item, ',')) {
    if (item.find_first_not_of(" \t\n[]") == std::string::npos) continue;
    size_t begin = item.find_first_not_of(" \t\n["), end = item.find_last_not_of(" \t\n]");
    const std::string number = item.substr(begin, end - begin + 1);
    try {
      size_t used = 0;
      const long long v = std::stoll(number, &used);
      DM_CHECK(used == number.size() && v >= 0 && v <= INT32_MAX, "--ids: '", number,
               "' is not a token id");
      ids.push_back(int32_t(v));
    } catch (const std::logic_error&) {
      throw dm::Error(dm::str_cat("--ids: '", number, "' is not a token id"));
    }
  }
  return ids;
}

dm::cli::Registrar reg("tokenizer", "Train, convert and apply byte-level BPE tokenizers", [](CLI::App* app) {
  app->require_subcommand(1);

  auto train = std::make_shared<TokenizerTrainOptions>();
  CLI::App* t = app->add_subcommand("train", "Train a BPE vocabulary on text files / folders");
  t->option_defaults()->always_capture_default();
  t->add_option("--input", train->inputs, ".txt/.md/.jsonl files or folders")->required();
  t->add_option("--out", train->out, "output tokenizer.json")->required();
  t->add_option("--vocab-size", train->vocab_size, "total vocabulary incl. 256 bytes and specials");
  t->add_option("--pattern", train->pattern, "pre-tokenisation regex, or kimi / cl100k");
  t->add_option("--doc-separator", train->doc_separator, "split .txt/.md files at this string");
  t->add_option("--max-bytes", train->max_bytes, "train on at most this many bytes of text");
  t->callback([train] { tokenizer_train_command(*train); });

  auto conv = std::make_shared<TokenizerConvertOptions>();
  CLI::App* c = app->add_subcommand("convert", "Convert a tiktoken vocabulary to our JSON");
  c->add_option("--tiktoken", conv->tiktoken, "tiktoken file (base64 token, space, rank)")->required();
  c->add_option("--pattern", conv->pattern, "pre-tokenisation regex, or kimi / cl100k");
  c->add_option("--out", conv->out, "output tokenizer.json")->required();
  c->callback([conv] {
    const dm::Tokenizer tok = dm::Tokenizer::load_tiktoken(conv->tiktoken, conv->pattern);
    tok.save(conv->out);
    std::printf("%lld ranks + %zu special tokens -> %s\n", static_cast<long long>(tok.num_ranks()),
                tok.special_tokens().size(), conv->out.c_str());
  });

  auto codec = std::make_shared<TokenizerCodecOptions>();
  auto add_tokenizer_option = [codec](CLI::App* sub) {
    sub->add_option("--tokenizer", codec->tokenizer, "tokenizer.json or tiktoken file")->required();
    sub->add_option("--pattern", codec->pattern, "regex for a tiktoken file, or kimi / cl100k");
  };
  CLI::App* e = app->add_subcommand("encode", "Print the token ids of a text");
  add_tokenizer_option(e);
  e->add_option("--text", codec->text, "text to encode");
  e->add_option("--file", codec->file, "file to encode (instead of --text)");
  e->add_flag("--allow-special", codec->allow_special, "turn special-token strings into their ids");
  e->add_flag("--json", codec->json, "print a JSON array");
  e->callback([codec] {
    const dm::Tokenizer tok = dm::Tokenizer::load_auto(codec->tokenizer, codec->pattern);
    const std::vector<int32_t> ids = tok.encode(read_text_argument(*codec), codec->allow_special);
    if (codec->json) {
      std::printf("%s\n", nlohmann::json(ids).dump().c_str());
      return;
    }
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? ",%d" : "%d", ids[i]);
    std::printf("\n");
  });

  CLI::App* d = app->add_subcommand("decode", "Print the text of token ids");
  add_tokenizer_option(d);
  d->add_option("--ids", codec->ids, "comma-separated ids (a JSON array works too)")->required();
  d->callback([codec] {
    const dm::Tokenizer tok = dm::Tokenizer::load_auto(codec->tokenizer, codec->pattern);
    const std::string text = tok.decode(parse_id_list(codec->ids));
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  });
});

}  // namespace
