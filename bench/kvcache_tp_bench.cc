// `kvstash-bench kvcache --save-tp N --load-tp M`: one session saved by the N ranks of a
// tensor-parallel engine and loaded by the M ranks of another, keys by KV heads, against the
// same session saved and loaded at M (same degree) and, at M, with keys by rank (one object
// per rank and chunk, whole blocks: what a reader of another degree cannot find). Every rank
// runs on a thread of its own, as an engine's workers do; every loaded head of every block is
// compared with the head the saving rank held.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <numeric>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvcache_bench.h"
#include "kvstash/store.h"
#include "measure.h"

namespace kvstash::bench {
namespace {

// The ranks of one engine: rank r's per-layer tensors hold heads [r * H / tp, (r + 1) * H / tp).
struct Ranks {
  std::uint32_t tp = 1;
  KvCacheShape shape;  // one rank's
  std::vector<HostKvCache> caches;
};

Result<Ranks> allocate_ranks(const KvCacheShape& whole, std::uint32_t tp, std::uint64_t seed) {
  Ranks r;
  r.tp = tp;
  r.shape = whole;
  r.shape.num_kv_heads = whole.num_kv_heads / tp;
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    KVSTASH_ASSIGN_OR_RETURN(HostKvCache c, allocate_host_cache(r.shape, seed * 64 + rank));
    r.caches.push_back(std::move(c));
  }
  return r;
}

// One KvCache per rank, keys by heads (`per_object` heads an object) or, per_object 0, by rank.
Result<std::vector<std::unique_ptr<KvCache>>> open_ranks(Store& store, const Ranks& r,
                                                         std::uint32_t heads_total,
                                                         std::uint32_t per_object) {
  std::vector<std::unique_ptr<KvCache>> out;
  for (std::uint32_t rank = 0; rank < r.tp; ++rank) {
    PrefixKeyOptions keys{.model = "llama-2-7b"};
    if (per_object == 0) {
      keys.tp_rank = rank;
      keys.tp_size = r.tp;
    } else {
      keys.heads_total = heads_total;
      keys.head_first = rank * r.shape.num_kv_heads;
      keys.head_count = per_object;
    }
    KVSTASH_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::per_layer(r.shape, r.caches[rank].ptrs));
    KVSTASH_ASSIGN_OR_RETURN(auto kv, KvCache::open(store, std::move(layout), std::move(keys)));
    out.push_back(std::move(kv));
  }
  return out;
}

// Runs `op(rank)` on a thread per rank; the seconds until the last returned.
double on_every_rank(std::size_t ranks, const std::function<void(std::size_t)>& op) {
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < ranks; ++r) threads.emplace_back(op, r);
  for (auto& t : threads) t.join();
  return seconds_since(t0);
}

// Whether every head of every block `to` loaded is the head `from` saved (either order).
bool same_session(const Ranks& from, const std::vector<std::uint32_t>& from_blocks, const Ranks& to,
                  const std::vector<std::uint32_t>& to_blocks) {
  const KvCacheShape& s = to.shape;
  const std::size_t hb = std::size_t{s.head_dim} * dtype_bytes(s.dtype);
  const std::uint32_t heads = s.num_kv_heads * to.tp;
  for (std::size_t i = 0; i < to_blocks.size(); ++i) {
    for (std::uint32_t l = 0; l < s.num_layers; ++l) {
      for (std::uint32_t p = 0; p < 2; ++p) {
        for (std::uint32_t t = 0; t < s.block_size; ++t) {
          for (std::uint32_t h = 0; h < heads; ++h) {
            auto at = [&](const Ranks& r, std::uint32_t b) {
              const std::uint32_t rank = h / r.shape.num_kv_heads, local = h % r.shape.num_kv_heads;
              const std::byte* block = r.caches[rank].layers[l].data() +
                                       (std::uint64_t{p} * r.shape.num_blocks + b) * r.shape.block_bytes();
              return block + (r.shape.order == KvBlockOrder::kNHD
                                  ? std::uint64_t{t} * r.shape.num_kv_heads + local
                                  : std::uint64_t{local} * r.shape.block_size + t) *
                                 hb;
            };
            if (std::memcmp(at(from, from_blocks[i]), at(to, to_blocks[i]), hb) != 0) return false;
          }
        }
      }
    }
  }
  return true;
}

struct Phase {
  const char* name;
  std::uint32_t save_tp, load_tp;
  bool by_heads;
  double gbps = 0;
};

}  // namespace

int run_kvcache_tp(const KvCacheBenchOptions& o) {
  auto planned = plan_session(o);
  if (!planned.is_ok()) {
    std::cerr << "kvstash-bench kvcache: " << planned.status().message() << "\n";
    return 2;
  }
  KvCacheShape whole = planned->shape;
  whole.order = o.hnd ? KvBlockOrder::kHND : KvBlockOrder::kNHD;
  const std::uint32_t heads = whole.num_kv_heads;
  for (std::uint32_t tp : {o.save_tp, o.load_tp}) {
    if (tp == 0 || heads % tp != 0) {
      std::cerr << "kvstash-bench kvcache: --save-tp and --load-tp must divide the model's " << heads
                << " KV heads\n";
      return 2;
    }
  }
  // Objects of as many heads as the wider degree's ranks hold: both degrees read them whole.
  const std::uint32_t per_object = heads / std::max(o.save_tp, o.load_tp);
  const std::uint64_t session = planned->bytes;
  auto cell = start_bench_cell(3 * session + (64ull << 20));
  if (!cell.is_ok()) {
    std::cerr << "kvstash-bench kvcache: " << cell.status().to_string() << "\n";
    return 1;
  }
  auto savers = allocate_ranks(whole, o.save_tp, 1), same = allocate_ranks(whole, o.load_tp, 2),
       loaders = allocate_ranks(whole, o.load_tp, 3);
  if (!savers.is_ok() || !same.is_ok() || !loaders.is_ok()) {
    std::cerr << "kvstash-bench kvcache: cannot allocate the caches (" << units::format_size(6 * session)
              << " in all): use fewer --tokens\n";
    return 1;
  }
  if (!o.json) {
    std::printf(
        "one Llama-2-7B session of %u tokens (%s, %u KV heads, %s blocks), saved at TP=%u and loaded at "
        "TP=%u, "
        "keys by heads (%u a object), a thread per rank\n",
        o.tokens, units::format_size(session).c_str(), heads, o.hnd ? "HND" : "NHD", o.save_tp, o.load_tp,
        per_object);
    std::printf("%-9s %-26s %8s %8s %12s %9s\n", "transport", "load", "save tp", "load tp", "GB/s",
                "vs same");
  }
  int rc = 0;
  for (TransportKind kind : o.transports) {
    auto store = open_bench_store(*cell, kind);
    if (!store.is_ok()) {
      std::cerr << "kvstash-bench kvcache: " << store.status().to_string() << "\n";
      return 1;
    }
    std::vector<Phase> phases{{"same degree, keys by heads", o.load_tp, o.load_tp, true},
                              {"across degrees", o.save_tp, o.load_tp, true},
                              {"same degree, keys by rank", o.load_tp, o.load_tp, false}};
    for (std::size_t ph = 0; ph < phases.size() && rc == 0; ++ph) {
      Phase& p = phases[ph];
      const Ranks& from = ph == 1 ? *savers : *same;  // across degrees: the savers
      auto src = open_ranks(**store, from, heads, p.by_heads ? per_object : 0);
      auto dst = open_ranks(**store, *loaders, heads, p.by_heads ? per_object : 0);
      if (!src.is_ok() || !dst.is_ok()) {
        std::cerr << "kvstash-bench kvcache: " << (src.is_ok() ? dst.status() : src.status()).to_string()
                  << "\n";
        return 1;
      }
      // Each phase its own tokens: no phase finds another's objects.
      std::vector<std::uint32_t> tokens = planned->tokens;
      for (auto& t : tokens) t = (t + 7919 * (ph + 1)) % 32000;
      double load_s = 0;
      for (std::uint32_t round = 0; round < o.rounds && rc == 0; ++round) {
        auto check = [&](const std::vector<Status>& all, const char* op) {
          for (const Status& st : all) {
            if (!st.is_ok()) std::cerr << op << ": " << st.to_string() << "\n", rc = 1;
          }
        };
        std::vector<std::vector<Status>> saved(from.tp), loaded(o.load_tp);
        on_every_rank(from.tp, [&](std::size_t r) {
          saved[r] = (*src)[r]->save(tokens, planned->blocks_src, 0, planned->chunks);
        });
        for (const auto& s : saved) check(s, "save");
        load_s += on_every_rank(o.load_tp, [&](std::size_t r) {
          loaded[r] = (*dst)[r]->load(tokens, planned->blocks_dst, planned->chunks);
        });
        for (const auto& l : loaded) check(l, "load");
      }
      if (rc == 0 && !same_session(from, planned->blocks_src, *loaders, planned->blocks_dst)) {
        std::cerr << "kvstash-bench kvcache: " << p.name << ": a loaded head differs from the saved one\n";
        rc = 1;
      }
      p.gbps = static_cast<double>(session) * o.rounds / 1e9 / load_s;
    }
    if (rc != 0) return rc;
    for (const Phase& p : phases) {
      const double ratio = p.gbps / phases[0].gbps;
      if (o.json) {
        std::cout << nlohmann::json{{"transport", std::string(to_string(kind))},
                                    {"op", "load"},
                                    {"phase", p.name},
                                    {"keys", p.by_heads ? "heads" : "rank"},
                                    {"order", o.hnd ? "hnd" : "nhd"},
                                    {"save_tp", p.save_tp},
                                    {"load_tp", p.load_tp},
                                    {"heads_per_object", p.by_heads ? per_object : heads / p.save_tp},
                                    {"bytes", session},
                                    {"gbps", p.gbps},
                                    {"vs_same_degree", ratio},
                                    {"verified", true}}
                         .dump()
                  << "\n";
      } else {
        std::printf("%-9s %-26s %8u %8u %12.2f %8.2fx\n", std::string(to_string(kind)).c_str(), p.name,
                    p.save_tp, p.load_tp, p.gbps, ratio);
      }
    }
  }
  if (!o.json) {
    std::printf(
        "\nGB/s: the session's bytes over the time from the first rank's load to the last one's end (every "
        "rank "
        "a thread).\nvs same: against the same-degree load with keys by heads. Keys by rank: the layout "
        "readers of "
        "another\ndegree cannot find (one object per rank and chunk). Every loaded head of every block "
        "verified.\n");
  }
  return rc;
}

}  // namespace kvstash::bench
