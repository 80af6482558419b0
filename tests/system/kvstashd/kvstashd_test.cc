// kvstashd as a process: its command line, config file, admin endpoint, cluster token and exit
// codes.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "http_get.h"
#include "kvstash/store.h"
#include "redis_server.h"
#include "test_pki.h"
#include "tests/harness/local_cluster.h"
#include "tests/harness/throwaway_tls.h"

namespace kvstash {
namespace {

using test::http_get;
using test::metric;

using namespace std::chrono_literals;

std::string kvstashd() { return harness::find_tool("kvstashd"); }

// Runs kvstashd with `args` to completion; returns its exit status and stderr+stdout. `env`
// runs in the shell first ("export NAME=value; ").
std::pair<int, std::string> run(std::vector<std::string> args, std::chrono::seconds limit = 20s,
                                const std::string& env = {}) {
  std::string out = "/tmp/kvstashd-test-" + std::to_string(getpid()) + ".out";
  args.insert(args.begin(), kvstashd());
  std::string cmd = env + "exec ";
  for (auto& a : args) cmd += "'" + a + "' ";
  auto sh = harness::ChildProcess::start({.argv = {"/bin/sh", "-c", cmd + ">" + out + " 2>&1"}});
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
  for (const char* flag :
       {"--capacity", "--page-size", "--redis", "--admin", "--heartbeat-ttl", "--config", "--listen",
        "--huge-pages", "--cluster-token-file", "KVSTASH_CLUSTER_TOKEN", "SIGTERM"}) {
    EXPECT_NE(out.find(flag), std::string::npos) << flag;
  }
  EXPECT_EQ(run({"--capacity", "lots"}).first, 2);
  EXPECT_EQ(run({"--no-such-flag"}).first, 2);
  auto [rc2, out2] = run({"--page-size", "3000", "--capacity", "1MiB"});
  EXPECT_EQ(rc2, 2);
  EXPECT_NE(out2.find("power of two"), std::string::npos) << out2;
  auto [rc3, out3] = run(
      {"--redis", "redis://127.0.0.1:1/0", "--capacity", "4MiB", "--admin", "off", "--join-timeout", "0s"});
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(out3.find("redis"), std::string::npos) << out3;
}

// The connection caps are flags, the help shows no password in a URL, and settings that expose
// or endanger the node are said loudly at start: serving a network without a cluster token,
// and caps the file-descriptor limit cannot hold.
TEST(Kvstashd, CapsAreFlagsAndRiskySettingsAreSaidAtStart) {
  ::unsetenv("KVSTASH_CLUSTER_TOKEN");
  auto [rc, help] = run({"--help"});
  EXPECT_EQ(rc, 0);
  for (const char* flag : {"--max-connections", "--max-unproven-connections", "--redis-password-file /"}) {
    EXPECT_NE(help.find(flag), std::string::npos) << flag << " in:\n" << help;
  }
  EXPECT_EQ(help.find(":secret@"), std::string::npos) << "the example puts a password in the URL";
  EXPECT_NE(help.find("shows in `ps`"), std::string::npos) << help;

  // A Redis that is not there: kvstashd checks its settings, says what it must, then fails
  // (at once: no --join-timeout to wait for it).
  const std::vector<std::string> base = {
      "--redis", "redis://127.0.0.1:1/0", "--capacity", "4MiB",           "--admin", "off", "--huge-pages",
      "off",     "--transports",          "tcp",        "--join-timeout", "0s"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  auto [rc_open, open] = run(with({"--listen", "0.0.0.0:0"}), 10s);
  EXPECT_EQ(rc_open, 1) << open;
  EXPECT_NE(open.find("WARNING: serving 0.0.0.0:0 without a cluster token"), std::string::npos) << open;
  auto [rc_lo, lo] = run(with({"--listen", "127.0.0.1:0"}), 10s);
  EXPECT_EQ(lo.find("without a cluster token"), std::string::npos) << "loopback is the safe default: " << lo;
  EXPECT_EQ(lo.find("holds a password"), std::string::npos) << lo;
  // A password in a URL on the command line: said; the same URL from the environment: not.
  std::vector<std::string> pw_args = with({});
  pw_args[1] = "redis://:pw-0123456789@127.0.0.1:1/0";
  auto [rc_pw, pw] = run(pw_args, 10s);
  EXPECT_NE(pw.find("holds a password"), std::string::npos) << pw;
  EXPECT_EQ(pw.find("pw-0123456789"), std::string::npos) << "the password is never echoed: " << pw;
  std::vector<std::string> env_args = with({});
  env_args.erase(env_args.begin(), env_args.begin() + 2);
  auto [rc_env_pw, env_pw] =
      run(env_args, 10s, "export KVSTASH_REDIS_URL=redis://:pw-0123456789@127.0.0.1:1/0; ");
  EXPECT_EQ(env_pw.find("holds a password"), std::string::npos) << env_pw;

  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  const std::string huge = std::to_string(limit.rlim_max == RLIM_INFINITY ? 1000000 : limit.rlim_max);
  auto [rc_caps, caps] = run(with({"--max-connections", huge}), 10s);
  EXPECT_NE(caps.find("RLIMIT_NOFILE"), std::string::npos) << caps;
  EXPECT_NE(caps.find("--max-connections"), std::string::npos) << caps;
  EXPECT_EQ(run(with({"--max-connections", "0"}), 10s).first, 2);
}

// kvstashd raises its soft descriptor limit to the hard one: the default caps need more than
// the usual soft 1,024.
TEST(Kvstashd, RaisesItsDescriptorLimit) {
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max <= 1024) GTEST_SKIP() << "the hard limit here is " << saved.rlim_max;
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  rlimit low = saved;
  low.rlim_cur = 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);  // inherited by the node
  auto node =
      harness::LocalNode::start({.redis_url = (*redis)->url(), .capacity = "4MiB", .page_size = "1MiB"});
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  std::ifstream limits("/proc/" + std::to_string((*node)->pid()) + "/limits");
  std::string line;
  bool found = false;
  while (std::getline(limits, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    found = true;
    std::istringstream in(line.substr(std::string("Max open files").size()));
    std::string soft, hard;
    in >> soft >> hard;
    EXPECT_EQ(soft, hard) << line;
  }
  EXPECT_TRUE(found);
}

TEST(Kvstashd, ConfigFileAdminEndpointAndHealth) {
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  std::string conf = "/tmp/kvstashd-test-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(conf);
    f << "# a kvstashd configuration\ncapacity = \"64MiB\"\npage-size = \"1MiB\"\nnode-id = \"from-file\"\n"
         "heartbeat-ttl = \"600ms\"\nhuge-pages = \"off\"\n";
  }
  auto node = harness::LocalNode::start(
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
  auto store = Store::open({.redis_url = (*redis)->url(), .put_reservation = 0});  // its own two pages
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
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  const std::string url = (*redis)->url();
  auto first = harness::LocalNode::start({.redis_url = url,
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

// Writes `content` to `path` with exactly `mode` (whatever the umask).
void write_file(const std::string& path, const std::string& content, mode_t mode) {
  std::ofstream(path, std::ios::trunc) << content;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0) << path;
}

// /healthz and /metrics answer at once while Redis is stopped (SIGSTOP): the node's loop is
// then stuck in a Redis command for its whole timeout, and the probes must not wait for it.
TEST(Kvstashd, HealthAndMetricsDoNotWaitForRedis) {
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  // A 6 s heartbeat TTL: each Redis command of the loop may take 2 s.
  auto node = harness::LocalNode::start({.redis_url = (*redis)->url(),
                                         .capacity = "4MiB",
                                         .page_size = "1MiB",
                                         .extra_args = {"--heartbeat-ttl", "6s", "--transports", "tcp"}});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  const std::string admin = (*node)->admin();
  ASSERT_EQ(http_get(admin, "/healthz").first, 200);
  ASSERT_EQ(::kill((*redis)->pid(), SIGSTOP), 0);
  std::chrono::nanoseconds slowest{};
  const auto until = Clock::now() + 4500ms;  // more than two heartbeats: the loop is inside one
  int probes = 0;
  while (Clock::now() < until) {
    for (const char* path : {"/healthz", "/metrics"}) {
      const auto t0 = Clock::now();
      const int code = http_get(admin, path).first;
      slowest = std::max<std::chrono::nanoseconds>(slowest, Clock::now() - t0);
      EXPECT_TRUE(code == 200 || code == 503) << path << ": " << code;
      ++probes;
    }
    std::this_thread::sleep_for(100ms);
  }
  ::kill((*redis)->pid(), SIGCONT);
  EXPECT_GT(probes, 20);
  EXPECT_LT(slowest, 300ms) << "a probe waited for the node's Redis command";
}

// A node (re)started while its cell's Redis is down (a restart of both, a failover) waits for
// it, up to --join-timeout, rather than exiting with the pool it allocated; past that it exits
// with Redis's error.
TEST(Kvstashd, AStartingNodeWaitsForItsRedisUpToTheJoinTimeout) {
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  (*redis)->kill();
  auto node = std::async(std::launch::async, [&] {
    return harness::LocalNode::start({.redis_url = (*redis)->url(),
                                      .capacity = "4MiB",
                                      .page_size = "1MiB",
                                      .extra_args = {"--transports", "tcp"},
                                      .ready_timeout = 20s});
  });
  std::this_thread::sleep_for(1500ms);
  ASSERT_TRUE((*redis)->restart().is_ok());
  auto started = node.get();
  ASSERT_TRUE(started.is_ok()) << started.status().to_string();
  EXPECT_TRUE((*started)->running());

  (*redis)->kill();
  const auto t0 = Clock::now();
  auto gave_up = harness::LocalNode::start({.redis_url = (*redis)->url(),
                                            .capacity = "4MiB",
                                            .page_size = "1MiB",
                                            .node_id = "late",
                                            .extra_args = {"--transports", "tcp", "--join-timeout", "1s"}});
  EXPECT_EQ(gave_up.status().code(), StatusCode::kUnavailable) << "it exited before it was ready";
  EXPECT_LT(Clock::now() - t0, 8s);
}

Status put_and_get(Store& store, const std::string& key) {
  std::string data = "bytes of " + key, back(data.size(), '\0');
  Slice in{data.data(), data.size()}, out{back.data(), back.size()};
  KVSTASH_RETURN_IF_ERROR(store.put(key, {&in, 1}));
  KVSTASH_RETURN_IF_ERROR(store.get(key, {&out, 1}).status());
  return back == data ? Status{} : Status::corrupt("other bytes came back");
}

Result<std::unique_ptr<Store>> open_tcp_store(const std::string& url, const std::string& token) {
  StoreOptions o;
  o.redis_url = url;
  o.engine.transports = {TransportKind::kTcp};
  o.engine.cluster_token = token;
  o.timeout = 10s;
  return Store::open(o);
}

TEST(Kvstashd, AClusterTokenFileMustBePrivateAndNotEmptyAndTheTokenGuardsThePool) {
  ::unsetenv("KVSTASH_CLUSTER_TOKEN");
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  const std::string url = (*redis)->url();
  const std::string token = "/tmp/kvstashd-test-token-" + std::to_string(getpid());
  const std::vector<std::string> base = {"--redis", url,   "--capacity",   "4MiB", "--page-size",  "1MiB",
                                         "--admin", "off", "--huge-pages", "off",  "--transports", "tcp"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };

  // Readable or writable by anyone but the owner: refused, naming the file, its mode and the fix.
  for (mode_t mode : {0644, 0640, 0604, 0620, 0602}) {
    write_file(token, "s3cret-token-0123\n", mode);
    auto [rc, out] = run(with({"--cluster-token-file", token}), 10s);
    char octal[8];
    std::snprintf(octal, sizeof octal, "%04o", static_cast<unsigned>(mode));
    EXPECT_EQ(rc, 2) << octal << ": " << out;
    EXPECT_NE(out.find(token), std::string::npos) << out;
    EXPECT_NE(out.find(std::string("mode ") + octal), std::string::npos) << out;
    EXPECT_NE(out.find("chmod 600"), std::string::npos) << out;
    EXPECT_EQ(out.find("s3cret"), std::string::npos) << "the token is never echoed: " << out;
  }
  // Empty, only a newline, only whitespace: refused instead of serving without a token.
  for (const char* empty : {"", "\n", " \t\n", "\r\n\n"}) {
    write_file(token, empty, 0600);
    auto [rc, out] = run(with({"--cluster-token-file", token}), 10s);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find("empty"), std::string::npos) << out;
  }
  // Shorter than 16 bytes, in a file or the environment: refused, saying how long it must be.
  write_file(token, "s3cret\n", 0600);
  auto [rc_short, out_short] = run(with({"--cluster-token-file", token}), 10s);
  EXPECT_EQ(rc_short, 2) << out_short;
  EXPECT_NE(out_short.find("at least 16 bytes"), std::string::npos) << out_short;
  auto [rc_short_env, out_short_env] = run(with({}), 10s, "export KVSTASH_CLUSTER_TOKEN=s3cret; ");
  EXPECT_EQ(rc_short_env, 2) << out_short_env;
  EXPECT_NE(out_short_env.find("at least 16 bytes"), std::string::npos) << out_short_env;
  auto [rc_env, out_env] = run(with({}), 10s, "export KVSTASH_CLUSTER_TOKEN=; ");
  EXPECT_EQ(rc_env, 2) << "set but empty: " << out_env;
  EXPECT_NE(out_env.find("KVSTASH_CLUSTER_TOKEN"), std::string::npos) << out_env;
  auto [rc_path, out_path] = run(with({"--cluster-token-file", ""}), 10s);
  EXPECT_EQ(rc_path, 2) << out_path;
  auto [rc_missing, out_missing] = run(with({"--cluster-token-file", token + ".absent"}), 10s);
  EXPECT_EQ(rc_missing, 2) << out_missing;
  EXPECT_NE(out_missing.find(token + ".absent"), std::string::npos) << out_missing;

  // 0600 (and 0400) with a trailing newline: served, the newline not part of the token.
  write_file(token, "s3cret-token-0123\n", 0400);
  auto node =
      harness::LocalNode::start({.redis_url = url,
                                 .capacity = "4MiB",
                                 .page_size = "1MiB",
                                 .node_id = "guarded",
                                 .extra_args = {"--transports", "tcp", "--cluster-token-file", token}});
  ::unlink(token.c_str());
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();

  auto right = open_tcp_store(url, "s3cret-token-0123");
  ASSERT_TRUE(right.is_ok()) << right.status().to_string();
  Status ok = put_and_get(**right, "with-token");
  EXPECT_TRUE(ok.is_ok()) << ok.to_string();
  for (const char* other : {"", "s3cret-token-0123\n", "guess-guess-guess-guess"}) {
    auto store = open_tcp_store(url, other);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    Status s = put_and_get(**store, std::string("token-") + other);
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << "'" << other << "': " << s.to_string();
    std::string back(32, '\0');
    Slice out{back.data(), back.size()};
    EXPECT_EQ((*store)->get("with-token", {&out, 1}).status().code(), StatusCode::kPermissionDenied) << other;
  }
}

// The whole product over TLS to Redis: a node registers, a store puts and gets, and the CLI
// reads the cell, each through a rediss:// URL with a client certificate; a store that does
// not trust the server's CA gets nothing from it.
TEST(Kvstashd, NodeStoreAndCliReachRedisOverTls) {
  test::TestPki pki;
  if (!pki.ok()) GTEST_SKIP() << "the test PKI could not be made";
  const int tls_port = test::RedisServer::free_port();
  test::RedisServer redis({"--tls-port", std::to_string(tls_port), "--tls-cert-file", pki.file("server.crt"),
                           "--tls-key-file", pki.file("server.key"), "--tls-ca-cert-file", pki.file("ca.crt"),
                           "--tls-auth-clients", "yes", "--requirepass", "tls-secret-0123"});
  if (!redis.running()) GTEST_SKIP() << "redis-server would not start with TLS (built without TLS?)";
  const std::string where = "127.0.0.1:" + std::to_string(tls_port) + "/0?ca=" + pki.file("ca.crt") +
                            "&cert=" + pki.file("client.crt") + "&key=" + pki.file("client.key");
  const std::string url = "rediss://" + where;
  auto node = harness::LocalNode::start({.redis_url = url,
                                         .redis_password = "tls-secret-0123",
                                         .capacity = "4MiB",
                                         .page_size = "1MiB",
                                         .node_id = "over-tls",
                                         .extra_args = {"--transports", "tcp", "--huge-pages", "off"}});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  StoreOptions o;
  o.redis_url = url;
  o.redis_password = "tls-secret-0123";
  o.engine.transports = {TransportKind::kTcp};
  o.timeout = 10s;
  auto store = Store::open(o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  Status ok = put_and_get(**store, "over-tls");
  EXPECT_TRUE(ok.is_ok()) << ok.to_string();

  auto cli = harness::ChildProcess::start(
      {.argv = {"/bin/sh", "-c",
                "exec '" + harness::find_tool("kvstash") + "' --redis '" + url + "' nodes 2>&1"},
       .env = {{"KVSTASH_REDIS_PASSWORD", "tls-secret-0123"}}});
  ASSERT_TRUE(cli.is_ok()) << cli.status().to_string();
  std::string cli_out;
  while (auto line = cli->read_line(deadline_after(20s))) cli_out += *line + "\n";
  EXPECT_EQ(cli->wait(deadline_after(5s)).value_or(-1), 0) << cli_out;
  EXPECT_NE(cli_out.find("over-tls"), std::string::npos) << cli_out;

  StoreOptions untrusting = o;
  untrusting.redis_url =
      "rediss://127.0.0.1:" + std::to_string(tls_port) + "/0?ca=" + pki.file("other-ca.crt");
  auto refused = Store::open(untrusting);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status().to_string();
  EXPECT_EQ((*node)->terminate(deadline_after(10s)).value_or(-1), 0);
}

// --tls-cert and --tls-key make the node's tcp TLS only; --tls-ca requires client
// certificates. A store whose options carry the CA (and its certificate) puts and gets; a plain
// one, or one without a certificate, is refused with a status that says which.
TEST(Kvstashd, TlsFlagsServeThePoolOverTlsOnly) {
  char dir_template[] = "/tmp/kvstashd-tls-XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  auto tls = harness::make_throwaway_tls(dir);
  ASSERT_TRUE(tls.is_ok()) << tls.status().to_string();
  auto redis = harness::LocalRedis::start();
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  const std::string url = (*redis)->url();
  const std::vector<std::string> base = {"--redis", url,   "--capacity",   "4MiB", "--page-size",  "1MiB",
                                         "--admin", "off", "--huge-pages", "off",  "--transports", "tcp"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  auto [rc_alone, out_alone] = run(with({"--tls-cert", tls->server_cert}), 10s);
  EXPECT_EQ(rc_alone, 2) << out_alone;
  EXPECT_NE(out_alone.find("--tls-key"), std::string::npos) << out_alone;
  auto [rc_ca, out_ca] = run(with({"--tls-ca", tls->ca_cert}), 10s);
  EXPECT_EQ(rc_ca, 2) << out_ca;
  auto [rc_bad, out_bad] = run(with({"--tls-cert", tls->server_cert, "--tls-key", tls->client_key}), 10s);
  EXPECT_EQ(rc_bad, 2) << "a key that is not the certificate's: " << out_bad;
  // A key others may read: refused as a token file would be.
  ::chmod(tls->server_key.c_str(), 0644);
  auto [rc_open, out_open] = run(with({"--tls-cert", tls->server_cert, "--tls-key", tls->server_key}), 10s);
  EXPECT_EQ(rc_open, 2) << out_open;
  EXPECT_NE(out_open.find("chmod 600"), std::string::npos) << out_open;
  ::chmod(tls->server_key.c_str(), 0600);

  auto node =
      harness::LocalNode::start({.redis_url = url,
                                 .capacity = "4MiB",
                                 .page_size = "1MiB",
                                 .node_id = "tls",
                                 .extra_args = {"--transports", "tcp", "--tls-cert", tls->server_cert,
                                                "--tls-key", tls->server_key, "--tls-ca", tls->ca_cert}});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  auto open = [&](bool ca, bool cert) {
    StoreOptions o;
    o.redis_url = url;
    o.engine.transports = {TransportKind::kTcp};
    o.timeout = 10s;
    if (ca) o.engine.tcp.tls.ca_file = tls->ca_cert;
    if (cert) {
      o.engine.tcp.tls.client_cert_file = tls->client_cert;
      o.engine.tcp.tls.client_key_file = tls->client_key;
    }
    return Store::open(o);
  };
  auto store = open(true, true);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  Status ok = put_and_get(**store, "over-tls");
  EXPECT_TRUE(ok.is_ok()) << ok.to_string();

  auto plain = open(false, false);
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  Status s = put_and_get(**plain, "in-the-clear");
  EXPECT_EQ(s.code(), StatusCode::kUnsupported) << s.to_string();
  EXPECT_NE(s.message().find("serves TLS only"), std::string::npos) << s.to_string();

  auto anonymous = open(true, false);
  ASSERT_TRUE(anonymous.is_ok()) << anonymous.status().to_string();
  s = put_and_get(**anonymous, "no-certificate");
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.to_string();
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace kvstash
