// The admin endpoint as a client sees it: real HTTP over loopback sockets, written and read
// byte for byte through plain POSIX calls; and the Prometheus text MetricsText produces.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "node/admin_server.h"
#include "node/metrics.h"

namespace kvstash::node {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// A minimal blocking HTTP client.

class Client {
 public:
  // Connects to "a.b.c.d:port" or "[v6]:port" (an IPv4 one from `source` when given); fd() < 0
  // when that fails.
  explicit Client(const std::string& address, const std::string& source = "") {
    auto colon = address.rfind(':');
    std::string host = address.substr(0, colon);
    int port = std::atoi(address.c_str() + colon + 1);
    if (host.front() == '[') {
      sockaddr_in6 sa{};
      sa.sin6_family = AF_INET6;
      sa.sin6_port = htons(static_cast<std::uint16_t>(port));
      if (inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &sa.sin6_addr) != 1) return;
      fd_ = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) close_fd();
    } else {
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(static_cast<std::uint16_t>(port));
      if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) return;
      fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd_ >= 0 && !source.empty()) {
        sockaddr_in from{};
        from.sin_family = AF_INET;
        if (inet_pton(AF_INET, source.c_str(), &from.sin_addr) != 1 ||
            ::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) {
          close_fd();
          return;
        }
      }
      if (fd_ >= 0 && ::connect(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) close_fd();
    }
  }
  ~Client() { close_fd(); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  int fd() const { return fd_; }

  // Sends every byte; false when the server closed first.
  bool send(std::string_view bytes) {
    while (!bytes.empty()) {
      ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  // Reads until the server closes the connection (EOF or reset) or `timeout` passes.
  // Returns what arrived; closed() says whether the server closed.
  std::string read_until_closed(std::chrono::milliseconds timeout = 5s) {
    std::string out;
    auto deadline = Clock::now() + timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return out;
      pollfd p{fd_, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>(left));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return out;
      char buf[4096];
      ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        closed_ = true;
        return out;
      }
      out.append(buf, static_cast<std::size_t>(n));
    }
  }
  bool closed() const { return closed_; }

 private:
  void close_fd() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
  bool closed_ = false;
};

struct Reply {
  bool closed = false;                         // the server closed the connection after it
  int status = 0;                              // 0: no parsable status line
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  std::string raw;
};

Reply parse_reply(std::string raw, bool closed) {
  Reply r;
  r.closed = closed;
  r.raw = raw;
  auto end = raw.find("\r\n\r\n");
  if (end == std::string::npos || !raw.starts_with("HTTP/1.1 ")) return r;
  r.status = std::atoi(raw.c_str() + 9);
  r.body = raw.substr(end + 4);
  std::size_t pos = raw.find("\r\n") + 2;
  while (pos < end) {
    auto eol = raw.find("\r\n", pos);
    std::string line = raw.substr(pos, eol - pos);
    auto colon = line.find(':');
    std::string name = line.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::size_t v = colon + 1;
    while (v < line.size() && line[v] == ' ') ++v;
    r.headers[name] = line.substr(v);
    pos = eol + 2;
  }
  return r;
}

// One request, sent whole, and everything the server answers until it closes.
Reply round_trip(const std::string& address, std::string_view request) {
  Client c(address);
  EXPECT_GE(c.fd(), 0) << "connect " << address;
  if (c.fd() < 0) return {};
  c.send(request);
  std::string raw = c.read_until_closed();
  return parse_reply(std::move(raw), c.closed());
}

Reply get(const std::string& address, std::string_view path, std::string_view method = "GET") {
  std::string req = std::string(method) + " " + std::string(path) + " HTTP/1.1\r\nHost: test\r\n\r\n";
  return round_trip(address, req);
}

// ---------------------------------------------------------------------------------------------
// The daemon's side, as handlers the test steers.

struct NodeState {
  std::mutex mu;
  bool healthy = true;
  std::string reason = "ok";
  std::string metrics = "# HELP up Whether the node is up.\n# TYPE up gauge\nup 1\n";
  bool throw_from_metrics = false;
};

AdminServer::Handlers handlers_for(const std::shared_ptr<NodeState>& state) {
  AdminServer::Handlers h;
  h.metrics = [state] {
    std::lock_guard lock(state->mu);
    if (state->throw_from_metrics) throw std::runtime_error("stats gathering failed");
    return state->metrics;
  };
  h.health = [state] {
    std::lock_guard lock(state->mu);
    return std::make_pair(state->healthy, state->reason);
  };
  return h;
}

class AdminServerTest : public ::testing::Test {
 protected:
  void start(std::chrono::milliseconds request_timeout = AdminServer::kDefaultRequestTimeout) {
    auto s = AdminServer::start("127.0.0.1:0", handlers_for(state_), request_timeout);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    server_ = std::move(s).value();
    address_ = server_->address();
  }

  std::shared_ptr<NodeState> state_ = std::make_shared<NodeState>();
  std::unique_ptr<AdminServer> server_;
  std::string address_;
};

TEST_F(AdminServerTest, ReportsTheRealPort) {
  start();
  ASSERT_TRUE(address_.starts_with("127.0.0.1:")) << address_;
  EXPECT_GT(std::atoi(address_.c_str() + 10), 0) << address_;
}

TEST_F(AdminServerTest, MetricsBodyAndHeaders) {
  start();
  Reply r = get(address_, "/metrics");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(r.headers["content-length"], std::to_string(state_->metrics.size()));
  EXPECT_EQ(r.headers["connection"], "close");
  EXPECT_TRUE(r.headers["date"].ends_with(" GMT")) << r.raw;
  EXPECT_EQ(r.body, state_->metrics);
  EXPECT_TRUE(r.closed);
}

TEST_F(AdminServerTest, HeadSendsHeadersWithoutBody) {
  start();
  Reply r = get(address_, "/metrics", "HEAD");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-length"], std::to_string(state_->metrics.size()));
  EXPECT_EQ(r.body, "");
  EXPECT_TRUE(r.closed);

  r = get(address_, "/healthz", "HEAD");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.headers["content-length"], "3");  // "ok\n"
  EXPECT_EQ(r.body, "");
}

TEST_F(AdminServerTest, HealthzFollowsTheHandler) {
  start();
  Reply r = get(address_, "/healthz");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body, "ok\n");
  EXPECT_EQ(r.headers["content-type"], "text/plain; charset=utf-8");

  {
    std::lock_guard lock(state_->mu);
    state_->healthy = false;
    state_->reason = "redis unreachable";
  }
  r = get(address_, "/healthz");
  EXPECT_EQ(r.status, 503) << r.raw;
  EXPECT_EQ(r.body, "redis unreachable\n");

  {
    std::lock_guard lock(state_->mu);
    state_->reason = "draining\r\nsince 10:00";
  }
  r = get(address_, "/healthz");
  EXPECT_EQ(r.status, 503) << r.raw;
  EXPECT_EQ(r.body, "draining  since 10:00\n");  // kept on one line
}

TEST_F(AdminServerTest, QueryStringIsIgnoredForRouting) {
  start();
  EXPECT_EQ(get(address_, "/healthz?verbose=1").status, 200);
  Reply r = get(address_, "/metrics?name[]=up");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body, state_->metrics);
  // The absolute form names the same resource.
  EXPECT_EQ(get(address_, "http://127.0.0.1/healthz").status, 200);
}

TEST_F(AdminServerTest, UnknownPathIs404) {
  start();
  EXPECT_EQ(get(address_, "/").status, 404);
  EXPECT_EQ(get(address_, "/metrics/").status, 404);
  EXPECT_EQ(get(address_, "/health").status, 404);
  Reply r = get(address_, "/nope", "HEAD");
  EXPECT_EQ(r.status, 404) << r.raw;
  EXPECT_EQ(r.body, "");
}

TEST_F(AdminServerTest, OtherMethodsAre405WithAllow) {
  start();
  for (const char* method : {"POST", "PUT", "DELETE", "OPTIONS", "get"}) {
    Reply r = get(address_, "/metrics", method);
    EXPECT_EQ(r.status, 405) << method << "\n" << r.raw;
    EXPECT_EQ(r.headers["allow"], "GET, HEAD") << method;
    EXPECT_EQ(r.headers["connection"], "close");
  }
  // A body the server never reads must not cost the client its response.
  Reply r = round_trip(address_,
                       "POST /healthz HTTP/1.1\r\nContent-Length: 100000\r\n\r\n" + std::string(100000, 'x'));
  EXPECT_EQ(r.status, 405) << r.raw;
}

TEST_F(AdminServerTest, MalformedRequestsAre400) {
  start();
  for (const char* req :
       {"GARBAGE\r\n\r\n", "GET /metrics\r\n\r\n", "GET metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1 extra\r\n\r\n", "GET  /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTX/1.1\r\n\r\n", "G(T /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nNoColonHere\r\n\r\n", "GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n"}) {
    Reply r = round_trip(address_, req);
    EXPECT_EQ(r.status, 400) << req << "\n" << r.raw;
    EXPECT_TRUE(r.closed);
  }
  EXPECT_EQ(round_trip(address_, "GET /metrics HTTP/2.0\r\n\r\n").status, 505);
}

TEST_F(AdminServerTest, BadRequestLineIsAnsweredWithoutWaitingForTheHead) {
  start();  // the default 5 s request timeout: an answer within 2 s did not wait for it
  Client c(address_);
  ASSERT_GE(c.fd(), 0);
  ASSERT_TRUE(c.send("BOGUS\r\n"));
  std::string raw = c.read_until_closed(2s);
  Reply r = parse_reply(std::move(raw), c.closed());
  EXPECT_EQ(r.status, 400) << r.raw;
  EXPECT_TRUE(r.closed);
}

TEST_F(AdminServerTest, AcceptsBareLineFeedsAndLeadingBlankLines) {
  start();
  Reply r = round_trip(address_, "\r\nGET /healthz HTTP/1.0\nHost: x\n\n");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body, "ok\n");
}

TEST_F(AdminServerTest, OversizedHeadIs431) {
  start();
  const std::string line = "GET /metrics HTTP/1.1\r\n";
  const std::string prefix = line + "X-Big: ";
  // Exactly at the limit is still served.
  std::string fits = prefix + std::string(AdminServer::kMaxHeaderBytes - prefix.size() - 4, 'a') + "\r\n\r\n";
  ASSERT_EQ(fits.size(), AdminServer::kMaxHeaderBytes);
  EXPECT_EQ(round_trip(address_, fits).status, 200);

  Reply r = round_trip(address_, prefix + std::string(9000, 'a') + "\r\n\r\n");
  EXPECT_EQ(r.status, 431) << r.raw.substr(0, 200);
  EXPECT_EQ(r.headers["connection"], "close");
  EXPECT_TRUE(r.closed);

  // Many small headers count together, and the server answers without waiting for the end.
  std::string many = line;
  for (int i = 0; i < 1000; ++i) many += "X-H" + std::to_string(i) + ": v\r\n";
  r = round_trip(address_, many);
  EXPECT_EQ(r.status, 431) << r.raw.substr(0, 200);
}

TEST_F(AdminServerTest, OversizedRequestLineIs414) {
  start();
  Reply r = round_trip(address_, "GET /" + std::string(9000, 'a') + " HTTP/1.1\r\n\r\n");
  EXPECT_EQ(r.status, 414) << r.raw.substr(0, 200);
}

TEST_F(AdminServerTest, ThrowingHandlerIs500AndServerKeepsServing) {
  start();
  {
    std::lock_guard lock(state_->mu);
    state_->throw_from_metrics = true;
  }
  Reply r = get(address_, "/metrics");
  EXPECT_EQ(r.status, 500) << r.raw;
  EXPECT_TRUE(r.closed);
  EXPECT_EQ(get(address_, "/healthz").status, 200);
  {
    std::lock_guard lock(state_->mu);
    state_->throw_from_metrics = false;
  }
  EXPECT_EQ(get(address_, "/metrics").body, state_->metrics);
}

TEST_F(AdminServerTest, ServesManyConnectionsInTurn) {
  start();
  for (int i = 0; i < 200; ++i) {
    Reply r = get(address_, i % 2 ? "/metrics" : "/healthz");
    ASSERT_EQ(r.status, 200) << "request " << i << "\n" << r.raw;
  }
}

// kMaxConnections clients that never finish their request (or never start it) cannot shut a
// health probe out: the oldest unfinished one makes room for it, and connections stay capped.
TEST_F(AdminServerTest, UnfinishedRequestsCannotShutOutAHealthProbe) {
  start();  // 5 s request timeout: the idle clients below would hold their slots for the whole test
  std::vector<std::unique_ptr<Client>> idle;
  for (std::size_t i = 0; i < 2 * AdminServer::kMaxConnections; ++i) {
    idle.push_back(std::make_unique<Client>(address_));
    ASSERT_GE(idle.back()->fd(), 0);
    if (i % 2 == 0) {
      ASSERT_TRUE(idle.back()->send("GET /metrics HTTP/1.1\r\nHost: x\r\n"));  // never finished
    }
  }
  std::this_thread::sleep_for(200ms);  // the server takes them all in
  for (int i = 0; i < 20; ++i) {
    Reply r = get(address_, "/healthz");
    ASSERT_EQ(r.status, 200) << "probe " << i << ": " << r.raw;
  }
  // The first ones were dropped for the newer ones: never more than the cap open at once.
  std::size_t closed = 0;
  for (auto& c : idle) {
    if (!c->read_until_closed(10ms).empty()) ADD_FAILURE() << "an unfinished request was answered";
    if (c->closed()) ++closed;
  }
  EXPECT_GE(closed, idle.size() - AdminServer::kMaxConnections);
}

// Clients that send a whole request and then never read their answer nor close hold their
// connections until the deadline; kMaxConnections of them, renewed as fast as they are dropped
// (from several addresses, to stay within each address's share), cannot shut a health probe
// out: the oldest answered one makes room for it.
TEST_F(AdminServerTest, AnsweredClientsThatNeverCloseCannotShutOutAHealthProbe) {
  start();
  std::atomic<bool> stop{false};
  std::atomic<int> opened{0};
  std::thread holders([&] {
    std::vector<std::unique_ptr<Client>> held;  // all kept open until the end
    for (int i = 0; !stop && i < 400; ++i) {
      const std::string from = "127.0.0." + std::to_string(2 + i % 4);
      held.push_back(std::make_unique<Client>(address_, from));
      if (held.back()->fd() >= 0 && held.back()->send("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")) ++opened;
      if (i >= static_cast<int>(AdminServer::kMaxConnections)) std::this_thread::sleep_for(5ms);
    }
    while (!stop) std::this_thread::sleep_for(5ms);
  });
  while (opened < static_cast<int>(AdminServer::kMaxConnections)) std::this_thread::sleep_for(5ms);
  std::this_thread::sleep_for(100ms);  // every one answered, none read
  int answered = 0;
  const int probes = 40;
  for (int i = 0; i < probes; ++i) {
    Reply r = get(address_, "/healthz");
    if (r.status == 200) ++answered;
    std::this_thread::sleep_for(50ms);
  }
  stop = true;
  holders.join();
  std::printf("health probes answered while %d connections held their answers unread: %d/%d\n", opened.load(),
              answered, probes);
  EXPECT_GT(opened.load(), static_cast<int>(2 * AdminServer::kMaxConnections)) << "the holders did not hold";
  EXPECT_EQ(answered, probes);
}

// One address cannot take every connection: its oldest makes room for its newest, and another
// address's unfinished request keeps its place.
TEST_F(AdminServerTest, OneAddressHoldsAtMostItsShareOfConnections) {
  start();
  Client other(address_, "127.0.0.9");
  ASSERT_GE(other.fd(), 0);
  ASSERT_TRUE(other.send("GET /healthz HTTP/1.1\r\n"));  // unfinished, the oldest of all
  std::this_thread::sleep_for(50ms);
  std::vector<std::unique_ptr<Client>> mine;
  for (std::size_t i = 0; i < AdminServer::kMaxConnections; ++i) {
    mine.push_back(std::make_unique<Client>(address_, "127.0.0.8"));
    ASSERT_GE(mine.back()->fd(), 0);
  }
  std::this_thread::sleep_for(200ms);
  std::size_t closed = 0;
  for (auto& c : mine) {
    (void)c->read_until_closed(10ms);
    if (c->closed()) ++closed;
  }
  EXPECT_EQ(closed, AdminServer::kMaxConnections - AdminServer::kMaxConnectionsPerPeer);
  ASSERT_TRUE(other.send("Host: x\r\n\r\n"));
  EXPECT_EQ(parse_reply(other.read_until_closed(), other.closed()).status, 200)
      << "the other address kept its place";
}

TEST_F(AdminServerTest, SilentClientIsDroppedAtTheDeadline) {
  start(200ms);
  auto t0 = Clock::now();
  Client c(address_);
  ASSERT_GE(c.fd(), 0);
  std::string got = c.read_until_closed(5s);
  auto waited = Clock::now() - t0;
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(got, "");  // dropped, not answered
  EXPECT_GE(waited, 150ms);
  EXPECT_LT(waited, 3s);
}

TEST_F(AdminServerTest, PartialRequestIsDroppedAtTheDeadline) {
  start(200ms);
  Client c(address_);
  ASSERT_GE(c.fd(), 0);
  ASSERT_TRUE(c.send("GET /metrics HTTP/1.1\r\nHost: x\r\n"));  // never finished
  auto t0 = Clock::now();
  std::string got = c.read_until_closed(5s);
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(got, "");
  EXPECT_LT(Clock::now() - t0, 3s);
  // Others are still served meanwhile and afterwards.
  EXPECT_EQ(get(address_, "/healthz").status, 200);
}

TEST_F(AdminServerTest, DestructionWithClientsConnectedIsPrompt) {
  start();  // 5 s request timeout, which destruction must not wait for
  Client idle(address_);
  Client partial(address_);
  ASSERT_GE(idle.fd(), 0);
  ASSERT_GE(partial.fd(), 0);
  ASSERT_TRUE(partial.send("GET /metr"));
  // Make sure the server has accepted both before it goes.
  EXPECT_EQ(get(address_, "/healthz").status, 200);

  auto t0 = Clock::now();
  server_.reset();
  EXPECT_LT(Clock::now() - t0, 2s);
  idle.read_until_closed(2s);
  partial.read_until_closed(2s);
  EXPECT_TRUE(idle.closed());
  EXPECT_TRUE(partial.closed());
  // Nothing listens any more.
  Client late(address_);
  EXPECT_LT(late.fd(), 0);
}

TEST_F(AdminServerTest, PortConflictIsUnavailable) {
  start();
  auto second = AdminServer::start(address_, handlers_for(state_));
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(address_), std::string::npos) << second.status().to_string();
  // The first is unaffected.
  EXPECT_EQ(get(address_, "/healthz").status, 200);
}

TEST(AdminServerStart, RejectsBadAddresses) {
  auto state = std::make_shared<NodeState>();
  for (const char* bad : {"", "127.0.0.1", "localhost:9745", "127.0.0.1:99999", "127.0.0.1:abc", "127.0.0.1:",
                          ":9745", "::1:9745", "[127.0.0.1]:0", "[::1]", "[::1]9745", "1.2.3:9745"}) {
    auto s = AdminServer::start(bad, handlers_for(state));
    ASSERT_FALSE(s.is_ok()) << bad;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << bad << ": " << s.status().to_string();
    if (*bad != '\0') {
      EXPECT_NE(s.status().message().find(bad), std::string::npos) << s.status().to_string();
    }
  }
}

TEST(AdminServerStart, AddressNotOnThisHostIsUnavailable) {
  // TEST-NET-1 (RFC 5737) is never assigned to a local interface.
  auto s = AdminServer::start("192.0.2.1:0", handlers_for(std::make_shared<NodeState>()));
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable) << s.status().to_string();
  EXPECT_NE(s.status().message().find("192.0.2.1:0"), std::string::npos) << s.status().to_string();
}

TEST(AdminServerStart, RequiresBothHandlers) {
  auto h = handlers_for(std::make_shared<NodeState>());
  h.health = nullptr;
  auto s = AdminServer::start("127.0.0.1:0", h);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
}

TEST(AdminServerStart, ServesOnIpv6Loopback) {
  auto state = std::make_shared<NodeState>();
  auto s = AdminServer::start("[::1]:0", handlers_for(state));
  if (!s.is_ok() && s.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << "no IPv6 loopback here: " << s.status().to_string();
  }
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  std::string address = (*s)->address();
  EXPECT_TRUE(address.starts_with("[::1]:")) << address;
  Reply r = get(address, "/healthz");
  EXPECT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body, "ok\n");
}

// ---------------------------------------------------------------------------------------------
// MetricsText

TEST(MetricsText, CounterAndGauge) {
  MetricsText m;
  m.counter("kvstash_requests_total", "Requests served.", 1234);
  m.gauge("kvstash_load", "Current load.", 0.25);
  EXPECT_EQ(m.str(),
            "# HELP kvstash_requests_total Requests served.\n"
            "# TYPE kvstash_requests_total counter\n"
            "kvstash_requests_total 1234\n"
            "# HELP kvstash_load Current load.\n"
            "# TYPE kvstash_load gauge\n"
            "kvstash_load 0.25\n");
  EXPECT_EQ(MetricsText().str(), "");
}

// The value text of a single unlabelled gauge.
std::string value_text(double v) {
  MetricsText m;
  m.gauge("g", "", v);
  std::string s = m.str();
  auto line = s.find("\ng ");
  return s.substr(line + 3, s.size() - line - 4);
}

TEST(MetricsText, Values) {
  EXPECT_EQ(value_text(0), "0");
  EXPECT_EQ(value_text(-3), "-3");
  EXPECT_EQ(value_text(1e15), "1000000000000000");
  EXPECT_EQ(value_text(18446744073709551616.0), "18446744073709551616");  // 2^64: past int64, still exact
  EXPECT_EQ(value_text(1e300), "1e+300");
  EXPECT_EQ(value_text(0.1), "0.1");
  EXPECT_EQ(value_text(-2.5), "-2.5");
  EXPECT_EQ(value_text(std::numeric_limits<double>::quiet_NaN()), "NaN");
  EXPECT_EQ(value_text(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(value_text(-std::numeric_limits<double>::infinity()), "-Inf");
  for (double v : {1.0 / 3.0, 1.5e-7, 123456.789, 6.02214076e23}) {
    EXPECT_EQ(std::strtod(value_text(v).c_str(), nullptr), v) << value_text(v);
  }
}

TEST(MetricsText, HelpAndTypeOncePerNameWithSamplesGrouped) {
  MetricsText m;
  m.counter("ops_total", "Operations.", 1, {{"op", "read"}});
  m.gauge("pages_free", "Free pages.", 7);
  m.counter("ops_total", "ignored help", 2, {{"op", "write"}, {"status", "ok"}});
  EXPECT_EQ(m.str(),
            "# HELP ops_total Operations.\n"
            "# TYPE ops_total counter\n"
            "ops_total{op=\"read\"} 1\n"
            "ops_total{op=\"write\",status=\"ok\"} 2\n"
            "# HELP pages_free Free pages.\n"
            "# TYPE pages_free gauge\n"
            "pages_free 7\n");
}

TEST(MetricsText, Escaping) {
  MetricsText m;
  m.gauge("x", "a \\ back\nslash \"quoted\"", 1, {{"path", "C:\\dir \"q\"\nnext"}});
  EXPECT_EQ(m.str(),
            "# HELP x a \\\\ back\\nslash \"quoted\"\n"
            "# TYPE x gauge\n"
            "x{path=\"C:\\\\dir \\\"q\\\"\\nnext\"} 1\n");
}

TEST(MetricsText, InvalidNamesAreSkipped) {
  MetricsText m;
  m.gauge("1starts_with_digit", "h", 1);
  m.gauge("has-dash", "h", 1);
  m.gauge("", "h", 1);
  m.gauge("ok", "h", 1, {{"0label", "v"}});
  m.gauge("ok", "h", 2, {{"__reserved", "v"}});
  m.gauge("ok", "h", 3, {{"bad-label", "v"}});
  m.gauge("ok", "h", 4, {{"a", "1"}, {"a", "2"}});
  EXPECT_EQ(m.str(), "");

  m.gauge(":ns:name_2", "h", 5, {{"_l1", "v"}});
  EXPECT_EQ(m.str(), "# HELP :ns:name_2 h\n# TYPE :ns:name_2 gauge\n:ns:name_2{_l1=\"v\"} 5\n");
}

TEST(MetricsText, TypeConflictKeepsTheFirst) {
  MetricsText m;
  m.counter("n", "first", 1);
  m.gauge("n", "second", 2);
  EXPECT_EQ(m.str(), "# HELP n first\n# TYPE n counter\nn 1\n");
}

}  // namespace
}  // namespace kvstash::node
