// core/env.h: the strict readers of the DM_* switches.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/env.h"
#include "core/error.h"
#include "test_util.h"

namespace dm {
namespace {

using test::ScopedEnv;

constexpr const char* kVar = "DM_TEST_ENV_SWITCH";

TEST(Env, FlagTakesZeroOneAndFallsBackWhenUnsetOrEmpty) {
  {
    ScopedEnv e(kVar, nullptr);
    EXPECT_TRUE(env_flag(kVar, true));
    EXPECT_FALSE(env_flag(kVar, false));
  }
  {
    ScopedEnv e(kVar, "");
    EXPECT_TRUE(env_flag(kVar, true));
  }
  {
    ScopedEnv e(kVar, "0");
    EXPECT_FALSE(env_flag(kVar, true));
  }
  {
    ScopedEnv e(kVar, "1");
    EXPECT_TRUE(env_flag(kVar, false));
  }
}

TEST(Env, FlagRejectsOtherValuesNamingTheVariable) {
  for (const char* bad : {"yes", "true", "2", " 1", "off"}) {
    ScopedEnv e(kVar, bad);
    try {
      env_flag(kVar, true);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(kVar), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find(bad), std::string::npos) << err.what();
    }
  }
}

TEST(Env, ChoiceIndexesItsValuesWithTheFirstAsDefault) {
  {
    ScopedEnv e(kVar, nullptr);
    EXPECT_EQ(env_choice(kVar, {"auto", "staged", "regs"}), 0);
  }
  {
    ScopedEnv e(kVar, "");
    EXPECT_EQ(env_choice(kVar, {"auto", "staged", "regs"}), 0);
  }
  {
    ScopedEnv e(kVar, "regs");
    EXPECT_EQ(env_choice(kVar, {"auto", "staged", "regs"}), 2);
  }
  {
    ScopedEnv e(kVar, "auto");
    EXPECT_EQ(env_choice(kVar, {"auto", "staged", "regs"}), 0);
  }
}

TEST(Env, ChoiceRejectsUnknownValuesListingTheAllowedOnes) {
  ScopedEnv e(kVar, "Staged");
  try {
    env_choice(kVar, {"auto", "staged", "regs"});
    ADD_FAILURE() << "accepted a value outside the list";
  } catch (const Error& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find(kVar), std::string::npos) << what;
    EXPECT_NE(what.find("auto, staged, regs"), std::string::npos) << what;
    EXPECT_NE(what.find("'Staged'"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace dm
