// `kvstash-bench kvcache`: a scattered, layer-wise session against contiguous objects.
#include "kvcache_bench.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <future>
#include <iostream>
#include <numeric>
#include <optional>
#include <random>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "measure.h"
#include "metadata/redis_client.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::bench {
namespace {

constexpr std::uint32_t kChunkTokens = 256;

}  // namespace

Result<HostKvCache> allocate_host_cache(const KvCacheShape& s, std::uint64_t seed) {
  HostKvCache c;
  std::mt19937_64 rng(seed);
  for (std::uint32_t l = 0; l < s.num_layers; ++l) {
    KVSTASH_ASSIGN_OR_RETURN(auto b,
                             Buffer::allocate(2ull * s.num_blocks * s.block_bytes(), {.populate = true}));
    auto* w = reinterpret_cast<std::uint64_t*>(b.data());
    for (std::size_t i = 0; i < b.size() / 8; ++i) w[i] = rng();
    c.ptrs.push_back(b.data());
    c.layers.push_back(std::move(b));
  }
  return c;
}

BenchCell::BenchCell() = default;
BenchCell::BenchCell(BenchCell&&) noexcept = default;
BenchCell::~BenchCell() = default;

Result<BenchCell> start_bench_cell(std::uint64_t capacity) {
  BenchCell cell;
  auto redis = harness::LocalRedis::start({});
  if (!redis.is_ok()) return redis.status().with_context("redis-server");
  cell.redis = std::move(redis).value();
  auto node = harness::LocalNode::start({.redis_url = cell.redis->url(),
                                         .capacity = std::to_string(capacity),
                                         .extra_args = {"--transports", "all"}});
  if (!node.is_ok()) return node.status().with_context("kvstashd");
  cell.node = std::move(node).value();
  return cell;
}

Result<std::unique_ptr<Store>> open_bench_store(const BenchCell& cell, TransportKind kind) {
  StoreOptions so;
  so.redis_url = cell.redis->url();
  so.engine.prefer = kind;
  so.engine.ucx.allow_emulated_rma = true;
  so.timeout = std::chrono::seconds(120);
  return Store::open(so);
}

namespace {

struct Row {
  std::string transport, op;
  std::uint64_t bytes = 0;
  double kvcache_gbps = 0, contiguous_gbps = 0;
  RedisCost per_chunk;  // what Redis spent per chunk moved
};

void print(const Row& r, bool json) {
  const double ratio = r.contiguous_gbps > 0 ? r.kvcache_gbps / r.contiguous_gbps : 0;
  if (json) {
    nlohmann::json j{{"transport", r.transport},
                     {"op", r.op},
                     {"bytes", r.bytes},
                     {"gbps", r.kvcache_gbps},
                     {"contiguous_gbps", r.contiguous_gbps},
                     {"vs_contiguous", ratio},
                     {"redis_command_us_per_chunk", r.per_chunk.commands_us},
                     {"redis_cpu_us_per_chunk", r.per_chunk.cpu_us},
                     {"verified", true}};
    std::cout << j.dump() << "\n";
    return;
  }
  std::printf("%-9s %-5s %10s %12.2f %14.2f %8.2fx %10.1f %10.1f\n", r.transport.c_str(), r.op.c_str(),
              units::format_size(r.bytes).c_str(), r.kvcache_gbps, r.contiguous_gbps, ratio,
              r.per_chunk.commands_us, r.per_chunk.cpu_us);
}

}  // namespace

struct RedisMeter::Impl {
  std::unique_ptr<metadata::RedisClient> redis;
};

RedisMeter::RedisMeter(const std::string& url) : impl_(std::make_unique<Impl>()) {
  metadata::RedisOptions ro;
  ro.url = url;
  if (auto c = metadata::RedisClient::connect(ro); c.is_ok()) impl_->redis = std::move(c).value();
  last_ = read();
}

RedisMeter::~RedisMeter() = default;

RedisCost RedisMeter::read() {
  RedisCost c;
  if (!impl_->redis) return c;
  auto field = [](std::string_view text, std::string_view name,
                  std::size_t from = 0) -> std::optional<double> {
    const auto at = text.find(name, from);
    if (at == std::string_view::npos) return std::nullopt;
    return std::strtod(std::string(text.substr(at + name.size(), 32)).c_str(), nullptr);
  };
  if (auto r = impl_->redis->command({"INFO", "commandstats"}); r.is_ok()) {
    // Scripts only: a script's own commands are counted in its time and again under their
    // names, and every kvstash metadata change is a script.
    const std::string_view text = r->str();
    for (std::string_view name : {"cmdstat_fcall:", "cmdstat_evalsha:", "cmdstat_eval:"}) {
      const auto at = text.find(name);
      if (at != std::string_view::npos) c.commands_us += field(text, "usec=", at).value_or(0);
    }
  }
  if (auto r = impl_->redis->command({"INFO", "cpu"}); r.is_ok()) {
    c.cpu_us =
        1e6 * (field(r->str(), "used_cpu_user:").value_or(0) + field(r->str(), "used_cpu_sys:").value_or(0));
  }
  return c;
}

void RedisMeter::add_since_last(RedisCost* cost) {
  const RedisCost now = read();
  if (cost != nullptr) {
    cost->commands_us += now.commands_us - last_.commands_us;
    cost->cpu_us += now.cpu_us - last_.cpu_us;
  }
  last_ = now;
}

int time_save_and_load(KvCache& src, KvCache& dst, const BenchSession& s, double* save_s, double* load_s,
                       RedisMeter* meter, RedisCost* save_cost, RedisCost* load_cost) {
  int rc = 0;
  if (meter != nullptr) meter->add_since_last(nullptr);
  auto t0 = Clock::now();
  for (const Status& st : src.save(s.tokens, s.blocks_src, 0, s.chunks)) {
    if (!st.is_ok()) std::cerr << "save: " << st.to_string() << "\n", rc = 1;
  }
  *save_s += seconds_since(t0);
  if (meter != nullptr) meter->add_since_last(save_cost);
  t0 = Clock::now();
  for (const Status& st : dst.load(s.tokens, s.blocks_dst, s.chunks)) {
    if (!st.is_ok()) std::cerr << "load: " << st.to_string() << "\n", rc = 1;
  }
  *load_s += seconds_since(t0);
  if (meter != nullptr) meter->add_since_last(load_cost);
  return rc;
}

Result<BenchSession> plan_session(const KvCacheBenchOptions& o) {
  if (o.tokens == 0 || o.tokens % kChunkTokens != 0 || o.block_size == 0 ||
      kChunkTokens % o.block_size != 0) {
    return Status::invalid_argument("--tokens must be a positive multiple of 256 and --block-size divide it");
  }
  BenchSession s;
  s.shape = {.num_layers = 32,
             .num_blocks = 2 * o.tokens / o.block_size,
             .block_size = o.block_size,
             .num_kv_heads = 32,
             .head_dim = 128,
             .dtype = KvDType::kFloat16};
  s.bytes = std::uint64_t{o.tokens} * s.shape.bytes_per_token();
  s.chunks = o.tokens / kChunkTokens;
  s.tokens.resize(o.tokens);
  std::mt19937 rng(7);
  for (auto& t : s.tokens) t = rng() % 32000;
  auto scattered = [&](std::uint32_t seed) {
    std::vector<std::uint32_t> b(s.shape.num_blocks);
    std::iota(b.begin(), b.end(), 0u);
    std::shuffle(b.begin(), b.end(), std::mt19937(seed));
    b.resize(o.tokens / o.block_size);
    return b;
  };
  s.blocks_src = scattered(8);
  s.blocks_dst = scattered(9);
  return s;
}

int run_kvcache(const KvCacheBenchOptions& o) {
  auto planned = plan_session(o);
  if (!planned.is_ok()) {
    std::cerr << "kvstash-bench kvcache: " << planned.status().message() << "\n";
    return 2;
  }
  const KvCacheShape& shape = planned->shape;
  const std::uint64_t session = planned->bytes;
  const std::size_t chunks = planned->chunks;
  const auto& blocks_src = planned->blocks_src;
  const auto& blocks_dst = planned->blocks_dst;
  const std::size_t used = blocks_src.size();

  // Room for the session twice over: the contiguous objects and the chunks live side by side
  // until overwritten.
  auto cell = start_bench_cell(2 * session + (64ull << 20));
  if (!cell.is_ok()) {
    std::cerr << "kvstash-bench kvcache: " << cell.status().to_string() << "\n";
    return 1;
  }
  auto src = allocate_host_cache(shape, 1), dst = allocate_host_cache(shape, 2);
  auto flat = Buffer::allocate(session, {.populate = true});
  if (!src.is_ok() || !dst.is_ok() || !flat.is_ok()) {
    std::cerr << "kvstash-bench kvcache: cannot allocate the caches (" << units::format_size(5 * session)
              << " in all): use fewer --tokens\n";
    return 1;
  }
  if (!o.json) {
    std::printf(
        "one Llama-2-7B session of %u tokens (%s), %zu chunks of %u tokens, blocks of %u tokens "
        "scattered over a paged cache\n",
        o.tokens, units::format_size(session).c_str(), chunks, kChunkTokens, o.block_size);
    std::printf("%-9s %-5s %10s %12s %14s %9s %10s %10s\n", "transport", "op", "bytes", "kvcache GB/s",
                "contiguous GB/s", "ratio", "redis us", "redis cpu");
  }
  int rc = 0;
  for (TransportKind kind : o.transports) {
    auto store = open_bench_store(*cell, kind);
    if (!store.is_ok()) {
      std::cerr << "kvstash-bench kvcache: " << store.status().to_string() << "\n";
      return 1;
    }
    auto src_layout = KvLayout::per_layer(shape, src->ptrs);
    auto dst_layout = KvLayout::per_layer(shape, dst->ptrs);
    auto kv_src = KvCache::open(**store, std::move(src_layout).value(), {.model = "llama-2-7b"});
    auto kv_dst = KvCache::open(**store, std::move(dst_layout).value(), {.model = "llama-2-7b"});
    auto flat_handle = (*store)->register_memory(flat->region());
    if (!kv_src.is_ok() || !kv_dst.is_ok() || !flat_handle.is_ok()) {
      std::cerr << "kvstash-bench kvcache: registering the caches failed\n";
      return 1;
    }
    Row save{std::string(to_string(kind)), "save", session},
        load{std::string(to_string(kind)), "load", session};
    double save_s = 0, load_s = 0, put_s = 0, get_s = 0;
    RedisMeter meter(cell->redis->url());
    RedisCost save_cost, load_cost;
    for (std::uint32_t round = 0; round < o.rounds; ++round) {
      // Contiguous: the same bytes as chunk-sized objects, all in flight at once.
      const std::uint64_t chunk_bytes = session / chunks;
      auto t0 = Clock::now();
      std::vector<std::future<Status>> puts;
      for (std::size_t c = 0; c < chunks; ++c) {
        puts.push_back((*store)->put_async("flat:" + std::to_string(c),
                                           {{flat->data() + c * chunk_bytes, chunk_bytes, &*flat_handle}}));
      }
      for (auto& f : puts) rc |= f.get().is_ok() ? 0 : 1;
      put_s += seconds_since(t0);
      t0 = Clock::now();
      std::vector<std::future<Result<ObjectInfo>>> gets;
      for (std::size_t c = 0; c < chunks; ++c) {
        gets.push_back((*store)->get_async("flat:" + std::to_string(c),
                                           {{flat->data() + c * chunk_bytes, chunk_bytes, &*flat_handle}}));
      }
      for (auto& f : gets) rc |= f.get().is_ok() ? 0 : 1;
      get_s += seconds_since(t0);

      // KvCache: scattered blocks, layer by layer.
      rc |=
          time_save_and_load(**kv_src, **kv_dst, *planned, &save_s, &load_s, &meter, &save_cost, &load_cost);
    }
    // Every block of every layer, K and V.
    const std::uint64_t bb = shape.block_bytes();
    for (std::size_t i = 0; i < used && rc == 0; ++i) {
      for (std::uint32_t l = 0; l < shape.num_layers; ++l) {
        for (std::uint32_t p = 0; p < 2; ++p) {
          const std::byte* a = src->layers[l].data() + (p * shape.num_blocks + blocks_src[i]) * bb;
          const std::byte* b = dst->layers[l].data() + (p * shape.num_blocks + blocks_dst[i]) * bb;
          if (std::memcmp(a, b, bb) != 0) {
            std::cerr << "kvstash-bench kvcache: block " << i << " layer " << l
                      << " differs after the load\n";
            rc = 1;
          }
        }
      }
    }
    const double bytes = static_cast<double>(session) * o.rounds / 1e9;
    save.kvcache_gbps = bytes / save_s;
    save.contiguous_gbps = bytes / put_s;
    load.kvcache_gbps = bytes / load_s;
    load.contiguous_gbps = bytes / get_s;
    const double moved = static_cast<double>(chunks) * o.rounds;
    save.per_chunk = {save_cost.commands_us / moved, save_cost.cpu_us / moved};
    load.per_chunk = {load_cost.commands_us / moved, load_cost.cpu_us / moved};
    if (rc != 0) return rc;
    print(save, o.json);
    print(load, o.json);
  }
  if (!o.json) {
    std::printf(
        "\nkvcache: KvCache save/load (per-layer streams, a checksum segment per layer, %zu-way chunk "
        "parallelism); "
        "contiguous: the same bytes as %zu objects of %s put/got at once. Every loaded block verified.\n"
        "redis us: Redis's time in kvstash's scripts (INFO commandstats: FCALL, EVALSHA) per chunk saved or "
        "loaded;\n"
        "redis cpu: its process's CPU (INFO cpu, user + system) per chunk, which adds the network, the "
        "event\n"
        "loop and the memory node's heartbeats.\n",
        chunks, chunks, units::format_size(session / chunks).c_str());
  }
  return rc;
}

}  // namespace kvstash::bench
