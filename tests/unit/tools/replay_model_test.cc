// The in-process cache kvstash-bench replays traces through: prefix hits, LRU's order, Belady's
// rule, against small traces worked out by hand, and the published figures of the production
// trace in ../shared/traces where it is present.
#include "tools/kvstash/replay_model.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace kvstash::replay {
namespace {

TraceRequest request(std::vector<std::uint64_t> blocks, std::uint32_t tokens = 0) {
  TraceRequest r;
  r.input_tokens = tokens ? tokens : static_cast<std::uint32_t>(blocks.size() * 512);
  r.blocks = std::move(blocks);
  return r;
}

TEST(ReplayModel, APrefixHitsOnlyItsLeadingBlocksAndCountsTheirTokens) {
  // The second request finds blocks 1 and 2; block 9 is new, so 4 (held) is past its prefix.
  std::vector<TraceRequest> trace{request({1, 2, 4}), request({1, 2, 9, 4}, 3 * 512 + 100)};
  const ModelResult r = replay_model(trace, 100, ReplayPolicy::kLru);
  EXPECT_EQ(r.hit_tokens, 2u * 512);
  EXPECT_EQ(r.prompt_tokens, 3u * 512 + 3 * 512 + 100);
  EXPECT_EQ(r.blocks_saved, 4u);  // 1, 2, 4, then 9
  EXPECT_EQ(r.evictions, 0u);
  // A partial last block counts what the prompt has of it.
  std::vector<TraceRequest> partial{request({5, 6}, 600), request({5, 6}, 600)};
  EXPECT_EQ(replay_model(partial, 10, ReplayPolicy::kLru).hit_tokens, 600u);
}

TEST(ReplayModel, LruEvictsTheLeastRecentAndBeladyTheFarthestAhead) {
  // Capacity 2, uses A B A C B C. LRU: A hits (its use renews it), C evicts B, B evicts A, C
  // hits: 2 hits. Belady: A hits; at C, A is never used again: it goes; B and C hit: 3.
  std::vector<TraceRequest> trace{request({10}), request({11}), request({10}),
                                  request({12}), request({11}), request({12})};
  const ModelResult lru = replay_model(trace, 2, ReplayPolicy::kLru);
  EXPECT_EQ(lru.hit_tokens, 2u * 512);
  EXPECT_EQ(lru.evictions, 2u);
  const ModelResult belady = replay_model(trace, 2, ReplayPolicy::kBelady);
  EXPECT_EQ(belady.hit_tokens, 3u * 512);
  EXPECT_EQ(belady.evictions, 1u);
  EXPECT_GT(belady.hit_rate(), lru.hit_rate());
  EXPECT_EQ(replay_model(trace, 0, ReplayPolicy::kLru).hit_tokens, 0u) << "no capacity, no hit";
  EXPECT_EQ(replay_model(trace, 3, ReplayPolicy::kLru).hit_tokens, 3u * 512) << "room for all";
}

TEST(ReplayModel, S3FifoKeepsAReusedSetThatOneShotBlocksFlushOutOfLru) {
  // Capacity 10: five blocks used again and again, six new blocks between their uses. LRU sees
  // 11 blocks between two uses of one and never hits; S3-FIFO lets the new ones pass through
  // its small FIFO and keeps the five, remembered by its ghost, in the main one.
  std::vector<TraceRequest> trace;
  std::uint64_t fresh = 1000;
  for (int round = 0; round < 20; ++round) {
    for (std::uint64_t hot = 1; hot <= 5; ++hot) trace.push_back(request({hot}));
    for (int i = 0; i < 6; ++i) trace.push_back(request({fresh++}));
  }
  EXPECT_EQ(replay_model(trace, 10, ReplayPolicy::kLru).hit_blocks, 0u);
  const ModelResult s3 = replay_model(trace, 10, ReplayPolicy::kS3Fifo);
  EXPECT_GE(s3.hit_blocks, 5u * 17) << "the five hit from the third round on";
  EXPECT_LE(s3.hit_blocks, 5u * 19);
  EXPECT_LE(s3.hit_rate(), replay_model(trace, 10, ReplayPolicy::kBelady).hit_rate());
  EXPECT_EQ(replay_model(trace, 0, ReplayPolicy::kS3Fifo).hit_blocks, 0u);
}

TEST(ReplayModel, ArcKeepsBlocksUsedTwiceAgainstAScanOfOneShotOnes) {
  // Capacity 10: each round uses five blocks twice in a row, then scans eight new ones. LRU
  // hits only the repeats (13 blocks pass between rounds); ARC moves the five to its frequency
  // list at their repeat, and the scan only passes through its recency list. (A block used
  // once per round, 11 blocks apart, ARC never keeps: its recency list drops it unremembered.)
  std::vector<TraceRequest> trace;
  std::uint64_t fresh = 1000;
  for (int round = 0; round < 20; ++round) {
    for (std::uint64_t hot = 1; hot <= 5; ++hot) {
      trace.push_back(request({hot}));
      trace.push_back(request({hot}));
    }
    for (int i = 0; i < 8; ++i) trace.push_back(request({fresh++}));
  }
  const ModelResult lru = replay_model(trace, 10, ReplayPolicy::kLru);
  EXPECT_EQ(lru.hit_blocks, 5u * 20) << "only the repeats";
  const ModelResult arc = replay_model(trace, 10, ReplayPolicy::kArc);
  EXPECT_GE(arc.hit_blocks, lru.hit_blocks + 5u * 18) << "the five from the second or third round on";
  EXPECT_LE(arc.hit_rate(), replay_model(trace, 10, ReplayPolicy::kBelady).hit_rate());
  EXPECT_EQ(replay_model(trace, 0, ReplayPolicy::kArc).hit_blocks, 0u);
  // With room for everything, every policy hits every block used again.
  for (ReplayPolicy p : {ReplayPolicy::kLru, ReplayPolicy::kS3Fifo, ReplayPolicy::kArc}) {
    EXPECT_EQ(replay_model(trace, 1000, p).hit_blocks, 5u * 20 + 5u * 19) << policy_name(p);
  }
}

TEST(ReplayModel, TurnTtlLearnsToKeepConversationsThroughAFloodOfOneShotPrompts) {
  // An hour: each second two one-shot prompts of 4 new blocks; 20 conversations, each back every
  // 60 s with one block more, for 10 turns, then a new one in its place. 300 blocks hold 37 s of
  // the one-shots: LRU has evicted a conversation before it comes back. The learned policy sees
  // a turn's blocks come back after 60 s, a one-shot's never, and keeps the first for 60 s.
  std::vector<TraceRequest> trace;
  std::uint64_t fresh = 1;
  std::vector<std::vector<std::uint64_t>> conversations(20);
  std::vector<int> turns(20, 0);
  for (std::uint64_t second = 0; second < 3600; ++second) {
    for (int i = 0; i < 2; ++i) {
      TraceRequest r = request({fresh, fresh + 1, fresh + 2, fresh + 3});
      fresh += 4;
      r.at_ms = second * 1000;
      trace.push_back(std::move(r));
    }
    if (second % 3 == 0) {  // conversation (second / 3) % 20 takes its turn
      const std::size_t c = (second / 3) % 20;
      if (turns[c]++ == 10) {
        conversations[c].clear();
        turns[c] = 1;
      }
      conversations[c].push_back(fresh++);
      TraceRequest r = request(conversations[c]);
      r.at_ms = second * 1000;
      trace.push_back(std::move(r));
    }
  }
  const ModelResult lru = replay_model(trace, 300, ReplayPolicy::kLru);
  const ModelResult learned = replay_model(trace, 300, ReplayPolicy::kTurnTtl);
  const ModelResult belady = replay_model(trace, 300, ReplayPolicy::kBelady);
  EXPECT_LT(lru.hit_rate(), 0.01);
  EXPECT_GT(learned.hit_rate(), 0.5 * belady.hit_rate()) << learned.hit_rate() << " " << belady.hit_rate();
  EXPECT_LE(learned.hit_rate(), belady.hit_rate());
  EXPECT_EQ(replay_model(trace, 0, ReplayPolicy::kTurnTtl).hit_blocks, 0u);
  // Room for everything: every block used again hits, as under LRU.
  EXPECT_EQ(replay_model(trace, 1u << 20, ReplayPolicy::kTurnTtl).hit_blocks,
            replay_model(trace, 1u << 20, ReplayPolicy::kLru).hit_blocks);
}

TEST(ReplayModel, TheConnectorSavesWholeBlocksAndPutsAHeldOneAgain) {
  // 3 whole blocks and a partial one: the connector neither saves nor finds the partial one.
  std::vector<TraceRequest> twice{request({1, 2, 3, 4}, 3 * 512 + 100), request({1, 2, 3, 4}, 3 * 512 + 100)};
  const ModelResult connector = replay_model(twice, 10, ReplayPolicy::kLru, 512, ReplaySaves::kConnector);
  EXPECT_EQ(connector.hit_tokens, 3u * 512);
  EXPECT_EQ(connector.blocks_saved, 3u);
  const ModelResult every = replay_model(twice, 10, ReplayPolicy::kLru, 512, ReplaySaves::kEveryBlock);
  EXPECT_EQ(every.hit_tokens, 3u * 512 + 100);
  EXPECT_EQ(every.blocks_saved, 4u);
  // Capacity 3, blocks 1 2 3, then 9 2 3: 9 misses, evicting 1; 2 and 3 are past the miss. The
  // connector puts them again: a full cell reserves each new copy's page first, evicting the
  // least recent block (2, then 3: each its own old copy), so three evictions and six saves;
  // counted the README's way they are only used: one eviction, four saves.
  std::vector<TraceRequest> past{request({1, 2, 3}), request({9, 2, 3})};
  const ModelResult replaced = replay_model(past, 3, ReplayPolicy::kLru, 512, ReplaySaves::kConnector);
  EXPECT_EQ(replaced.evictions, 3u);
  EXPECT_EQ(replaced.blocks_saved, 6u);
  const ModelResult used = replay_model(past, 3, ReplayPolicy::kLru, 512, ReplaySaves::kEveryBlock);
  EXPECT_EQ(used.evictions, 1u);
  EXPECT_EQ(used.blocks_saved, 4u);
}

TEST(ReplayModel, APoolOverATierMovesWhatItGivesUpDownAndPromotesHits) {
  // Pool 2, tier 2: 1 and 2 fill the pool, 3 moves 1 down, 1 comes back from the tier (moving
  // 2 down).
  std::vector<TraceRequest> trace{request({1}), request({2}), request({3}), request({1})};
  const TierResult t = replay_tiers(trace, 2, 2);
  EXPECT_EQ(t.total.hit_blocks, 1u);
  EXPECT_EQ(t.tier_hit_blocks, 1u);
  EXPECT_EQ(t.written_down, 2u);
  EXPECT_EQ(t.tier_evictions, 0u);
  EXPECT_EQ(replay_tiers(trace, 2, 0).total.hit_blocks, 0u) << "no tier: 1 is gone";
  // Pool 1, tier 1: 3 moves 2 down and the tier gives 1 up; 1 misses, moving 3 down, 2 goes.
  const TierResult small = replay_tiers(trace, 1, 1);
  EXPECT_EQ(small.total.hit_blocks, 0u);
  EXPECT_EQ(small.tier_evictions, 2u);
  EXPECT_EQ(small.written_down, 3u);
}

TEST(ReplayModel, ReadsTheTraceFormatAndRefusesWhatIsNotIt) {
  const std::string path = std::filesystem::temp_directory_path() / "kvstash-replay-model-test.jsonl";
  {
    std::ofstream out(path);
    out << R"({"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]})"
        << "\n"
        << R"({"timestamp": 7, "input_length": 512, "output_length": 3, "hash_ids": [0]})"
        << "\n";
  }
  auto t = read_trace(path);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ((*t)[1].at_ms, 7u);
  EXPECT_EQ((*t)[0].blocks, (std::vector<std::uint64_t>{0, 1}));
  EXPECT_EQ(read_trace(path, 1)->size(), 1u);
  {
    std::ofstream out(path, std::ios::app);
    out << R"({"timestamp": 9, "hash_ids": "x"})"
        << "\n";
  }
  auto bad = read_trace(path);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("line 3"), std::string::npos) << bad.status().to_string();
  std::remove(path.c_str());
}

TEST(ReplayModel, TheProductionTraceGivesItsPublishedFigures) {
  const std::string path = KVSTASH_TRACES_DIR "/kimi-conversation.jsonl";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "no production trace at " << path;
  auto trace = read_trace(path);
  ASSERT_TRUE(trace.is_ok()) << trace.status().to_string();
  ASSERT_EQ(trace->size(), 12031u);
  // The trace's README (measured on the trace alone, in whole blocks), to its three decimals.
  const struct {
    std::uint64_t capacity;
    double lru, belady;
  } published[] = {{2000, 0.054, 0.255}, {6000, 0.139, 0.355}, {20000, 0.287, 0.366}};
  for (const auto& p : published) {
    EXPECT_NEAR(replay_model(*trace, p.capacity, ReplayPolicy::kLru).block_hit_rate(), p.lru, 0.0005)
        << p.capacity;
    EXPECT_NEAR(replay_model(*trace, p.capacity, ReplayPolicy::kBelady).block_hit_rate(), p.belady, 0.0005)
        << p.capacity;
  }
  // As the connectors save (whole blocks), the learned policy: 1.5x LRU's tokens at 2,000
  // blocks, more than LRU at every capacity, less than Belady's bound.
  for (std::uint64_t capacity : {2000u, 6000u, 20000u}) {
    const double lru =
        replay_model(*trace, capacity, ReplayPolicy::kLru, 512, ReplaySaves::kConnector).hit_rate();
    const double learned =
        replay_model(*trace, capacity, ReplayPolicy::kTurnTtl, 512, ReplaySaves::kConnector).hit_rate();
    EXPECT_GT(learned, lru) << capacity;
    if (capacity == 2000) {
      EXPECT_GE(learned, 1.5 * lru);
    }
    EXPECT_LT(learned,
              replay_model(*trace, capacity, ReplayPolicy::kBelady, 512, ReplaySaves::kConnector).hit_rate());
  }
  // A pool over a tier, both LRU, holds what one LRU pool of both sizes holds: the pool the most
  // recent blocks, the tier the next ones (apart from a block put again while on the tier).
  const TierResult tiers = replay_tiers(*trace, 2000, 18000);
  const double one_pool =
      replay_model(*trace, 20000, ReplayPolicy::kLru, 512, ReplaySaves::kConnector).hit_rate();
  EXPECT_NEAR(tiers.total.hit_rate(), one_pool, 0.005 * one_pool);
  EXPECT_GT(tiers.tier_hit_blocks, 0u);
  EXPECT_GT(tiers.total.hit_rate(), 5 * replay_tiers(*trace, 2000, 0).total.hit_rate());
}

}  // namespace
}  // namespace kvstash::replay
