// The logging facade's rate limit (common/log.h): a call site a peer can trigger in a loop
// logs a burst, then one line a second, and says how many it dropped.
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>

#include <chrono>
#include <thread>

#include "common/log.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

TEST(LogLimiter, ABurstThenOneASecond) {
  log::Limiter limiter;
  const Clock::time_point t0 = Clock::now();
  std::uint64_t dropped = 99;
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(limiter.allow(&dropped, t0)) << i;
  EXPECT_EQ(dropped, 0u);
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(limiter.allow(&dropped, t0));
  EXPECT_FALSE(limiter.allow(&dropped, t0 + 500ms));
  ASSERT_TRUE(limiter.allow(&dropped, t0 + 1100ms));
  EXPECT_EQ(dropped, 1001u) << "the line that goes out says how many were dropped";
  EXPECT_FALSE(limiter.allow(&dropped, t0 + 1200ms));
}

TEST(LogLimiter, AFloodingCallSiteWritesAFewLinesAndTheCountOfTheRest) {
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(4096);
  sink->set_pattern("%v");
  log::get().sinks().push_back(sink);
  const auto level = log::get().level();
  log::get().set_level(spdlog::level::warn);
  auto flood = [](int i) { KVSTASH_LOG_WARN_LIMITED("refused peer {}", i); };
  for (int i = 0; i < 19000; ++i) flood(i);
  EXPECT_EQ(sink->last_formatted().size(), 10u) << "a burst of 10, then nothing within the second";
  std::this_thread::sleep_for(1100ms);
  flood(19000);
  const auto lines = sink->last_formatted();
  log::get().sinks().pop_back();
  log::get().set_level(level);
  ASSERT_EQ(lines.size(), 12u);
  EXPECT_EQ(lines[10], "18990 similar messages suppressed (this line is rate-limited)\n");
  EXPECT_EQ(lines[11], "refused peer 19000\n");
}

}  // namespace
}  // namespace kvstash
