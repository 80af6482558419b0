// The kvstash CLI as a real process against a real redis-server and kvstashd: output parsed
// from --json and checked against the cell's state; plan against the published figures; usage
// errors exit 2, missing objects 3; destructive commands without --yes change nothing.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "command.h"
#include "fake_sysfs.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "kvstash_config.h"
#include "tests/harness/local_cluster.h"

namespace kvstash {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

struct Outcome {
  int code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
  json j() const { return json::parse(out); }
};

class Cli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* exe = std::getenv("KVSTASH_CLI");
    if (exe != nullptr) cli_ = exe;
  }

  void SetUp() override {
    if (cli_.empty()) GTEST_SKIP() << "KVSTASH_CLI not set (run via meson test)";
    dir_ = std::filesystem::temp_directory_path() / ("kvstash-cli-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    node_.reset();
    redis_.reset();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  void start_cell(const std::string& capacity = "16MiB", harness::LocalRedisOptions ro = {},
                  const std::vector<std::string>& node_args = {}) {
    auto redis = harness::LocalRedis::start(ro);
    ASSERT_TRUE(redis.is_ok()) << redis.status().to_string();
    redis_ = std::move(redis).value();
    std::vector<std::string> args = {"--heartbeat-ttl", "1s"};
    args.insert(args.end(), node_args.begin(), node_args.end());
    auto node = harness::LocalNode::start({.redis_url = redis_->url(),
                                           .redis_password = ro.password,
                                           .capacity = capacity,
                                           .page_size = "1MiB",
                                           .node_id = "n1",
                                           .extra_args = args});
    ASSERT_TRUE(node.is_ok()) << node.status().to_string();
    node_ = std::move(node).value();
  }

  // Runs `kvstash ARGS` against the cell (its URL in KVSTASH_REDIS_URL, as an operator would).
  Outcome kv(const std::string& args, const std::string& env = {}) {
    const std::string err_file = (dir_ / "stderr").string();
    std::string cmd = env;
    if (redis_) cmd += " KVSTASH_REDIS_URL=" + redis_->url();
    cmd += " " + cli_ + " " + args + " 2>" + err_file;
    Outcome r;
    int status = -1;
    r.out = test::run(cmd, &status);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream e(err_file);
    r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
    return r;
  }

  std::string file_of(std::size_t bytes, std::uint32_t seed) {
    std::string data(bytes, '\0');
    std::mt19937 rng(seed);
    for (auto& c : data) c = static_cast<char>(rng());
    const auto path = dir_ / ("blob" + std::to_string(seed));
    std::ofstream(path, std::ios::binary).write(data.data(), static_cast<std::streamsize>(data.size()));
    return path.string();
  }

  static std::string slurp(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  static inline std::string cli_;
  std::filesystem::path dir_;
  std::unique_ptr<harness::LocalRedis> redis_;
  std::unique_ptr<harness::LocalNode> node_;
};

TEST_F(Cli, PlanReproducesTheKvCacheArithmetic) {
  // Llama-2-7B fp16: 524,288 bytes per token, 2.1 GB per 4,096-token sequence, about 30 of them
  // in the 66.5 GB an 80 GB card has left by 13.5 GB of weights; 123 with 8 KV heads; 247 in int8.
  Outcome r = kv("plan --model llama-2-7b --context 4096 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.j()["bytes_per_token"], 524288);
  EXPECT_EQ(r.j()["bytes_per_sequence"], 524288ull * 4096);
  EXPECT_NEAR(r.j()["bytes_per_sequence"].get<double>() / 1e9, 2.1, 0.05);
  EXPECT_NEAR(r.j()["kv_budget_bytes"].get<double>() / 1e9, 66.5, 0.1);
  EXPECT_EQ(r.j()["max_sequences"], 30);
  EXPECT_EQ(kv("plan --model llama-2-7b --context 4096 --kv-heads 8 --json").j()["max_sequences"], 123);
  EXPECT_EQ(
      kv("plan --model llama-2-7b --context 4096 --kv-heads 8 --kv-dtype int8 --json").j()["max_sequences"],
      247);
  // Remote memory: how many more sequences stay warm.
  Outcome remote = kv("plan --model llama-2-7b --remote-mem 1TiB --batch 64 --json");
  EXPECT_EQ(remote.j()["remote_sequences"], 512);
  EXPECT_EQ(remote.j()["batch_waiting_sequences"], 64 - 30);
  // DRAM and NVMe together: 2 GiB sequences; 8 TiB of tier holds 4,096 more; a restore from
  // the tier reads 2.15 GB at 2 GB/s (1.07 s) before moving it at 10 GB/s (0.21 s); 4,096
  // tokens of prefill at 2,000 tokens/s take 2.048 s, longer than either restore. At 1 GB/s
  // against 4,000 tokens/s the tier loses to a recompute, and the plan says so.
  Outcome tiers =
      kv("plan --model llama-2-7b --remote-mem 1TiB --nvme-mem 8TiB --nvme-gbps 2 --prefill-tps 2000 --json");
  ASSERT_EQ(tiers.code, 0) << tiers.err;
  EXPECT_EQ(tiers.j()["nvme_sequences"], 4096);
  EXPECT_NEAR(tiers.j()["restore_seconds"].get<double>(), 0.2147, 0.001);
  EXPECT_NEAR(tiers.j()["nvme_restore_seconds"].get<double>(), 1.0737 + 0.2147, 0.002);
  EXPECT_NEAR(tiers.j()["recompute_seconds"].get<double>(), 2.048, 0.001);
  Outcome slow = kv("plan --model llama-2-7b --nvme-mem 1TiB --nvme-gbps 1 --prefill-tps 4000");
  EXPECT_NE(slow.out.find("from the NVMe slower"), std::string::npos) << slow.out;
  // Human output shows the arithmetic.
  Outcome human = kv("plan --model llama-2-7b");
  EXPECT_NE(human.out.find("524,288 bytes"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("30 sequences"), std::string::npos) << human.out;
  // Custom shapes and presets.
  Outcome custom = kv("plan --model custom --layers 10 --kv-heads 2 --head-dim 64 --params 1 --json");
  EXPECT_EQ(custom.j()["bytes_per_token"], 2 * 10 * 2 * 64 * 2);
  EXPECT_GE(kv("plan --list-models --json").j().size(), 8u);
  Outcome unknown = kv("plan --model gpt-17");
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("--list-models"), std::string::npos) << unknown.err;
}

TEST_F(Cli, PlanSizesDramAndNvmeForAHitRateOnATrace) {
  // Ten uses of a 4-block prompt, a new 1-block prompt after each: the 4 blocks hit from the
  // second use on (18,432 of 25,600 tokens: 0.72) once the cache holds 5 blocks (with 4 the
  // new prompt evicts the first block, and a prefix without its first block finds nothing).
  const std::string trace = (dir_ / "trace.jsonl").string();
  {
    std::ofstream out(trace);
    for (int i = 0; i < 10; ++i) {
      out << R"({"timestamp": )" << i * 2000 << R"(, "input_length": 2048, "hash_ids": [1, 2, 3, 4]})"
          << "\n";
      out << R"({"timestamp": )" << i * 2000 + 1000 << R"(, "input_length": 512, "hash_ids": [)" << 100 + i
          << "]}\n";
    }
  }
  Outcome r = kv("plan --model llama-2-7b --trace " + trace + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json j = r.j();
  EXPECT_DOUBLE_EQ(j["unlimited_hit_rate"].get<double>(), 0.72);
  EXPECT_DOUBLE_EQ(j["target_hit_rate"].get<double>(), 0.95 * 0.72);
  EXPECT_EQ(j["block_bytes"], 524288ull * 512);
  ASSERT_EQ(j["layouts"].size(), 4u);
  EXPECT_EQ(j["layouts"][0]["layout"], "DRAM alone");
  EXPECT_EQ(j["layouts"][0]["dram_blocks"], 5);
  EXPECT_EQ(j["layouts"][0]["dram_bytes"], 5 * 524288ull * 512);
  for (const auto& l : j["layouts"]) {
    EXPECT_EQ(l["reached"], true) << l.dump();
    EXPECT_GE(l["hit_rate"].get<double>(), 0.95 * 0.72) << l.dump();
    EXPECT_GE(l["dram_blocks"].get<int>() + l["nvme_blocks"].get<int>(), 5) << l.dump();
  }
  EXPECT_EQ(j["layouts"][1]["dram_blocks"], 2) << "half of DRAM alone";
  EXPECT_GT(j["layouts"][1]["nvme_blocks"].get<int>(), 0);
  // More than an unlimited cache finds: not reachable, and said so.
  Outcome beyond = kv("plan --model llama-2-7b --trace " + trace + " --hit-rate 0.9");
  EXPECT_EQ(beyond.code, 1);
  EXPECT_NE(beyond.out.find("not reachable"), std::string::npos) << beyond.out;
  EXPECT_EQ(kv("plan --trace " + (dir_ / "absent.jsonl").string()).code, 3) << "no such trace";
}

TEST_F(Cli, BadArgumentsAreUsageErrorsAndHelpHasExamples) {
  EXPECT_EQ(kv("").code, 2);
  EXPECT_EQ(kv("frobnicate").code, 2);
  EXPECT_EQ(kv("plan --kv-dtype fp7").code, 2);
  EXPECT_EQ(kv("ls --limit 0").code, 2);
  EXPECT_EQ(kv("touch some-key").code, 2) << "--ttl is required";
  EXPECT_EQ(kv("evict").code, 2) << "nothing says what to evict";
  EXPECT_EQ(kv("evict --older-than yesterday").code, 2);
  for (const char* sub :
       {"status", "ls", "show", "evict", "drain", "doctor", "plan", "get", "put", "node rm"}) {
    Outcome h = kv(std::string(sub) + " --help");
    EXPECT_EQ(h.code, 0) << sub;
    EXPECT_NE(h.out.find("Examples:"), std::string::npos) << sub << ": " << h.out;
  }
}

TEST_F(Cli, UnreachableRedisIsAnErrorThatSaysHowToFixIt) {
  Outcome r = kv("status --redis redis://127.0.0.1:1/0 --timeout 1s");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("fix:"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--redis"), std::string::npos) << r.err;
}

TEST_F(Cli, StatusAndNodesDescribeTheCell) {
  start_cell("16MiB");
  const std::string a = file_of(1536 * 1024, 1), b = file_of(100, 2);
  ASSERT_EQ(kv("put obj:a " + a).code, 0);
  ASSERT_EQ(kv("put obj:b " + b + " --ttl 10m").code, 0);
  ASSERT_EQ(kv("get obj:a -o " + (dir_ / "a.out").string()).code, 0);
  EXPECT_EQ(kv("get obj:none -o " + (dir_ / "none.out").string()).code, 3);

  Outcome st = kv("status --json");
  ASSERT_EQ(st.code, 0) << st.err;
  const json j = st.j();
  EXPECT_EQ(j["objects"], 2);
  EXPECT_EQ(j["stored_bytes"], 1536 * 1024 + 100);
  EXPECT_EQ(j["capacity_bytes"], 16u << 20);
  EXPECT_EQ(j["used_bytes"], 3u << 20) << "2 pages for obj:a, 1 for obj:b";
  EXPECT_EQ(j["hits"], 1) << "the get of obj:a (the CLI's get of a missing key stops at its stat)";
  EXPECT_EQ(j["misses"], 0);
  ASSERT_EQ(j["nodes"].size(), 1u);
  EXPECT_EQ(j["nodes"][0]["id"], "n1");
  EXPECT_EQ(j["nodes"][0]["state"], "up");
  EXPECT_FALSE(j["redis"]["version"].get<std::string>().empty());

  Outcome nodes = kv("nodes --json");
  ASSERT_EQ(nodes.code, 0);
  EXPECT_EQ(nodes.j()[0]["objects"], 2);
  EXPECT_EQ(nodes.j()[0]["free_bytes"], 13u << 20);
  EXPECT_EQ(kv("node show n1 --json").j()["pages"], 16);
  EXPECT_EQ(kv("node show nope").code, 3);
  Outcome human = kv("status");
  EXPECT_NE(human.out.find("n1"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("objects   2,"), std::string::npos) << human.out;

  // The rkey scope: connection unless set; a dry run until --yes; status shows it.
  EXPECT_EQ(j["rkey_scope"], "connection");
  EXPECT_EQ(kv("rkey-scope --json").j()["rkey_scope"], "connection");
  Outcome dry = kv("rkey-scope lease");
  EXPECT_NE(dry.out.find("--yes"), std::string::npos) << dry.out;
  EXPECT_EQ(kv("rkey-scope --json").j()["rkey_scope"], "connection") << "unchanged by a dry run";
  Outcome set = kv("rkey-scope lease --yes --json");
  ASSERT_EQ(set.code, 0) << set.err;
  EXPECT_EQ(set.j()["changed"], true);
  EXPECT_EQ(kv("status --json").j()["rkey_scope"], "lease");
  EXPECT_EQ(kv("rkey-scope window").code, 2) << "not a scope";

  // The eviction policy: lru unless set; a dry run until --yes; status shows it.
  EXPECT_EQ(j["eviction_policy"]["name"], "lru");
  EXPECT_NE(human.out.find("policy    lru"), std::string::npos) << human.out;
  Outcome would = kv("policy arc");
  ASSERT_EQ(would.code, 0) << would.err;
  EXPECT_NE(would.out.find("--yes"), std::string::npos) << would.out;
  EXPECT_EQ(kv("policy --json").j()["name"], "lru") << "unchanged by a dry run";
  Outcome arc = kv("policy arc --yes --json");
  ASSERT_EQ(arc.code, 0) << arc.err;
  EXPECT_EQ(arc.j()["changed"], true);
  EXPECT_EQ(arc.j()["t1"], 0);
  EXPECT_EQ(kv("status --json").j()["eviction_policy"]["name"], "arc");
  EXPECT_NE(kv("status").out.find("policy    arc: "), std::string::npos);
  Outcome ttl = kv("policy turn-ttl --yes --json");
  ASSERT_EQ(ttl.code, 0) << ttl.err;
  EXPECT_EQ(ttl.j()["name"], "turn-ttl");
  EXPECT_EQ(ttl.j()["clock_rate"], 1.0);
  EXPECT_NE(kv("status").out.find("policy    turn-ttl: "), std::string::npos);
  EXPECT_EQ(kv("policy fifo").code, 2) << "not a policy";
}

TEST_F(Cli, ObjectsCanBeListedShownTouchedReadAndRemoved) {
  start_cell("16MiB");
  const std::string a = file_of(3 << 20, 3);
  ASSERT_EQ(kv("put kvp:one " + a + " --layout L1.test").code, 0);
  ASSERT_EQ(kv("put kvp:two " + file_of(10, 4)).code, 0);
  ASSERT_EQ(kv("put other " + file_of(10, 5)).code, 0);

  Outcome ls = kv("ls 'kvp:*' --sort size --json");
  ASSERT_EQ(ls.code, 0) << ls.err;
  ASSERT_EQ(ls.j().size(), 2u);
  EXPECT_EQ(ls.j()[0]["key"], "kvp:one") << "largest first";
  EXPECT_EQ(ls.j()[0]["size"], 3 << 20);
  EXPECT_EQ(ls.j()[0]["ttl_ms"], -1);
  EXPECT_EQ(kv("ls --json").j().size(), 3u);
  EXPECT_EQ(kv("ls --limit 1 --json").j().size(), 1u);
  EXPECT_EQ(kv("ls 'nothing*' --json").j().size(), 0u);

  Outcome show = kv("show kvp:one --json");
  ASSERT_EQ(show.code, 0) << show.err;
  EXPECT_EQ(show.j()["pages"], 3);
  EXPECT_EQ(show.j()["extents"].size(), 3u);
  EXPECT_EQ(show.j()["extents"][0]["node"], "n1");
  EXPECT_EQ(show.j()["layout"], "L1.test");
  EXPECT_EQ(show.j()["checksum"].get<std::string>().size(), 16u);
  EXPECT_EQ(kv("show kvp:none").code, 3);

  ASSERT_EQ(kv("touch kvp:one --ttl 30m").code, 0);
  const auto ttl = kv("show kvp:one --json").j()["ttl_ms"].get<std::int64_t>();
  EXPECT_GT(ttl, 29 * 60 * 1000);
  EXPECT_LE(ttl, 30 * 60 * 1000);
  EXPECT_EQ(kv("touch kvp:none --ttl 30m").code, 3);

  const std::string out = (dir_ / "one.out").string();
  ASSERT_EQ(kv("get kvp:one -o " + out).code, 0);
  EXPECT_EQ(slurp(out), slurp(a)) << "the bytes went through the data path and back";

  Outcome dry = kv("rm kvp:one kvp:two");
  EXPECT_EQ(dry.code, 0);
  EXPECT_NE(dry.out.find("--yes"), std::string::npos);
  EXPECT_EQ(kv("ls --json").j().size(), 3u) << "rm without --yes changes nothing";
  Outcome rm = kv("rm kvp:one kvp:two --yes --json");
  ASSERT_EQ(rm.code, 0) << rm.err;
  EXPECT_EQ(kv("ls --json").j().size(), 1u);
  EXPECT_EQ(kv("rm kvp:one --yes").code, 3);
  EXPECT_EQ(kv("status --json").j()["stored_bytes"], 10);
}

TEST_F(Cli, EvictIsADryRunUntilYesAndGoesInLruOrder) {
  start_cell("16MiB");
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(kv("put e:" + std::to_string(i) + " " + file_of(1 << 20, 10 + i)).code, 0);
    std::this_thread::sleep_for(20ms);  // distinct last-access times
  }
  ASSERT_EQ(kv("get e:0 -o /dev/null").code, 0);  // e:0 is now the most recently used
  Outcome dry = kv("evict --bytes 1MiB --json");
  ASSERT_EQ(dry.code, 0) << dry.err;
  EXPECT_TRUE(dry.j()["dry_run"].get<bool>());
  ASSERT_EQ(dry.j()["objects"].size(), 1u);
  EXPECT_EQ(dry.j()["objects"][0]["key"], "e:1") << "least recently used first";
  EXPECT_EQ(kv("ls --json").j().size(), 3u) << "a dry run changes nothing";

  Outcome act = kv("evict --bytes 1500KiB --yes --json");
  ASSERT_EQ(act.code, 0) << act.err;
  EXPECT_FALSE(act.j()["dry_run"].get<bool>());
  ASSERT_EQ(act.j()["count"], 2) << "e:1 then e:2 reach 1500 KiB";
  EXPECT_EQ(kv("show e:1").code, 3);
  EXPECT_EQ(kv("show e:2").code, 3);
  EXPECT_EQ(kv("show e:0").code, 0);
  EXPECT_EQ(kv("status --json").j()["evicted"], 2);
  // Nothing has been idle for an hour.
  EXPECT_EQ(kv("evict --older-than 1h --yes --json").j()["count"], 0);
}

// A tenant's quota through the CLI and real puts (kvstash put, through kvstashd): the tenant at
// its quota evicts its own oldest objects, another tenant's stay, and status shows it all.
TEST_F(Cli, AQuotaKeepsATenantWithinItsShareAndStatusShowsIt) {
  start_cell("16MiB");
  ASSERT_EQ(kv("put other/old " + file_of(1 << 20, 40)).code, 0);
  Outcome set = kv("quota set tenant-a/ --bytes 3MiB --objects 10");
  ASSERT_EQ(set.code, 0) << set.err;
  for (int i = 0; i < 6; ++i) {
    Outcome put = kv("put tenant-a/" + std::to_string(i) + " " + file_of(1 << 20, 50 + i));
    ASSERT_EQ(put.code, 0) << put.err;
    std::this_thread::sleep_for(20ms);
  }
  json q = kv("quota --json").j();
  ASSERT_EQ(q.size(), 1u) << q.dump();
  EXPECT_EQ(q[0]["prefix"], "tenant-a/");
  EXPECT_EQ(q[0]["objects"], 3);
  EXPECT_EQ(q[0]["bytes"], 3 << 20);
  EXPECT_EQ(q[0]["evicted"], 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(kv("show tenant-a/" + std::to_string(i)).code, 3) << i;
  for (int i = 3; i < 6; ++i) EXPECT_EQ(kv("show tenant-a/" + std::to_string(i)).code, 0) << i;
  EXPECT_EQ(kv("show other/old").code, 0) << "another prefix's older object stays";
  // An object larger than the whole quota is refused, and nothing of the tenant's goes.
  Outcome big = kv("put tenant-a/big " + file_of(4 << 20, 60));
  EXPECT_NE(big.code, 0);
  EXPECT_NE(big.err.find("quota of prefix tenant-a/"), std::string::npos) << big.err;
  EXPECT_EQ(kv("show tenant-a/5").code, 0);

  Outcome status = kv("status");
  EXPECT_NE(status.out.find(
                "quotas    tenant-a/: 3 of 10 objects, 3 MiB of 3 MiB of the pool; 3 evicted, 1 refused"),
            std::string::npos)
      << status.out;
  EXPECT_EQ(kv("status --json").j()["quotas"][0]["refused"], 1);
  EXPECT_EQ(kv("quota set tenant-a/").code, 2) << "a quota needs a limit";
  ASSERT_EQ(kv("quota rm tenant-a/").code, 0);
  EXPECT_EQ(kv("quota --json").j().size(), 0u);
}

TEST_F(Cli, DrainStopsPlacementsAndNodeRmForgetsADeadNode) {
  start_cell("8MiB");
  ASSERT_EQ(kv("put d:1 " + file_of(1000, 20)).code, 0);
  Outcome dry = kv("drain n1");
  EXPECT_EQ(dry.code, 0);
  EXPECT_EQ(kv("node show n1 --json").j()["state"], "up") << "drain without --yes changes nothing";

  Outcome drain = kv("drain n1 --yes --json");
  ASSERT_EQ(drain.code, 0) << drain.err;
  EXPECT_EQ(drain.j()["objects_left"], 1);
  EXPECT_EQ(kv("node show n1 --json").j()["state"], "draining");
  EXPECT_EQ(kv("get d:1 -o /dev/null").code, 0) << "a draining node's objects stay readable";
  Outcome put = kv("put d:2 " + file_of(1000, 21));
  EXPECT_EQ(put.code, 1) << "no node takes new objects";
  EXPECT_NE(put.err.find("no_space"), std::string::npos) << put.err;
  // --wait gives up at its timeout while the object stays; rm lets the drain finish.
  EXPECT_EQ(kv("drain n1 --yes --wait --wait-timeout 1s").code, 1);
  ASSERT_EQ(kv("rm d:1 --yes").code, 0);
  Outcome waited = kv("drain n1 --yes --wait --wait-timeout 10s --json");
  EXPECT_EQ(waited.code, 0) << waited.err;
  EXPECT_EQ(waited.j()["objects_left"], 0);

  Outcome alive = kv("node rm n1 --yes");
  EXPECT_EQ(alive.code, 2) << "a live node is not removed";
  EXPECT_EQ(kv("nodes --json").j().size(), 1u);
  node_->kill();  // SIGKILL: its heartbeat (1 s) runs out
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (kv("node show n1 --json").j()["state"] != "dead" && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_EQ(kv("node show n1 --json").j()["state"], "dead");
  EXPECT_EQ(kv("node rm n1").code, 0);
  EXPECT_EQ(kv("nodes --json").j().size(), 1u) << "node rm without --yes changes nothing";
  ASSERT_EQ(kv("node rm n1 --yes").code, 0);
  EXPECT_EQ(kv("nodes --json").j().size(), 0u);
}

// kvstash explain answers each reason a key can be missing for, from the cell's record of
// removals: never stored, removed, removed as corrupt, its TTL ended, evicted (and under what
// pressure), its node died, its node registered again; and for a prompt's tokens, the chunk
// keys of a neighbour (another TP rank, another model) that exist.
TEST_F(Cli, ExplainSaysWhyEachMissingKeyIsMissing) {
  start_cell("4MiB");
  auto why = [&](const std::string& args) -> json {
    Outcome r = kv("explain " + args + " --json");
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? r.j() : json::array();
  };
  const std::string mb = file_of(1000000, 31);
  ASSERT_EQ(kv("put here " + file_of(1000, 30)).code, 0);
  ASSERT_EQ(kv("put gone:rm " + file_of(1000, 32)).code, 0);
  ASSERT_EQ(kv("rm gone:rm --yes").code, 0);
  ASSERT_EQ(kv("put gone:ttl " + file_of(1000, 33) + " --ttl 1ms").code, 0);
  {
    StoreOptions o;
    o.redis_url = redis_->url();
    o.engine.transports = {TransportKind::kTcp};
    auto store = Store::open(o);
    ASSERT_TRUE(store.is_ok()) << store.status().to_string();
    std::string data(1000, 'c');
    Slice in{data.data(), data.size()};
    ASSERT_TRUE((*store)->put("gone:corrupt", {&in, 1}).is_ok());
    ASSERT_TRUE((*store)->remove_corrupt("gone:corrupt").is_ok());
  }
  std::this_thread::sleep_for(50ms);
  json j = why("here never:stored gone:rm gone:ttl gone:corrupt");
  ASSERT_EQ(j.size(), 5u) << j.dump();
  EXPECT_EQ(j[0]["present"], true);
  EXPECT_EQ(j[0]["node"], "n1");
  EXPECT_EQ(j[0]["tier"], "dram");
  EXPECT_EQ(j[1]["reason"], "never_stored");
  EXPECT_EQ(j[2]["reason"], "removed");
  EXPECT_EQ(j[3]["reason"], "expired");
  EXPECT_EQ(j[4]["reason"], "corrupt");
  Outcome text = kv("explain gone:ttl never:stored");
  EXPECT_NE(text.out.find("its TTL ended"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("never stored in this cell"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("0 of 2 present"), std::string::npos) << text.out;

  // Five objects of a page into a pool of four: the first are evicted, and explain says why.
  for (int i = 0; i < 5; ++i) ASSERT_EQ(kv("put full:" + std::to_string(i) + " " + mb).code, 0) << i;
  j = why("full:0");
  EXPECT_EQ(j[0]["reason"], "evicted") << j.dump();
  EXPECT_NE(j[0]["detail"].get<std::string>().find("the pool was full: a put needed 1 page"),
            std::string::npos)
      << j.dump();

  // A prompt's chunk keys: stored for TP rank 1 of 2 and for another model, asked for as rank 0.
  std::vector<std::uint32_t> tokens(64);
  for (std::uint32_t i = 0; i < tokens.size(); ++i) tokens[i] = 100 + i;
  PrefixKeyOptions mine{
      .model = "m", .layout_tag = "L2.P2.H1.D8.B16.fp16.nhd", .tp_rank = 0, .tp_size = 2, .chunk_tokens = 16};
  PrefixKeyOptions rank1 = mine, other_model = mine;
  rank1.tp_rank = 1;
  other_model.model = "m-other";
  ASSERT_EQ(kv("rm full:1 full:2 full:3 full:4 --yes").code, 0);
  ASSERT_EQ(kv("put " + prefix_chunk_keys(tokens, rank1)[0] + " " + file_of(100, 34)).code, 0);
  ASSERT_EQ(kv("put " + prefix_chunk_keys(tokens, other_model)[1] + " " + file_of(100, 35)).code, 0);
  std::string ids;
  for (auto t : tokens) ids += (ids.empty() ? "" : ",") + std::to_string(t);
  j = why("--tokens " + ids +
          " --model m --layout L2.P2.H1.D8.B16.fp16.nhd --chunk-tokens 16 --tp-rank 0 "
          "--tp-size 2 --also-model m-other");
  ASSERT_EQ(j.size(), 4u) << j.dump();
  EXPECT_EQ(j[0]["key"], prefix_chunk_keys(tokens, mine)[0]);
  EXPECT_EQ(j[0]["neighbours"], json::array({"TP rank 1"})) << j.dump();
  EXPECT_EQ(j[1]["neighbours"], json::array({"model m-other"})) << j.dump();
  EXPECT_FALSE(j[2].contains("neighbours"));
  // Keys by heads: --heads names the object (of head 1 of 2), and its key is the one asked for.
  PrefixKeyOptions head1{.model = "m",
                         .layout_tag = "L2.P2.H1.D8.B16.fp16.nhd",
                         .chunk_tokens = 16,
                         .heads_total = 2,
                         .head_first = 1,
                         .head_count = 1};
  ASSERT_EQ(kv("put " + prefix_chunk_keys(tokens, head1)[0] + " " + file_of(100, 38)).code, 0);
  j = why("--tokens " + ids + " --model m --layout L2.P2.H1.D8.B16.fp16.nhd --chunk-tokens 16 --heads 1+1/2");
  ASSERT_EQ(j.size(), 4u) << j.dump();
  EXPECT_EQ(j[0]["key"], prefix_chunk_keys(tokens, head1)[0]);
  EXPECT_EQ(j[0]["present"], true) << j.dump();
  EXPECT_EQ(j[1]["present"], false) << j.dump();
  EXPECT_NE(kv("explain --tokens " + ids + " --model m --layout L2 --heads 1/2").code, 0)
      << "not FIRST+COUNT/TOTAL";
  // A hybrid model's group: --group names the group's objects.
  PrefixKeyOptions window{
      .model = "m", .layout_tag = "L2.P2.H1.D8.B16.fp16.nhd", .chunk_tokens = 16, .group = "swa64.0a1b2c3d"};
  ASSERT_EQ(kv("put " + prefix_chunk_keys(tokens, window)[1] + " " + file_of(100, 39)).code, 0);
  j = why("--tokens " + ids +
          " --model m --layout L2.P2.H1.D8.B16.fp16.nhd --chunk-tokens 16 --group swa64.0a1b2c3d");
  ASSERT_EQ(j.size(), 4u) << j.dump();
  EXPECT_EQ(j[1]["key"], prefix_chunk_keys(tokens, window)[1]);
  EXPECT_EQ(j[0]["present"], false) << j.dump();
  EXPECT_EQ(j[1]["present"], true) << j.dump();

  // Its node dies: a key on it is missing because of that; the node back, another key put
  // before is missing because the node's pool started over.
  ASSERT_EQ(kv("put on:n1:a " + file_of(1000, 36)).code, 0);
  ASSERT_EQ(kv("put on:n1:b " + file_of(1000, 37)).code, 0);
  node_->kill();
  std::this_thread::sleep_for(1500ms);  // its heartbeat (1 s) ran out
  j = why("on:n1:a");
  EXPECT_EQ(j[0]["reason"], "node_down") << j.dump();
  EXPECT_EQ(j[0]["detail"], "n1");
  auto node = harness::LocalNode::start({.redis_url = redis_->url(),
                                         .capacity = "4MiB",
                                         .page_size = "1MiB",
                                         .node_id = "n1",
                                         .extra_args = {"--heartbeat-ttl", "1s"}});
  ASSERT_TRUE(node.is_ok()) << node.status().to_string();
  node_ = std::move(node).value();
  j = why("on:n1:b");
  EXPECT_EQ(j[0]["reason"], "node_restarted") << j.dump();
  EXPECT_NE(kv("explain on:n1:b").out.find("registered again"), std::string::npos);
}

TEST_F(Cli, DrainMoveTakesTheObjectsToTheOtherNodesIntact) {
  start_cell("8MiB");
  std::vector<std::string> files;
  for (int i = 0; i < 3; ++i) {
    files.push_back(file_of(1536 * 1024 + i, 30 + i));
    ASSERT_EQ(
        kv("put m:" + std::to_string(i) + " " + files.back() + " --ttl 1h --layout L" + std::to_string(i))
            .code,
        0);
  }
  auto second = harness::LocalNode::start({.redis_url = redis_->url(),
                                           .capacity = "16MiB",
                                           .page_size = "1MiB",
                                           .node_id = "n2",
                                           .extra_args = {"--heartbeat-ttl", "1s"}});
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  EXPECT_EQ(kv("drain n1 --move").code, 0);
  EXPECT_EQ(kv("node show n1 --json").j()["objects"], 3) << "without --yes nothing moves";
  Outcome moved = kv("drain n1 --yes --move --json");
  ASSERT_EQ(moved.code, 0) << moved.err;
  EXPECT_EQ(moved.j()["moved_objects"], 3);
  EXPECT_EQ(moved.j()["objects_left"], 0);
  EXPECT_EQ(kv("node show n1 --json").j()["objects"], 0);
  for (int i = 0; i < 3; ++i) {
    const std::string key = "m:" + std::to_string(i);
    const json shown = kv("show " + key + " --json").j();
    EXPECT_EQ(shown["nodes"], json::array({"n2"})) << key;
    EXPECT_EQ(shown["layout"], "L" + std::to_string(i)) << "the layout moves with it";
    EXPECT_GT(shown["ttl_ms"].get<std::int64_t>(), 59 * 60 * 1000) << "and its time to live";
    const std::string out = (dir_ / ("m" + std::to_string(i))).string();
    ASSERT_EQ(kv("get " + key + " -o " + out).code, 0);
    EXPECT_EQ(slurp(out), slurp(files[i])) << key;
  }
  EXPECT_EQ(kv("drain n1 --yes --move --release").code, 2) << "move or release, not both";
  (*second)->stop();
}

TEST_F(Cli, DoctorExplainsWhatThisHostHasAndLacks) {
  start_cell("8MiB");
  Outcome d = kv("doctor --json");
  ASSERT_EQ(d.code, 0) << d.out << d.err;
  const json report = d.j();
  std::map<std::string, json> checks;
  for (const auto& c : report["checks"]) checks[c["check"].get<std::string>()] = c;
  EXPECT_EQ(checks["redis"]["status"], "ok");
  EXPECT_EQ(checks["lua scripts"]["status"], "ok");
  EXPECT_EQ(checks["node n1"]["status"], "ok");
  EXPECT_EQ(checks["transport tcp"]["status"], "ok");
  // This host's RDMA: a device is listed per port; none is a warning with an explanation.
  const bool rdma =
      std::filesystem::exists("/sys/class/infiniband") && !std::filesystem::is_empty("/sys/class/infiniband");
  if (!rdma) {
    ASSERT_TRUE(checks.count("rdma"));
    EXPECT_EQ(checks["rdma"]["status"], "warn");
    EXPECT_FALSE(checks["rdma"]["fix"].get<std::string>().empty());
  }
  for (const char* name : {"memlock", "hugepages", "cuda", "gpudirect", "clock skew", "transport shm"}) {
    EXPECT_TRUE(checks.count(name)) << name;
  }
  EXPECT_EQ(checks.count("ssd"), 0u) << "the NVMe tier is checked only when named";

  // --ssd: a file tier on this machine's disk is probed (O_DIRECT, io_uring) and the probe
  // goes; a path whose folder is not there fails the check and doctor.
  const std::filesystem::path tier = std::filesystem::current_path() / "doctor-tier";
  Outcome ssd = kv("doctor --json --ssd " + tier.string());
  const json ssd_report = ssd.j();  // held: a loop over a temporary's member would dangle
  json ssd_check;
  for (const auto& c : ssd_report["checks"]) {
    if (c["check"] == "ssd") ssd_check = c;
  }
  ASSERT_FALSE(ssd_check.is_null()) << ssd.out;
  const std::string status = ssd_check["status"], detail = ssd_check["detail"];
  // A host whose file system here takes no O_DIRECT, or whose kernel has io_uring off, is told
  // so (a fail); anywhere else the probe works (warn: a rotational virtual disk).
  const bool unsupported = detail.find("takes no O_DIRECT") != std::string::npos ||
                           detail.find("io_uring is off") != std::string::npos;
  EXPECT_TRUE(status == "ok" || status == "warn" || (status == "fail" && unsupported)) << ssd_check.dump();
  if (!unsupported) {
    EXPECT_NE(detail.find("O_DIRECT and io_uring work"), std::string::npos) << ssd_check.dump();
  }
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::current_path())) {
    EXPECT_EQ(entry.path().filename().string().rfind(".kvstash-doctor-probe", 0), std::string::npos)
        << "the probe file stayed: " << entry.path();
  }
  Outcome missing = kv("doctor --ssd /nonexistent-dir/tier");
  EXPECT_EQ(missing.code, 1) << missing.out;
  EXPECT_NE(missing.out.find("/nonexistent-dir does not exist"), std::string::npos) << missing.out;
  // With the node gone, doctor fails and says how to fix it.
  node_->kill();
  std::this_thread::sleep_for(1500ms);
  Outcome sick = kv("doctor");
  EXPECT_EQ(sick.code, 1) << sick.out;
  EXPECT_NE(sick.out.find("How to fix"), std::string::npos) << sick.out;
  EXPECT_NE(sick.out.find("node rm n1"), std::string::npos) << sick.out;
}

// A driver older than the CUDA runtime this build links is a failed check naming the floor
// (a fake libcuda.so.1, tests/gpu/fake_libcuda, answers as a CUDA 12.2 driver), and a new enough
// one passes.
TEST_F(Cli, DoctorHoldsTheGpuDriverAgainstTheCudaRuntimeItLinks) {
#if !KVSTASH_HAVE_CUDA_KERNELS
  GTEST_SKIP() << "this build has no CUDA kernels, so no CUDA runtime to hold a driver against";
#else
  const char* fake = std::getenv("KVSTASH_FAKE_LIBCUDA_DIR");
  ASSERT_NE(fake, nullptr) << "meson test cli sets KVSTASH_FAKE_LIBCUDA_DIR";
  start_cell("8MiB");
  const std::string lib = std::string("LD_LIBRARY_PATH=") + fake;
  auto check = [&](const std::string& env) {
    Outcome d = kv("doctor --json", lib + " " + env);
    const json report = d.j();
    std::map<std::string, json> checks;
    for (const auto& c : report["checks"]) checks[c["check"].get<std::string>()] = c;
    EXPECT_EQ(checks["cuda"]["status"], "ok") << d.out;
    return std::make_pair(d.code, checks["cuda driver"]);
  };
  const int runtime_major = KVSTASH_CUDA_RUNTIME_VERSION / 1000;
  auto [old_code, old_driver] =
      check("KVSTASH_FAKE_CUDA_DRIVER_VERSION=" + std::to_string((runtime_major - 1) * 1000 + 20));
  EXPECT_EQ(old_code, 1) << "a failed check";
  EXPECT_EQ(old_driver["status"], "fail") << old_driver;
  const std::string detail = old_driver["detail"].get<std::string>();
  EXPECT_NE(detail.find(runtime_major >= 13 ? "R580" : "R525"), std::string::npos) << detail;
  EXPECT_NE(old_driver["fix"].get<std::string>().find("GPU drivers"), std::string::npos) << old_driver;
  auto [new_code, new_driver] =
      check("KVSTASH_FAKE_CUDA_DRIVER_VERSION=" + std::to_string(runtime_major * 1000 + 20));
  EXPECT_EQ(new_driver["status"], "ok") << new_driver;
#endif
}

TEST_F(Cli, DoctorPrintsTheGpuNicMatrixOfTheSysfsTreeAndSaysSoWhenThereIsNone) {
  // A fake sysfs tree (KVSTASH_SYSFS_ROOT): two sockets, each with a PCIe switch holding a GPU
  // and a NIC, and one more NIC on a root port of socket 0. No cell: doctor fails on Redis,
  // but still reports this host.
  using test::FakeSysfs;
  FakeSysfs sys(dir_ / "sys");
  sys.pci("pci0000:17", {"0000:17:00.0", "0000:18:00.0", "0000:19:00.0", "0000:1a:00.0"},
          FakeSysfs::k3dController, FakeSysfs::kNvidia, 0);
  sys.rdma("mlx5_0", sys.pci("pci0000:17", {"0000:17:00.0", "0000:18:00.0", "0000:19:04.0", "0000:1b:00.0"},
                             FakeSysfs::kInfiniband, FakeSysfs::kMellanox, 0));
  sys.pci("pci0000:ae", {"0000:ae:00.0", "0000:af:00.0", "0000:b0:00.0", "0000:b1:00.0"},
          FakeSysfs::k3dController, FakeSysfs::kNvidia, 1);
  sys.rdma("mlx5_1", sys.pci("pci0000:ae", {"0000:ae:00.0", "0000:af:00.0", "0000:b0:04.0", "0000:b2:00.0"},
                             FakeSysfs::kInfiniband, FakeSysfs::kMellanox, 1));
  sys.rdma("mlx5_2", sys.pci("pci0000:17", {"0000:17:02.0", "0000:1c:00.0"}, FakeSysfs::kEthernet,
                             FakeSysfs::kMellanox, 0));
  const std::string env = "KVSTASH_REDIS_URL=redis://127.0.0.1:1 KVSTASH_SYSFS_ROOT=" + sys.root().string();

  Outcome d = kv("doctor --json", env);
  EXPECT_EQ(d.code, 1) << "no Redis" << d.err;
  const json m = d.j()["gpu_nic"];
  EXPECT_EQ(m["gpus"], json({"0000:1a:00.0", "0000:b1:00.0"}));
  EXPECT_EQ(m["nics"], json({"mlx5_0", "mlx5_1", "mlx5_2"}));
  EXPECT_EQ(m["distance"], json({{"PIX", "SYS", "PHB"}, {"SYS", "PIX", "SYS"}}));
  EXPECT_EQ(m["chosen"], json({{"mlx5_0"}, {"mlx5_1"}})) << "each GPU its own NIC";

  Outcome text = kv("doctor", env);
  EXPECT_NE(text.out.find("GPU x NIC"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("0000:1a:00.0  PIX*    SYS     PHB"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("0000:b1:00.0  SYS     PIX*    SYS"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("0000:1a:00.0 -> mlx5_0 (PIX); 0000:b1:00.0 -> mlx5_1 (PIX)"), std::string::npos)
      << text.out;

  // Neither GPUs nor RDMA devices: one line says so, and the matrix is empty.
  FakeSysfs none(dir_ / "none");
  Outcome empty =
      kv("doctor --json", "KVSTASH_REDIS_URL=redis://127.0.0.1:1 KVSTASH_SYSFS_ROOT=" + none.root().string());
  const json report = empty.j();
  EXPECT_TRUE(report["gpu_nic"]["gpus"].empty());
  EXPECT_TRUE(report["gpu_nic"]["nics"].empty());
  bool said = false;
  for (const auto& c : report["checks"]) {
    if (c["check"] != "gpu-nic affinity") continue;
    said = c["detail"].get<std::string>().find("no NVIDIA GPU and no RDMA device") != std::string::npos;
  }
  EXPECT_TRUE(said) << empty.out;
}

TEST_F(Cli, PasswordsComeFromAFileOrTheEnvironmentAndAreNeverEchoed) {
  start_cell("8MiB", {.password = "s3cret-pw"});
  Outcome none = kv("status --json");
  EXPECT_EQ(none.code, 1) << "no password";
  const std::string pw = (dir_ / "pw").string();
  std::ofstream(pw) << "s3cret-pw\n";
  Outcome file = kv("status --json --redis-password-file " + pw);
  ASSERT_EQ(file.code, 0) << file.err;
  EXPECT_EQ(file.j()["nodes"].size(), 1u);
  Outcome env = kv("status", "KVSTASH_REDIS_PASSWORD=s3cret-pw");
  ASSERT_EQ(env.code, 0) << env.err;
  Outcome url = kv("status --redis redis://:s3cret-pw@127.0.0.1:" + std::to_string(redis_->port()) + "/0");
  ASSERT_EQ(url.code, 0) << url.err;
  for (const Outcome* r : {&file, &env, &url}) {
    EXPECT_EQ(r->out.find("s3cret"), std::string::npos) << r->out;
    EXPECT_EQ(r->err.find("s3cret"), std::string::npos) << r->err;
  }
  Outcome wrong = kv("doctor", "KVSTASH_REDIS_PASSWORD=wrong");
  EXPECT_EQ(wrong.code, 1);
  EXPECT_NE(wrong.out.find("fail"), std::string::npos) << wrong.out;
}

TEST_F(Cli, TheClusterTokenComesFromAPrivateFileOrTheEnvironmentAndIsNeverEmpty) {
  ::unsetenv("KVSTASH_CLUSTER_TOKEN");
  const std::string token = (dir_ / "token").string();
  std::ofstream(token) << "cell-t0ken-0123456789\n";
  ASSERT_EQ(::chmod(token.c_str(), 0600), 0);
  // The node serves tcp only: shm (same host, same user) needs no token.
  start_cell("8MiB", {}, {"--transports", "tcp", "--cluster-token-file", token});
  const std::string blob = file_of(3 << 20, 7), out = (dir_ / "out").string();

  Outcome none = kv("put guarded " + blob);
  EXPECT_EQ(none.code, 1) << none.err;
  EXPECT_NE(none.err.find("permission_denied"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("--cluster-token-file"), std::string::npos)
      << "the fix names the option: " << none.err;
  Outcome wrong = kv("put guarded " + blob, "KVSTASH_CLUSTER_TOKEN=guess-guess-guess-guess");
  EXPECT_EQ(wrong.code, 1) << wrong.err;
  EXPECT_NE(wrong.err.find("permission_denied"), std::string::npos) << wrong.err;

  Outcome put = kv("--cluster-token-file " + token + " put guarded " + blob);
  ASSERT_EQ(put.code, 0) << put.err;
  Outcome get = kv("get guarded -o " + out + " --cluster-token-file " + token);
  ASSERT_EQ(get.code, 0) << get.err;
  EXPECT_EQ(slurp(out), slurp(blob));
  std::filesystem::remove(out);
  Outcome env = kv("get guarded -o " + out, "KVSTASH_CLUSTER_TOKEN=cell-t0ken-0123456789");
  ASSERT_EQ(env.code, 0) << env.err;
  EXPECT_EQ(slurp(out), slurp(blob));
  Outcome refused = kv("get guarded -o " + out);
  EXPECT_EQ(refused.code, 1) << refused.err;
  EXPECT_NE(refused.err.find("permission_denied"), std::string::npos) << refused.err;
  for (const Outcome* r : {&none, &wrong, &put, &get, &env, &refused}) {
    EXPECT_EQ(r->out.find("t0ken"), std::string::npos) << r->out;
    EXPECT_EQ(r->err.find("t0ken"), std::string::npos) << r->err;
  }

  // Set but empty, an empty or blank file, a file others may read or write: usage errors,
  // before anything reaches the cell.
  for (const char* empty : {"KVSTASH_CLUSTER_TOKEN=", "KVSTASH_CLUSTER_TOKEN=' '"}) {
    Outcome e = kv("get guarded -o " + out, empty);
    EXPECT_EQ(e.code, 2) << empty << ": " << e.err;
    EXPECT_NE(e.err.find("KVSTASH_CLUSTER_TOKEN"), std::string::npos) << e.err;
    EXPECT_EQ(kv("status", empty).code, 2) << empty;
  }
  // Shorter than 16 bytes: refused, whatever the cell's token is.
  Outcome short_token = kv("get guarded -o " + out, "KVSTASH_CLUSTER_TOKEN=cell-t0ken");
  EXPECT_EQ(short_token.code, 2) << short_token.err;
  EXPECT_NE(short_token.err.find("at least 16 bytes"), std::string::npos) << short_token.err;
  const std::string blank = (dir_ / "blank").string();
  std::ofstream(blank) << " \n";
  ASSERT_EQ(::chmod(blank.c_str(), 0600), 0);
  Outcome b = kv("--cluster-token-file " + blank + " get guarded -o " + out);
  EXPECT_EQ(b.code, 2) << b.err;
  EXPECT_NE(b.err.find("empty"), std::string::npos) << b.err;
  EXPECT_EQ(kv("--cluster-token-file '' get guarded -o " + out).code, 2);
  ASSERT_EQ(::chmod(token.c_str(), 0640), 0);
  Outcome open = kv("get guarded -o " + out + " --cluster-token-file " + token);
  EXPECT_EQ(open.code, 2) << open.err;
  EXPECT_NE(open.err.find(token), std::string::npos) << open.err;
  EXPECT_NE(open.err.find("mode 0640"), std::string::npos) << open.err;
  EXPECT_NE(open.err.find("chmod 600"), std::string::npos) << open.err;
  EXPECT_EQ(kv("--cluster-token-file " + token + " status").code, 2);
}

TEST_F(Cli, BenchIsForwardedToKvstashBench) {
  // Found in the build tree next to the CLI (build/tools/kvstash -> build/bench).
  Outcome help = kv("bench store --help");
  EXPECT_EQ(help.code, 0) << help.err;
  EXPECT_NE(help.out.find("kvstash-bench store"), std::string::npos) << help.out;
  EXPECT_EQ(kv("bench store --object-size banana").code, 2) << "its usage errors come back";
  Outcome missing = kv("bench store", "KVSTASH_BENCH=/nonexistent/kvstash-bench");
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find("KVSTASH_BENCH"), std::string::npos) << missing.err;
}

TEST_F(Cli, BashCompletionCoversTheCommandTree) {
  Outcome c = kv("completion bash");
  ASSERT_EQ(c.code, 0);
  for (const char* w : {"drain", "evict", "--older-than", "--json", "show", "rm", "completion"}) {
    EXPECT_NE(c.out.find(w), std::string::npos) << w;
  }
  const std::string script = (dir_ / "completion.bash").string();
  std::ofstream(script) << c.out;
  int status = -1;
  test::run("bash -n " + script, &status);
  EXPECT_EQ(status, 0) << "the script parses";
  // Completing `kvstash dr` offers drain.
  test::run("bash -c 'source " + script +
                "; COMP_WORDS=(kvstash dr); COMP_CWORD=1; _kvstash; echo ${COMPREPLY[*]}' > " +
                (dir_ / "reply").string(),
            &status);
  EXPECT_NE(slurp((dir_ / "reply").string()).find("drain"), std::string::npos);
}

}  // namespace
}  // namespace kvstash
