// kvstash-bench store as a real process (with its private redis-server and kvstashd, or
// against a cell started here): its --json rows carry the documented fields, every restored
// byte was verified, and it cleans up after itself. Sizes are tiny: this checks output and
// correctness, not speed. Also the local-cluster helpers it starts the cell with.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "command.h"

#include <hiredis/hiredis.h>

#include "metadata/redis_client.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using namespace std::chrono_literals;

using kvstash::test::bench;
using kvstash::test::run;

std::vector<nlohmann::json> json_lines(const std::string& out) {
  std::vector<nlohmann::json> rows;
  std::size_t start = 0;
  while (start < out.size()) {
    const std::size_t end = out.find('\n', start);
    const std::string line = out.substr(start, end - start);
    start = end == std::string::npos ? out.size() : end + 1;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << line;
    if (!j.is_discarded()) rows.push_back(std::move(j));
  }
  return rows;
}

// Every backend measured both ways, verified, with the documented fields.
void expect_rows(const std::vector<nlohmann::json>& rows, const std::vector<std::string>& backends,
                 std::uint64_t object_bytes, std::uint32_t sessions) {
  std::map<std::string, int> seen;  // "backend/op" -> rows
  for (const auto& j : rows) {
    const std::string line = j.dump();
    for (const char* field :
         {"backend", "op", "sessions", "object_bytes", "gbps", "p50_us", "p99_us", "vs_redis", "verified"}) {
      ASSERT_TRUE(j.contains(field)) << field << " missing in " << line;
    }
    EXPECT_FALSE(j.contains("error")) << line;
    EXPECT_FALSE(j.contains("skipped")) << line;
    const std::string backend = j["backend"], op = j["op"];
    seen[backend + "/" + op]++;
    EXPECT_TRUE(op == "put" || op == "get") << line;
    EXPECT_EQ(j["verified"], true) << line;
    EXPECT_EQ(j["sessions"], sessions) << line;
    EXPECT_EQ(j["object_bytes"], object_bytes) << line;
    EXPECT_GT(j["gbps"].get<double>(), 0) << line;
    EXPECT_GT(j["p50_us"].get<double>(), 0) << line;
    EXPECT_GE(j["p99_us"].get<double>(), j["p50_us"].get<double>()) << line;
    if (backend.rfind("kvstash-", 0) == 0) {
      ASSERT_TRUE(j["vs_redis"].is_number()) << "no ratio to the redis-bytes baseline: " << line;
      EXPECT_GT(j["vs_redis"].get<double>(), 0) << line;
      for (const char* field : {"metadata_p50_us", "metadata_p99_us", "redis_round_trips"}) {
        ASSERT_TRUE(j.contains(field)) << field << " missing in " << line;
      }
      EXPECT_GT(j["redis_round_trips"].get<double>(), 0) << line;
      EXPECT_LE(j["metadata_p50_us"].get<double>(), j["p50_us"].get<double>()) << line;
    }
  }
  for (const auto& b : backends) {
    EXPECT_EQ(seen[b + "/put"], 1) << b;
    EXPECT_EQ(seen[b + "/get"], 1) << b;
  }
  EXPECT_EQ(rows.size(), 2 * backends.size());
}

TEST(BenchStore, JsonRowsForEveryBackendWithAPrivateCell) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  const std::string out = run(bench() +
                                  " store --sessions 2 --object-size 4MiB --rounds 1 --json"
                                  " --backends kvstash-shm,kvstash-tcp,redis-bytes",
                              &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  expect_rows(json_lines(out), {"kvstash-shm", "kvstash-tcp", "redis-bytes"}, 4u << 20, 2);
}

// kvstash-bench metadata, over TLS to Redis and with quotas: every kind of operation ran,
// without an error (a TLS or quota failure would stop the mix).
TEST(BenchMetadata, TheMixRunsOverTlsToRedisAndUnderQuotas) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  const std::string out =
      run(bench() + " metadata --clients 2 --seconds 0.3 --tls --quotas 3 --json", &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  std::set<std::string> kinds;
  for (const auto& j : json_lines(out)) {
    const std::string what = j["what"];
    if (what.rfind("kvstash", 0) != 0) continue;
    EXPECT_FALSE(j.contains("error")) << j.dump();
    EXPECT_GT(j.value("ops_per_s", 0.0), 0) << j.dump();
    kinds.insert(what);
  }
  EXPECT_EQ(kinds.size(), 4u) << out;  // the mix and its three kinds
}

// kvstash-bench metadata --scripts: each script's server time and the Redis commands it ran,
// under each eviction policy; the rows of a full pool did evict (else the bench fails).
TEST(BenchMetadata, TheScriptsTableCountsCommandsUnderEachPolicy) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  std::map<std::string, std::map<std::string, double>> commands;  // policy -> script -> commands
  for (const std::string policy : {"lru", "arc", "turn-ttl"}) {
    int status = -1;
    const std::string out =
        run(bench() + " metadata --scripts --objects 10000 --policy " + policy + " --json", &status);
    ASSERT_TRUE(WIFEXITED(status)) << out;
    ASSERT_EQ(WEXITSTATUS(status), 0) << out;
    const auto rows = json_lines(out.substr(out.rfind("\n{") + 1));
    ASSERT_EQ(rows.size(), 1u) << out;
    EXPECT_EQ(rows[0]["policy"], policy);
    for (const auto& r : rows[0]["rows"]) commands[policy][r["script"]] = r["commands"].get<double>();
  }
  for (const char* script :
       {"begin_get + end_get", "begin_put + commit_put (room free)", "begin_put evicting one object"}) {
    EXPECT_GT(commands["lru"][script], 0) << script;
    // ARC's bookkeeping: a few commands more than LRU's, never a walk.
    EXPECT_GE(commands["arc"][script], commands["lru"][script]) << script;
    EXPECT_LE(commands["arc"][script], 1.25 * commands["lru"][script]) << script;
  }
  // turn-ttl's (its clients' keep hints on the puts, saves and loads): within 1.2x of LRU's.
  for (const char* script :
       {"begin_get + end_get", "begin_put + commit_put (room free)", "begin_put evicting one object",
        "KV save, 32 chunks of 32 pages: one commit (per chunk)",
        "KV load, 32 chunks: begin_gets, end_gets (per chunk)"}) {
    EXPECT_GT(commands["turn-ttl"][script], commands["lru"][script]) << script;
    EXPECT_LE(commands["turn-ttl"][script], 1.2 * commands["lru"][script]) << script;
  }
  // A put into a full pool runs the eviction: more than a put into free pages.
  EXPECT_GT(commands["lru"]["begin_put evicting one object"], 23) << "no eviction ran";
}

// A trace of conversations in the production trace's format: a system prompt's block every
// request shares, then each conversation's own blocks, a turn extending the one before (its
// prompt ends in a partial block), one-shot prompts between them. Deterministic.
std::string write_conversation_trace(const std::string& path, int requests, std::uint64_t* prompt_tokens) {
  std::mt19937_64 rng(7);
  std::vector<std::vector<std::uint64_t>> conversations;
  std::uint64_t next_block = 1;
  std::ofstream out(path);
  for (int i = 0; i < requests; ++i) {
    std::vector<std::uint64_t>* c = nullptr;
    if (!conversations.empty() && rng() % 3 != 0) {
      c = &conversations[rng() % conversations.size()];
    } else {
      conversations.push_back({0});
      c = &conversations.back();
    }
    for (std::uint64_t n = 1 + rng() % 4; n > 0; --n) c->push_back(next_block++);
    *prompt_tokens += (c->size() - 1) * 512 + 100;
    nlohmann::json j{{"timestamp", i * 10},
                     {"input_length", (c->size() - 1) * 512 + 100},
                     {"output_length", 20},
                     {"hash_ids", *c}};
    out << j.dump() << "\n";
    c->back() = next_block++;  // the partial block is not the next turn's
  }
  return path;
}

// A trace where conversations come back after a user's think time (40 requests: 200 s at 5 s
// apart; up to five turns) among as many one-shot prompts: a pool smaller than the think time's
// blocks loses conversations under LRU, which a policy that learns turns keeps.
std::string write_think_time_trace(const std::string& path, int requests, std::uint64_t* prompt_tokens) {
  struct Conversation {
    int due = 0;
    std::vector<std::uint64_t> blocks;
    int turns = 0;
  };
  std::mt19937_64 rng(7);
  std::deque<Conversation> waiting;
  std::uint64_t next_block = 1;
  std::ofstream out(path);
  for (int i = 0; i < requests; ++i) {
    Conversation c;
    bool one_shot = false;
    if (!waiting.empty() && waiting.front().due <= i) {
      c = std::move(waiting.front());
      waiting.pop_front();
    } else {
      one_shot = rng() % 2 == 0;
    }
    for (std::uint64_t n = one_shot ? 2 + rng() % 5 : 1 + rng() % 4; n > 0; --n)
      c.blocks.push_back(next_block++);
    *prompt_tokens += (c.blocks.size() - 1) * 512 + 100;
    nlohmann::json j{{"timestamp", i * 5000},
                     {"input_length", (c.blocks.size() - 1) * 512 + 100},
                     {"output_length", 20},
                     {"hash_ids", c.blocks}};
    out << j.dump() << "\n";
    if (one_shot || ++c.turns >= 5) continue;
    c.blocks.back() = next_block++;  // the partial block is not the next turn's
    c.due = i + 40;
    waiting.push_back(std::move(c));
  }
  return path;
}

using ReplayRows = std::map<std::pair<std::uint64_t, std::string>, nlohmann::json>;

// kvstash-bench replay `args` over a trace of 600 requests (`think_time`: write_think_time_trace,
// else write_conversation_trace): its rows by capacity and policy; none (and a failure) if it
// failed.
ReplayRows replay_rows(const std::string& args, bool think_time, std::uint64_t* prompt_tokens) {
  const std::string path = (std::filesystem::current_path() / "bench-replay-test.jsonl").string();
  const std::string trace = think_time ? write_think_time_trace(path, 600, prompt_tokens)
                                       : write_conversation_trace(path, 600, prompt_tokens);
  int status = -1;
  const std::string out = run(bench() + " replay --trace " + trace + " " + args + " --json", &status);
  std::filesystem::remove(trace);
  ReplayRows rows;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ADD_FAILURE() << "kvstash-bench replay failed:\n" << out;
    return rows;
  }
  for (const auto& j : json_lines(out)) rows[{j["capacity_blocks"], j["policy"]}] = j;
  return rows;
}

// kvstash-bench replay: a trace through a private cell per eviction policy, beside the model of
// each policy. Each cell gives its model's hits, saves and evictions exactly (a lost touch, a
// leaked page, an evicted leased object or a use out of order would part them), every loaded
// byte was checked, and latencies and the TTFT estimate are reported.
TEST(BenchReplay, EachPolicysCellMatchesItsModelRequestForRequest) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  std::uint64_t prompt_tokens = 0;
  ReplayRows rows =
      replay_rows("--capacities 120,400 --block-bytes 4KiB --cell-policies lru,arc", false, &prompt_tokens);
  for (std::uint64_t capacity : {120u, 400u}) {
    for (const char* policy : {"lru", "s3-fifo", "arc", "belady", "cell-lru", "cell-arc"}) {
      ASSERT_TRUE(rows.contains({capacity, policy})) << capacity << " " << policy << " missing";
    }
    const auto& belady = rows[{capacity, "belady"}];
    for (const std::string policy : {"lru", "arc"}) {
      const auto& model = rows[{capacity, policy}];
      const auto& cell = rows[{capacity, "cell-" + policy}];
      const std::string line = cell.dump();
      EXPECT_GT(model["token_hit_rate"].get<double>(), 0.05) << model.dump();
      EXPECT_EQ(cell["hit_tokens"], model["hit_tokens"]) << line << "\n" << model.dump();
      EXPECT_EQ(cell["evictions"], model["evictions"]) << line;
      EXPECT_EQ(cell["blocks_saved"], model["blocks_saved"]) << line;
      EXPECT_EQ(cell["vs_model"].get<double>(), 0.0) << line;
      EXPECT_GT(cell["evictions"].get<std::uint64_t>(), 0u) << "the cell was never full: " << line;
      EXPECT_GE(belady["token_hit_rate"].get<double>(), model["token_hit_rate"].get<double>())
          << belady.dump();
      EXPECT_EQ(cell["failed_loads"], 0) << line;
      EXPECT_EQ(cell["failed_saves"], 0) << line;
      EXPECT_EQ(cell["bytes_loaded"].get<std::uint64_t>(), 4096 * cell["hit_blocks"].get<std::uint64_t>())
          << line;
      EXPECT_EQ(cell["bytes_saved"].get<std::uint64_t>(), 4096 * cell["blocks_saved"].get<std::uint64_t>())
          << line;
      EXPECT_GT(cell["hit_blocks"].get<std::uint64_t>(), 0u) << line;
      EXPECT_GE(cell["lookup_us"]["p99"].get<double>(), cell["lookup_us"]["p50"].get<double>()) << line;
      EXPECT_GT(cell["load_bytes_per_s"].get<double>(), 0) << line;
      // Without the cache every prompt is computed at the default 8,000 tokens/s; with it, the
      // hit tokens' part becomes a load (how fast depends on this machine).
      EXPECT_NEAR(cell["ttft_no_cache_s"]["mean"].get<double>(), double(prompt_tokens) / 600 / 8000, 1e-9)
          << line;
      EXPECT_GT(cell["ttft_s"]["mean"].get<double>(), 0) << line;
    }
  }
  // The policies differ on this trace (else the comparison above could not tell them apart).
  const auto small_lru = rows[{120u, "lru"}], small_arc = rows[{120u, "arc"}];
  EXPECT_NE(small_lru["hit_tokens"], small_arc["hit_tokens"]);
}

// turn-ttl's cell over fifty minutes of conversations coming back after a think time, replayed
// 300 times as fast (its clock too): it learns what its model learns and follows it within 1%
// (the cell's read leases end off the request's path, so a block just read may still be leased
// when the request's saves need room: the model knows no leases), and both beat LRU here, by
// far where the pool holds less than the think time.
TEST(BenchReplay, TurnTtlsCellLearnsWhatItsModelLearns) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  std::uint64_t prompt_tokens = 0;
  ReplayRows rows = replay_rows(
      "--capacities 160,240 --block-bytes 4KiB --cell-policies turn-ttl --speed 300", true, &prompt_tokens);
  for (std::uint64_t capacity : {160u, 240u}) {
    ASSERT_TRUE(rows.contains({capacity, "cell-turn-ttl"})) << capacity;
    const auto& model = rows[{capacity, "turn-ttl"}];
    const auto& lru = rows[{capacity, "lru"}];
    const auto& cell = rows[{capacity, "cell-turn-ttl"}];
    const std::string line = cell.dump();
    EXPECT_GT(model["token_hit_rate"].get<double>(), 1.2 * lru["token_hit_rate"].get<double>())
        << model.dump();
    EXPECT_LE(std::abs(cell["vs_model"].get<double>()), 0.01) << line << "\n" << model.dump();
    EXPECT_GT(cell["token_hit_rate"].get<double>(), lru["token_hit_rate"].get<double>()) << line;
    EXPECT_GT(cell["evictions"].get<std::uint64_t>(), 0u) << line;
    EXPECT_EQ(cell["failed_loads"], 0) << line;
    EXPECT_EQ(cell["failed_saves"], 0) << line;
  }
  // Without --speed the cell's clock would not be the trace's: refused, with the reason.
  int status = -1;
  const std::string refused =
      run(bench() + " replay --trace /dev/null --cell-policies turn-ttl 2>&1", &status);
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_NE(refused.find("--speed"), std::string::npos) << refused;
}

// A pool over a real NVMe tier (kvstashd --ssd): the blocks the pool gives up move down and a hit
// on the tier is promoted back, byte-checked; the cell hits more than the pool alone, near its
// model, and leaves no tier file behind.
TEST(BenchReplay, APoolOverATierHitsWhatThePoolAloneLoses) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  const std::string dir = (std::filesystem::current_path() / "bench-replay-tier").string();
  std::filesystem::create_directories(dir);
  std::uint64_t prompt_tokens = 0;
  ReplayRows rows = replay_rows(
      "--capacities 60 --tier-capacities 0,300 --block-bytes 4KiB --tier-dir " + dir, false, &prompt_tokens);
  const bool left = !std::filesystem::is_empty(dir);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(rows.contains({60u, "cell-lru+tier"}));
  const auto& cell = rows[{60u, "cell-lru+tier"}];
  const auto& alone = rows[{60u, "cell-lru"}];
  const std::string line = cell.dump();
  EXPECT_GT(cell["token_hit_rate"].get<double>(), 1.5 * alone["token_hit_rate"].get<double>()) << line;
  EXPECT_GT(cell["tier_hit_blocks"].get<std::uint64_t>(), 0u) << line;
  EXPECT_GT(cell["written_down"].get<std::uint64_t>(), 0u) << line;
  EXPECT_LE(std::abs(cell["vs_model"].get<double>()), 0.1) << line;
  EXPECT_EQ(cell["failed_loads"], 0) << line;
  EXPECT_EQ(cell["failed_saves"], 0) << line;
  EXPECT_FALSE(left) << "the tier's file was left in " << dir;
}

// kvstash-bench tier: the NVMe tier's device layer and fio on the same file, each op measured;
// the file is gone afterwards. (fio may be missing: its rows then say so.)
TEST(BenchTier, TheDeviceLayerAndFioWriteAndReadTheSameFile) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  const std::string file = (std::filesystem::current_path() / "bench-tier-test").string();
  int status = -1;
  const std::string out =
      run(bench() + " tier --path " + file + " --bytes 16MiB --io-size 1MiB --depth 4 --rounds 1 --json 2>&1",
          &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  if (WEXITSTATUS(status) != 0 && (out.find("takes no O_DIRECT") != std::string::npos ||
                                   out.find("io_uring is off") != std::string::npos)) {
    GTEST_SKIP() << "no NVMe tier possible here: " << out;
  }
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  std::set<std::string> rows;
  for (const auto& j : json_lines(out)) {
    const std::string row = j["engine"].get<std::string>() + "/" + j["op"].get<std::string>();
    rows.insert(row);
    if (j["engine"] == "kvstash-ssd" || !j.contains("note")) {
      EXPECT_GT(j["gbps"].get<double>(), 0) << j.dump();
    }
    EXPECT_EQ(j["bytes"], 16 << 20) << j.dump();
  }
  EXPECT_EQ(rows, (std::set<std::string>{"kvstash-ssd/write", "kvstash-ssd/read", "fio/write", "fio/read"}))
      << out;
  EXPECT_FALSE(std::filesystem::exists(file)) << "the bench left its file";
  EXPECT_EQ(WEXITSTATUS(
                std::system((bench() + " tier --path " + file + " --io-size 1000 >/dev/null 2>&1").c_str())),
            2);
}

TEST(BenchStore, TokenRangesReportTheirSpread) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  const std::string out =
      run(bench() + " store --sessions 3 --tokens 2-9 --rounds 2 --json --backends kvstash-tcp,redis-bytes",
          &status);
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  for (const auto& j : json_lines(out)) {
    const std::uint64_t lo = j["min_object_bytes"], hi = j["max_object_bytes"], mean = j["object_bytes"];
    EXPECT_GE(lo, 2u * 512 * 1024) << j.dump();
    EXPECT_LE(hi, 9u * 512 * 1024) << j.dump();
    EXPECT_TRUE(lo <= mean && mean <= hi) << j.dump();
    EXPECT_EQ(j["verified"], true) << j.dump();
  }
}

TEST(BenchStore, TableOutputExplainsItself) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  const std::string out =
      run(bench() + " store --sessions 1 --tokens 4 --rounds 1 --backends kvstash-tcp,redis-bytes", &status);
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  for (const char* text : {"Llama-2-7B", "1 x 4 tokens = 2 MiB", "a private redis-server", "kvstashd",
                           "x redis", "redis-bytes", "kvstash-tcp"}) {
    EXPECT_NE(out.find(text), std::string::npos) << text << " missing in\n" << out;
  }
}

// --redis: the bench starts nothing and leaves nothing behind in the cell it was given.
TEST(BenchStore, RunsAgainstAnExistingCellWithAPasswordAndCleansUp) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  auto redis = harness::LocalRedis::start({.password = "bench-secret"});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto node = harness::LocalNode::start({.redis_url = (*redis)->url(),
                                         .redis_password = "bench-secret",
                                         .capacity = "32MiB",
                                         .page_size = "1MiB",
                                         .node_id = "bench-node",
                                         .extra_args = {"--huge-pages", "off"}});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  EXPECT_EQ((*node)->node_id(), "bench-node");
  EXPECT_EQ((*node)->page_size(), 1u << 20);
  EXPECT_EQ((*node)->pages(), 32u);

  int status = -1;
  const std::string out =
      run("KVSTASH_REDIS_PASSWORD=bench-secret " + bench() + " store --redis " + (*redis)->url() +
              " --sessions 2 --object-size 3MiB --rounds 2 --json"
              " --backends kvstash-tcp,redis-bytes",
          &status);
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  expect_rows(json_lines(out), {"kvstash-tcp", "redis-bytes"}, 3u << 20, 2);

  auto c = metadata::RedisClient::connect({.url = (*redis)->url(), .password = "bench-secret"});
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  // The baseline's hashes and the store's objects (kvs:{kvs:<cell>}:obj:<key>).
  for (const char* pattern : {"bench:*", "*:obj:bench/*"}) {
    auto keys = (*c)->command({"KEYS", pattern});
    ASSERT_TRUE(keys.is_ok()) << keys.status().to_string();
    std::string left;
    for (std::size_t i = 0; i < keys->size(); ++i) left.append(" ").append(keys->element(i)->str);
    EXPECT_EQ(keys->size(), 0u) << "the bench left keys behind:" << left;
  }
  EXPECT_EQ((*node)->terminate(deadline_after(10s)).value_or(-1), 0);
}

TEST(BenchStore, BadOptionsAreUsageErrors) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  for (const char* args :
       {"--tokens 0", "--tokens 300-200", "--tokens 40000", "--tokens many", "--backends carrier-pigeon",
        "--object-size 12XB", "--sessions 0", "--rounds 0", "--page-size 3MiB",
        "--redis redis://127.0.0.1:1/0 --capacity 1GiB", "--redis mysql://x"}) {
    const std::string out = run(bench() + " store " + args + " 2>&1", &status);
    EXPECT_EQ(WEXITSTATUS(status), 2) << args << ": " << out;
    EXPECT_FALSE(out.empty()) << args << ": no message";
  }
  const std::string out = run(bench() + " store --tokens 0 2>&1", &status);
  EXPECT_NE(out.find("--tokens"), std::string::npos) << out;
  const std::string help = run(bench() + " store --help", &status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_NE(help.find("--object-size"), std::string::npos) << help;
}

TEST(BenchStore, AnUnreachableCellIsARuntimeFailure) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  // Port 1 on loopback: nothing listens there.
  const std::string out = run(bench() +
                                  " store --redis redis://127.0.0.1:1/0 --sessions 1 --object-size 1MiB"
                                  " --rounds 1 --json 2>&1",
                              &status);
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_NE(out.find("redis://127.0.0.1:1/0"), std::string::npos) << out;
}

// ---- the local-cluster helpers the bench starts its cell with ------------------------------

TEST(BenchKvCache, JsonRowsForEachTransportAndOpVerified) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  const std::string out =
      run(bench() + " kvcache --tokens 256 --rounds 1 --transport shm,tcp --json", &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  const auto rows = json_lines(out);
  ASSERT_EQ(rows.size(), 4u) << out;
  std::set<std::string> seen;
  for (const auto& j : rows) {
    const std::string line = j.dump();
    EXPECT_EQ(j["bytes"], 256u * 524288u) << "one 256-token Llama-2-7B session: " << line;
    EXPECT_EQ(j["verified"], true) << line;
    EXPECT_GT(j["gbps"].get<double>(), 0) << line;
    EXPECT_GT(j["contiguous_gbps"].get<double>(), 0) << line;
    EXPECT_NEAR(j["vs_contiguous"].get<double>(),
                j["gbps"].get<double>() / j["contiguous_gbps"].get<double>(), 1e-9)
        << line;
    seen.insert(j["transport"].get<std::string>() + "/" + j["op"].get<std::string>());
  }
  EXPECT_EQ(seen, (std::set<std::string>{"shm/save", "shm/load", "tcp/save", "tcp/load"}));
  // Usage errors exit 2.
  run(bench() + " kvcache --tokens 100", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2) << "not a multiple of 256";
  run(bench() + " kvcache --block-size 3", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

TEST(BenchKvCache, AcrossTensorParallelDegreesEveryHeadVerified) {
  if (bench().empty()) GTEST_SKIP() << "KVSTASH_BENCH not set (run via meson test)";
  int status = -1;
  const std::string out = run(
      bench() + " kvcache --tokens 256 --rounds 1 --transport tcp --save-tp 2 --load-tp 1 --json", &status);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_EQ(WEXITSTATUS(status), 0) << out;
  const auto rows = json_lines(out);
  ASSERT_EQ(rows.size(), 3u) << out;
  std::set<std::string> seen;
  for (const auto& j : rows) {
    const std::string line = j.dump();
    EXPECT_EQ(j["verified"], true) << line;
    EXPECT_EQ(j["load_tp"], 1u) << line;
    EXPECT_GT(j["gbps"].get<double>(), 0) << line;
    EXPECT_NEAR(j["vs_same_degree"].get<double>(), j["gbps"].get<double>() / rows[0]["gbps"].get<double>(),
                1e-9)
        << line;
    seen.insert(j["keys"].get<std::string>() + "/" + std::to_string(j["save_tp"].get<int>()));
  }
  EXPECT_EQ(seen, (std::set<std::string>{"heads/1", "heads/2", "rank/1"}));
  EXPECT_EQ(rows[1]["heads_per_object"], 16u) << "32 heads over the wider degree's 2 ranks";
  // Heads outermost in each block (HND): every head verified in that order too.
  const std::string hnd =
      run(bench() + " kvcache --tokens 256 --rounds 1 --transport shm --save-tp 1 --load-tp 2 --hnd --json",
          &status);
  ASSERT_EQ(WEXITSTATUS(status), 0) << hnd;
  for (const auto& j : json_lines(hnd)) EXPECT_TRUE(j["verified"] == true && j["order"] == "hnd") << j.dump();
  // Usage errors exit 2: a degree that does not divide the 32 heads, one degree alone.
  run(bench() + " kvcache --save-tp 3 --load-tp 1", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  run(bench() + " kvcache --save-tp 2", &status);
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

TEST(LocalCluster, ChildProcessLinesTimeoutsAndExitStatus) {
  auto child = harness::ChildProcess::start({.argv = {"sh", "-c", "echo one; printf two; sleep 1; exit 3"}});
  ASSERT_TRUE(child.is_ok()) << child.status().to_string();
  EXPECT_EQ(child->read_line(deadline_after(5s)).value_or("<none>"), "one");
  // "two" has no newline yet: not a line until EOF.
  EXPECT_FALSE(child->read_line(deadline_after(50ms)).has_value());
  EXPECT_FALSE(child->eof());
  EXPECT_EQ(child->read_line(deadline_after(5s)).value_or("<none>"), "two");
  EXPECT_FALSE(child->read_line(deadline_after(5s)).has_value());
  EXPECT_TRUE(child->eof());
  EXPECT_EQ(child->wait(deadline_after(5s)).value_or(-1), 3);

  auto sleeper = harness::ChildProcess::start({.argv = {"sleep", "30"}});
  ASSERT_TRUE(sleeper.is_ok());
  EXPECT_FALSE(sleeper->wait(deadline_after(20ms)).has_value());
  sleeper->signal(SIGTERM);
  EXPECT_EQ(sleeper->wait(deadline_after(5s)).value_or(-1), 128 + SIGTERM);

  auto missing = harness::ChildProcess::start({.argv = {"kvstash-no-such-program"}});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().to_string();
}

TEST(LocalCluster, RedisRestartKeepsDataOnlyWithPersistence) {
  for (bool persistence : {false, true}) {
    auto redis = harness::LocalRedis::start({.persistence = persistence});
    ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
    const std::string dir = (*redis)->dir();
    EXPECT_TRUE(std::filesystem::is_directory(dir));
    auto c = metadata::RedisClient::connect({.url = (*redis)->url()});
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    ASSERT_TRUE((*c)->command({"SET", "k", "v"}).is_ok());
    const int port = (*redis)->port();
    ASSERT_TRUE((*redis)->restart().is_ok());
    EXPECT_EQ((*redis)->port(), port);
    auto v = (*c)->command({"GET", "k"});  // reconnects
    ASSERT_TRUE(v.is_ok()) << v.status().to_string();
    EXPECT_EQ(v->is_nil(), !persistence) << "persistence=" << persistence;
    redis->reset();
    EXPECT_FALSE(std::filesystem::exists(dir)) << "the private directory outlived the server";
  }
}

TEST(LocalCluster, RedisRestartRefusesAPortTakenMeanwhile) {
  for (const std::string password : {"", "pw"}) {
    auto redis = harness::LocalRedis::start({.password = password});
    ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
    const std::string port = std::to_string((*redis)->port());
    ::kill((*redis)->pid(), SIGKILL);
    // Another server takes the port (protected by another password, or by none).
    auto squatter =
        harness::ChildProcess::start({.argv = {"redis-server", "--port", port, "--bind", "127.0.0.1",
                                               "--save", "", "--requirepass", "other", "--logfile", ""},
                                      .capture_stdout = false});
    ASSERT_TRUE(squatter.is_ok()) << squatter.status().to_string();
    std::this_thread::sleep_for(200ms);
    Status s = (*redis)->restart();
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << "password '" << password << "': " << s.to_string();
    EXPECT_NE(s.message().find("taken"), std::string::npos) << s.to_string();
  }
}

TEST(LocalCluster, ANodeThatCannotStartReportsItsExitStatus) {
  auto redis = harness::LocalRedis::start({});
  ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
  auto node = harness::LocalNode::start({.redis_url = (*redis)->url(), .capacity = "not-a-size"});
  ASSERT_FALSE(node.is_ok());
  EXPECT_EQ(node.status().code(), StatusCode::kUnavailable) << node.status().to_string();
  EXPECT_NE(node.status().message().find("exited with status"), std::string::npos)
      << node.status().to_string();
  auto absent =
      harness::LocalNode::start({.kvstashd = "/nonexistent/kvstashd", .redis_url = (*redis)->url()});
  EXPECT_EQ(absent.status().code(), StatusCode::kNotFound) << absent.status().to_string();
}

}  // namespace
}  // namespace kvstash
