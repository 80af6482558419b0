// The Redis client against real redis-server processes on loopback.
#include "metadata/redis_client.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "redis_server.h"
#include "test_pki.h"

namespace kvstash::metadata {
namespace {

using namespace std::chrono_literals;

TEST(RedisUrl, ParsesHostsCredentialsAndDatabases) {
  auto u = RedisUrl::parse("redis://127.0.0.1:7000/3").value();
  EXPECT_FALSE(u.unix_socket);
  EXPECT_EQ(u.host, "127.0.0.1");
  EXPECT_EQ(u.port, 7000);
  EXPECT_EQ(u.db, 3);
  EXPECT_TRUE(u.password.empty());

  u = RedisUrl::parse("redis://alice:p%40ss:w@redis.internal").value();
  EXPECT_EQ(u.user, "alice");
  EXPECT_EQ(u.password, "p@ss:w");
  EXPECT_EQ(u.host, "redis.internal");
  EXPECT_EQ(u.port, 6379);
  EXPECT_EQ(u.redacted(), "redis://alice:***@redis.internal:6379/0");

  u = RedisUrl::parse("redis://:secret@[::1]:6380").value();
  EXPECT_EQ(u.host, "::1");
  EXPECT_EQ(u.port, 6380);
  EXPECT_TRUE(u.user.empty());
  EXPECT_EQ(u.password, "secret");
  EXPECT_EQ(u.redacted().find("secret"), std::string::npos);

  u = RedisUrl::parse("unix:///run/redis/redis.sock?db=2").value();
  EXPECT_TRUE(u.unix_socket);
  EXPECT_EQ(u.path, "/run/redis/redis.sock");
  EXPECT_EQ(u.db, 2);
}

TEST(RedisUrl, RefusesMalformedUrlsWithoutEchoingSecrets) {
  for (const char* bad : {"", "http://x", "redis://", "redis://host:0", "redis://host:99999",
                          "redis://host:x", "redis://host/abc", "redis://[::1", "unix://relative.sock",
                          "unix:///s?user=x", "redis://justuser@host", "redis://a:%zz@host"}) {
    auto r = RedisUrl::parse(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
  auto r = RedisUrl::parse("redis://u:hunter2@host:bad");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message().find("hunter2"), std::string::npos);
}

TEST(RedisClient, BinarySafeCommands) {
  test::RedisServer server;
  ASSERT_TRUE(server.running()) << "redis-server did not start (is it installed?)";
  auto c = RedisClient::connect({.url = server.url()}).value();
  const std::string value("a\0b\r\nc", 6);
  ASSERT_TRUE(c->command({"SET", "k", value}).is_ok());
  auto r = c->command({"GET", "k"}).value();
  EXPECT_EQ(r.type(), Reply::Type::kString);
  EXPECT_EQ(r.str(), value);
  EXPECT_TRUE(c->command({"GET", "missing"})->is_nil());
  auto bad = c->command({"NOSUCHCOMMAND"});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInternal);
  EXPECT_NE(bad.status().message().find("unknown command"), std::string::npos);
}

TEST(RedisClient, UnreachableServerIsUnavailable) {
  int port;
  {
    test::RedisServer gone;
    port = gone.port();
  }
  auto r = RedisClient::connect({.url = "redis://127.0.0.1:" + std::to_string(port)});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

TEST(RedisClient, PasswordsAndAclUsers) {
  test::RedisServer server(
      {"--requirepass", "s3cret", "--user", "reader", "on", ">rpw", "~*", "&*", "-@all", "+ping", "+get"});
  ASSERT_TRUE(server.running());
  EXPECT_TRUE(RedisClient::connect({.url = server.url(":s3cret")}).is_ok());
  // The password may also come from the options (never from a command line).
  EXPECT_TRUE(RedisClient::connect({.url = server.url(), .password = "s3cret"}).is_ok());

  auto wrong = RedisClient::connect({.url = server.url(":guess")});
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(wrong.status().message().find("guess"), std::string::npos) << "password echoed";

  auto anonymous = RedisClient::connect({.url = server.url()}).value();
  EXPECT_EQ(anonymous->command({"GET", "k"}).status().code(), StatusCode::kPermissionDenied);

  auto reader = RedisClient::connect({.url = server.url("reader:rpw")}).value();
  EXPECT_TRUE(reader->command({"GET", "k"}).is_ok());
  auto denied = reader->command({"SET", "k", "v"});
  ASSERT_FALSE(denied.is_ok());
  EXPECT_EQ(denied.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(denied.status().message().find("NOPERM"), std::string::npos);

  // A user without a password is refused before connecting, not quietly run as `default`.
  EXPECT_EQ(RedisClient::connect({.url = server.url("reader:")}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(RedisClient::connect({.url = server.url("reader:"), .password = "rpw"}).is_ok());
}

TEST(RedisClient, ScriptsRunBySha1AndReloadAfterFlush) {
  test::RedisServer server;
  ASSERT_TRUE(server.running());
  auto c = RedisClient::connect({.url = server.url()}).value();
  Script incr("return redis.call('INCRBY', KEYS[1], ARGV[1])");
  EXPECT_EQ(incr.sha.size(), 40u);
  EXPECT_EQ(c->eval(incr, {"n"}, {"5"})->integer(), 5);
  ASSERT_TRUE(c->command({"SCRIPT", "FLUSH"}).is_ok());
  EXPECT_EQ(c->eval(incr, {"n"}, {"2"})->integer(), 7);
}

// How many times Redis ran `verb` (INFO commandstats).
std::int64_t calls_of(RedisClient& c, std::string_view verb) {
  auto info = c.command({"INFO", "commandstats"});
  if (!info.is_ok()) return -1;
  const std::string text(info->str());
  const auto at = text.find("cmdstat_" + std::string(verb) + ":calls=");
  return at == std::string::npos ? 0 : std::stoll(text.substr(at + verb.size() + 15));
}

// A script of a library runs as its function: the library is loaded by the first call that
// finds the function missing (and again after Redis lost it), never per call.
TEST(RedisClient, ScriptsRunAsFunctionsOfALibraryLoadedWhenMissing) {
  test::RedisServer server;
  ASSERT_TRUE(server.running());
  auto c = RedisClient::connect({.url = server.url()}).value();
  const FunctionLibrary lib{
      "kvstash_test",
      "#!lua name=kvstash_test\nredis.register_function('incr_test', function(keys, args) return "
      "redis.call('INCRBY', keys[1], args[1]) end)\n"};
  Script incr("return redis.call('INCRBY', KEYS[1], ARGV[1])", "incr_test", &lib);
  EXPECT_EQ(c->eval(incr, {"n"}, {"5"})->integer(), 5);
  EXPECT_EQ(c->eval(incr, {"n"}, {"2"})->integer(), 7);
  EXPECT_EQ(calls_of(*c, "fcall"), 3) << "one FCALL that found no function, then one per call";
  EXPECT_EQ(calls_of(*c, "function|load"), 1);
  EXPECT_EQ(calls_of(*c, "evalsha"), 0);
  EXPECT_TRUE(c->runs_functions());
  // Redis lost its functions (restarted without them, FUNCTION FLUSH): loaded again.
  ASSERT_TRUE(c->command({"FUNCTION", "FLUSH"}).is_ok());
  EXPECT_EQ(c->eval(incr, {"n"}, {"1"})->integer(), 8);
  EXPECT_EQ(calls_of(*c, "function|load"), 2);
}

// A user whose ACL predates Functions (EVALSHA and SCRIPT LOAD only) still runs every script,
// by EVALSHA, after one refused FCALL.
TEST(RedisClient, AUserWithoutFunctionsRunsScriptsByEvalsha) {
  test::RedisServer server;
  ASSERT_TRUE(server.running());
  auto admin = RedisClient::connect({.url = server.url()}).value();
  ASSERT_TRUE(admin
                  ->command({"ACL", "SETUSER", "old", "on", ">old-pw-0123456789", "~*", "-@all", "+evalsha",
                             "+script|load", "+incrby"})
                  .is_ok());
  auto c = RedisClient::connect({.url = server.url("old:old-pw-0123456789")}).value();
  const FunctionLibrary lib{
      "kvstash_test",
      "#!lua name=kvstash_test\nredis.register_function('incr_test', function(keys, args) return "
      "redis.call('INCRBY', keys[1], args[1]) end)\n"};
  Script incr("return redis.call('INCRBY', KEYS[1], ARGV[1])", "incr_test", &lib);
  auto first = c->eval(incr, {"n"}, {"5"});
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  EXPECT_EQ(first->integer(), 5);
  EXPECT_FALSE(c->runs_functions());
  EXPECT_EQ(c->eval(incr, {"n"}, {"2"})->integer(), 7);
  EXPECT_EQ(calls_of(*admin, "evalsha"), 3) << "NOSCRIPT once, then both calls";
  // A refusal from inside a script is the script's error, not a reason to leave Functions.
  auto fresh = RedisClient::connect({.url = server.url()}).value();
  EXPECT_FALSE(fresh->eval(incr, {"n"}, {"not a number"}).is_ok());
  EXPECT_TRUE(fresh->runs_functions());
  EXPECT_EQ(fresh->eval(incr, {"n"}, {"1"})->integer(), 8);
}

TEST(RedisClient, ReconnectsAfterRedisRestarts) {
  test::RedisServer server;
  ASSERT_TRUE(server.running());
  auto c = RedisClient::connect({.url = server.url(), .reconnect_budget = 1s}).value();
  ASSERT_TRUE(c->command({"SET", "k", "v"}).is_ok());
  ASSERT_TRUE(server.restart());
  // The data is gone (no persistence) but the client carries on by itself.
  auto r = c->command({"GET", "k"});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(r->is_nil());
  EXPECT_EQ(c->reconnects(), 1u);
  // With the server gone for good, a command gives up within the reconnect budget.
  server.stop();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(c->command({"PING"}).status().code(), StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

}  // namespace
}  // namespace kvstash::metadata

// ---- redirects and the password ---------------------------------------------------------------

namespace kvstash::metadata {
namespace {

// A TCP listener on `host` that counts connections and keeps what they sent; answers every
// read with `reply` (a RESP text), until the test ends.
class FakeServer {
 public:
  FakeServer(const std::string& host, std::string reply) : reply_(std::move(reply)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    inet_pton(AF_INET, host.c_str(), &a.sin_addr);
    int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd_, 8);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      for (;;) {
        pollfd p{fd_, POLLIN, 0};
        if (stop_) return;
        if (::poll(&p, 1, 50) <= 0) continue;
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) continue;
        ++connections_;
        timeval tv{0, 300000};
        ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char buf[4096];
        for (ssize_t n; (n = ::recv(c, buf, sizeof buf, 0)) > 0;) {
          std::lock_guard lock(mu_);
          received_.append(buf, static_cast<std::size_t>(n));
          (void)!::send(c, reply_.data(), reply_.size(), MSG_NOSIGNAL);
        }
        ::close(c);
      }
    });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }
  int connections() const { return connections_; }
  std::string received() {
    std::lock_guard lock(mu_);
    return received_;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::string reply_;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::mutex mu_;
  std::string received_;
  std::thread thread_;
};

// (fmt, not "*" + std::to_string(...): GCC 12 at -O3 warns -Wrestrict about that, wrongly.)
std::string resp_array(const std::vector<std::string>& items) {
  std::string out = fmt::format("*{}\r\n", items.size());
  for (const auto& i : items) out += fmt::format("${}\r\n{}\r\n", i.size(), i);
  return out;
}

// A sentinel that names a master on a host the URL does not name gets no password sent there,
// unless that host is allowed; without a password any host is followed.
TEST(RedisClient, ASentinelCannotSendThePasswordToAHostTheUrlDoesNotName) {
  FakeServer master("127.0.0.2", "-ERR not a real master\r\n");
  FakeServer sentinel("127.0.0.1", resp_array({"127.0.0.2", std::to_string(master.port())}));
  const std::string url =
      "redis+sentinel://:pw-0123456789@127.0.0.1:" + std::to_string(sentinel.port()) + "/svc";
  auto refused = RedisClient::connect({.url = url, .connect_timeout = std::chrono::milliseconds(1000)});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("redirect="), std::string::npos) << refused.status().to_string();
  EXPECT_EQ(master.connections(), 0) << "the client connected to the host the sentinel named";
  EXPECT_EQ(master.received().find("pw-0123456789"), std::string::npos);

  RedisOptions allowed{.url = url, .connect_timeout = std::chrono::milliseconds(1000)};
  allowed.redirect_hosts = {"127.0.0.2"};
  (void)RedisClient::connect(allowed);  // the fake master answers nothing useful
  EXPECT_GE(master.connections(), 1) << "an allowed host is followed";

  // The same allowance in the URL, where every tool that takes a URL can give it: a host, or
  // a host:port (another port of that host is not).
  int before = master.connections();
  (void)RedisClient::connect({.url = url + "?redirect=127.0.0.9,127.0.0.2:" + std::to_string(master.port()),
                              .connect_timeout = std::chrono::milliseconds(1000)});
  EXPECT_GT(master.connections(), before) << "a host:port the URL's redirect= names is followed";
  before = master.connections();
  auto other_port = RedisClient::connect(
      {.url = url + "?redirect=127.0.0.2:7000", .connect_timeout = std::chrono::milliseconds(1000)});
  EXPECT_EQ(other_port.status().code(), StatusCode::kPermissionDenied) << other_port.status().to_string();
  EXPECT_EQ(master.connections(), before) << "another port of a host redirect= names";
}

// A sentinel that names another port of its own host (a server of whoever took the sentinel
// over, or another user's on that host) gets no password: the sentinel's host is not one the
// URL vouches for as a Redis server.
TEST(RedisClient, ASentinelCannotSendThePasswordToAnotherPortOfItsOwnHost) {
  FakeServer rogue("127.0.0.1", "-ERR not a real master\r\n");
  FakeServer sentinel("127.0.0.1", resp_array({"127.0.0.1", std::to_string(rogue.port())}));
  const std::string url =
      "redis+sentinel://:pw-0123456789@127.0.0.1:" + std::to_string(sentinel.port()) + "/svc";
  auto refused = RedisClient::connect({.url = url, .connect_timeout = std::chrono::milliseconds(1000)});
  EXPECT_EQ(refused.status().code(), StatusCode::kPermissionDenied) << refused.status().to_string();
  EXPECT_EQ(rogue.connections(), 0) << "the client connected to the port the sentinel named";
  EXPECT_EQ(rogue.received().find("pw-0123456789"), std::string::npos);
}

}  // namespace
}  // namespace kvstash::metadata

// ---- TLS (rediss://) --------------------------------------------------------------------------

namespace kvstash::metadata {
namespace {

TEST(RedisUrl, TlsFormsAndOptions) {
  auto u =
      RedisUrl::parse(
          "rediss://:pw@127.0.0.1:6380/2?ca=/etc/ca%20file.crt&cert=/c.crt&key=/c.key&sni=redis.internal")
          .value();
  EXPECT_TRUE(u.tls);
  EXPECT_EQ(u.port, 6380);
  EXPECT_EQ(u.db, 2);
  EXPECT_EQ(u.password, "pw");
  EXPECT_EQ(u.tls_ca, "/etc/ca file.crt");
  EXPECT_EQ(u.tls_cert, "/c.crt");
  EXPECT_EQ(u.tls_key, "/c.key");
  EXPECT_EQ(u.tls_server_name, "redis.internal");
  EXPECT_EQ(u.redacted(), "rediss://:***@127.0.0.1:6380/2");

  u = RedisUrl::parse("rediss+sentinel://s1,s2:5000/main?redirect=10.0.0.5,[::1]:6379").value();
  EXPECT_TRUE(u.tls);
  EXPECT_TRUE(u.sentinel());
  EXPECT_EQ(u.sentinels.size(), 2u);
  EXPECT_EQ(u.redirect_hosts, (std::vector<std::string>{"10.0.0.5", "[::1]:6379"}))
      << "a host, or a host:port";
  EXPECT_EQ(RedisUrl::parse("rediss+cluster://a,b").value().cluster(), true);
  EXPECT_FALSE(RedisUrl::parse("redis://h/0").value().tls);

  for (const char* bad : {"redis://h/0?ca=/x.crt", "rediss://h/0?pem=/x", "rediss://h/0?ca=",
                          "rediss://h/0?ca", "unixs:///s", "unix:///s?sni=x", "redis://h?db=1"}) {
    auto r = RedisUrl::parse(bad);
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

// A redis-server with a plain port (the fixture's) and a TLS port, its certificate signed by
// the test CA; `clients` is its tls-auth-clients (yes: a client certificate is required).
class TlsRedis {
 public:
  explicit TlsRedis(const test::TestPki& pki, const std::string& clients = "yes",
                    std::vector<std::string> more = {})
      : tls_port_(test::RedisServer::free_port()), server_(args(pki, clients, std::move(more))) {}
  bool running() const { return server_.running(); }
  int plain_port() const { return server_.port(); }
  std::string url(const std::string& options, const std::string& credentials = "") const {
    return "rediss://" + credentials + (credentials.empty() ? "" : "@") +
           "127.0.0.1:" + std::to_string(tls_port_) + "/0" + (options.empty() ? "" : "?") + options;
  }
  test::RedisServer& server() { return server_; }

 private:
  std::vector<std::string> args(const test::TestPki& pki, const std::string& clients,
                                std::vector<std::string> more) {
    std::vector<std::string> a{"--tls-port",         std::to_string(tls_port_),
                               "--tls-cert-file",    pki.file("server.crt"),
                               "--tls-key-file",     pki.file("server.key"),
                               "--tls-ca-cert-file", pki.file("ca.crt"),
                               "--tls-auth-clients", clients};
    a.insert(a.end(), more.begin(), more.end());
    return a;
  }
  int tls_port_;
  test::RedisServer server_;
};

#define KVSTASH_NEED_TLS_REDIS(pki, redis)                           \
  if (!(pki).ok()) GTEST_SKIP() << "the test PKI could not be made"; \
  if (!(redis).running()) GTEST_SKIP() << "redis-server would not start with TLS (built without TLS?)"

TEST(RedisTls, CommandsScriptsAndPasswordsOverTlsWithAClientCertificate) {
  test::TestPki pki;
  TlsRedis redis(pki, "yes", {"--requirepass", "tls-secret-0123"});
  KVSTASH_NEED_TLS_REDIS(pki, redis);
  const std::string options =
      "ca=" + pki.file("ca.crt") + "&cert=" + pki.file("client.crt") + "&key=" + pki.file("client.key");
  auto c = RedisClient::connect({.url = redis.url(options, ":tls-secret-0123")});
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();

  // Binary values, one larger than many TLS records and reads.
  std::string big(3 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + (i >> 12));
  ASSERT_TRUE((*c)->command({"SET", "big", big}).is_ok());
  auto got = (*c)->command({"GET", "big"});
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_TRUE(got->str() == big) << "3 MiB came back different over TLS";
  for (int i = 0; i < 200; ++i) ASSERT_TRUE((*c)->command({"INCR", "n"}).is_ok());
  EXPECT_EQ((*c)->command({"GET", "n"})->str(), "200");
  Script script("return redis.call('GET', KEYS[1])");
  auto r = (*c)->eval(script, {"n"}, {});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->str(), "200");
  // An error reply stays a reply, and the link stays usable.
  EXPECT_EQ((*c)->command({"NOSUCHCOMMAND"}).status().code(), StatusCode::kInternal);
  EXPECT_TRUE((*c)->command({"PING"}).is_ok());

  // A restart of the server: the client reconnects over TLS.
  ASSERT_TRUE(redis.server().restart());
  auto after = (*c)->command({"SET", "k", "v"});
  EXPECT_TRUE(after.is_ok()) << after.status().to_string();
  EXPECT_GE((*c)->reconnects(), 1u);

  // The wrong password is still the wrong password.
  auto wrong = RedisClient::connect({.url = redis.url(options, ":not-it-0123456789")});
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kPermissionDenied) << wrong.status().to_string();
}

TEST(RedisTls, AServerThatDoesNotVerifyIsRefusedBeforeAnythingIsSent) {
  test::TestPki pki;
  TlsRedis redis(pki, "no");
  KVSTASH_NEED_TLS_REDIS(pki, redis);
  // Another CA signed the server's certificate: refused, and no retrying.
  const auto started = std::chrono::steady_clock::now();
  auto other =
      RedisClient::connect({.url = redis.url("ca=" + pki.file("other-ca.crt"), ":some-password-0123")});
  ASSERT_FALSE(other.is_ok());
  EXPECT_EQ(other.status().code(), StatusCode::kPermissionDenied) << other.status().to_string();
  EXPECT_NE(other.status().message().find("did not verify"), std::string::npos) << other.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 1500ms);
  // The system's CAs do not know the test CA either.
  auto system = RedisClient::connect({.url = redis.url("")});
  EXPECT_EQ(system.status().code(), StatusCode::kPermissionDenied) << system.status().to_string();
  // The certificate names 127.0.0.1 and localhost, not another name.
  auto name = RedisClient::connect({.url = redis.url("ca=" + pki.file("ca.crt") + "&sni=redis.elsewhere")});
  ASSERT_FALSE(name.is_ok());
  EXPECT_EQ(name.status().code(), StatusCode::kPermissionDenied) << name.status().to_string();
  auto localhost = RedisClient::connect({.url = redis.url("ca=" + pki.file("ca.crt") + "&sni=localhost")});
  EXPECT_TRUE(localhost.is_ok()) << localhost.status().to_string();
  // Without a client certificate, where the server does not ask for one.
  auto plain_client = RedisClient::connect({.url = redis.url("ca=" + pki.file("ca.crt"))});
  ASSERT_TRUE(plain_client.is_ok()) << plain_client.status().to_string();
  EXPECT_TRUE((*plain_client)->command({"PING"}).is_ok());
}

TEST(RedisTls, AServerThatWantsAClientCertificateRefusesOneWithout) {
  test::TestPki pki;
  TlsRedis redis(pki, "yes");
  KVSTASH_NEED_TLS_REDIS(pki, redis);
  auto none = RedisClient::connect({.url = redis.url("ca=" + pki.file("ca.crt"))});
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kPermissionDenied) << none.status().to_string();
  // A certificate the client cannot load, or without its key: a clear error before connecting.
  auto missing = RedisClient::connect(
      {.url = redis.url("ca=" + pki.file("ca.crt") + "&cert=" + pki.file("client.crt"))});
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument) << missing.status().to_string();
  auto unreadable = RedisClient::connect({.url = redis.url("ca=" + pki.file("nothing-here.crt"))});
  EXPECT_EQ(unreadable.status().code(), StatusCode::kInvalidArgument) << unreadable.status().to_string();
  auto mismatched =
      RedisClient::connect({.url = redis.url("ca=" + pki.file("ca.crt") + "&cert=" + pki.file("client.crt") +
                                             "&key=" + pki.file("server.key"))});
  EXPECT_EQ(mismatched.status().code(), StatusCode::kInvalidArgument) << mismatched.status().to_string();
}

TEST(RedisTls, TlsAndPlainPortsMixedUpFailFastAndSaySo) {
  test::TestPki pki;
  TlsRedis redis(pki, "no");
  KVSTASH_NEED_TLS_REDIS(pki, redis);
  const RedisOptions quick{.connect_timeout = 1000ms, .command_timeout = 1000ms, .reconnect_budget = 1000ms};
  // rediss:// to the plain port.
  RedisOptions o = quick;
  o.url = "rediss://127.0.0.1:" + std::to_string(redis.plain_port()) + "/0?ca=" + pki.file("ca.crt");
  auto started = std::chrono::steady_clock::now();
  auto tls_to_plain = RedisClient::connect(o);
  ASSERT_FALSE(tls_to_plain.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - started, 2500ms);
  EXPECT_NE(tls_to_plain.status().message().find("TLS"), std::string::npos)
      << tls_to_plain.status().to_string();
  // redis:// to the TLS port.
  o = quick;
  o.url = redis.url("");
  o.url.replace(0, 6, "redis");
  o.url = o.url.substr(0, o.url.find('?'));
  started = std::chrono::steady_clock::now();
  auto plain_to_tls = RedisClient::connect(o);
  Status first = plain_to_tls.is_ok() ? (*plain_to_tls)->command({"PING"}).status() : plain_to_tls.status();
  ASSERT_FALSE(first.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - started, 2500ms);
  EXPECT_NE(first.message().find("rediss://"), std::string::npos) << first.to_string();
}

}  // namespace
}  // namespace kvstash::metadata
