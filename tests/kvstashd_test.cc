// kvstashd as a process: its command line, config file, admin endpoint and exit codes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "http_get.h"
#include "kvstash/store.h"
#include "tools/common/local_cluster.h"

namespace kvstash {
namespace {

using test::http_get;
using test::metric;

using namespace std::chrono_literals;

std::string kvstashd() { return tools::find_tool("kvstashd"); }

// Runs kvstashd with `args` to completion; returns its exit status and stderr+stdout.
std::pair<int, std::string> run(std::vector<std::string> args, std::chrono::seconds limit = 20s) {
  std::string out = "/tmp/kvstashd-test-" + std::to_string(getpid()) + ".out";
  args.insert(args.begin(), kvstashd());
  std::string cmd = "exec ";
  for (auto& a : args) cmd += "'" + a + "' ";
  auto sh = tools::ChildProcess::start({.argv = {"/bin/sh", "-c", cmd + ">" + out + " 2>&1"}});
  EXPECT_TRUE(sh.is_ok());
  auto rc = sh->wait(deadline_after(limit));
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ::unlink(out.c_str());
  return {rc.value_or(-1), text};
}

TEST(Kvstashd, HelpExplainsEveryOptionAndBadInputExitsTwo) {
  auto [rc, out] = run({"--help"});
  EXPECT_EQ(rc, 0);
  for (const char* flag : {"--capacity", "--page-size", "--redis", "--admin", "--heartbeat-ttl", "--config",
                           "--listen", "--huge-pages", "SIGTERM"}) {
    EXPECT_NE(out.find(flag), std::string::npos) << flag;
  }
  EXPECT_EQ(run({"--capacity", "lots"}).first, 2);
  EXPECT_EQ(run({"--no-such-flag"}).first, 2);
  auto [rc2, out2] = run({"--page-size", "3000", "--capacity", "1MiB"});
  EXPECT_EQ(rc2, 2);
  EXPECT_NE(out2.find("power of two"), std::string::npos) << out2;
  auto [rc3, out3] = run({"--redis", "redis://127.0.0.1:1/0", "--capacity", "4MiB", "--admin", "off"});
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(out3.find("redis"), std::string::npos) << out3;
}

TEST(Kvstashd, ConfigFileAdminEndpointAndHealth) {
  auto redis = tools::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  std::string conf = "/tmp/kvstashd-test-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(conf);
    f << "# a kvstashd configuration\ncapacity = \"64MiB\"\npage-size = \"1MiB\"\nnode-id = \"from-file\"\n"
         "heartbeat-ttl = \"600ms\"\nhuge-pages = \"off\"\n";
  }
  auto node = tools::LocalNode::start(
      {.redis_url = (*redis)->url(), .capacity = "6MiB", .extra_args = {"--config", conf}});
  ::unlink(conf.c_str());
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  EXPECT_EQ((*node)->node_id(), "from-file");
  EXPECT_EQ((*node)->pages(), 6u) << "the command line overrides the file";
  EXPECT_EQ((*node)->page_size(), 1u << 20);
  const std::string admin = (*node)->admin();
  EXPECT_EQ(admin.rfind("127.0.0.1:", 0), 0u) << "the admin endpoint must bind loopback by default";

  auto [code, body] = http_get(admin, "/healthz");
  EXPECT_EQ(code, 200);
  EXPECT_EQ(body, "ok\n");
  auto [mcode, text] = http_get(admin, "/metrics");
  EXPECT_EQ(mcode, 200);
  EXPECT_EQ(metric(text, "kvstash_node_pages"), 6);
  bool beating = false;
  for (int i = 0; i < 100 && !beating; ++i, std::this_thread::sleep_for(20ms)) {
    beating = metric(http_get(admin, "/metrics").second, "kvstash_node_heartbeats_total") >= 1;
  }
  EXPECT_TRUE(beating);
  EXPECT_NE(text.find("kvstash_node_info{node=\"from-file\""), std::string::npos) << text;
  EXPECT_NE(text.find("kvstash_node_transport{transport=\"tcp\"} 1"), std::string::npos) << text;

  // A put shows in the free-page gauge at the next heartbeat.
  auto store = Store::open({.redis_url = (*redis)->url()});
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  std::vector<std::byte> data(2u << 20);
  Slice s{data.data(), data.size()};
  ASSERT_TRUE((*store)->put("k", {&s, 1}).is_ok());
  bool seen = false;
  for (int i = 0; i < 100 && !seen; ++i, std::this_thread::sleep_for(50ms)) {
    seen = metric(http_get(admin, "/metrics").second, "kvstash_node_free_pages") == 4;
  }
  EXPECT_TRUE(seen) << "free pages gauge did not follow the put";

  // Redis goes away: the node says so on /healthz instead of pretending.
  (*redis)->stop();
  bool unhealthy = false;
  for (int i = 0; i < 100 && !unhealthy; ++i, std::this_thread::sleep_for(50ms)) {
    auto [c, b] = http_get(admin, "/healthz");
    unhealthy = c == 503 && b.find("redis") != std::string::npos;
  }
  EXPECT_TRUE(unhealthy);
  EXPECT_EQ(http_get(admin, "/nope").first, 404);
}

TEST(Kvstashd, ASecondDaemonWithTheSameIdIsRefusedAndAMisspeltConfigKeyIsAnError) {
  auto redis = tools::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  const std::string url = (*redis)->url();
  auto first = tools::LocalNode::start({.redis_url = url,
                                        .capacity = "4MiB",
                                        .page_size = "1MiB",
                                        .node_id = "twin",
                                        .extra_args = {"--heartbeat-ttl", "500ms", "--huge-pages", "off"}});
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  auto [rc, out] = run({"--redis", url, "--capacity", "4MiB", "--page-size", "1MiB", "--node-id", "twin",
                        "--heartbeat-ttl", "500ms", "--admin", "off", "--huge-pages", "off"});
  EXPECT_EQ(rc, 2) << "a duplicate node id is a configuration error";
  EXPECT_NE(out.find("held by a live node"), std::string::npos) << out;
  EXPECT_EQ((*first)->terminate(deadline_after(10s)).value_or(-1), 0) << "the first daemon must be unharmed";

  std::string conf = "/tmp/kvstashd-test-extra-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(conf);
    f << "page_sise = \"1MiB\"\n";
  }
  auto [rc2, out2] = run({"--config", conf, "--redis", url});
  ::unlink(conf.c_str());
  EXPECT_EQ(rc2, 2);
  EXPECT_NE(out2.find("page_sise"), std::string::npos) << out2;
}

}  // namespace
}  // namespace kvstash
