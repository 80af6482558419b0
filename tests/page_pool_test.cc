// The page pool's scripts against a real redis-server.
#include "metadata/page_pool.h"

#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "redis_server.h"

namespace kvstash::metadata {
namespace {

using namespace std::chrono_literals;

class PagePoolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.running()) << "redis-server did not start (is it installed?)";
    redis_ = RedisClient::connect({.url = server_.url()}).value();
    pool_ = std::make_unique<PagePool>(*redis_);
  }
  NodeRecord node(std::string id, std::string epoch, std::uint64_t pages) {
    return {std::move(id), std::move(epoch), 1u << 20, pages, "addr", "key"};
  }

  test::RedisServer server_;
  std::unique_ptr<RedisClient> redis_;
  std::unique_ptr<PagePool> pool_;
};

TEST_F(PagePoolTest, AllocationSpansNodesMostFreeFirstAndFreeingRestoresCounts) {
  ASSERT_TRUE(pool_->register_node(node("a", "e1", 10), 10s).is_ok());
  ASSERT_TRUE(pool_->register_node(node("b", "e1", 6), 10s).is_ok());
  auto ext = pool_->allocate(13);
  ASSERT_TRUE(ext.is_ok()) << ext.status().to_string();
  ASSERT_EQ(ext->size(), 13u);
  std::set<std::pair<std::string, std::uint64_t>> distinct;
  int on_a = 0;
  for (const Extent& e : *ext) {
    distinct.emplace(e.node, e.page);
    on_a += e.node == "a";
    EXPECT_EQ(e.generation, 1);
  }
  EXPECT_EQ(distinct.size(), 13u) << "a page was handed out twice";
  EXPECT_EQ(on_a, 10) << "the node with most free pages is used first";
  EXPECT_EQ(*pool_->free_pages("a"), 0u);
  EXPECT_EQ(*pool_->free_pages("b"), 3u);

  ASSERT_TRUE(pool_->free(*ext).is_ok());
  EXPECT_EQ(*pool_->free_pages("a"), 10u);
  EXPECT_EQ(*pool_->free_pages("b"), 6u);
  // A repeated free changes nothing.
  ASSERT_TRUE(pool_->free(*ext).is_ok());
  EXPECT_EQ(*pool_->free_pages("a"), 10u);
}

TEST_F(PagePoolTest, ReusedPagesGetNewGenerationsAndOldExtentsCannotFreeThem) {
  ASSERT_TRUE(pool_->register_node(node("a", "e1", 1), 10s).is_ok());
  auto first = pool_->allocate(1).value();
  ASSERT_TRUE(pool_->free(first).is_ok());
  auto second = pool_->allocate(1).value();
  EXPECT_EQ(second[0].page, first[0].page);
  EXPECT_EQ(second[0].generation, first[0].generation + 1);
  // The stale extent no longer frees the page its new owner holds.
  ASSERT_TRUE(pool_->free(first).is_ok());
  EXPECT_EQ(*pool_->free_pages("a"), 0u);
}

TEST_F(PagePoolTest, NotEnoughPagesIsNoSpaceAndTakesNothing) {
  ASSERT_TRUE(pool_->register_node(node("a", "e1", 4), 10s).is_ok());
  auto r = pool_->allocate(5);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoSpace);
  EXPECT_EQ(*pool_->free_pages("a"), 4u);
}

TEST_F(PagePoolTest, DeadAndRestartedNodes) {
  ASSERT_TRUE(pool_->register_node(node("a", "e1", 4), 200ms).is_ok());
  ASSERT_TRUE(pool_->register_node(node("b", "e1", 4), 10s).is_ok());
  auto held = pool_->allocate(2).value();
  std::this_thread::sleep_for(300ms);  // a's heartbeat lapses
  auto r = pool_->allocate(4);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  for (const Extent& e : *r) EXPECT_EQ(e.node, "b") << "a dead node got pages";
  EXPECT_EQ(pool_->heartbeat("a", "old-epoch", 10s).code(), StatusCode::kStale);
  EXPECT_EQ(pool_->heartbeat("nobody", "e1", 10s).code(), StatusCode::kStale);
  // a restarts with a new epoch: a fresh pool, and extents of its old life are void.
  ASSERT_TRUE(pool_->register_node(node("a", "e2", 4), 10s).is_ok());
  EXPECT_EQ(*pool_->free_pages("a"), 4u);
  ASSERT_TRUE(pool_->free(held).is_ok());
  EXPECT_EQ(*pool_->free_pages("a"), 4u) << "an old-epoch extent was freed into the new pool";
  EXPECT_TRUE(pool_->heartbeat("a", "e2", 10s).is_ok());
}

TEST_F(PagePoolTest, RegistrationIsValidated) {
  ASSERT_TRUE(pool_->register_node(node("a", "e1", 4), 10s).is_ok());
  NodeRecord other = node("b", "e1", 4);
  other.page_size = 4096;
  EXPECT_EQ(pool_->register_node(other, 10s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->register_node(node("c", "e1", 0), 10s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->register_node(node("", "e1", 4), 10s).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool_->free_pages("zzz").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvstash::metadata
