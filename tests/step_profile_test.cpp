// StepProfile (runner/step_profile.h): marks split a step into parts, parts of one kind add up over layers
// and steps, and misuse is an error rather than a wrong profile. The decoder's marks are checked through
// `sparrow bench forward --profile` in cli_test.cpp.
#include "runner/step_profile.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/error.h"

using namespace sparrow;

TEST(StepProfile, PartsAddUpByKindOverLayersAndSteps) {
  StepProfile profile;
  for (int step = 0; step < 2; ++step) {
    profile.start(Device::Cpu);
    profile.mark("embedding");
    for (int layer = 0; layer < 3; ++layer) {
      if (layer == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      profile.mark(layer == 1 ? "mixer slow" : "mixer fast");
    }
    profile.mark("lm_head");
    profile.end_step();
  }
  EXPECT_EQ(profile.steps(), 2);
  ASSERT_EQ(profile.parts().size(), 4u);
  const auto& parts = profile.parts();
  EXPECT_EQ(parts[0].name, "embedding");
  EXPECT_EQ(parts[1].name, "mixer fast");  // in the order first seen
  EXPECT_EQ(parts[2].name, "mixer slow");
  EXPECT_EQ(parts[3].name, "lm_head");
  EXPECT_EQ(parts[0].count, 2);
  EXPECT_EQ(parts[1].count, 4);  // two layers a step
  EXPECT_EQ(parts[2].count, 2);
  // The 20 ms sleeps land in the part whose mark ends them, and the parts add up to the whole.
  EXPECT_GE(parts[2].seconds, 0.040);
  double sum = 0;
  for (const auto& p : parts) {
    EXPECT_GE(p.seconds, 0.0) << p.name;
    sum += p.seconds;
  }
  EXPECT_DOUBLE_EQ(profile.seconds(), sum);
  EXPECT_GT(parts[2].seconds, 10 * (parts[0].seconds + parts[1].seconds + parts[3].seconds));
}

TEST(StepProfile, MisuseIsAnError) {
  StepProfile profile;
  EXPECT_THROW(profile.mark("x"), Error);   // no step
  EXPECT_THROW(profile.end_step(), Error);  // no step
  profile.start(Device::Cpu);
  EXPECT_TRUE(profile.active());
  EXPECT_THROW(profile.start(Device::Cpu), Error);  // a step inside a step
}
