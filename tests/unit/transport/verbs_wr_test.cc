// The verbs work-request builder: splitting, SGE packing, chaining and selective signaling.
// Pure logic: runs on every machine, RDMA or not.
#include "transport/verbs/verbs_wr.h"

#include <gtest/gtest.h>

namespace kvstash::transport::verbs {
namespace {

std::uint64_t total(const ibv_send_wr& wr) {
  std::uint64_t n = 0;
  for (int i = 0; i < wr.num_sge; ++i) n += wr.sg_list[i].length;
  return n;
}

TEST(WrBuilder, SplitsRequestsAboveTheMaxMessageSize) {
  WrBuilder b({.max_wrs = 8, .max_sge = 4, .max_msg = 1000});
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x1000, 7, 0x9000, 9, 2500}, 1));
  ASSERT_EQ(b.size(), 3u);
  std::uint64_t expect[] = {1000, 1000, 500};
  for (std::uint32_t i = 0; i < 3; ++i) {
    const auto& wr = b.request(i);
    EXPECT_EQ(total(wr), expect[i]);
    EXPECT_EQ(wr.num_sge, 1);
    EXPECT_EQ(wr.sg_list[0].addr, 0x1000u + i * 1000);
    EXPECT_EQ(wr.wr.rdma.remote_addr, 0x9000u + i * 1000);
    EXPECT_EQ(wr.wr.rdma.rkey, 9u);
    EXPECT_EQ(wr.sg_list[0].lkey, 7u);
    EXPECT_EQ(wr.opcode, IBV_WR_RDMA_WRITE);
    EXPECT_EQ(wr.wr_id, 1u);
  }
}

TEST(WrBuilder, PacksRemotelyContiguousPiecesIntoSgesUpToMaxSge) {
  WrBuilder b({.max_wrs = 8, .max_sge = 3, .max_msg = 1 << 20});
  for (std::uint64_t i = 0; i < 5; ++i) {
    // Local pieces scattered, remote ranges back to back: one gather per request.
    ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x100000 * (i + 1), 1, 0x5000 + 100 * i, 2, 100}, i));
  }
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b.request(0).num_sge, 3);
  EXPECT_EQ(b.request(1).num_sge, 2);
  EXPECT_EQ(b.request(0).wr_id, 2u) << "a request's id is its last piece's";
  EXPECT_EQ(b.request(1).wr_id, 4u);
  EXPECT_EQ(b.request(1).wr.rdma.remote_addr, 0x5000u + 300);
  EXPECT_EQ(total(b.request(0)) + total(b.request(1)), 500u);
}

TEST(WrBuilder, ALocalRangeThatContinuesExtendsItsSge) {
  WrBuilder b({.max_wrs = 4, .max_sge = 2, .max_msg = 1 << 20});
  ASSERT_TRUE(b.add(IBV_WR_RDMA_READ, {0x1000, 1, 0x8000, 2, 64}, 0));
  ASSERT_TRUE(b.add(IBV_WR_RDMA_READ, {0x1040, 1, 0x8040, 2, 64}, 1));
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b.request(0).num_sge, 1);
  EXPECT_EQ(b.request(0).sg_list[0].length, 128u);
}

TEST(WrBuilder, NeverMergesAcrossKeysOpcodesOrGaps) {
  WrBuilder b({.max_wrs = 8, .max_sge = 4, .max_msg = 1 << 20});
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x1000, 1, 0x8000, 2, 64}, 0));
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x1040, 1, 0x8040, 3, 64}, 1));  // other rkey
  ASSERT_TRUE(b.add(IBV_WR_RDMA_READ, {0x1080, 1, 0x8080, 3, 64}, 2));   // other opcode
  ASSERT_TRUE(b.add(IBV_WR_RDMA_READ, {0x10c0, 1, 0x9000, 3, 64}, 3));   // remote gap
  EXPECT_EQ(b.size(), 4u);
}

TEST(WrBuilder, MergingStopsAtTheMaxMessageSize) {
  WrBuilder b({.max_wrs = 8, .max_sge = 4, .max_msg = 1000});
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x1000, 1, 0x8000, 2, 700}, 0));
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x5000, 1, 0x8000 + 700, 2, 700}, 1));
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(total(b.request(0)), 1000u);
  EXPECT_EQ(total(b.request(1)), 400u);
  EXPECT_EQ(b.request(1).wr.rdma.remote_addr, 0x8000u + 1000);
  EXPECT_EQ(b.request(1).sg_list[0].addr, 0x5000u + 300);
}

TEST(WrBuilder, ChainsAndSignalsEveryNthAndTheLast) {
  WrBuilder b({.max_wrs = 16, .max_sge = 1, .max_msg = 1 << 20});
  for (std::uint64_t i = 0; i < 10; ++i)
    ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x1000 * i, 1, 0x100000 * i, 2, 8}, i));
  ibv_send_wr* head = b.chain(4);
  ASSERT_EQ(head, &b.request(0));
  int n = 0, signaled = 0;
  for (ibv_send_wr* w = head; w != nullptr; w = w->next, ++n) {
    bool s = (w->send_flags & IBV_SEND_SIGNALED) != 0;
    signaled += s;
    EXPECT_EQ(s, n == 3 || n == 7 || n == 9) << n;
  }
  EXPECT_EQ(n, 10);
  EXPECT_EQ(signaled, 3);
  EXPECT_EQ(b.signaled(), 3u);
  WrBuilder empty({});
  EXPECT_EQ(empty.chain(4), nullptr);
}

TEST(WrBuilder, AFullChainRefusesAPieceWholeAndTakesItAfterReset) {
  WrBuilder b({.max_wrs = 2, .max_sge = 1, .max_msg = 1000});
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x1000, 1, 0x8000, 2, 10}, 0));
  EXPECT_FALSE(b.add(IBV_WR_RDMA_WRITE, {0x2000, 1, 0x9000, 2, 1500}, 1))
      << "needs two requests, one is left";
  EXPECT_EQ(b.size(), 1u) << "a refused piece adds nothing";
  ASSERT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x2000, 1, 0x9000, 2, 10}, 1));
  EXPECT_FALSE(b.add(IBV_WR_RDMA_WRITE, {0x3000, 1, 0xa000, 2, 10}, 2));
  // A piece that continues the last request on both sides still fits a full chain.
  EXPECT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x200a, 1, 0x900a, 2, 10}, 3));
  EXPECT_EQ(b.size(), 2u);
  b.reset();
  EXPECT_EQ(b.size(), 0u);
  EXPECT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x3000, 1, 0xa000, 2, 1500}, 2));
  EXPECT_EQ(b.size(), 2u);
  EXPECT_TRUE(b.add(IBV_WR_RDMA_WRITE, {0x4000, 1, 0xb000, 2, 0}, 3)) << "an empty piece is a no-op";
  EXPECT_EQ(b.size(), 2u);
}

}  // namespace
}  // namespace kvstash::transport::verbs
