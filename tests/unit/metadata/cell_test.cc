// A cell connection and the pool of them against a real redis-server: the catalogs a Cell
// hands out, and the pool's bound, its wait until the borrower's deadline, the deadline on a
// borrowed connection's commands and its removal when the connection comes back.
#include "metadata/cell.h"

#include <gtest/gtest.h>

#include <thread>

#include "metadata/cell_pool.h"
#include "redis_server.h"

namespace kvstash::metadata {
namespace {

using namespace std::chrono_literals;

class CellTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.running()) << "redis-server did not start (is it installed?)";
    watcher_ = RedisClient::connect({.url = server_.url()}).value();
  }
  CellOptions options(std::string cell = "default") {
    // Commands may wait long (BLPOP below): only a deadline cuts them short.
    return {.redis = {.url = server_.url(), .command_timeout = 10s}, .cell = std::move(cell)};
  }
  // Connections Redis has open, the watcher's own left out.
  std::int64_t redis_clients() {
    auto r = watcher_->command({"CLIENT", "LIST"});
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    if (!r.is_ok()) return -1;
    std::int64_t lines = 0;
    for (char c : r->str()) lines += c == '\n';
    return lines - 1;
  }

  test::RedisServer server_;
  std::unique_ptr<RedisClient> watcher_;
};

TEST_F(CellTest, ItsCatalogsShareOneConnectionAndTheCellsPrefix) {
  auto cell = Cell::open(options("prod-a")).value();
  EXPECT_EQ(cell->name(), "prod-a");
  EXPECT_EQ(cell->prefix(), "kvs:{kvs:prod-a}");
  EXPECT_EQ(cell->catalog().prefix(), cell->prefix());
  EXPECT_EQ(cell->node_catalog().prefix(), cell->prefix());
  EXPECT_EQ(cell->admin().prefix(), cell->prefix());

  // What the node writes, the operator and the client read, on the same connection.
  ASSERT_TRUE(cell->node_catalog().register_node({"n1", "e1", 4096, 8, "addr", "key"}, 30s).is_ok());
  EXPECT_EQ(cell->admin().free_pages("n1").value(), 8u);
  auto p = cell->catalog().begin_put("t1", "k", 4096, 30s);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  ASSERT_TRUE(cell->catalog().commit_put("t1", "k", {1}, "", 0ms).is_ok());
  EXPECT_EQ(cell->admin().summary()->objects, 1u);
  EXPECT_EQ(redis_clients(), 1);
  EXPECT_TRUE(cell->check_schema().is_ok());
  ASSERT_TRUE(cell->redis().command({"HSET", cell->prefix() + ":cell", "schema", "99"}).is_ok());
  EXPECT_EQ(cell->check_schema().code(), StatusCode::kCorrupt);

  // Another cell on the same Redis sees none of it.
  auto other = Cell::open(options("prod-b")).value();
  EXPECT_EQ(other->admin().known_nodes()->size(), 0u);
  EXPECT_EQ(other->catalog().stat("k").status().code(), StatusCode::kNotFound);
}

TEST_F(CellTest, OpeningNeedsAReachableRedis) {
  CellOptions o = options();
  server_.stop();
  EXPECT_EQ(Cell::open(o).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(CellPool::open(o, 2).status().code(), StatusCode::kUnavailable);
}

TEST_F(CellTest, APoolOpensAtMostItsSizeAndABorrowerWaitsUntilItsDeadline) {
  auto pool = CellPool::open(options(), 2).value();
  EXPECT_EQ(pool->size(), 2u);
  EXPECT_EQ(pool->open_connections(), 1u) << "the first connection opens with the pool";

  auto a = pool->borrow(deadline_after(2s));
  auto b = pool->borrow(deadline_after(2s));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_TRUE((*a)->check_schema().is_ok());
  EXPECT_TRUE(b->redis().command({"PING"}).is_ok());
  EXPECT_EQ(pool->open_connections(), 2u);
  EXPECT_EQ(redis_clients(), 2);

  const Deadline soon = deadline_after(150ms);
  auto c = pool->borrow(soon);
  EXPECT_EQ(c.status().code(), StatusCode::kTimeout);
  EXPECT_GE(Clock::now(), soon) << "gave up before its deadline";
  EXPECT_EQ(pool->open_connections(), 2u);
  EXPECT_EQ(redis_clients(), 2) << "a third connection opened";

  // One comes back: the next borrower takes it, no new connection.
  { auto back = std::move(b).value(); }
  auto d = pool->borrow(deadline_after(2s));
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(redis_clients(), 2);

  // A pool of size 0 is a pool of one.
  auto one = CellPool::open(options(), 0).value();
  EXPECT_EQ(one->size(), 1u);
}

TEST_F(CellTest, AWaitingBorrowerGetsTheConnectionGivenBack) {
  auto pool = CellPool::open(options(), 1).value();
  auto held = pool->borrow(deadline_after(2s));
  ASSERT_TRUE(held.is_ok());
  std::thread giver([&] {
    std::this_thread::sleep_for(100ms);
    auto back = std::move(held).value();  // given back as it goes
  });
  const auto start = Clock::now();
  auto next = pool->borrow(deadline_after(5s));
  const auto waited = Clock::now() - start;
  giver.join();
  ASSERT_TRUE(next.is_ok()) << next.status().to_string();
  EXPECT_LT(waited, 4s) << "waited for its deadline rather than for the connection";
  EXPECT_TRUE(next->redis().command({"PING"}).is_ok());
  EXPECT_EQ(pool->open_connections(), 1u);
  EXPECT_EQ(redis_clients(), 1);
}

TEST_F(CellTest, ABorrowersDeadlineBoundsItsCommandsUntilTheConnectionComesBack) {
  auto pool = CellPool::open(options(), 1).value();
  RedisClient* client = nullptr;
  {
    const Deadline deadline = deadline_after(300ms);
    auto b = pool->borrow(deadline);
    ASSERT_TRUE(b.is_ok());
    client = &b->redis();
    EXPECT_EQ(client->deadline(), std::optional<Deadline>(deadline));
    // BLPOP would wait 5 s (the command timeout is 10 s): the deadline ends it.
    const auto start = Clock::now();
    auto popped = b->redis().command({"BLPOP", "nothing", "5"});
    EXPECT_EQ(popped.status().code(), StatusCode::kTimeout) << popped.status().to_string();
    EXPECT_LT(Clock::now() - start, 2s);
    // Past the deadline a command is not even sent.
    std::this_thread::sleep_until(deadline + 10ms);
    EXPECT_EQ((*b)->stat("k").status().code(), StatusCode::kTimeout);
  }
  // Back in the pool (idle; this test is its only user): no deadline left on it.
  EXPECT_FALSE(client->deadline().has_value());

  // The next borrower gets the same connection under its own deadline, and it works again.
  const Deadline later = deadline_after(5s);
  auto again = pool->borrow(later);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(&again->redis(), client);
  EXPECT_EQ(client->deadline(), std::optional<Deadline>(later));
  EXPECT_TRUE(again->redis().command({"PING"}).is_ok());
  EXPECT_EQ((*again)->stat("k").status().code(), StatusCode::kNotFound);
}

TEST_F(CellTest, AFailedConnectGivesItsSlotBack) {
  auto pool = CellPool::open(options(), 2).value();
  auto first = pool->borrow(deadline_after(2s));
  ASSERT_TRUE(first.is_ok());
  server_.stop();
  auto second = pool->borrow(deadline_after(2s));
  EXPECT_EQ(second.status().code(), StatusCode::kUnavailable) << second.status().to_string();
  EXPECT_EQ(pool->open_connections(), 1u);

  ASSERT_TRUE(server_.restart());
  second = pool->borrow(deadline_after(2s));
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  EXPECT_EQ(pool->open_connections(), 2u);
  EXPECT_TRUE(second->redis().command({"PING"}).is_ok());
}

}  // namespace
}  // namespace kvstash::metadata
