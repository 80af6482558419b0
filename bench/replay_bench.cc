// `kvstash-bench replay` (replay_bench.h): the model's rows, then the trace through a real cell.
#include "replay_bench.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvstash/memory.h"
#include "kvstash/store.h"
#include "measure.h"
#include "metadata/cell.h"
#include "plot.h"
#include "sessions.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::bench {
namespace {

constexpr ReplayPolicy kModelPolicies[] = {ReplayPolicy::kLru, ReplayPolicy::kS3Fifo, ReplayPolicy::kArc,
                                           ReplayPolicy::kTurnTtl, ReplayPolicy::kBelady};
// The bytes of a trace block: its id seeds them, so a get that returns another block fails.
constexpr std::uint64_t kPatternTag = 0x7265706c6179;  // "replay"

std::string block_key(std::uint64_t block) { return fmt::format("replay/{:x}", block); }

// What one capacity's replay through the cell measured.
struct CellRun {
  ModelResult counts;
  std::uint64_t bytes_loaded = 0, bytes_saved = 0;
  std::uint64_t cell_evictions = 0;
  std::uint64_t failed_loads = 0, failed_saves = 0;
  // Blocks the lookup found that were gone when loaded (a tier that evicted them meanwhile):
  // the hit ends there, as a connector recomputes from it. Not a failure.
  std::uint64_t gone_since_lookup = 0;
  std::string first_failure;                        // the first failed load's or save's error
  std::vector<double> lookup_us, load_us, save_us;  // per request (loads and saves: those with any)
  double load_seconds = 0;
  // The TTFT estimate's load bandwidth: one object as large as a real block (or the pool) put and
  // read back before the replay.
  double calibration_bps = 0;
  std::uint64_t calibration_bytes = 0;
  double wall_seconds = 0;
  double max_lag_seconds = 0;  // how far behind the trace's clock (with --speed)
  std::vector<double> ttft_s, ttft_none_s;
  // Over an NVMe tier: blocks moved down, promoted back, and evicted from the full tier.
  std::uint64_t written_down = 0, promoted = 0, tier_evicted = 0;
};

// A file that is removed when this goes (the cell's NVMe tier).
struct RemovedFile {
  std::string path;
  RemovedFile() = default;
  RemovedFile(RemovedFile&& o) noexcept : path(std::exchange(o.path, {})) {}
  RemovedFile& operator=(RemovedFile&&) = delete;
  ~RemovedFile() {
    std::error_code ignored;
    if (!path.empty()) std::filesystem::remove(path, ignored);
  }
};

// One private cell of `capacity` blocks (over an NVMe tier of `tier` blocks: kvstashd --ssd):
// its Redis, its node, a store.
struct PrivateCell {
  RemovedFile tier_file;  // destroyed last: after the node that uses it
  std::unique_ptr<harness::LocalRedis> redis;
  std::unique_ptr<harness::LocalNode> node;
  std::unique_ptr<metadata::Cell> cell;
  std::unique_ptr<Store> store;
};

Result<PrivateCell> start_cell(std::uint64_t capacity, std::uint64_t tier, const ReplayBenchOptions& o) {
  PrivateCell c;
  KVSTASH_ASSIGN_OR_RETURN(c.redis, harness::LocalRedis::start({}));
  std::vector<std::string> args{"--transports", "all"};
  if (tier > 0) {
    // Write-down keeps 1% of the pool free (the model's pool holds it all), at least 4 pages.
    c.tier_file.path = (std::filesystem::path(o.tier_dir) /
                        fmt::format("kvstash-replay-tier-{}-{}-{}", ::getpid(), capacity, tier))
                           .string();
    const double low_water = 100.0 * static_cast<double>(std::max<std::uint64_t>(4, capacity / 100)) /
                             static_cast<double>(capacity);
    // The tier's bytes: a 4 KiB header place per slot and one before them (docs/nvme-tier.md).
    const std::uint64_t tier_bytes = 4096 + tier * (4096 + o.block_bytes);
    args.insert(args.end(), {"--ssd", c.tier_file.path, "--ssd-capacity", std::to_string(tier_bytes),
                             "--ssd-low-water", fmt::format("{:.3f}%", low_water)});
  }
  KVSTASH_ASSIGN_OR_RETURN(c.node,
                           harness::LocalNode::start({.redis_url = c.redis->url(),
                                                      .capacity = std::to_string(capacity * o.block_bytes),
                                                      .page_size = std::to_string(o.block_bytes),
                                                      .node_id = "replay",
                                                      .extra_args = args}));
  if (c.node->pages() != capacity) {
    return Status::internal(fmt::format("the node holds {} pages, not {}", c.node->pages(), capacity));
  }
  metadata::CellOptions co;
  co.redis.url = c.redis->url();
  KVSTASH_ASSIGN_OR_RETURN(c.cell, metadata::Cell::open(co));
  if (tier > 0) {
    // The node announces its tier to the cell just after it is ready.
    KVSTASH_ASSIGN_OR_RETURN(auto summary, c.cell->admin().summary());
    for (int i = 0; i < 100 && summary.tier_slots == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      KVSTASH_ASSIGN_OR_RETURN(summary, c.cell->admin().summary());
    }
    if (summary.tier_slots != tier) {
      return Status::internal(
          fmt::format("the node's tier holds {} slots, not {}", summary.tier_slots, tier));
    }
  }
  StoreOptions so;
  so.redis_url = c.redis->url();
  so.engine.prefer = o.transport;
  KVSTASH_ASSIGN_OR_RETURN(c.store, Store::open(so));
  return c;
}

// The cell's load bandwidth for the TTFT estimate, before the replay, while the pool is empty:
// an object of a real block's KV (or of the whole pool, if smaller) put, read three times (the
// best read counts) and removed. Returns bytes per second and the object's size.
Result<std::pair<double, std::uint64_t>> calibrate_load(Store& store, std::uint64_t pool_bytes,
                                                        const ReplayBenchOptions& o) {
  const std::uint64_t size =
      std::min<std::uint64_t>(pool_bytes, std::uint64_t{o.block_tokens} * o.kv_bytes_per_token);
  KVSTASH_ASSIGN_OR_RETURN(Buffer buffer, Buffer::allocate(size));
  KVSTASH_ASSIGN_OR_RETURN(auto handle, store.register_memory(buffer.region()));
  fill_pattern(buffer.data(), size, kPatternTag, 1, 0);
  Slice s{buffer.data(), size, &handle};
  const std::string key = "replay-calibration";
  KVSTASH_RETURN_IF_ERROR(store.put(key, {&s, 1}));
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    KVSTASH_RETURN_IF_ERROR(store.get(key, {&s, 1}).status());
    best = std::max(best, static_cast<double>(size) / seconds_since(t0));
  }
  KVSTASH_RETURN_IF_ERROR(store.remove(key));
  return std::pair{best, size};
}

// The trace through a fresh cell of `capacity` blocks (over a tier of `tier`), as a connector
// runs it: per request, one prefix lookup, the found blocks loaded (each checked byte for byte;
// one on the tier promoted first), the rest saved.
Result<CellRun> replay_cell(const std::vector<TraceRequest>& trace, std::uint64_t capacity,
                            ReplayPolicy policy, const ReplayBenchOptions& o, Progress& progress,
                            std::uint64_t tier = 0) {
  KVSTASH_ASSIGN_OR_RETURN(PrivateCell c, start_cell(capacity, tier, o));
  std::size_t most = 1;
  for (const auto& r : trace) most = std::max(most, r.blocks.size());
  KVSTASH_ASSIGN_OR_RETURN(Buffer source, Buffer::allocate(most * o.block_bytes));
  KVSTASH_ASSIGN_OR_RETURN(Buffer into, Buffer::allocate(most * o.block_bytes));
  KVSTASH_ASSIGN_OR_RETURN(auto source_handle, c.store->register_memory(source.region()));
  KVSTASH_ASSIGN_OR_RETURN(auto into_handle, c.store->register_memory(into.region()));
  CellRun run;
  KVSTASH_ASSIGN_OR_RETURN(auto calibration, calibrate_load(*c.store, capacity * o.block_bytes, o));
  std::tie(run.calibration_bps, run.calibration_bytes) = calibration;
  KVSTASH_ASSIGN_OR_RETURN(auto before, c.cell->admin().summary());
  // The policy from the trace's start on: turn-ttl's times are the trace's, its clock running as
  // fast as the replay.
  const double clock_rate = policy == ReplayPolicy::kTurnTtl && o.speed > 0 ? o.speed : 1;
  KVSTASH_RETURN_IF_ERROR(c.cell->admin().set_policy(policy_name(policy), clock_rate).status());

  std::vector<std::byte> expected(o.block_bytes);
  std::vector<std::string> keys;
  const std::vector<double> times = replay::request_times(trace);
  const auto start = Clock::now();
  auto shown = start;
  for (std::size_t i = 0; i < trace.size() && !interrupted(); ++i) {
    const TraceRequest& r = trace[i];
    if (o.speed > 0) {
      const auto due = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                   static_cast<double>(r.at_ms) / 1000 / o.speed));
      if (Clock::now() < due) std::this_thread::sleep_until(due);
      run.max_lag_seconds =
          std::max(run.max_lag_seconds, std::chrono::duration<double>(Clock::now() - due).count());
    }
    const std::size_t kept = replay::blocks_kept(r, o.block_tokens, o.saves);
    keys.clear();
    for (std::size_t b = 0; b < kept; ++b) keys.push_back(block_key(r.blocks[b]));
    run.counts.prompt_tokens += r.input_tokens;
    run.counts.block_uses += r.blocks.size();

    auto t0 = Clock::now();
    std::size_t hit = 0;
    std::vector<KeepHint> hints;  // turn-ttl's, per block
    if (policy == ReplayPolicy::kTurnTtl) {
      KVSTASH_ASSIGN_OR_RETURN(PrefixLookup found, c.store->lookup_prefix(keys));
      hit = found.hit;
      const std::uint64_t split = kept == 0 ? 0 : r.blocks[std::min(hit, kept - 1)];
      for (std::size_t b = 0; b < kept; ++b) {
        hints.push_back(
            {.turn = found.turn,
             .chunks = static_cast<std::uint32_t>(kept),
             .index = static_cast<std::uint32_t>(b),
             .tokens = static_cast<std::uint32_t>(replay::prefix_tokens(r, b + 1, o.block_tokens) -
                                                  replay::prefix_tokens(r, b, o.block_tokens)),
             .key_hash = r.blocks[b],
             .split_hash = split,
             // The trace's time (the model's), as the cell's clock would have it
             // had the replay kept pace: the cell's figures are not the lag's.
             .looked_up = std::max(times[i], 1e-9)});
      }
    } else {
      KVSTASH_ASSIGN_OR_RETURN(hit, c.store->contains_prefix(keys));
    }
    const double lookup_us = us_since(t0);
    run.lookup_us.push_back(lookup_us);

    // Loads: the found blocks, under one batch of read leases. A block gone since the lookup
    // ends the hit there (the connector recomputes from it).
    std::size_t loaded = 0;
    if (hit > 0) {
      t0 = Clock::now();
      KVSTASH_ASSIGN_OR_RETURN(ReadLeases leases,
                               c.store->lease_reads(std::span(keys).first(hit), {},
                                                    std::span(hints).first(hints.empty() ? 0 : hit)));
      for (; loaded < hit; ++loaded) {
        std::byte* at = into.data() + loaded * o.block_bytes;
        Slice s{at, o.block_bytes, &into_handle};
        GetOptions go;
        go.leases = &leases;
        auto got = c.store->get(keys[loaded], {&s, 1}, go);
        if (!got.is_ok()) {
          if (got.status().code() == StatusCode::kNotFound) {
            ++run.gone_since_lookup;
          } else {
            ++run.failed_loads;
            if (run.first_failure.empty()) run.first_failure = got.status().to_string();
          }
          break;
        }
        fill_pattern(expected.data(), expected.size(), kPatternTag, 0, r.blocks[loaded]);
        if (std::memcmp(at, expected.data(), o.block_bytes) != 0) {
          return Status::corrupt(
              fmt::format("block {} of request {} ({}) came back with other bytes (at byte {})", loaded, i,
                          keys[loaded], first_difference(at, expected.data(), o.block_bytes)));
        }
      }
      const double us = us_since(t0);
      run.load_us.push_back(us);
      run.load_seconds += us / 1e6;
      run.bytes_loaded += loaded * o.block_bytes;
    }
    run.counts.hit_blocks += loaded;
    const std::uint64_t hit_tokens = replay::prefix_tokens(r, loaded, o.block_tokens);
    run.counts.hit_tokens += hit_tokens;

    // Saves: every block from the hit on, one put each (a held one is replaced).
    if (loaded < kept) {
      t0 = Clock::now();
      for (std::size_t b = loaded; b < kept; ++b) {
        std::byte* at = source.data() + b * o.block_bytes;
        fill_pattern(at, o.block_bytes, kPatternTag, 0, r.blocks[b]);
        Slice s{at, o.block_bytes, &source_handle};
        PutOptions po;
        if (!hints.empty()) po.keep = hints[b];
        if (Status st = c.store->put(keys[b], {&s, 1}, po); st.is_ok()) {
          ++run.counts.blocks_saved;
          run.bytes_saved += o.block_bytes;
        } else {
          ++run.failed_saves;
          if (run.first_failure.empty()) run.first_failure = st.to_string();
        }
      }
      run.save_us.push_back(us_since(t0));
    }

    // TTFT: the lookup, the hit tokens' KV at the measured load bandwidth, the rest computed.
    const double kv_bytes = static_cast<double>(hit_tokens) * static_cast<double>(o.kv_bytes_per_token);
    run.ttft_s.push_back(lookup_us / 1e6 + kv_bytes / run.calibration_bps +
                         static_cast<double>(r.input_tokens - hit_tokens) / o.prefill_tokens_per_s);
    run.ttft_none_s.push_back(static_cast<double>(r.input_tokens) / o.prefill_tokens_per_s);

    if (Clock::now() - shown > std::chrono::milliseconds(200) || i + 1 == trace.size()) {
      shown = Clock::now();
      const double done = static_cast<double>(i + 1) / static_cast<double>(trace.size());
      const int bar = static_cast<int>(done * 30);
      const double elapsed = seconds_since(start);
      progress.show(
          fmt::format("cell of {} blocks [{}{}] {:5.1f}%  {}/{} requests  token hit {:.3f}  {:.0f} s left",
                      capacity, std::string(bar, '#'), std::string(30 - bar, '.'), 100 * done, i + 1,
                      trace.size(), run.counts.hit_rate(), elapsed / done - elapsed));
    }
  }
  progress.clear();
  run.wall_seconds = seconds_since(start);
  if (interrupted()) return Status::cancelled("interrupted");
  KVSTASH_ASSIGN_OR_RETURN(auto after, c.cell->admin().summary());
  run.cell_evictions = after.evicted - before.evicted;
  run.counts.evictions = run.cell_evictions;
  run.written_down = after.written_down - before.written_down;
  run.promoted = after.promoted - before.promoted;
  run.tier_evicted = after.tier_evicted - before.tier_evicted;
  return run;
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

void print_row(std::uint64_t capacity, const std::string& name, const ModelResult& r, const ModelResult& lru,
               const ModelResult& belady) {
  const double x_lru = lru.hit_rate() > 0 ? r.hit_rate() / lru.hit_rate() : 0.0;
  const double of_belady = belady.hit_rate() > 0 ? r.hit_rate() / belady.hit_rate() : 0.0;
  std::cout << fmt::format("{:<10} {:<10} {:>10.4f} {:>10.4f} {:>8.2f}x {:>8.2f}x {:>10} {:>10}\n", capacity,
                           name, r.hit_rate(), r.block_hit_rate(), x_lru, of_belady, r.blocks_saved,
                           r.evictions);
}

nlohmann::json row_json(std::uint64_t capacity, const std::string& name, const ModelResult& r,
                        const ModelResult& lru, const ModelResult& belady) {
  return {{"capacity_blocks", capacity},
          {"policy", name},
          {"token_hit_rate", r.hit_rate()},
          {"block_hit_rate", r.block_hit_rate()},
          {"hit_tokens", r.hit_tokens},
          {"hit_blocks", r.hit_blocks},
          {"x_lru", lru.hit_rate() > 0 ? r.hit_rate() / lru.hit_rate() : 0.0},
          {"of_belady", belady.hit_rate() > 0 ? r.hit_rate() / belady.hit_rate() : 0.0},
          {"blocks_saved", r.blocks_saved},
          {"evictions", r.evictions}};
}

void print_cell(const CellRun& run, ReplayPolicy policy, const ModelResult& model,
                const ReplayBenchOptions& o) {
  const double gap = model.hit_rate() > 0 ? run.counts.hit_rate() / model.hit_rate() - 1 : 0.0;
  std::cout << fmt::format(
      "           the cell against the model's {}: {:+.2f}% (relative); {:.1f} s, {:.0f} requests/s{}\n",
      policy_name(policy), 100 * gap, run.wall_seconds,
      static_cast<double>(run.lookup_us.size()) / std::max(1e-9, run.wall_seconds),
      o.speed > 0 ? fmt::format(", at most {:.2f} s behind the trace's clock", run.max_lag_seconds) : "");
  std::cout << fmt::format(
      "           lookup p50 {:.0f} us p99 {:.0f} us; load (a request's blocks) p50 {:.0f} us p99 {:.0f} us, "
      "{}/s; save p50 {:.0f} us p99 {:.0f} us\n",
      percentile(run.lookup_us, 0.5), percentile(run.lookup_us, 0.99), percentile(run.load_us, 0.5),
      percentile(run.load_us, 0.99),
      units::format_size(static_cast<std::uint64_t>(static_cast<double>(run.bytes_loaded) /
                                                    std::max(1e-9, run.load_seconds))),
      percentile(run.save_us, 0.5), percentile(run.save_us, 0.99));
  std::cout << fmt::format(
      "           loaded {}, saved {}; {} loads and {} saves failed{}\n"
      "           TTFT estimate mean {:.3f} s p99 {:.3f} s, against {:.3f} s and {:.3f} s without the cache "
      "({:.3f}x faster on the mean; loads at {}/s, a {} object's best read)\n",
      units::format_size(run.bytes_loaded), units::format_size(run.bytes_saved), run.failed_loads,
      run.failed_saves, run.first_failure.empty() ? "" : " (the first: " + run.first_failure + ")",
      mean(run.ttft_s), percentile(run.ttft_s, 0.99), mean(run.ttft_none_s),
      percentile(run.ttft_none_s, 0.99), mean(run.ttft_none_s) / std::max(1e-9, mean(run.ttft_s)),
      units::format_size(static_cast<std::uint64_t>(run.calibration_bps)),
      units::format_size(run.calibration_bytes));
}

nlohmann::json cell_json(std::uint64_t capacity, const CellRun& run, ReplayPolicy policy,
                         const ModelResult& model, const ModelResult& lru, const ModelResult& belady) {
  nlohmann::json j = row_json(capacity, std::string("cell-") + policy_name(policy), run.counts, lru, belady);
  j["vs_model"] = model.hit_rate() > 0 ? run.counts.hit_rate() / model.hit_rate() - 1 : 0.0;
  j["seconds"] = run.wall_seconds;
  j["lookup_us"] = {{"p50", percentile(run.lookup_us, 0.5)}, {"p99", percentile(run.lookup_us, 0.99)}};
  j["load_us"] = {{"p50", percentile(run.load_us, 0.5)}, {"p99", percentile(run.load_us, 0.99)}};
  j["save_us"] = {{"p50", percentile(run.save_us, 0.5)}, {"p99", percentile(run.save_us, 0.99)}};
  j["bytes_loaded"] = run.bytes_loaded;
  j["bytes_saved"] = run.bytes_saved;
  j["failed_loads"] = run.failed_loads;
  j["gone_since_lookup"] = run.gone_since_lookup;
  if (!run.first_failure.empty()) j["first_failure"] = run.first_failure;
  j["failed_saves"] = run.failed_saves;
  j["max_lag_s"] = run.max_lag_seconds;
  j["ttft_s"] = {{"mean", mean(run.ttft_s)}, {"p99", percentile(run.ttft_s, 0.99)}};
  j["ttft_no_cache_s"] = {{"mean", mean(run.ttft_none_s)}, {"p99", percentile(run.ttft_none_s, 0.99)}};
  j["load_bytes_per_s"] = run.calibration_bps;
  j["calibration_bytes"] = run.calibration_bytes;
  return j;
}

// The pool over an NVMe tier (the model, LRU in both): a row per pool and tier capacity, and
// unless --model-only a cell's (kvstashd --ssd) below each. Returns 1 when a cell failed.
int print_tiers(const std::vector<TraceRequest>& trace, const ReplayBenchOptions& o, Progress& progress) {
  if (!o.json) {
    std::cout << fmt::format(
        "\na pool over an NVMe tier (the model: LRU in both, a block the pool gives up moves down, a hit on "
        "the "
        "tier is promoted)\n{:<10} {:<10} {:>10} {:>12} {:>12} {:>12} {:>14}\n",
        "pool", "tier", "token hit", "x pool alone", "promoted", "written down", "tier evictions");
  }
  for (std::uint64_t pool : o.capacities) {
    const double alone = replay_tiers(trace, pool, 0, o.block_tokens).total.hit_rate();
    for (std::uint64_t tier : o.tier_capacities) {
      const TierResult t = replay_tiers(trace, pool, tier, o.block_tokens);
      const double x = alone > 0 ? t.total.hit_rate() / alone : 0.0;
      if (o.json) {
        std::cout << nlohmann::json{{"capacity_blocks", pool},
                                    {"tier_blocks", tier},
                                    {"policy", "lru+tier"},
                                    {"token_hit_rate", t.total.hit_rate()},
                                    {"x_pool_alone", x},
                                    {"tier_hit_blocks", t.tier_hit_blocks},
                                    {"written_down", t.written_down},
                                    {"tier_evictions", t.tier_evictions}}
                         .dump()
                  << "\n";
      } else {
        std::cout << fmt::format("{:<10} {:<10} {:>10.4f} {:>11.2f}x {:>12} {:>12} {:>14}\n", pool, tier,
                                 t.total.hit_rate(), x, t.tier_hit_blocks, t.written_down, t.tier_evictions);
      }
      if (o.model_only || tier == 0) continue;
      auto run = replay_cell(trace, pool, ReplayPolicy::kLru, o, progress, tier);
      if (!run.is_ok()) {
        std::cerr << fmt::format("kvstash-bench replay: the cell of {} blocks over a tier of {}: {}\n", pool,
                                 tier, run.status().to_string());
        return 1;
      }
      const double cell_x = alone > 0 ? run->counts.hit_rate() / alone : 0.0;
      const double vs = t.total.hit_rate() > 0 ? run->counts.hit_rate() / t.total.hit_rate() - 1 : 0.0;
      if (o.json) {
        std::cout << nlohmann::json{{"capacity_blocks", pool},
                                    {"tier_blocks", tier},
                                    {"policy", "cell-lru+tier"},
                                    {"token_hit_rate", run->counts.hit_rate()},
                                    {"x_pool_alone", cell_x},
                                    {"vs_model", vs},
                                    {"tier_hit_blocks", run->promoted},
                                    {"written_down", run->written_down},
                                    {"tier_evictions", run->tier_evicted},
                                    {"evictions", run->cell_evictions},
                                    {"failed_loads", run->failed_loads},
                                    {"gone_since_lookup", run->gone_since_lookup},
                                    {"first_failure", run->first_failure},
                                    {"failed_saves", run->failed_saves},
                                    {"load_us",
                                     {{"p50", percentile(run->load_us, 0.5)},
                                      {"p99", percentile(run->load_us, 0.99)}}},
                                    {"seconds", run->wall_seconds}}
                         .dump()
                  << std::endl;
      } else {
        std::cout
            << fmt::format(
                   "{:<10} {:<10} {:>10.4f} {:>11.2f}x {:>12} {:>12} {:>14}  (cell: {:+.2f}% against "
                   "the model; {} evicted from the pool; {} found by the lookup gone from the tier by the "
                   "load; loads p50 {:.0f} us p99 {:.0f} us; {} loads and {} saves failed{}; {:.1f} s)\n",
                   "  cell", "", run->counts.hit_rate(), cell_x, run->promoted, run->written_down,
                   run->tier_evicted, 100 * vs, run->cell_evictions, run->gone_since_lookup,
                   percentile(run->load_us, 0.5), percentile(run->load_us, 0.99), run->failed_loads,
                   run->failed_saves,
                   run->first_failure.empty() ? "" : " (the first: " + run->first_failure + ")",
                   run->wall_seconds)
            << std::flush;
      }
      if (run->failed_loads + run->failed_saves > 0) return 1;
    }
  }
  return 0;
}

}  // namespace

int run_replay(const ReplayBenchOptions& o) {
  auto trace = read_trace(o.trace, o.requests);
  if (!trace.is_ok()) {
    std::cerr << "kvstash-bench replay: " << trace.status().to_string() << "\n";
    return 2;
  }
  InterruptHandler on_interrupt;
  Progress progress(!o.json && ::isatty(STDERR_FILENO) == 1);
  if (!o.json) {
    std::cout << fmt::format(
        "{} requests of {}, blocks of {} tokens ({}); the in-process model of each policy{}\n\n",
        trace->size(), o.trace, o.block_tokens,
        o.saves == ReplaySaves::kConnector ? "whole blocks saved, as the connectors do" : "every block saved",
        o.model_only ? ""
                     : fmt::format(", then a cell per policy (kvstashd over {}, blocks of {})",
                                   to_string(o.transport), units::format_size(o.block_bytes)));
    std::cout << fmt::format("{:<10} {:<10} {:>10} {:>10} {:>9} {:>9} {:>10} {:>10}\n", "capacity", "policy",
                             "token hit", "block hit", "x LRU", "of Belady", "saved", "evictions");
  }
  std::vector<PlotSeries> series;
  for (ReplayPolicy p : kModelPolicies) {
    series.push_back(
        {.title = std::string(policy_name(p)) + " (model)", .group = policy_name(p), .dashed = true});
  }
  for (ReplayPolicy p : o.cell_policies) {
    series.push_back({.title = std::string(policy_name(p)) + " (cell)", .group = policy_name(p)});
  }
  int exit_code = 0;
  for (std::uint64_t capacity : o.capacities) {
    std::vector<std::pair<ReplayPolicy, ModelResult>> rows;
    for (ReplayPolicy p : kModelPolicies) {
      rows.emplace_back(p, replay_model(*trace, capacity, p, o.block_tokens, o.saves));
    }
    const ModelResult& lru = rows.front().second;
    const ModelResult& belady = rows.back().second;
    for (std::size_t k = 0; k < rows.size(); ++k) {
      series[k].points.emplace_back(static_cast<double>(capacity), rows[k].second.hit_rate());
      if (o.json) {
        std::cout << row_json(capacity, policy_name(rows[k].first), rows[k].second, lru, belady).dump()
                  << "\n";
      } else {
        print_row(capacity, policy_name(rows[k].first), rows[k].second, lru, belady);
      }
    }
    if (o.model_only) continue;
    for (std::size_t k = 0; k < o.cell_policies.size(); ++k) {
      const ReplayPolicy policy = o.cell_policies[k];
      const ModelResult model = replay_model(*trace, capacity, policy, o.block_tokens, o.saves);
      auto run = replay_cell(*trace, capacity, policy, o, progress);
      if (!run.is_ok()) {
        std::cerr << fmt::format("kvstash-bench replay: the {} cell of {} blocks: {}\n", policy_name(policy),
                                 capacity, run.status().to_string());
        return 1;
      }
      series[std::size(kModelPolicies) + k].points.emplace_back(static_cast<double>(capacity),
                                                                run->counts.hit_rate());
      if (run->failed_loads + run->failed_saves > 0) exit_code = 1;
      if (o.json) {
        std::cout << cell_json(capacity, *run, policy, model, lru, belady).dump() << std::endl;
      } else {
        print_row(capacity, std::string("cell-") + policy_name(policy), run->counts, lru, belady);
        print_cell(*run, policy, model, o);
        std::cout << std::flush;
      }
    }
  }
  if (!o.tier_capacities.empty() && print_tiers(*trace, o, progress) != 0) exit_code = 1;
  if (!o.json) {
    std::cout << fmt::format(
        "\ntoken hit: prompt tokens found as a prefix over all prompt tokens; block hit: the same in whole\n"
        "blocks (the trace's README figures count every block); x LRU, of Belady: token hit rate over "
        "theirs.\n"
        "Belady's rule is offline (it knows the future): the bound no online policy reaches.{}\n",
        o.model_only
            ? ""
            : fmt::format("\nTTFT estimate: the lookup, a hit token's {} of KV at the load bandwidth "
                          "measured in the cell\n(one object of a real block's KV, or of the pool if "
                          "smaller), the other tokens computed at {:.0f} tokens/s.",
                          units::format_size(o.kv_bytes_per_token), o.prefill_tokens_per_s));
  }
  if (!o.plot.empty()) {
    if (Status s = plot_xy(o.plot, plot_title("kvstash-bench replay: token hit rate"), "capacity (blocks)",
                           "token hit rate", series);
        !s.is_ok()) {
      std::cerr << "kvstash-bench replay: --plot: " << s.to_string() << "\n";
      return 1;
    }
  }
  return exit_code;
}

}  // namespace kvstash::bench
