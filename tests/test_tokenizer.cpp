#include <gtest/gtest.h>
#include <omp.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "data/builtin.h"
#include "io/tokenizer.h"
#include "test_util.h"

using namespace dm;

namespace {
// A small mixed corpus: English, code, numbers, CJK, emoji.
std::vector<std::string> tokenizer_test_corpus() {
  std::vector<std::string> texts = synthetic_english_corpus({200, 7, 6, 16});
  texts.push_back("int main() { return 0; }\nfor (int i = 0; i < 10; ++i) x += i;\n");
  texts.push_back("東京は日本の首都です。你好，世界！今日はいい天気ですね。");
  texts.push_back("Emoji: 🙂🙂 👍🏽 👨‍👩‍👧 — done. Prices: $12.50, €7, 1,234,567.");
  return texts;
}

const Tokenizer& shared_trained_tokenizer() {
  static const Tokenizer tok = Tokenizer::train(tokenizer_test_corpus(), 700);
  return tok;
}

std::vector<std::string_view> split_with(const std::string& pattern, std::string_view text) {
  PreTokenizer p(tokenizer_pattern_by_name(pattern));
  std::vector<std::string_view> pieces;
  p.split(text, pieces);
  return pieces;
}

std::string error_text_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no dm::Error>";
}
}  // namespace

TEST(Tokenizer, RoundTripAsciiCjkEmojiAndInvalidBytes) {
  const Tokenizer& tok = shared_trained_tokenizer();
  std::string all_bytes;
  for (int b = 0; b < 256; ++b) all_bytes.push_back(char(b));
  const std::vector<std::string> samples = {
      "",
      "Hello, world! The quick brown fox jumps over 13 lazy dogs.\n\n  indented\ttabs\r\n",
      "東京は日本の首都です。你好，世界！한국어 텍스트",
      "🙂 👍🏽 👨‍👩‍👧 🏳️‍🌈 emoji mixed with text",
      "\xff\xfe\x80\xc3 invalid \xe2\x82 utf-8 \xf0\x9f\x99 truncated",
      all_bytes,
      std::string(5000, '='),   // one long piece: the heap path
      std::string(3000, ' ') + "x",
  };
  for (const auto& s : samples) {
    const auto ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s) << "sample of " << s.size() << " bytes";
    for (int32_t id : ids) EXPECT_FALSE(tok.is_special(id));
  }
  std::mt19937 rng(3);
  for (int trial = 0; trial < 300; ++trial) {  // arbitrary byte strings
    std::string s(size_t(rng() % 64), '\0');
    for (auto& c : s) c = char(rng() % 256);
    ASSERT_EQ(tok.decode(tok.encode(s)), s);
  }
  // Compression on text it was trained on.
  const std::string doc = synthetic_english_document(7, 3);
  EXPECT_LT(tok.encode(doc).size(), doc.size() / 2);
}

TEST(Tokenizer, TrainingIsDeterministicAcrossThreadCounts) {
  const auto corpus = tokenizer_test_corpus();
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Tokenizer a = Tokenizer::train(corpus, 600);
  omp_set_num_threads(std::max(2, threads));
  const Tokenizer b = Tokenizer::train(corpus, 600);
  omp_set_num_threads(threads);
  ASSERT_EQ(a.vocab_size(), 600);
  ASSERT_EQ(a.vocab_size(), b.vocab_size());
  EXPECT_EQ(a.merges(), b.merges());
  for (int32_t id = 0; id < a.num_ranks(); ++id) ASSERT_EQ(a.token_bytes(id), b.token_bytes(id));
}

TEST(Tokenizer, KnownMergesOnTinyCorpus) {
  // The classic "aaabdaaabac": (a,a) has count 4; then (a,b) and (aa,a) tie at 2 and the smaller
  // pair (97,98) wins; then (aa,ab) → "aaab"; then four pairs tie at 1 and (a,c) is smallest.
  const Tokenizer tok = Tokenizer::train({"aaabdaaabac"}, 256 + 4, {});
  const std::vector<std::pair<int32_t, int32_t>> expected = {{97, 97}, {97, 98}, {256, 257}, {97, 99}};
  EXPECT_EQ(tok.merges(), expected);
  EXPECT_EQ(tok.token_bytes(256), "aa");
  EXPECT_EQ(tok.token_bytes(257), "ab");
  EXPECT_EQ(tok.token_bytes(258), "aaab");
  EXPECT_EQ(tok.token_bytes(259), "ac");
  EXPECT_EQ(tok.encode("aaabdaaabac"), (std::vector<int32_t>{258, 'd', 258, 259}));
  // Runs out of pairs: the vocabulary stops growing instead of inventing tokens.
  const Tokenizer small = Tokenizer::train({"ab"}, 300, {"<|endoftext|>"});
  EXPECT_EQ(small.num_ranks(), 257);
  EXPECT_EQ(small.special_id("<|endoftext|>"), 257);
  EXPECT_THROW(Tokenizer::train({"ab"}, 100, {}), Error);
}

TEST(Tokenizer, SpecialTokensEncodeToSingleIdsOnlyWhenAllowed) {
  const Tokenizer& tok = shared_trained_tokenizer();
  const auto& names = tokenizer_default_special_tokens();
  ASSERT_EQ(names.size(), 16u);
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(tok.special_id(names[i]), tok.num_ranks() + int64_t(i));
    EXPECT_EQ(tok.encode(names[i], true), std::vector<int32_t>{tok.special_id(names[i])});
    const auto plain = tok.encode(names[i], false);
    EXPECT_GT(plain.size(), 1u);
    for (int32_t id : plain) EXPECT_FALSE(tok.is_special(id));
    EXPECT_EQ(tok.decode(plain), names[i]);
  }
  const std::string mixed = "hi<|im_user|>there<|im_end|><|im_end|>x<|im_";
  const auto ids = tok.encode(mixed, true);
  EXPECT_EQ(tok.decode(ids), mixed);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.special_id("<|im_end|>")), 2);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.special_id("<|im_user|>")), 1);
  EXPECT_EQ(tok.vocab_size(), 700);
  EXPECT_THROW(tok.special_id("<|nope|>"), Error);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{int32_t(tok.vocab_size())}), Error);
  EXPECT_THROW(tok.decode(std::vector<int32_t>{-1}), Error);
}

TEST(Tokenizer, TiktokenFileLoadEncodesAsExpected) {
  const std::string dir = test::temp_dir("tiktoken");
  const std::string path = dir + "/tiny.tiktoken";
  // Single bytes get permuted ranks ((b + 7) mod 256), so byte value ≠ id; merges are implied
  // by the ranks of "ab" < "cd" < "abcd". Lines are written out of rank order.
  auto b64 = [](const std::string& s) {
    static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    size_t i = 0;
    for (; i + 2 < s.size(); i += 3) {
      const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8) | uint8_t(s[i + 2]);
      out += {a[v >> 18], a[(v >> 12) & 63], a[(v >> 6) & 63], a[v & 63]};
    }
    if (s.size() - i == 1) {
      const uint32_t v = uint8_t(s[i]) << 16;
      out += {a[v >> 18], a[(v >> 12) & 63], '=', '='};
    } else if (s.size() - i == 2) {
      const uint32_t v = (uint8_t(s[i]) << 16) | (uint8_t(s[i + 1]) << 8);
      out += {a[v >> 18], a[(v >> 12) & 63], a[(v >> 6) & 63], '='};
    }
    return out;
  };
  {
    std::ofstream f(path);
    f << b64("abcd") << " 258\n" << b64("cd") << " 257\n";
    for (int b = 255; b >= 0; --b) f << b64(std::string(1, char(b))) << " " << (b + 7) % 256 << "\n";
    f << b64("ab") << " 256\n";
  }
  const Tokenizer tok = Tokenizer::load_tiktoken(path, "cl100k", {"<|endoftext|>", "<|pad|>"});
  EXPECT_EQ(tok.num_ranks(), 259);
  EXPECT_EQ(tok.vocab_size(), 261);
  EXPECT_EQ(tok.special_id("<|pad|>"), 260);
  auto byte_id = [](char c) { return int32_t((uint8_t(c) + 7) % 256); };
  EXPECT_EQ(tok.encode("abcd"), std::vector<int32_t>{258});
  EXPECT_EQ(tok.encode("abcx"), (std::vector<int32_t>{256, byte_id('c'), byte_id('x')}));
  EXPECT_EQ(tok.encode(" abcd"), (std::vector<int32_t>{byte_id(' '), 258}));
  EXPECT_EQ(tok.encode("cdab"), (std::vector<int32_t>{257, 256}));
  EXPECT_EQ(tok.encode("a<|pad|>", true), (std::vector<int32_t>{byte_id('a'), 260}));
  EXPECT_TRUE(tok.merges().empty());
  // load_auto recognises the format by its first byte.
  EXPECT_EQ(Tokenizer::load_auto(path, "cl100k").num_ranks(), 259);

  // Malformed files: errors name the file and line.
  std::ofstream(dir + "/bad1.tiktoken") << "YWI= 0\n!!!! 1\n";
  EXPECT_NE(error_text_of([&] { Tokenizer::load_tiktoken(dir + "/bad1.tiktoken", "kimi"); }).find("bad1.tiktoken:2"),
            std::string::npos);
  std::ofstream(dir + "/bad2.tiktoken") << "YWI= 0\nYWM= 2\n";
  EXPECT_NE(error_text_of([&] { Tokenizer::load_tiktoken(dir + "/bad2.tiktoken", "kimi"); }).find("rank 1 is missing"),
            std::string::npos);
  std::ofstream(dir + "/bad3.tiktoken") << "YWI= 0\n";  // lacks single bytes
  EXPECT_NE(error_text_of([&] { Tokenizer::load_tiktoken(dir + "/bad3.tiktoken", "kimi"); }).find("bad3.tiktoken"),
            std::string::npos);
}

TEST(Tokenizer, SaveLoadRoundTripAndMalformedJson) {
  const Tokenizer& tok = shared_trained_tokenizer();
  const std::string dir = test::temp_dir("tokjson");
  tok.save(dir + "/tokenizer.json");
  const Tokenizer back = Tokenizer::load(dir + "/tokenizer.json");
  EXPECT_EQ(back.vocab_size(), tok.vocab_size());
  EXPECT_EQ(back.merges(), tok.merges());
  EXPECT_EQ(back.special_tokens(), tok.special_tokens());
  EXPECT_EQ(back.pattern(), tok.pattern());
  for (const auto& s : tokenizer_test_corpus()) ASSERT_EQ(back.encode(s, true), tok.encode(s, true));

  std::ofstream(dir + "/bad.json") << R"({"format": "deltamoe-bpe", "version": 1, "pattern": "x", "tokens": ["@@"]})";
  const std::string msg = error_text_of([&] { Tokenizer::load(dir + "/bad.json"); });
  EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tokens[0]"), std::string::npos) << msg;
  std::ofstream(dir + "/trunc.json") << R"({"format": "deltamoe-bpe", "vers)";
  EXPECT_NE(error_text_of([&] { Tokenizer::load(dir + "/trunc.json"); }).find("trunc.json"), std::string::npos);
}

TEST(Tokenizer, PreTokenizerPatterns) {
  if (!PreTokenizer::regex_available()) GTEST_SKIP() << "built without PCRE2";
  using V = std::vector<std::string_view>;
  EXPECT_EQ(split_with("cl100k", "Hello world's 12345 ...\n\n  x"),
            (V{"Hello", " world", "'s", " ", "123", "45", " ...\n\n", " ", " x"}));
  // Kimi: Han runs apart from other letters, CamelCase split, contraction kept on the word.
  EXPECT_EQ(split_with("kimi", "你好世界abc HelloWorld they're"),
            (V{"你好世界", "abc", " Hello", "World", " they're"}));
  EXPECT_EQ(split_with("kimi", "naïve café 1234"), (V{"naïve", " café", " ", "123", "4"}));
  // Invalid UTF-8 becomes pieces of its own; the pieces cover the input.
  const std::string bad = "ab\xff\xfe cd";
  std::string joined;
  for (auto p : split_with("kimi", bad)) joined += p;
  EXPECT_EQ(joined, bad);
  EXPECT_THROW(PreTokenizer("(unclosed"), Error);
}

TEST(Tokenizer, BuiltinSplitterMatchesCl100kOnAscii) {
  using V = std::vector<std::string_view>;
  V pieces;
  pretokenize_builtin_split("Hello world's 12345 ...\n\n  x", pieces);
  EXPECT_EQ(pieces, (V{"Hello", " world", "'s", " ", "123", "45", " ...\n\n", " ", " x"}));
  if (!PreTokenizer::regex_available()) return;
  // On ASCII the built-in splitter is the cl100k regex.
  std::mt19937 rng(11);
  const std::string alphabet = "abcXYZ019 '\n\r\t.,!?-_sdtmlrev";
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s(size_t(rng() % 24), ' ');
    for (auto& c : s) c = alphabet[rng() % alphabet.size()];
    pieces.clear();
    pretokenize_builtin_split(s, pieces);
    ASSERT_EQ(pieces, split_with("cl100k", s)) << "input: '" << s << "'";
  }
}

TEST(Tokenizer, HeapAndScanBpeAgree) {
  const Tokenizer& tok = shared_trained_tokenizer();
  std::mt19937 rng(5);
  const std::string text = synthetic_english_document(1, 1) + synthetic_english_document(1, 2);
  for (int trial = 0; trial < 500; ++trial) {
    const size_t begin = rng() % (text.size() - 40), len = 2 + rng() % 38;
    const std::string_view piece = std::string_view(text).substr(begin, len);
    std::vector<int32_t> scan, heap;
    tok.encode_piece(piece, scan);
    tok.encode_piece_heap(piece, heap);
    if (scan.size() == 1) continue;  // whole-piece shortcut of the scan path
    ASSERT_EQ(scan, heap) << "piece '" << piece << "'";
  }
}

TEST(Tokenizer, ChatTemplateAndEncoding) {
  const Tokenizer& tok = shared_trained_tokenizer();
  std::vector<ChatMessage> chat = {
      {"system", "You are helpful.", {}},
      {"user", "Say <|im_end|> please", {}},
      {"assistant", "Calling.", {{"", "search", R"({"q":"x"})"}}},
      {"tool", "result", {}},
      {"assistant", "Done.", {}},
  };
  const std::string text = tok.chat_template(chat, true);
  EXPECT_EQ(text,
            "<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
            "<|im_user|>user<|im_middle|>Say <|im_end|> please<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>Calling.<|tool_calls_section_begin|><|tool_call_begin|>"
            "functions.search:0<|tool_call_argument_begin|>{\"q\":\"x\"}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|>"
            "<|im_system|>tool<|im_middle|>result<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>Done.<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>");
  const ChatEncoding enc = tok.encode_chat(chat, true);
  ASSERT_EQ(enc.ids.size(), enc.assistant_mask.size());
  EXPECT_EQ(tok.decode(enc.ids), text);
  // The user's literal "<|im_end|>" stays text: the only im_end ids are the 5 message ends.
  EXPECT_EQ(std::count(enc.ids.begin(), enc.ids.end(), tok.special_id("<|im_end|>")), 5);
  std::string assistant_text;
  for (size_t i = 0; i < enc.ids.size(); ++i)
    if (enc.assistant_mask[i]) assistant_text += tok.token_bytes(enc.ids[i]);
  EXPECT_EQ(assistant_text,
            "Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
            "<|tool_call_argument_begin|>{\"q\":\"x\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
            "Done.<|im_end|>");
  EXPECT_THROW(tok.chat_template({{"robot", "x", {}}}), Error);
}
