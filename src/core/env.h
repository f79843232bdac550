// Switches read from the environment (the DM_* variables docs/gpu.md lists): kernel A/B
// choices and diagnostics that a user or a benchmark flips without a rebuild. A switch is
// strict: a value it does not know is an error naming the variable, never a silent default.
#pragma once
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

#include "core/error.h"

namespace dm {

// "1" → true, "0" → false, unset or empty → fallback; anything else throws dm::Error.
inline bool env_flag(const char* var, bool fallback) {
  const char* env = std::getenv(var);
  if (env == nullptr || env[0] == '\0') return fallback;
  DM_CHECK(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, var,
           " must be '0' or '1', got '", env, "'");
  return env[0] == '1';
}

// A switch with named values: the index of its value in `values`; unset or empty → 0 (values[0]
// names the default). A value not in the list throws dm::Error naming the variable and the list.
inline int env_choice(const char* var, std::initializer_list<const char*> values) {
  const char* env = std::getenv(var);
  if (env == nullptr || env[0] == '\0') return 0;
  int index = 0;
  std::string allowed;
  for (const char* v : values) {
    if (std::strcmp(env, v) == 0) return index;
    allowed += (index++ ? ", " : "") + std::string(v);
  }
  throw Error(str_cat(var, " must be one of ", allowed, "; got '", env, "'"));
}

}  // namespace dm
