// Pre-tokenisation: the regex splitter (PCRE2, UTF + UCP, invalid UTF-8 tolerated) and the
// built-in ASCII-class splitter used when the engine is built without PCRE2.
#include <cstring>
#include <string>

#include "core/error.h"
#include "io/tokenizer.h"

#if DELTAMOE_HAVE_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

namespace dm {

// `(?!\p{Han})[...]` stands in for the `[...&&[^\p{Han}]]` class intersection of the original
// (Python `regex` / fancy-regex syntax), which PCRE2 does not have.
const char* const kTokenizerPatternKimi =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*)"
    R"((?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+)"
    R"((?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

const char* const kTokenizerPatternCl100k =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string tokenizer_pattern_by_name(const std::string& name_or_regex) {
  if (name_or_regex == "kimi") return kTokenizerPatternKimi;
  if (name_or_regex == "cl100k") return kTokenizerPatternCl100k;
  return name_or_regex;
}

// ---------------------------------------------------------------------------------------------
// Built-in splitter: the cl100k alternatives evaluated by hand over byte classes. Bytes ≥ 0x80
// (any part of a UTF-8 multibyte sequence, or invalid bytes) count as letters, so non-ASCII words
// stay whole and every byte lands in some piece.
namespace {
inline bool builtin_is_letter(unsigned char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
}
inline bool builtin_is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
inline bool builtin_is_space(unsigned char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}
inline bool builtin_is_newline(unsigned char c) { return c == '\n' || c == '\r'; }
inline bool builtin_is_punct(unsigned char c) {
  return !builtin_is_letter(c) && !builtin_is_digit(c) && !builtin_is_space(c);
}
inline unsigned char lower_ascii(unsigned char c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// Length of an English contraction ('s 't 're 've 'm 'll 'd, any case) at text[i], or 0.
size_t builtin_contraction_length(std::string_view text, size_t i) {
  if (text[i] != '\'' || i + 1 >= text.size()) return 0;
  const unsigned char c1 = lower_ascii(static_cast<unsigned char>(text[i + 1]));
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (i + 2 >= text.size()) return 0;
  const unsigned char c2 = lower_ascii(static_cast<unsigned char>(text[i + 2]));
  if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
  return 0;
}
}  // namespace

void pretokenize_builtin_split(std::string_view text, std::vector<std::string_view>& pieces) {
  const size_t n = text.size();
  auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  size_t i = 0;
  while (i < n) {
    const unsigned char c = at(i);
    size_t j = i;
    if (const size_t len = builtin_contraction_length(text, i)) {
      j = i + len;
    } else if (builtin_is_letter(c) ||
               (!builtin_is_digit(c) && !builtin_is_newline(c) && i + 1 < n &&
                builtin_is_letter(at(i + 1)))) {
      j = builtin_is_letter(c) ? i : i + 1;  // optional leading non-letter (e.g. the space)
      while (j < n && builtin_is_letter(at(j))) ++j;
    } else if (builtin_is_digit(c)) {
      while (j < n && j < i + 3 && builtin_is_digit(at(j))) ++j;
    } else if (builtin_is_punct(c) || (c == ' ' && i + 1 < n && builtin_is_punct(at(i + 1)))) {
      j = (c == ' ') ? i + 1 : i;
      while (j < n && builtin_is_punct(at(j))) ++j;
      while (j < n && builtin_is_newline(at(j))) ++j;
    } else {  // whitespace run
      size_t run_end = i;
      size_t last_newline = std::string_view::npos;
      while (run_end < n && builtin_is_space(at(run_end))) {
        if (builtin_is_newline(at(run_end))) last_newline = run_end;
        ++run_end;
      }
      if (last_newline != std::string_view::npos) j = last_newline + 1;      // \s*[\r\n]+
      else if (run_end == n || run_end - i == 1) j = run_end;                // \s+ at end / \s
      else j = run_end - 1;  // \s+(?!\S): leave the last space to lead the next word
    }
    pieces.push_back(text.substr(i, j - i));
    i = j;
  }
}

// ---------------------------------------------------------------------------------------------
#if DELTAMOE_HAVE_PCRE2
namespace {
// Per-thread match state: pcre2 match data and a JIT stack large enough for long runs of one
// class (the JIT's default 32 KiB stack overflows on e.g. a 100 kB line of '=').
struct Pcre2ThreadState {
  pcre2_match_data* match_data = nullptr;
  pcre2_match_context* match_context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  Pcre2ThreadState() {
    match_data = pcre2_match_data_create(1, nullptr);
    match_context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    if (match_context && jit_stack) pcre2_jit_stack_assign(match_context, nullptr, jit_stack);
  }
  ~Pcre2ThreadState() {
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
    if (match_context) pcre2_match_context_free(match_context);
    if (match_data) pcre2_match_data_free(match_data);
  }
};

std::string pcre2_error_text(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return std::string(reinterpret_cast<const char*>(buf));
}
}  // namespace

PreTokenizer::PreTokenizer(const std::string& pattern) : pattern_(pattern) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // MATCH_INVALID_UTF: invalid UTF-8 never matches (instead of failing the whole match), so
  // arbitrary bytes can be split; the gaps become pieces of their own in split().
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &error_code,
                                   &error_offset, nullptr);
  DM_CHECK(code != nullptr, "tokenizer pattern: ", pcre2_error_text(error_code), " at offset ",
           error_offset, " in '", pattern, "'");
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // failure is fine: the interpreter runs instead
  compiled_ = code;
}

PreTokenizer::~PreTokenizer() {
  if (compiled_) pcre2_code_free(static_cast<pcre2_code*>(compiled_));
}

bool PreTokenizer::regex_available() { return true; }

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  thread_local Pcre2ThreadState state;
  const pcre2_code* code = static_cast<const pcre2_code*>(compiled_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t offset = 0;
  while (offset < n) {
    int rc = pcre2_match(code, subject, n, offset, 0, state.match_data, state.match_context);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH)  // e.g. JIT stack exhausted: the interpreter uses the heap
      rc = pcre2_match(code, subject, n, offset, PCRE2_NO_JIT, state.match_data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) {
      pieces.push_back(text.substr(offset));
      break;
    }
    DM_CHECK(rc >= 0, "tokenizer pattern: match failed at byte ", offset, " (",
             pcre2_error_text(rc), ")");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.match_data);
    const size_t match_begin = ovector[0];
    size_t match_end = ovector[1];
    if (match_begin > offset) pieces.push_back(text.substr(offset, match_begin - offset));
    if (match_end <= match_begin) match_end = match_begin + 1;  // an empty match: move on one byte
    pieces.push_back(text.substr(match_begin, match_end - match_begin));
    offset = match_end;
  }
}

#else  // no PCRE2: the built-in splitter

PreTokenizer::PreTokenizer(const std::string& pattern) : pattern_(pattern) {}
PreTokenizer::~PreTokenizer() = default;
bool PreTokenizer::regex_available() { return false; }
void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  pretokenize_builtin_split(text, pieces);
}

#endif

}  // namespace dm
