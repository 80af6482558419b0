// Connection setup helpers (src/common/net.h): parsing, and name resolution and connects that
// end by their deadline whatever the name server does.
#include "common/net.h"

#include <gtest/gtest.h>

#include <thread>

namespace kvstash::net {
namespace {

using namespace std::chrono_literals;

TEST(Net, NumericHostsResolveToThemselvesWithoutAWait) {
  auto v4 = resolve("127.0.0.1", deadline_after(1s));
  ASSERT_TRUE(v4.is_ok()) << v4.status().to_string();
  EXPECT_EQ(v4->front(), "127.0.0.1");
  // Even with no time left: a numeric address needs no name server.
  auto v6 = resolve("::1", Clock::now());
  ASSERT_TRUE(v6.is_ok()) << v6.status().to_string();
  EXPECT_EQ(v6->front(), "::1");
}

TEST(Net, NamesResolveWithinTheDeadline) {
  auto local = resolve("localhost", deadline_after(5s));
  ASSERT_TRUE(local.is_ok()) << local.status().to_string();
  EXPECT_FALSE(local->empty());
  // A name no server knows: however the resolver behaves here (an answer at once, or a wait
  // for a name server that is not there), the call returns by its deadline.
  for (auto budget : {0ms, 50ms, 300ms}) {
    const auto start = Clock::now();
    auto r = resolve("kvstash-no-such-host.invalid", start + budget);
    EXPECT_FALSE(r.is_ok());
    EXPECT_TRUE(r.status().code() == StatusCode::kTimeout || r.status().code() == StatusCode::kUnavailable)
        << r.status().to_string();
    EXPECT_LT(Clock::now() - start, budget + 200ms) << "resolution outlived its deadline";
  }
}

TEST(Net, ConnectsEndByTheirDeadline) {
  const auto start = Clock::now();
  auto r = connect_tcp({"kvstash-no-such-host.invalid", 7}, start + 100ms);
  EXPECT_FALSE(r.is_ok());
  EXPECT_LT(Clock::now() - start, 300ms);
  // Nothing listens on port 1 of loopback: refused at once.
  auto refused = connect_tcp({"127.0.0.1", 1}, deadline_after(2s));
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status().to_string();
}

TEST(Net, HostPortsParseOrSayWhy) {
  auto hp = parse_host_port("[::1]:7400");
  ASSERT_TRUE(hp.is_ok());
  EXPECT_EQ(hp->host, "::1");
  EXPECT_EQ(hp->port, 7400);
  for (const char* bad : {"", "host", "host:", ":80", "host:99999", "[::1:80"}) {
    EXPECT_EQ(parse_host_port(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace kvstash::net
