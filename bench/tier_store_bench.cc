// `kvstash-bench tier --store`: the NVMe tier under a real kvstashd (bench/tier_bench.h says what
// it measures). docs/nvme-tier.md has the figures.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iostream>
#include <mutex>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvstash/memory.h"
#include "kvstash/store.h"
#include "measure.h"
#include "metadata/cell.h"
#include "tests/harness/local_cluster.h"
#include "tier_bench.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;

// Object `i`'s bytes: a word per 8 bytes that only it has, cheap to make and to check.
void fill(std::byte* p, std::uint64_t size, std::uint64_t i) {
  for (std::uint64_t at = 0; at + 8 <= size; at += 8) {
    const std::uint64_t v = (i << 40) ^ at ^ 0x9e3779b97f4a7c15ull;
    std::memcpy(p + at, &v, 8);
  }
}

struct Row {
  std::string op;
  std::uint64_t object_bytes = 0;
  std::uint64_t objects = 0;
  double gbps = 0, p50_us = 0, p99_us = 0;
  double vs_fio = 0;
  bool verified = true;
  std::string note;
};

class Bench {
 public:
  explicit Bench(const TierStoreBenchOptions& o) : o_(o) {}

  // One object size: a fresh Redis and node, so that each size starts from an empty tier.
  Result<std::vector<Row>> run(std::uint64_t size) {
    const std::uint64_t pages_per = (size + o_.page - 1) / o_.page;
    const std::uint64_t pool_objects = o_.pool / o_.page / pages_per;
    if (pool_objects < 2) return Status::invalid_argument("--pool holds fewer than two objects of this size");
    const std::uint64_t n = pool_objects * o_.pools_of_objects;
    const std::uint64_t tier_bytes = n * pages_per * o_.page + (64ull << 20);
    KVSTASH_ASSIGN_OR_RETURN(auto redis, harness::LocalRedis::start({}));
    KVSTASH_ASSIGN_OR_RETURN(
        auto node,
        harness::LocalNode::start({.redis_url = redis->url(),
                                   .capacity = std::to_string(o_.pool),
                                   .page_size = std::to_string(o_.page),
                                   .node_id = "tier-bench",
                                   .extra_args = {"--transports", "tcp", "--ssd", o_.path, "--ssd-capacity",
                                                  std::to_string(tier_bytes), "--ssd-low-water", "10%"}}));
    metadata::CellOptions co;
    co.redis.url = redis->url();
    KVSTASH_ASSIGN_OR_RETURN(auto cell, metadata::Cell::open(co));
    StoreOptions so;
    so.redis_url = redis->url();
    so.engine.transports = {TransportKind::kTcp};
    so.verify_checksum = o_.verify_checksum;
    so.timeout = 120s;
    so.redis_connections = std::max<std::uint32_t>(4, o_.sessions * 2);
    KVSTASH_ASSIGN_OR_RETURN(auto store, Store::open(so));
    auto free_pages = [&]() -> std::uint64_t {
      auto s = cell->admin().node_status("tier-bench");
      return s.is_ok() ? s->free_pages : 0;
    };
    std::vector<Row> rows;

    // Puts, each waiting for the write-down to leave room (none may be evicted): their rate
    // past the first pool is the write-down's.
    KVSTASH_ASSIGN_OR_RETURN(Buffer buf, Buffer::allocate(size * o_.sessions));
    KVSTASH_ASSIGN_OR_RETURN(MemoryHandle reg, store->register_memory(buf.region()));
    std::vector<double> put_us;
    Clock::time_point past_pool{};
    for (std::uint64_t i = 0; i < n; ++i) {
      if (i == pool_objects) past_pool = Clock::now();
      const Deadline until = deadline_after(60s);
      while (free_pages() < pages_per && Clock::now() < until) std::this_thread::sleep_for(1ms);
      fill(buf.data(), size, i);
      Slice in{buf.data(), size};
      const auto t0 = Clock::now();
      KVSTASH_RETURN_IF_ERROR(store->put(fmt::format("tb/{}", i), {&in, 1}).with_context("put"));
      put_us.push_back(us_since(t0));
    }
    const double down_s = seconds_since(past_pool);
    Row put{"put", size, n, 0, percentile(put_us, 0.5), percentile(put_us, 0.99)};
    put.gbps = static_cast<double>(pool_objects * size) / 1e9 /
               (std::accumulate(put_us.begin(), put_us.begin() + static_cast<long>(pool_objects), 0.0) / 1e6);
    put.note = "into the pool (the first pool's worth)";
    rows.push_back(put);
    Row down{"write_down", size, n - pool_objects};
    down.gbps = static_cast<double>((n - pool_objects) * size) / 1e9 / down_s;
    down.note = "puts past the pool, each waiting for the node to move an older object down";
    rows.push_back(down);

    // Promoted gets: the objects on the tier, oldest first, `sessions` at once, into a pool
    // with room (the objects that stayed in it are removed first, so each get is one promotion
    // and one read, with no write-down).
    std::vector<std::string> cold;
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::string key = fmt::format("tb/{}", i);
      auto where = store->prefix_tiers({&key, 1});
      if (!where.is_ok() || where->empty()) {
        auto sum = cell->admin().summary();
        return Status::internal(
            fmt::format("object {} was lost ({} evicted from the pool, {} from the tier, {} "
                        "lost there)",
                        key, sum.is_ok() ? sum->evicted : 0, sum.is_ok() ? sum->tier_evicted : 0,
                        sum.is_ok() ? sum->tier_lost : 0));
      }
      if (where->front() == Tier::kSsd) {
        cold.push_back(key);
      } else {
        KVSTASH_RETURN_IF_ERROR(store->remove(key));
      }
    }
    cold.resize(std::min<std::size_t>(cold.size(), pool_objects * 9 / 10));
    std::vector<double> get_us;
    std::mutex mu;
    std::atomic<std::size_t> next{0};
    std::atomic<bool> wrong{false};
    Status failed;
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (std::uint32_t s = 0; s < o_.sessions; ++s) {
      threads.emplace_back([&, s] {
        std::byte* mine = buf.data() + s * size;
        for (std::size_t k; (k = next++) < cold.size();) {
          Slice out{mine, size};
          const auto g0 = Clock::now();
          auto got = store->get(cold[k], {&out, 1});
          const double us = us_since(g0);
          // Every word checked in place (no copy of the expected bytes to make).
          const std::uint64_t i = std::stoull(cold[k].substr(3));
          bool same = got.is_ok();
          for (std::uint64_t at = 0; same && at + 8 <= size; at += 8) {
            std::uint64_t v;
            std::memcpy(&v, mine + at, 8);
            same = v == ((i << 40) ^ at ^ 0x9e3779b97f4a7c15ull);
          }
          std::lock_guard lock(mu);
          if (!got.is_ok()) {
            if (failed.is_ok()) failed = got.status();
            continue;
          }
          if (!same) wrong = true;
          get_us.push_back(us);
        }
      });
    }
    for (auto& t : threads) t.join();
    const double get_s = seconds_since(t0);
    KVSTASH_RETURN_IF_ERROR(failed.with_context("promoted get"));
    Row get{"promoted_get", size, cold.size(), 0, percentile(get_us, 0.5), percentile(get_us, 0.99)};
    get.gbps = static_cast<double>(cold.size() * size) / 1e9 / get_s;
    get.verified = !wrong;
    get.note =
        fmt::format("{} at once: the node's read into pool pages, then the client's over tcp", o_.sessions);
    rows.push_back(get);
    node->stop();
    ::unlink(o_.path.c_str());
    return rows;
  }

 private:
  const TierStoreBenchOptions& o_;
};

}  // namespace

int run_tier_store(const TierStoreBenchOptions& o) {
  if (o.path.empty()) {
    std::cerr << "tier --store: --path names a file on the tier's file system\n";
    return 2;
  }
  Bench bench(o);
  std::vector<Row> rows;
  for (std::uint64_t size : o.object_sizes) {
    auto r = bench.run(size);
    if (!r.is_ok()) {
      std::cerr << "tier --store: objects of " << units::format_size(size) << ": " << r.status().to_string()
                << "\n";
      ::unlink(o.path.c_str());
      return 1;
    }
    rows.insert(rows.end(), r->begin(), r->end());
  }
  // The reference: fio on a file of the same file system, as large as the largest run's tier.
  const std::uint64_t fio_bytes = std::max<std::uint64_t>(o.pool * o.pools_of_objects, 256ull << 20);
  const std::string fio_path = o.path + ".fio";
  auto [fio_write, why_w] = fio_gbps(fio_path, "write", fio_bytes, o.page, o.depth, 2);
  auto [fio_read, why_r] = fio_gbps(fio_path, "read", fio_bytes, o.page, o.depth, 2);
  ::unlink(fio_path.c_str());
  for (Row& r : rows) {
    if (r.op == "write_down" && fio_write > 0) r.vs_fio = r.gbps / fio_write;
    if (r.op == "promoted_get" && fio_read > 0) r.vs_fio = r.gbps / fio_read;
  }
  rows.push_back({"fio_write", o.page, 0, fio_write, 0, 0, 0, true, why_w});
  rows.push_back({"fio_read", o.page, 0, fio_read, 0, 0, 0, true, why_r});
  if (!o.json) {
    std::printf(
        "NVMe tier under a kvstashd: %s, pool %s in pages of %s, %u pools' worth of objects, gets %u at "
        "once, checksum %s; fio: O_DIRECT io_uring, %s I/Os, depth %u, same file system\n",
        o.path.c_str(), units::format_size(o.pool).c_str(), units::format_size(o.page).c_str(),
        o.pools_of_objects, o.sessions, o.verify_checksum ? "on" : "off", units::format_size(o.page).c_str(),
        o.depth);
    std::printf("%-13s %9s %8s %8s %10s %10s %7s  %s\n", "op", "object", "objects", "GB/s", "p50_us",
                "p99_us", "x fio", "");
  }
  bool all_verified = true;
  for (const Row& r : rows) {
    all_verified = all_verified && r.verified;
    if (o.json) {
      nlohmann::json j{{"op", r.op},
                       {"object_bytes", r.object_bytes},
                       {"objects", r.objects},
                       {"gbps", r.gbps},
                       {"verified", r.verified}};
      if (r.p50_us > 0) j["p50_us"] = r.p50_us, j["p99_us"] = r.p99_us;
      if (r.vs_fio > 0) j["vs_fio"] = r.vs_fio;
      if (!r.note.empty()) j["note"] = r.note;
      std::cout << j.dump() << "\n";
      continue;
    }
    std::printf("%-13s %9s %8llu %8.2f %10.0f %10.0f %7s  %s%s\n", r.op.c_str(),
                units::format_size(r.object_bytes).c_str(), static_cast<unsigned long long>(r.objects),
                r.gbps, r.p50_us, r.p99_us, r.vs_fio > 0 ? fmt::format("{:.2f}x", r.vs_fio).c_str() : "-",
                r.verified ? "" : "WRONG BYTES ", r.note.c_str());
  }
  return all_verified ? 0 : 1;
}

}  // namespace kvstash::bench
