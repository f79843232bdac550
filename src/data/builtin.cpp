// Synthetic English corpus and token-stream entropies. See builtin.h.
#include "data/builtin.h"

#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "data/random.h"

namespace dm {

namespace {
struct EnglishNoun {
  const char* singular;
  const char* plural;
};
struct EnglishVerb {
  const char* base;
  const char* third_person;  // he/she/it form
  const char* past;
};
struct EnglishPerson {
  const char* name;
  bool female;
};

const std::vector<EnglishPerson> kPeople = {
    {"Anna", true},  {"Ben", false},   {"Clara", true}, {"David", false}, {"Emma", true},
    {"Felix", false}, {"Grace", true}, {"Henry", false}, {"Iris", true},  {"Jack", false},
    {"Kate", true},  {"Leo", false},   {"Mia", true},   {"Noah", false},  {"Olivia", true},
    {"Peter", false}, {"Rosa", true},  {"Sam", false},  {"Tara", true},   {"Victor", false}};
const std::vector<EnglishNoun> kThings = {
    {"apple", "apples"}, {"pear", "pears"},     {"book", "books"},     {"cup", "cups"},
    {"key", "keys"},     {"lamp", "lamps"},     {"chair", "chairs"},   {"table", "tables"},
    {"boat", "boats"},   {"box", "boxes"},      {"stone", "stones"},   {"letter", "letters"},
    {"coin", "coins"},   {"basket", "baskets"}, {"candle", "candles"}, {"shell", "shells"},
    {"kite", "kites"},   {"hat", "hats"},       {"ball", "balls"},     {"map", "maps"},
    {"brush", "brushes"}, {"glass", "glasses"}, {"knife", "knives"},   {"leaf", "leaves"}};
const std::vector<EnglishNoun> kBeings = {
    {"cat", "cats"},         {"dog", "dogs"},       {"bird", "birds"},       {"horse", "horses"},
    {"fox", "foxes"},        {"mouse", "mice"},     {"sheep", "sheep"},      {"child", "children"},
    {"teacher", "teachers"}, {"farmer", "farmers"}, {"baker", "bakers"},     {"doctor", "doctors"},
    {"sailor", "sailors"},   {"goose", "geese"},    {"rabbit", "rabbits"},   {"student", "students"}};
const std::vector<const char*> kAdjectives = {
    "small", "big",  "old",   "young", "quiet", "happy", "tired", "bright", "dark",  "heavy",
    "light", "warm", "cold",  "clever", "brave", "shy",  "busy",  "gentle", "noisy", "careful"};
const std::vector<const char*> kColours = {"red",   "blue",   "green", "yellow", "white",
                                           "black", "orange", "brown", "grey",   "purple"};
const std::vector<EnglishVerb> kTransitiveVerbs = {
    {"see", "sees", "saw"},          {"find", "finds", "found"},      {"carry", "carries", "carried"},
    {"like", "likes", "liked"},      {"watch", "watches", "watched"}, {"paint", "paints", "painted"},
    {"buy", "buys", "bought"},       {"sell", "sells", "sold"},       {"open", "opens", "opened"},
    {"count", "counts", "counted"},  {"clean", "cleans", "cleaned"},  {"build", "builds", "built"},
    {"follow", "follows", "followed"}, {"help", "helps", "helped"},   {"hide", "hides", "hid"},
    {"bring", "brings", "brought"},  {"draw", "draws", "drew"},       {"hold", "holds", "held"}};
const std::vector<EnglishVerb> kIntransitiveVerbs = {
    {"sleep", "sleeps", "slept"}, {"run", "runs", "ran"},         {"sing", "sings", "sang"},
    {"wait", "waits", "waited"},  {"laugh", "laughs", "laughed"}, {"rest", "rests", "rested"},
    {"play", "plays", "played"},  {"work", "works", "worked"},    {"sit", "sits", "sat"}};
const std::vector<const char*> kPlaces = {"kitchen", "garden", "market",  "school", "forest",
                                          "village", "library", "harbour", "station", "field",
                                          "bakery",  "barn"};
const std::vector<const char*> kPrepositions = {"in", "near", "behind", "under", "next to", "beside"};
const std::vector<const char*> kDays = {"Monday", "Tuesday", "Wednesday", "Thursday",
                                        "Friday", "Saturday", "Sunday"};
const std::vector<const char*> kMonths = {"January", "February", "March",     "April",   "May",      "June",
                                          "July",    "August",   "September", "October", "November", "December"};

std::string english_number_word(int64_t n) {
  static const char* const small[] = {"zero",    "one",     "two",       "three",    "four",
                                      "five",    "six",     "seven",     "eight",    "nine",
                                      "ten",     "eleven",  "twelve",    "thirteen", "fourteen",
                                      "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"};
  static const char* const tens[] = {"", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy",
                                     "eighty", "ninety"};
  if (n < 0) return "minus " + english_number_word(-n);
  if (n < 20) return small[n];
  if (n < 100) return std::string(tens[n / 10]) + (n % 10 ? std::string("-") + small[n % 10] : "");
  return std::to_string(n);
}

std::string capitalised(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = char(s[0] - 32);
  return s;
}

// Writes one document; the state (protagonist, a friend, object colours) ties sentences of the
// document together so that some tokens are predictable only from earlier in the document.
class SyntheticEnglishWriter {
 public:
  explicit SyntheticEnglishWriter(uint64_t seed) : rng_(seed) {
    hero_ = rng_.pick(kPeople);
    do friend_ = rng_.pick(kPeople);
    while (friend_.name == hero_.name);
    home_ = rng_.pick(kPlaces);
  }

  std::string document(int num_sentences) {
    std::string out = capitalised(str_cat(hero_.name, " and the ", rng_.pick(kAdjectives), " ",
                                          rng_.pick(kThings).singular)) + "\n\n";
    int in_paragraph = 0;
    for (int s = 0; s < num_sentences; ++s) {
      out += sentence();
      if (++in_paragraph >= 3 && rng_.coin(0.4)) {
        out += "\n\n";
        in_paragraph = 0;
      } else if (s + 1 < num_sentences) {
        out += " ";
      }
    }
    out += "\n";
    return out;
  }

 private:
  const char* pronoun() const { return hero_.female ? "she" : "he"; }
  const char* possessive() const { return hero_.female ? "her" : "his"; }
  std::string counted(int64_t n, const EnglishNoun& noun, bool words) {
    return str_cat(words ? english_number_word(n) : std::to_string(n), " ",
                   n == 1 ? noun.singular : noun.plural);
  }
  // "the old dog" / "the foxes" / "Anna"; sets `plural`.
  std::string subject(bool& plural) {
    const int kind = int(rng_.uniform(4));
    plural = false;
    if (kind == 0) return hero_.name;
    if (kind == 1) return pronoun();
    const EnglishNoun& n = rng_.pick(kBeings);
    plural = rng_.coin(0.4);
    std::string s = "the ";
    if (rng_.coin(0.5)) s += str_cat(rng_.pick(kAdjectives), " ");
    return s + (plural ? n.plural : n.singular);
  }
  std::string object_phrase() {
    const EnglishNoun& n = rng_.pick(kThings);
    if (rng_.coin(0.3)) return str_cat(possessive(), " ", n.singular);
    if (rng_.coin(0.3)) return str_cat("the ", rng_.pick(kColours), " ", n.plural);
    return str_cat("the ", n.singular);
  }

  std::string sentence() {
    switch (rng_.uniform(12)) {
      case 0: case 1: {  // transitive, tense from the time adverb, verb agrees with the subject
        bool plural = false;
        const std::string subj = subject(plural);
        const EnglishVerb& v = rng_.pick(kTransitiveVerbs);
        if (rng_.coin(0.4))
          return str_cat("Yesterday ", subj, " ", v.past, " ", object_phrase(), ".");
        return capitalised(str_cat(subj, " ", plural ? v.base : v.third_person, " ", object_phrase(),
                                   " every ", rng_.pick(kDays), "."));
      }
      case 2: {  // intransitive with a place
        bool plural = false;
        const std::string subj = subject(plural);
        const EnglishVerb& v = rng_.pick(kIntransitiveVerbs);
        return capitalised(str_cat(subj, " ", plural ? v.base : v.third_person, " ",
                                   rng_.pick(kPrepositions), " the ", rng_.pick(kPlaces), "."));
      }
      case 3: {  // a list with its total
        const int64_t a = rng_.uniform_range(1, 9), b = rng_.uniform_range(1, 9), c = rng_.uniform_range(1, 9);
        const EnglishNoun &x = kThings[rng_.uniform(8)], &y = kThings[8 + rng_.uniform(8)],
                          &z = kThings[16 + rng_.uniform(8)];
        return str_cat(hero_.name, " bought ", counted(a, x, true), ", ", counted(b, y, true), " and ",
                       counted(c, z, true), " at the market, so ", pronoun(), " carried ",
                       english_number_word(a + b + c), " things home.");
      }
      case 4: {  // arithmetic facts in digits
        const int op = int(rng_.uniform(3));
        if (op == 0) {
          const int64_t a = rng_.uniform_range(0, 99), b = rng_.uniform_range(0, 99);
          return str_cat(a, " plus ", b, " is ", a + b, ".");
        }
        if (op == 1) {
          const int64_t a = rng_.uniform_range(0, 99), b = rng_.uniform_range(0, a);
          return str_cat(a, " minus ", b, " is ", a - b, ".");
        }
        const int64_t a = rng_.uniform_range(0, 12), b = rng_.uniform_range(0, 12);
        return str_cat(a, " times ", b, " is ", a * b, ".");
      }
      case 5: {  // arithmetic in words
        const int64_t a = rng_.uniform_range(0, 10), b = rng_.uniform_range(0, 10);
        return capitalised(str_cat(english_number_word(a), " and ", english_number_word(b), " make ",
                                   english_number_word(a + b), "."));
      }
      case 6: {  // counting sequence
        const int64_t start = rng_.uniform_range(0, 20), step = rng_.uniform_range(1, 9);
        std::string s = str_cat("Counting by ", english_number_word(step), ": ");
        for (int i = 0; i < 6; ++i) s += str_cat(start + i * step, i < 5 ? ", " : ".");
        return s;
      }
      case 7: {  // comparison
        const int64_t a = rng_.uniform_range(0, 50), b = rng_.uniform_range(0, 50);
        if (a == b) return str_cat(a, " is equal to ", b, ".");
        return str_cat(a, a > b ? " is more than " : " is less than ", b, ".");
      }
      case 8: {  // a colour fact, asked back later in the document
        if (!colour_facts_.empty() && rng_.coin(0.5)) {
          const auto& [thing, colour] = colour_facts_[rng_.uniform(colour_facts_.size())];
          return str_cat("What colour is the ", thing, "? The ", thing, " is ", colour, ".");
        }
        const std::string thing = rng_.pick(kThings).singular;
        for (const auto& f : colour_facts_)
          if (f.first == thing) return str_cat("The ", thing, " is still ", f.second, ".");
        colour_facts_.emplace_back(thing, rng_.pick(kColours));
        return str_cat("The ", thing, " in the ", home_, " is ", colour_facts_.back().second, ".");
      }
      case 9: {  // dialogue between the two characters
        const std::string thing = rng_.pick(kThings).singular;
        return str_cat("\"Where is the ", thing, "?\" asked ", friend_.name, ". \"It is ",
                       rng_.pick(kPrepositions), " the ", rng_.pick(kThings).singular, ",\" said ",
                       hero_.name, ".");
      }
      case 10: {  // calendar order
        if (rng_.coin(0.5)) {
          const size_t d = rng_.uniform(7);
          return str_cat("After ", kDays[d], " comes ", kDays[(d + 1) % 7], ".");
        }
        const size_t m = rng_.uniform(12);
        return str_cat("The month after ", kMonths[m], " is ", kMonths[(m + 1) % 12], ".");
      }
      default: {  // question and answer
        const int64_t a = rng_.uniform_range(1, 30), b = rng_.uniform_range(1, 30);
        return str_cat("Question: what is ", a, " plus ", b, "? Answer: ", a + b, ".");
      }
    }
  }

  DataRng rng_;
  EnglishPerson hero_{}, friend_{};
  const char* home_ = nullptr;
  std::vector<std::pair<std::string, std::string>> colour_facts_;
};
}  // namespace

std::string synthetic_english_document(uint64_t seed, int64_t index, int min_sentences,
                                       int max_sentences) {
  DM_CHECK(min_sentences >= 1 && max_sentences >= min_sentences,
           "synthetic English: need 1 <= min_sentences <= max_sentences");
  DataRng length_rng(seed_mix(seed, uint64_t(index), 1));
  const int sentences = int(length_rng.uniform_range(min_sentences, max_sentences));
  SyntheticEnglishWriter writer(seed_mix(seed, uint64_t(index), 2));
  return writer.document(sentences);
}

std::vector<std::string> synthetic_english_corpus(const SyntheticEnglishOptions& options) {
  DM_CHECK(options.num_documents >= 0, "synthetic English: num_documents must be >= 0");
  std::vector<std::string> docs(size_t(options.num_documents));
#pragma omp parallel for schedule(dynamic, 64)
  for (int64_t i = 0; i < options.num_documents; ++i)
    docs[size_t(i)] = synthetic_english_document(options.seed, i, options.min_sentences,
                                                 options.max_sentences);
  return docs;
}

// ---------------------------------------------------------------------------------------------
double unigram_entropy_nats(std::span<const int32_t> tokens) {
  if (tokens.empty()) return 0.0;
  std::unordered_map<int32_t, int64_t> counts;
  for (int32_t t : tokens) ++counts[t];
  const double n = double(tokens.size());
  double h = 0;
  for (const auto& [id, c] : counts) {
    const double p = double(c) / n;
    h -= p * std::log(p);
  }
  return h;
}

double bigram_conditional_entropy_nats(std::span<const int32_t> tokens) {
  if (tokens.size() < 2) return 0.0;
  std::unordered_map<uint64_t, int64_t> pair_counts;
  std::unordered_map<int32_t, int64_t> prev_counts;
  for (size_t i = 1; i < tokens.size(); ++i) {
    ++pair_counts[(uint64_t(uint32_t(tokens[i - 1])) << 32) | uint32_t(tokens[i])];
    ++prev_counts[tokens[i - 1]];
  }
  const double n = double(tokens.size() - 1);
  double h = 0;  // −Σ p(a,b) log p(b|a)
  for (const auto& [key, c] : pair_counts) {
    const int64_t prev = prev_counts[int32_t(uint32_t(key >> 32))];
    h -= double(c) / n * std::log(double(c) / double(prev));
  }
  return h;
}

}  // namespace dm
