// The store's transfer planner (src/store/transfer_plan.h) driven without Redis, nodes or
// registered memory: the entries it plans, applied as writes to arrays that stand for the
// nodes' pools, must put every byte of the object into its page.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <numeric>

#include "store/transfer_plan.h"

namespace kvstash::store {
namespace {

constexpr std::uint64_t kPage = 4096;

struct Cell {
  metadata::Placement placement;
  std::map<std::string, std::vector<std::byte>> pools;  // node -> its pool
  std::vector<RemoteMemory> leases;                     // one per node (what entries name)
  std::vector<TransferPlan::Node> nodes;

  // `pages` as (node, page) in object order.
  explicit Cell(const std::vector<std::pair<std::string, std::uint64_t>>& pages) {
    placement.page_size = kPage;
    for (const auto& [node, page] : pages) {
      placement.extents.push_back({node, page, 1});
      if (!pools.count(node)) placement.nodes.push_back({node, "address of " + node, "key of " + node});
      auto& pool = pools[node];
      pool.resize(std::max<std::size_t>(pool.size(), (page + 1) * kPage));
    }
    leases.resize(placement.nodes.size());
    for (std::size_t i = 0; i < placement.nodes.size(); ++i) {
      const RemoteMemory* lease = &leases[i];
      nodes.push_back({base_of(i), [lease](std::uint64_t) { return lease; }});
    }
  }
  static std::uint64_t base_of(std::size_t node) { return (node + 1) << 40; }

  // Applies one wave's entries as writes into the pools; false on an entry outside them.
  bool apply(const std::vector<std::vector<TransferEntry>>& by_node) {
    for (std::size_t i = 0; i < by_node.size(); ++i) {
      auto& pool = pools[placement.nodes[i].id];
      for (const TransferEntry& e : by_node[i]) {
        if (e.remote != &leases[i] || e.op != TransferOp::kWrite) return false;
        if (e.remote_addr < base_of(i) || e.remote_addr - base_of(i) + e.length > pool.size()) return false;
        std::memcpy(pool.data() + (e.remote_addr - base_of(i)), e.local_addr, e.length);
      }
    }
    return true;
  }

  // The object's byte `offset` as its page holds it.
  std::byte at(std::uint64_t offset) const {
    const metadata::Extent& e = placement.extents[offset / kPage];
    return pools.at(e.node)[e.page * kPage + offset % kPage];
  }
};

std::vector<std::byte> object_bytes(std::size_t n) {
  std::vector<std::byte> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 131 + i / 4096) & 0xff);
  return b;
}

struct Planned {
  Status status;
  std::vector<std::uint64_t> wave_ends;
  std::size_t entries = 0;
};

Planned plan_all(Cell& cell, std::span<const Slice> slices, std::uint64_t begin, std::uint64_t end,
                 std::uint64_t wave_bytes) {
  std::vector<MemoryHandle> handles(slices.size());
  std::vector<const MemoryHandle*> handle_of;
  for (const auto& h : handles) handle_of.push_back(&h);
  TransferPlan plan(TransferOp::kWrite, cell.placement, cell.nodes, slices, handle_of, begin, end,
                    wave_bytes);
  Planned out;
  std::vector<std::vector<TransferEntry>> by_node;
  for (;;) {
    auto wave = plan.next(by_node);
    if (!wave.is_ok()) {
      out.status = wave.status();
      return out;
    }
    if (!*wave) return out;
    out.wave_ends.push_back(**wave);
    for (const auto& list : by_node) out.entries += list.size();
    if (!cell.apply(by_node)) {
      out.status = Status::internal("an entry left the pools");
      return out;
    }
  }
}

TEST(TransferPlan, EveryByteLandsInItsPageAcrossNodesSlicesAndWaves) {
  // Pages spread over three nodes out of order; slices that cut pages at odd places.
  Cell cell({{"a", 3}, {"b", 0}, {"a", 1}, {"c", 7}, {"b", 2}, {"a", 0}});
  const std::size_t size = 6 * kPage - 100;
  auto bytes = object_bytes(size);
  std::vector<Slice> slices;
  for (std::size_t at = 0, i = 0; at < size; ++i) {
    const std::size_t n = std::min<std::size_t>(size - at, 1000 + i * 777);
    slices.push_back({bytes.data() + at, n});
    at += n;
  }
  Planned p = plan_all(cell, slices, 0, size, 2 * kPage);
  ASSERT_TRUE(p.status.is_ok()) << p.status.to_string();
  EXPECT_EQ(p.wave_ends, (std::vector<std::uint64_t>{2 * kPage, 4 * kPage, size}));
  for (std::size_t i = 0; i < size; ++i) ASSERT_EQ(cell.at(i), bytes[i]) << "object byte " << i;
}

TEST(TransferPlan, ContiguousPiecesTravelAsOneEntry) {
  // Three adjacent pages on one node and one slice: one entry per wave.
  Cell cell({{"a", 4}, {"a", 5}, {"a", 6}});
  auto bytes = object_bytes(3 * kPage);
  Slice whole{bytes.data(), bytes.size()};
  Planned one_wave = plan_all(cell, {&whole, 1}, 0, 3 * kPage, 3 * kPage);
  ASSERT_TRUE(one_wave.status.is_ok());
  EXPECT_EQ(one_wave.entries, 1u);
  // Not adjacent in the pool: one entry per run.
  Cell gaps({{"a", 4}, {"a", 6}, {"a", 7}});
  Planned runs = plan_all(gaps, {&whole, 1}, 0, 3 * kPage, 3 * kPage);
  ASSERT_TRUE(runs.status.is_ok());
  EXPECT_EQ(runs.entries, 2u);
  for (std::size_t i = 0; i < bytes.size(); ++i) ASSERT_EQ(gaps.at(i), bytes[i]);
}

// A stream appends a stretch of the object at a time: [begin, end) from slices holding just it.
TEST(TransferPlan, AStretchFromTheMiddleLandsWhereItBelongs) {
  Cell cell({{"a", 0}, {"b", 0}, {"a", 1}});
  auto bytes = object_bytes(3 * kPage);
  const std::uint64_t begin = kPage + 300, end = 2 * kPage + 5;
  Slice stretch{bytes.data() + begin, end - begin};
  Planned p = plan_all(cell, {&stretch, 1}, begin, end, kPage);  // waves end at whole pages of the object
  ASSERT_TRUE(p.status.is_ok());
  EXPECT_EQ(p.wave_ends, (std::vector<std::uint64_t>{2 * kPage, end}));
  for (std::uint64_t i = begin; i < end; ++i) ASSERT_EQ(cell.at(i), bytes[i]) << i;
  EXPECT_EQ(cell.at(begin - 1), std::byte{0}) << "nothing before the stretch was written";
}

// A put whose transport digests its writes: an entry carries the digests of the blocks it
// holds whole (a short block only at the object's end), each block's digest has exactly one
// writer, and what the entries carry is what digested() says.
TEST(TransferPlan, EntriesCarryTheDigestsOfTheBlocksTheyHoldWhole) {
  Cell cell({{"a", 0}, {"a", 1}, {"b", 0}, {"a", 2}});
  for (auto& n : cell.nodes) n.digests = true;
  cell.nodes[1].digests = false;  // b's transport does not digest: its page is the caller's
  const std::size_t size = 4 * kPage - 10;
  auto bytes = object_bytes(size);
  // Slices cutting blocks at odd places: 5000 | 3192 (ends on a block) | rest.
  std::vector<Slice> slices{
      {bytes.data(), 5000}, {bytes.data() + 5000, 3192}, {bytes.data() + 8192, size - 8192}};
  std::vector<MemoryHandle> handles(slices.size());
  std::vector<const MemoryHandle*> handle_of;
  for (const auto& h : handles) handle_of.push_back(&h);
  std::vector<std::uint64_t> digests(4 + 1);
  TransferPlan plan(TransferOp::kWrite, cell.placement, cell.nodes, slices, handle_of, 0, size, size,
                    digests.data());
  std::vector<std::vector<TransferEntry>> by_node;
  auto wave = plan.next(by_node);
  ASSERT_TRUE(wave.is_ok() && *wave);
  ASSERT_TRUE(cell.apply(by_node));
  std::vector<int> writers(4, 0);
  for (std::size_t ni = 0; ni < by_node.size(); ++ni) {
    for (const TransferEntry& e : by_node[ni]) {
      if (e.block_digests == nullptr) continue;
      EXPECT_TRUE(cell.nodes[ni].digests) << "an entry to a node that does not digest carries digests";
      const std::uint64_t from = static_cast<std::uint64_t>(e.block_digests - digests.data()) * kPage;
      EXPECT_EQ(static_cast<const std::byte*>(e.local_addr), bytes.data() + from) << "digests of other bytes";
      EXPECT_TRUE(e.length % kPage == 0 || from + e.length == size) << "a short block inside the object";
      for (std::uint64_t b = from / kPage; b * kPage < from + e.length; ++b) ++writers[b];
    }
  }
  // Block 1 is cut by the slices' edge at 5000 and block 2 is on b: the caller's. Blocks 0
  // and 3 the transport's (3 is the object's short last block).
  EXPECT_EQ(writers, (std::vector<int>{1, 0, 0, 1}));
  using Range = std::pair<std::uint64_t, std::uint64_t>;
  EXPECT_EQ(plan.digested(), (std::vector<Range>{{0, kPage}, {3 * kPage, size}}));
  for (std::size_t i = 0; i < size; ++i) ASSERT_EQ(cell.at(i), bytes[i]) << "object byte " << i;
  EXPECT_FALSE(*plan.next(by_node));
}

TEST(TransferPlan, APageOnANodeThePlacementDoesNotListIsCorrupt) {
  Cell cell({{"a", 0}, {"b", 0}});
  cell.placement.extents[1].node = "ghost";
  auto bytes = object_bytes(2 * kPage);
  Slice whole{bytes.data(), bytes.size()};
  Planned p = plan_all(cell, {&whole, 1}, 0, 2 * kPage, 2 * kPage);
  EXPECT_EQ(p.status.code(), StatusCode::kCorrupt);
  EXPECT_NE(p.status.message().find("ghost"), std::string::npos);
}

}  // namespace
}  // namespace kvstash::store
