// Unauthenticated connections against a real kvstashd (tcp, with a cluster token) and a real
// redis-server, all on loopback: a flood of connections that never prove the token must not
// keep out clients that do, and guessing the token must get few answers a second.
//
// Bounded: the flood opens at most kFloodThreads x kFloodRate x kFlood connections, from
// 127.0.0.2..9, and every thread stops by itself.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <deque>
#include <fstream>
#include <thread>

#include "common/handshake.h"
#include "http_get.h"
#include "kvstash/store.h"
#include "tests/harness/local_cluster.h"
#include "transport/tcp/tcp_internal.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;
using test::http_get;
using test::metric;

constexpr char kToken[] = "flood-test-cluster-token-0123456789";

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A TCP socket from `source` (a loopback address) to 127.0.0.1:port; -1 when it failed.
// Non-blocking when `wait` is false: the flood does not wait for the connect to finish.
int connect_from(const std::string& source, int port, bool wait) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (wait ? 0 : SOCK_NONBLOCK), 0);
  if (fd < 0) return -1;
  sockaddr_in src{};
  src.sin_family = AF_INET;
  inet_pton(AF_INET, source.c_str(), &src.sin_addr);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<std::uint16_t>(port));
  dst.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0 ||
      (::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) != 0 && errno != EINPROGRESS)) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Opens connections from `source` that never say a word, `rate` a second from `start` until
// `length` has passed or `stop`, holding at most `hold` open (the oldest closes); counts them.
void flood_from(const std::string& source, int port, int rate, int hold, Clock::time_point start,
                Clock::duration length, const std::atomic<bool>& stop, std::atomic<std::uint64_t>& opened) {
  using namespace std::chrono_literals;
  std::deque<int> held;
  for (int n = 0; !stop.load() && Clock::now() - start < length; ++n) {
    std::this_thread::sleep_until(start + n * (1000000us / rate));
    const int fd = connect_from(source, port, false);
    if (fd < 0) continue;
    ++opened;
    held.push_back(fd);
    if (held.size() > static_cast<std::size_t>(hold)) {
      ::close(held.front());
      held.pop_front();
    }
  }
  for (int fd : held) ::close(fd);
}

enum class Outcome { kClosed, kDenied, kAccepted };

// One tcp handshake from `source` proving `token` (right or wrong): kClosed when the target
// closed the connection before its hello (refused at accept), else its verdict. With `rtt`,
// the client answers the target's hello that much later: what the target sees of a client a
// round trip of `rtt` away (loopback has no tc netem here: the kernel lacks sch_netem).
Outcome attempt(const std::string& source, int port, const std::string& token,
                std::chrono::milliseconds rtt = std::chrono::milliseconds(0)) {
  using namespace transport::tcp;
  const int fd = connect_from(source, port, true);
  if (fd < 0) return Outcome::kClosed;
  Outcome out = Outcome::kClosed;
  ServerHello hello{};
  if (::recv(fd, &hello, sizeof hello, MSG_WAITALL) == static_cast<ssize_t>(sizeof hello)) {
    std::this_thread::sleep_for(rtt);
    handshake::Handshake me(handshake::Role::kClient, token);
    (void)me.on_peer_hello(hello.nonce, hello.token_required != 0);
    ClientHello mine{};
    mine.magic = kClientMagic;
    mine.version = kProtocolVersion;
    mine.nonce = me.nonce();
    mine.mac = me.proof();
    ServerVerdict verdict{};
    if (::send(fd, &mine, sizeof mine, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof mine) &&
        ::recv(fd, &verdict, sizeof verdict, MSG_WAITALL) == static_cast<ssize_t>(sizeof verdict)) {
      out = verdict.status == static_cast<std::uint32_t>(StatusCode::kOk) ? Outcome::kAccepted
                                                                          : Outcome::kDenied;
    }
  }
  ::close(fd);
  return out;
}

class Flood : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv("KVSTASH_CLUSTER_TOKEN");
    auto redis = harness::LocalRedis::start();
    ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
    redis_ = std::move(redis).value();
    const std::string token_file = "/tmp/kvstash-flood-token-" + std::to_string(::getpid());
    { std::ofstream(token_file) << kToken << "\n"; }
    ASSERT_EQ(::chmod(token_file.c_str(), 0600), 0);
    port_ = free_port();
    auto node = harness::LocalNode::start(
        {.redis_url = redis_->url(),
         .capacity = "64MiB",
         .page_size = "1MiB",
         .node_id = "flooded",
         .extra_args = {"--transports", "tcp", "--listen", "127.0.0.1:" + std::to_string(port_),
                        "--cluster-token-file", token_file}});
    ::unlink(token_file.c_str());
    ASSERT_TRUE(node.is_ok()) << node.status().to_string();
    node_ = std::move(node).value();
  }

  Result<std::unique_ptr<Store>> open_store() const {
    StoreOptions o;
    o.redis_url = redis_->url();
    o.engine.transports = {TransportKind::kTcp};
    o.engine.cluster_token = kToken;
    o.timeout = 5s;
    return Store::open(o);
  }

  double tcp_event(const std::string& event) const {
    auto [code, body] = http_get(node_->admin(), "/metrics");
    return metric(body, "kvstash_transport_events_total", "{transport=\"tcp\",event=\"" + event + "\"}");
  }

  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<harness::LocalNode> node_;
  int port_ = 0;
};

Status put_and_check(Store& store, const std::string& key, std::vector<char>& data) {
  std::vector<char> back(data.size());
  Slice in{data.data(), data.size()}, out{back.data(), back.size()};
  KVSTASH_RETURN_IF_ERROR(store.put(key, {&in, 1}));
  KVSTASH_RETURN_IF_ERROR(store.get(key, {&out, 1}).status());
  return back == data ? Status{} : Status::corrupt("other bytes came back");
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

// 8 addresses open connections as fast as kFloodRate allows, each holding up to kHeld of
// them open and never saying a word; meanwhile clients that know the token open fresh
// stores (new connections, new handshakes) and put and get, and one warm client keeps
// putting. Every proven put must succeed.
TEST_F(Flood, UnprovenConnectionsCannotKeepOutClientsThatProveTheToken) {
  constexpr int kFloodThreads = 8;
  constexpr int kFloodRate = 150;  // connections a second per thread
  constexpr int kHeld = 200;       // open at once per thread: 1,600 in all, over the 1,024 cap
  constexpr auto kFlood = 8s;

  auto warm = open_store();
  ASSERT_TRUE(warm.is_ok()) << warm.status().to_string();
  std::vector<char> data(256u << 10);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  ASSERT_TRUE(put_and_check(**warm, "before", data).is_ok());

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> opened{0};
  std::vector<std::thread> flooders;
  for (int t = 0; t < kFloodThreads; ++t) {
    flooders.emplace_back([&, t] {
      flood_from("127.0.0." + std::to_string(2 + t), port_, kFloodRate, kHeld, Clock::now(), kFlood, stop,
                 opened);
    });
  }

  // Proven clients, from 1 s into the flood (the budgets are full by then) until its end.
  std::this_thread::sleep_for(1s);
  std::vector<double> fresh_ms, warm_ms;
  int fresh_ok = 0, fresh_total = 0, warm_ok = 0, warm_total = 0;
  std::string first_error;
  const auto until = Clock::now() + kFlood - 2s;
  for (int round = 0; Clock::now() < until; ++round) {
    {
      // A fresh client: its engine connects (and proves the token) during the flood.
      const auto t0 = Clock::now();
      auto store = open_store();
      Status s =
          store.is_ok() ? put_and_check(**store, "fresh-" + std::to_string(round), data) : store.status();
      ++fresh_total;
      if (s.is_ok()) {
        ++fresh_ok;
        fresh_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      } else if (first_error.empty()) {
        first_error = "fresh client: " + s.to_string();
      }
    }
    {
      const auto t0 = Clock::now();
      Status s = put_and_check(**warm, "warm-" + std::to_string(round), data);
      ++warm_total;
      if (s.is_ok()) {
        ++warm_ok;
        warm_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      } else if (first_error.empty()) {
        first_error = "warm client: " + s.to_string();
      }
    }
    std::this_thread::sleep_for(100ms);
  }
  stop = true;
  for (auto& t : flooders) t.join();

  const double evicted = tcp_event("unproven_evicted");
  const double timeouts = tcp_event("handshake_timeouts");
  std::printf(
      "flood: %llu unproven connections opened from 127.0.0.2-9 in %lld s; during it, proven clients:\n"
      "  fresh client (connect + handshake + put + get of 256 KiB): %d/%d ok, p50 %.1f ms, p99 %.1f ms\n"
      "  warm client (put + get of 256 KiB):                       %d/%d ok, p50 %.1f ms, p99 %.1f ms\n"
      "  target: %.0f handshakes dropped for newer ones, %.0f handshake timeouts\n",
      static_cast<unsigned long long>(opened.load()),
      static_cast<long long>(std::chrono::duration_cast<std::chrono::seconds>(kFlood).count()), fresh_ok,
      fresh_total, percentile(fresh_ms, 0.5), percentile(fresh_ms, 0.99), warm_ok, warm_total,
      percentile(warm_ms, 0.5), percentile(warm_ms, 0.99), evicted, timeouts);
  EXPECT_GT(opened.load(), 1500u) << "the flood did not flood";
  EXPECT_GE(fresh_total, 5);
  EXPECT_EQ(fresh_ok, fresh_total) << first_error;
  EXPECT_EQ(warm_ok, warm_total) << first_error;
  EXPECT_GT(evicted + timeouts, 0) << "the target never felt the flood";
}

// A fast flood (the attacker that let 0 of 48 clients in at 10 ms of round trip, when a full
// budget dropped the oldest handshake): 6,000 connections a second keep a handshake in the
// budget of 64 for about 11 ms, far less than the clients' 50 ms round trip, and the node
// still accepts them all on a busy two-core machine (at 20,000 a second it fell behind, the
// flood's connections died in the listen queue and never filled the budget). Clients that
// know the token, a 50 ms round trip away, one from an address new to the node and one from
// an address that proved the token before, all get in, because a full budget displaces the
// handshakes of the source holding the most places.
TEST_F(Flood, ClientsFiftyMillisecondsAwayGetInDuringAFastFlood) {
  constexpr auto kRtt = 50ms;
  constexpr auto kFlood = 7s;
  constexpr int kHeld = 300;       // open at once per flooding address
  constexpr int kMaxRate = 3'000;  // connections a second per address
  ASSERT_EQ(attempt("127.0.0.1", port_, kToken), Outcome::kAccepted) << "127.0.0.1 proves the token first";
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> opened{0};
  std::vector<std::thread> flooders;
  const auto start = Clock::now();
  for (int t = 0; t < 2; ++t) {
    flooders.emplace_back([&, t] {
      flood_from("127.0.0." + std::to_string(2 + t), port_, kMaxRate, kHeld, start, kFlood, stop, opened);
    });
  }
  std::this_thread::sleep_for(1s);  // the budget is full of the flood's handshakes by then
  const double evicted_before = tcp_event("unproven_evicted");
  const double refused_before = tcp_event("connections_refused");
  std::vector<double> fresh_ms, known_ms;
  int fresh_ok = 0, known_ok = 0, tries = 0;
  const auto timed = [&](const std::string& source, std::vector<double>& ms) {
    const auto t0 = Clock::now();
    const bool ok = attempt(source, port_, kToken, kRtt) == Outcome::kAccepted;
    if (ok) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    return ok;
  };
  while (Clock::now() - start < kFlood - 1s) {
    ++tries;
    fresh_ok += timed("127.0.0.40", fresh_ms);
    known_ok += timed("127.0.0.1", known_ms);
  }
  const double evicted_during = tcp_event("unproven_evicted") - evicted_before;
  const double refused_during = tcp_event("connections_refused") - refused_before;
  stop = true;
  for (auto& t : flooders) t.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf(
      "fast flood: %llu unproven connections from 2 addresses in %.1f s (%.0f/s), %.0f handshakes displaced "
      "while the clients tried; clients %lld ms of round trip away:\n"
      "  new address:    %d/%d in, p50 %.1f ms, p99 %.1f ms\n"
      "  proven address: %d/%d in, p50 %.1f ms, p99 %.1f ms\n",
      static_cast<unsigned long long>(opened.load()), seconds, static_cast<double>(opened.load()) / seconds,
      evicted_during, static_cast<long long>(kRtt.count()), fresh_ok, tries, percentile(fresh_ms, 0.5),
      percentile(fresh_ms, 0.99), known_ok, tries, percentile(known_ms, 0.5), percentile(known_ms, 0.99));
  // The flood kept the node full while the clients tried: its handshakes displaced (or refused
  // at accept once an address held its cap).
  EXPECT_GT(evicted_during + refused_during, 1000) << "the flood did not fill the budget";
  // A try takes 0.1-1.4 s on a busy two-core machine (the flood shares its cores).
  EXPECT_GE(tries, 3) << "the clients had too few tries to tell";
  EXPECT_EQ(fresh_ok, tries);
  EXPECT_EQ(known_ok, tries);
}

// Wrong guesses back their address off, and the listener as a whole checks only a few proofs
// a second from addresses that never proved the token; one that did keeps getting in.
TEST_F(Flood, WrongTokenGuessesAreSlowed) {
  const std::string wrong = "not-the-cluster-token-at-all-0000";
  // 127.0.0.1 proves the token once, before the attack.
  ASSERT_EQ(attempt("127.0.0.1", port_, kToken), Outcome::kAccepted);

  // Four addresses guess as fast as they can for 3 s. Each counts the verdicts it got (a
  // verdict is a checked proof: a failure the target holds against the address).
  std::atomic<int> tries{0}, answered{0};
  std::array<std::atomic<int>, 4> verdicts{};
  std::vector<std::thread> guessers;
  const auto start = Clock::now();
  for (int t = 0; t < 4; ++t) {
    guessers.emplace_back([&, t] {
      const std::string source = "127.0.0." + std::to_string(20 + t);
      while (Clock::now() - start < 3s) {
        ++tries;
        if (attempt(source, port_, wrong) != Outcome::kClosed) ++answered, ++verdicts[t];
      }
    });
  }
  for (auto& t : guessers) t.join();
  std::printf(
      "guessing: %d handshakes tried from 4 addresses in 3 s, %d of them got a verdict (%d %d %d %d)\n",
      tries.load(), answered.load(), verdicts[0].load(), verdicts[1].load(), verdicts[2].load(),
      verdicts[3].load());
  EXPECT_GT(tries.load(), 100) << "the guessers did not try hard";
  // The listener checks at most 16 + 4/s proofs of addresses that have not proven the token
  // (and each address gets 8 failures free, then a backoff from 250 ms doubling).
  EXPECT_LE(answered.load(), 75);

  // A guessing address is refused at once, even with the right token, until its backoff ends.
  // Which of the four got how many verdicts is the scheduler's choice, so 127.0.0.20 guesses on
  // until a fresh verdict makes its 11th failure or more: that backoff is at least 1 s long.
  int fresh = 0;
  for (const auto until = Clock::now() + 15s; (fresh == 0 || verdicts[0] < 11) && Clock::now() < until;) {
    if (attempt("127.0.0.20", port_, wrong) != Outcome::kClosed) {
      ++fresh, ++verdicts[0];
    } else {
      std::this_thread::sleep_for(50ms);
    }
  }
  ASSERT_GE(verdicts[0].load(), 11) << "127.0.0.20 never got its proofs checked";
  // The listener's allowance refills a proof in 250 ms: only the address's own backoff refuses.
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(attempt("127.0.0.20", port_, kToken), Outcome::kClosed);

  // Many addresses, one wrong guess each: the listener's allowance runs out, and then even a
  // right proof from an address that never proved it is refused unchecked...
  for (int i = 1; i <= 40; ++i) (void)attempt("127.0.1." + std::to_string(i), port_, wrong);
  EXPECT_NE(attempt("127.0.2.1", port_, kToken), Outcome::kAccepted);
  // ...while one that proved it before still gets in, and a client with the token works.
  EXPECT_EQ(attempt("127.0.0.1", port_, kToken), Outcome::kAccepted);
  auto store = open_store();
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  std::vector<char> data(4096, 'g');
  Status s = put_and_check(**store, "after-guessing", data);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_GT(tcp_event("handshakes_failed"), 0);
  EXPECT_GT(tcp_event("connections_refused"), 0);
}

}  // namespace
}  // namespace kvstash
