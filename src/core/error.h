// Error type of the engine: every failure a user can cause (bad file, bad config, bad request)
// becomes one dm::Error with a single line naming the file / tensor / field. The CLI turns it
// into exit code 1; nothing in the library aborts on bad input.
#pragma once
#include <stdexcept>
#include <string>

namespace dm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Concatenates its arguments with operator<< into a string (for error messages).
template <typename... Args>
std::string str_cat(const Args&... args);

}  // namespace dm

#include <sstream>
namespace dm {
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace dm

#define DM_CHECK(cond, ...)                                   \
  do {                                                        \
    if (!(cond)) throw ::dm::Error(::dm::str_cat(__VA_ARGS__)); \
  } while (0)
