// kvstash-bench serve as a real process: a small stream whose numbers must add up. This checks
// output and accounting, not speed.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <string>

#include <nlohmann/json.hpp>

#include "command.h"

namespace {

using kvstash::test::bench;
using kvstash::test::run;

TEST(BenchServe, AStreamOfSharedPromptsRestoresOffloadedSessionsFromKvstash) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  for (const char* transport : {"shm", "tcp"}) {
    int status = -1;
    const std::string out = run(bench() +
                                    " serve --sessions 4 --system-prompts 1 --system-tokens 512 --turns 2 "
                                    "--user-tokens 64 --answer-tokens 64 --resident 1 --json --transport " +
                                    transport + " 2>&1",
                                &status);
    ASSERT_EQ(WEXITSTATUS(status), 0) << out;
    const auto j = nlohmann::json::parse(out.substr(out.find('{')));
    SCOPED_TRACE(out);
    EXPECT_EQ(j["turns"], 8);
    // Four sessions, one resident at a time: every turn after the first finds its session offloaded.
    EXPECT_GE(j["offloads"].get<int>(), 6);
    // The shared system prompt (2 chunks) is saved once and loaded by the three other sessions.
    EXPECT_GE(j["loaded_tokens"].get<int>(), 3 * 512);
    EXPECT_LE(j["loaded_tokens"].get<int>(), j["prefix_tokens"].get<int>());
    EXPECT_GT(j["hit_rate"].get<double>(), 0.5);
    EXPECT_EQ(j["loaded_bytes"].get<long long>(), j["loaded_chunks"].get<long long>() * 256 * 128 * 1024);
    EXPECT_GT(j["restore_us_per_token"].get<double>(), 0);
    EXPECT_GT(j["redis_bytes_us_per_token"].get<double>(), 0);
    EXPECT_EQ(j["transport"], transport);
  }
}

TEST(BenchServe, BadArgumentsAreUsageErrors) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  run(bench() + " serve --chunk-tokens 100 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  run(bench() + " serve --transport carrier-pigeon 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

}  // namespace
