// kvstash-bench p2p as a real process: its --json rows carry the documented fields and every
// row's data was verified. Sizes and time are tiny: this checks output, not speed.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>
#include <vector>

#include "command.h"

namespace {

using kvstash::test::bench;
using kvstash::test::run;

TEST(BenchP2P, JsonRowsCarryTheDocumentedFieldsForEveryTransport) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  std::string out =
      run(bench() + " p2p --transport tcp,shm --sizes 4KiB,1MiB --seconds 0.05 --json", &status);
  ASSERT_EQ(status, 0) << out;
  std::map<std::string, int> rows;  // "transport/op" -> count
  std::size_t n = 0;
  std::size_t start = 0;
  while (start < out.size()) {
    std::size_t end = out.find('\n', start);
    std::string line = out.substr(start, end - start);
    start = end == std::string::npos ? out.size() : end + 1;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << "not JSON: " << line;
    for (const char* field : {"transport", "op", "size", "threads", "gbps", "p50_us", "p99_us"}) {
      ASSERT_TRUE(j.contains(field)) << field << " missing in " << line;
    }
    EXPECT_FALSE(j.contains("error")) << line;
    const std::string t = j["transport"];
    rows[t + "/" + std::string(j["op"])]++;
    if (t == "tcp" || t == "shm") {
      EXPECT_EQ(j["verified"], true) << line;
      EXPECT_GT(j["gbps"].get<double>(), 0) << line;
      EXPECT_GT(j["p50_us"].get<double>(), 0) << line;
      EXPECT_GE(j["p99_us"].get<double>(), j["p50_us"].get<double>()) << line;
      EXPECT_TRUE(j.contains("vs_memcpy") && j.contains("vs_socket")) << line;
      // A small tcp transfer's latency is held to a raw round trip of its size.
      EXPECT_EQ(j.contains("p50_vs_pingpong"), t == "tcp" && j["size"] == 4096) << line;
    }
    if (j["op"] == "pingpong") {
      EXPECT_GT(j["p50_us"].get<double>(), 0) << line;
    }
    ++n;
  }
  // Two sizes: a memcpy and a socket reference each, a ping-pong for the small one, and
  // write+read per transport.
  EXPECT_EQ(rows["memcpy/copy"], 2);
  EXPECT_EQ(rows["tcp-socket/stream"], 2);
  EXPECT_EQ(rows["tcp-socket/pingpong"], 1);
  for (const char* key : {"tcp/write", "tcp/read", "shm/write", "shm/read"}) EXPECT_EQ(rows[key], 2) << key;
  EXPECT_EQ(n, 13u);
}

// --tls: tcp over TLS is measured in the same run, right after plain tcp, against the same
// references, and its bytes verified too.
TEST(BenchP2P, TlsRowsStandBesidePlainTcpRows) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  std::string out = run(bench() + " p2p --transport tcp --tls --sizes 64KiB --seconds 0.05 --json", &status);
  ASSERT_EQ(status, 0) << out;
  std::vector<std::string> order;
  std::size_t start = 0;
  while (start < out.size()) {
    std::size_t end = out.find('\n', start);
    std::string line = out.substr(start, end - start);
    start = end == std::string::npos ? out.size() : end + 1;
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (line.empty() || j.is_discarded() || j["transport"] == "memcpy" || j["transport"] == "tcp-socket") continue;
    EXPECT_FALSE(j.contains("error")) << line;
    EXPECT_EQ(j["verified"], true) << line;
    EXPECT_TRUE(j.contains("vs_memcpy") && j.contains("vs_socket") && j.contains("p50_vs_pingpong")) << line;
    order.push_back(std::string(j["transport"]) + "/" + std::string(j["op"]));
  }
  EXPECT_EQ(order, (std::vector<std::string>{"tcp/write", "tcp/read", "tcp+tls/write", "tcp+tls/read"})) << out;
}

TEST(BenchP2P, RunsAgainstASeparatelyStartedTarget) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  char dir[] = "/tmp/kvstash-bench-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string lines = std::string(dir) + "/target.txt";
  int in[2];
  ASSERT_EQ(pipe(in), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(in[0], 0);
    close(in[1]);
    int out = open(lines.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(out, 1);
    execl(bench().c_str(), bench().c_str(), "p2p-target", "--region", "2MiB", "--transports", "tcp", nullptr);
    _exit(127);
  }
  close(in[0]);
  // Wait for its three lines (address, key, socket).
  std::string text;
  for (int i = 0; i < 500 && std::count(text.begin(), text.end(), '\n') < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ifstream f(lines);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  int status = -1;
  std::string out =
      run(bench() + " p2p --peer " + lines + " --transport tcp --sizes 1MiB --seconds 0.05 --json", &status);
  close(in[1]);  // the target exits when its stdin closes
  int target_status = -1;
  waitpid(pid, &target_status, 0);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(status, 0) << out;
  EXPECT_EQ(WEXITSTATUS(target_status), 0);
  EXPECT_NE(out.find("tcp"), std::string::npos) << out;
  EXPECT_NE(out.find("\"verified\":true"), std::string::npos) << out;
}

TEST(BenchP2P, BadArgumentsAreUsageErrors) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  run(bench() + " p2p --sizes 12XB 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  run(bench() + " p2p --transport carrier-pigeon 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  run(bench() + " p2p-target --transports carrier-pigeon 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  std::string out = run(bench() + " p2p --help", &status);
  EXPECT_EQ(status, 0);
  EXPECT_NE(out.find("--json"), std::string::npos);
}

// The cluster token comes from a file or KVSTASH_CLUSTER_TOKEN; an empty or short one is a
// usage error (never "no token"), and --token on the command line still works but is warned
// about (it shows in ps), and the target the bench spawns never sees it in its argv.
TEST(BenchP2P, TheTokenComesFromAFileOrTheEnvironmentAndIsNeverEmpty) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  std::string out = run("env -u KVSTASH_CLUSTER_TOKEN " + bench() + " p2p --token '' --seconds 0.05 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2) << out;
  EXPECT_NE(out.find("empty"), std::string::npos) << out;
  out = run("env -u KVSTASH_CLUSTER_TOKEN " + bench() + " p2p-target --token short 2>&1 </dev/null", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2) << out;
  EXPECT_NE(out.find("at least 16 bytes"), std::string::npos) << out;
  out = run("KVSTASH_CLUSTER_TOKEN= " + bench() + " p2p --seconds 0.05 2>&1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2) << out;

  const std::string file = "/tmp/kvstash-bench-token-" + std::to_string(::getpid());
  std::ofstream(file) << "bench-cluster-token-0123456789\n";
  ::chmod(file.c_str(), 0600);
  out = run("env -u KVSTASH_CLUSTER_TOKEN " + bench() + " p2p --token-file " + file +
                " --transport tcp --sizes 4KiB --seconds 0.05 --json 2>&1",
            &status);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("tcp"), std::string::npos) << out;
  out = run("env -u KVSTASH_CLUSTER_TOKEN " + bench() +
                " p2p --token bench-cluster-token-0123456789 --transport tcp --sizes 4KiB --seconds 0.05 2>&1",
            &status);
  EXPECT_EQ(status, 0) << out;
  EXPECT_NE(out.find("--token shows the cluster token in ps"), std::string::npos) << out;
  ::unlink(file.c_str());
}

}  // namespace
