// `kvstash-bench serve`: a simulated engine's request stream over kvstash (serve_bench.h).
#include "serve_bench.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvstash/kvcache.h"
#include "kvstash/store.h"
#include "measure.h"
#include "metadata/redis_client.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;

// Llama-3-8B's KV geometry (GQA: 8 KV heads): 128 KiB per token, as vLLM lays it out.
KvCacheShape model_shape(std::uint32_t num_blocks) {
  return {.num_layers = 32,
          .num_blocks = num_blocks,
          .block_size = 16,
          .num_kv_heads = 8,
          .head_dim = 128,
          .dtype = KvDType::kFloat16};
}

struct Session {
  std::uint32_t prompt = 0;           // which system prompt it started from
  std::vector<std::uint32_t> tokens;  // every token whose KV it has had
  std::vector<std::uint32_t> blocks;  // its blocks while resident; empty once offloaded
  std::size_t saved_chunks = 0;       // leading chunks known to be in the cell
  std::uint64_t last_used = 0;
  bool busy = false;  // in the turn being served: never offloaded
};

struct Tally {
  std::uint64_t turns = 0, resident_turns = 0;
  std::uint64_t prefix_tokens = 0;  // prompt tokens before the turn's own message, in turns not resident
  std::uint64_t loaded_tokens = 0, computed_tokens = 0;
  std::uint64_t saved_chunks = 0, loaded_chunks = 0, offloads = 0;
  std::uint64_t saved_bytes = 0, loaded_bytes = 0;
  double save_s = 0, load_s = 0, lookup_s = 0;
  std::uint64_t lookups = 0;
};

// The engine: a paged cache in host memory (vLLM's per-layer tensors), a block allocator, and
// the sessions it serves.
class Engine {
 public:
  Engine(const ServeBenchOptions& o, KvCacheShape shape) : o_(o), shape_(shape) {}

  Status open(Store& store) {
    const std::uint64_t per_layer = shape_.parts() * std::uint64_t{shape_.num_blocks} * shape_.block_bytes();
    std::vector<void*> ptrs;
    for (std::uint32_t l = 0; l < shape_.num_layers; ++l) {
      KVSTASH_ASSIGN_OR_RETURN(Buffer b, Buffer::allocate(per_layer, {.populate = true}));
      ptrs.push_back(b.data());
      layers_.push_back(std::move(b));
    }
    KVSTASH_ASSIGN_OR_RETURN(KvLayout layout, KvLayout::per_layer(shape_, ptrs));
    KVSTASH_ASSIGN_OR_RETURN(kv_, KvCache::open(store, std::move(layout),
                                                {.model = "bench-serve", .chunk_tokens = o_.chunk_tokens}));
    free_.resize(shape_.num_blocks);
    for (std::uint32_t b = 0; b < shape_.num_blocks; ++b) free_[b] = shape_.num_blocks - 1 - b;
    return {};
  }

  // One turn of session `s`: its message (whose first `shared` tokens other sessions may have
  // sent: a system prompt), the KV its prompt needs (held, loaded or computed), the answer, and
  // the saves of the chunks that became full.
  Status turn(std::vector<Session>& all, std::size_t s, const std::vector<std::uint32_t>& message,
              std::size_t shared, const std::vector<std::uint32_t>& answer) {
    Session& me = all[s];
    me.busy = true;
    ++tally_.turns;
    const std::size_t before = me.tokens.size();
    std::vector<std::uint32_t> prompt = me.tokens;
    prompt.insert(prompt.end(), message.begin(), message.end());
    std::size_t have = before;  // tokens whose KV is in the cache
    if (me.blocks.empty()) {
      tally_.prefix_tokens += before + shared;
      KVSTASH_RETURN_IF_ERROR(make_room(all, blocks_for(prompt.size() + answer.size())));
      me.blocks = take(blocks_for(prompt.size()));
      KVSTASH_ASSIGN_OR_RETURN(have, restore(me, prompt));
    } else {
      ++tally_.resident_turns;
    }
    // The engine computes the rest of the prompt, then the answer.
    std::vector<std::uint32_t> all_tokens = prompt;
    all_tokens.insert(all_tokens.end(), answer.begin(), answer.end());
    KVSTASH_RETURN_IF_ERROR(make_room(all, blocks_for(all_tokens.size()) - me.blocks.size()));
    auto more = take(blocks_for(all_tokens.size()) - me.blocks.size());
    me.blocks.insert(me.blocks.end(), more.begin(), more.end());
    compute(me.blocks, all_tokens, have, all_tokens.size());
    tally_.computed_tokens += all_tokens.size() - have;
    me.tokens = std::move(all_tokens);
    me.last_used = ++clock_;
    me.busy = false;
    return save_new_chunks(me);
  }

  const Tally& tally() const { return tally_; }
  std::uint64_t chunk_bytes() const { return kv_->chunk_bytes(); }

 private:
  std::size_t blocks_for(std::size_t tokens) const {
    return (tokens + shape_.block_size - 1) / shape_.block_size;
  }

  std::vector<std::uint32_t> take(std::size_t n) {
    std::vector<std::uint32_t> out(free_.end() - static_cast<std::ptrdiff_t>(n), free_.end());
    free_.resize(free_.size() - n);
    return out;
  }

  // Offloads the least recently used idle sessions until `need` blocks are free (their chunks
  // were saved as they filled: offloading frees their blocks).
  Status make_room(std::vector<Session>& all, std::size_t need) {
    while (free_.size() < need) {
      Session* lru = nullptr;
      for (auto& s : all) {
        if (!s.busy && !s.blocks.empty() && (lru == nullptr || s.last_used < lru->last_used)) lru = &s;
      }
      if (lru == nullptr)
        return Status::no_space("the engine's cache cannot hold one turn: raise --resident");
      free_.insert(free_.end(), lru->blocks.begin(), lru->blocks.end());
      lru->blocks.clear();
      ++tally_.offloads;
    }
    return {};
  }

  // Loads what the cell holds of `prompt` into the session's fresh blocks, leaving at least the
  // prompt's last token to compute. Returns how many tokens' KV is now in place.
  Result<std::size_t> restore(Session& me, const std::vector<std::uint32_t>& prompt) {
    const std::size_t chunk = o_.chunk_tokens;
    const auto t0 = Clock::now();
    KVSTASH_ASSIGN_OR_RETURN(std::size_t found, kv_->contains_prefix(prompt));
    tally_.lookup_s += seconds_since(t0);
    ++tally_.lookups;
    const std::size_t n = std::min(found, (prompt.size() - 1) / chunk);
    me.saved_chunks = found;
    if (n == 0) return 0;
    const auto t1 = Clock::now();
    auto load = kv_->begin_load(prompt, me.blocks, n);
    if (!load.is_ok()) return load.status();
    std::size_t whole = 0;
    for (const Status& st : load->wait()) {
      if (!st.is_ok()) break;  // a chunk gone meanwhile: the rest is computed
      ++whole;
    }
    tally_.load_s += seconds_since(t1);
    tally_.loaded_chunks += whole;
    tally_.loaded_bytes += whole * kv_->chunk_bytes();
    tally_.loaded_tokens += whole * chunk;
    KVSTASH_RETURN_IF_ERROR(verify(me.blocks, prompt, whole * chunk));
    return whole * chunk;
  }

  Status save_new_chunks(Session& me) {
    const std::size_t full = me.tokens.size() / o_.chunk_tokens;
    if (full <= me.saved_chunks) return {};
    // Chunks another session saved already (a shared system prompt) are not written again.
    KVSTASH_ASSIGN_OR_RETURN(std::size_t present, kv_->contains_prefix(me.tokens));
    ++tally_.lookups;
    const std::size_t first = std::max(me.saved_chunks, std::min(present, full));
    if (first < full) {
      const auto t0 = Clock::now();
      for (const Status& st : kv_->save(me.tokens, me.blocks, first, full - first)) {
        if (!st.is_ok()) return st.with_context("saving a chunk");
      }
      tally_.save_s += seconds_since(t0);
      tally_.saved_chunks += full - first;
      tally_.saved_bytes += (full - first) * kv_->chunk_bytes();
    }
    me.saved_chunks = full;
    return {};
  }

  // The KV the model would compute for token `t` at position `pos` of layer `l`, part `p`: one
  // word, repeated over the token's slot.
  static std::uint64_t kv_word(std::uint32_t t, std::size_t pos, std::uint32_t l, std::uint32_t p) {
    std::uint64_t x = (std::uint64_t{t} << 32) ^ (pos * 0x9E3779B97F4A7C15ull) ^ (std::uint64_t{l} << 8) ^ p;
    x ^= x >> 31;
    return x * 0xBF58476D1CE4E5B9ull;
  }

  std::byte* slot(std::uint32_t layer, std::uint32_t part, std::uint32_t block, std::size_t in_block) {
    const std::uint64_t token_bytes = shape_.block_bytes() / shape_.block_size;
    return layers_[layer].data() + (std::uint64_t{part} * shape_.num_blocks + block) * shape_.block_bytes() +
           in_block * token_bytes;
  }

  void compute(const std::vector<std::uint32_t>& blocks, const std::vector<std::uint32_t>& tokens,
               std::size_t from, std::size_t to) {
    const std::size_t words = shape_.block_bytes() / shape_.block_size / sizeof(std::uint64_t);
    for (std::uint32_t l = 0; l < shape_.num_layers; ++l) {
      for (std::uint32_t p = 0; p < shape_.parts(); ++p) {
        for (std::size_t pos = from; pos < to; ++pos) {
          auto* w = reinterpret_cast<std::uint64_t*>(
              slot(l, p, blocks[pos / shape_.block_size], pos % shape_.block_size));
          std::fill(w, w + words, kv_word(tokens[pos], pos, l, p));
        }
      }
    }
  }

  // The first and last word of every loaded token's slot are what compute() would write.
  Status verify(const std::vector<std::uint32_t>& blocks, const std::vector<std::uint32_t>& tokens,
                std::size_t to) {
    const std::size_t words = shape_.block_bytes() / shape_.block_size / sizeof(std::uint64_t);
    for (std::uint32_t l = 0; l < shape_.num_layers; ++l) {
      for (std::uint32_t p = 0; p < shape_.parts(); ++p) {
        for (std::size_t pos = 0; pos < to; ++pos) {
          const auto* w = reinterpret_cast<const std::uint64_t*>(
              slot(l, p, blocks[pos / shape_.block_size], pos % shape_.block_size));
          const std::uint64_t want = kv_word(tokens[pos], pos, l, p);
          if (w[0] != want || w[words - 1] != want) {
            return Status::corrupt("token " + std::to_string(pos) + " of layer " + std::to_string(l) +
                                   " was loaded with other bytes");
          }
        }
      }
    }
    return {};
  }

  const ServeBenchOptions& o_;
  KvCacheShape shape_;
  std::vector<Buffer> layers_;
  std::unique_ptr<KvCache> kv_;
  std::vector<std::uint32_t> free_;
  std::uint64_t clock_ = 0;
  Tally tally_;
};

// The tutorial's approach on the same Redis: a chunk's bytes as a value, SET then GET (copied
// into the cache's buffer, as an engine would need them). Seconds per GET of one chunk.
Result<double> redis_get_seconds(const std::string& url, std::uint64_t chunk_bytes, int samples) {
  metadata::RedisOptions ro;
  ro.url = url;
  ro.command_timeout = 60s;
  KVSTASH_ASSIGN_OR_RETURN(auto redis, metadata::RedisClient::connect(ro));
  std::string value(chunk_bytes, '\0');
  std::mt19937_64 rng(3);
  for (std::size_t i = 0; i + 8 <= value.size(); i += 4096) {
    const std::uint64_t x = rng();
    std::memcpy(value.data() + i, &x, 8);
  }
  std::vector<std::byte> into(chunk_bytes);
  double total = 0;
  for (int i = 0; i < samples; ++i) {
    const std::string key = "bench:serve:redis-bytes:" + std::to_string(i);
    KVSTASH_RETURN_IF_ERROR(redis->command({"SET", key, value}).status());
    const auto t0 = Clock::now();
    KVSTASH_ASSIGN_OR_RETURN(metadata::Reply r, redis->command({"GET", key}));
    const std::string_view got = r.str();
    if (got.size() != chunk_bytes) return Status::corrupt("Redis returned another value");
    std::memcpy(into.data(), got.data(), got.size());
    total += seconds_since(t0);
    (void)redis->command({"DEL", key});
  }
  return total / samples;
}

}  // namespace

int run_serve(const ServeBenchOptions& o) {
  if (o.chunk_tokens == 0 || o.chunk_tokens % 16 != 0 || o.sessions == 0 || o.system_prompts == 0 ||
      o.turns == 0 || o.resident_sessions == 0 || o.prefill_rate <= 0) {
    std::cerr
        << "kvstash-bench serve: --chunk-tokens must be a multiple of 16; counts and the prefill rate > 0\n";
    return 2;
  }
  const std::uint64_t max_session =
      o.system_tokens + std::uint64_t{o.turns} * (o.user_tokens + o.answer_tokens);
  const auto num_blocks = static_cast<std::uint32_t>(o.resident_sessions * ((max_session + 15) / 16) + 16);
  const KvCacheShape shape = model_shape(num_blocks);
  const std::uint64_t token_bytes = shape.bytes_per_token();
  // Every chunk of every session could be stored at once, with room to spare.
  const std::uint64_t pool =
      (std::uint64_t{o.sessions} * max_session + o.system_prompts * o.system_tokens) * token_bytes * 5 / 4 +
      (256ull << 20);

  auto redis = harness::LocalRedis::start({});
  if (!redis.is_ok()) {
    std::cerr << "kvstash-bench serve: redis-server: " << redis.status().to_string() << "\n";
    return 1;
  }
  auto node = harness::LocalNode::start({.redis_url = (*redis)->url(),
                                         .capacity = std::to_string(pool),
                                         .extra_args = {"--transports", "all"}});
  if (!node.is_ok()) {
    std::cerr << "kvstash-bench serve: kvstashd: " << node.status().to_string() << "\n";
    return 1;
  }
  StoreOptions so;
  so.redis_url = (*redis)->url();
  so.engine.prefer = o.transport;
  so.engine.ucx.allow_emulated_rma = true;
  so.timeout = 120s;
  auto store = Store::open(so);
  Engine engine(o, shape);
  Status opened = store.is_ok() ? engine.open(**store) : store.status();
  if (!opened.is_ok()) {
    std::cerr << "kvstash-bench serve: " << opened.to_string() << "\n";
    return 1;
  }

  // The stream: every session takes its turns in rounds, in a shuffled order each round.
  std::mt19937 rng(o.seed);
  auto words = [&](std::size_t n) {
    std::vector<std::uint32_t> v(n);
    for (auto& t : v) t = rng() % 128000;
    return v;
  };
  std::vector<std::vector<std::uint32_t>> prompts;
  for (std::uint32_t p = 0; p < o.system_prompts; ++p) prompts.push_back(words(o.system_tokens));
  std::vector<Session> sessions(o.sessions);
  for (std::uint32_t s = 0; s < o.sessions; ++s) sessions[s].prompt = s % o.system_prompts;
  const auto t0 = Clock::now();
  for (std::uint32_t t = 0; t < o.turns; ++t) {
    std::vector<std::size_t> order(o.sessions);
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t s : order) {
      std::vector<std::uint32_t> message = words(o.user_tokens);
      std::size_t shared = 0;
      if (t == 0) {
        const auto& system = prompts[sessions[s].prompt];
        message.insert(message.begin(), system.begin(), system.end());
        shared = system.size();
      }
      const Status st = engine.turn(sessions, s, message, shared, words(o.answer_tokens));
      if (!st.is_ok()) {
        std::cerr << "kvstash-bench serve: session " << s << " turn " << t << ": " << st.to_string() << "\n";
        return 1;
      }
    }
  }
  const double wall = seconds_since(t0);
  const Tally& k = engine.tally();
  auto redis_get = redis_get_seconds((*redis)->url(), engine.chunk_bytes(), 4);

  const double us_per_token_kvstash = k.loaded_tokens > 0 ? k.load_s * 1e6 / k.loaded_tokens : 0;
  const double us_per_token_redis = redis_get.is_ok() ? *redis_get * 1e6 / o.chunk_tokens : 0;
  const double us_per_token_recompute = 1e6 / o.prefill_rate;
  const double hit = k.prefix_tokens > 0 ? double(k.loaded_tokens) / k.prefix_tokens : 0;
  if (o.json) {
    nlohmann::json j{{"sessions", o.sessions},
                     {"turns", k.turns},
                     {"resident_turns", k.resident_turns},
                     {"transport", std::string(to_string(o.transport))},
                     {"prefix_tokens", k.prefix_tokens},
                     {"loaded_tokens", k.loaded_tokens},
                     {"computed_tokens", k.computed_tokens},
                     {"hit_rate", hit},
                     {"offloads", k.offloads},
                     {"saved_chunks", k.saved_chunks},
                     {"loaded_chunks", k.loaded_chunks},
                     {"saved_bytes", k.saved_bytes},
                     {"loaded_bytes", k.loaded_bytes},
                     {"save_s", k.save_s},
                     {"load_s", k.load_s},
                     {"lookups", k.lookups},
                     {"lookup_us", k.lookups ? k.lookup_s * 1e6 / k.lookups : 0},
                     {"restore_us_per_token", us_per_token_kvstash},
                     {"redis_bytes_us_per_token", us_per_token_redis},
                     {"recompute_us_per_token", us_per_token_recompute},
                     {"prefill_rate", o.prefill_rate},
                     {"wall_s", wall}};
    if (!redis_get.is_ok()) j["redis_bytes_error"] = redis_get.status().to_string();
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf(
      "%u sessions over %u shared system prompts of %u tokens, %u turns each (%u-token messages, "
      "%u-token answers); the engine's cache holds %u sessions; %u-token chunks of %s (%s per token, "
      "Llama-3-8B's KV); transport %s\n\n",
      o.sessions, o.system_prompts, o.system_tokens, o.turns, o.user_tokens, o.answer_tokens,
      o.resident_sessions, o.chunk_tokens, units::format_size(engine.chunk_bytes()).c_str(),
      units::format_size(token_bytes).c_str(), std::string(to_string(o.transport)).c_str());
  std::printf("turns                      %8llu (%llu with the session still in the engine's cache)\n",
              (unsigned long long)k.turns, (unsigned long long)k.resident_turns);
  std::printf("offloads                   %8llu sessions' blocks freed for others\n",
              (unsigned long long)k.offloads);
  std::printf(
      "hit rate                   %8.1f%% of the %llu prefix tokens the other turns needed came from "
      "kvstash\n",
      100 * hit, (unsigned long long)k.prefix_tokens);
  std::printf("tokens                     %8llu loaded, %llu computed\n", (unsigned long long)k.loaded_tokens,
              (unsigned long long)k.computed_tokens);
  std::printf(
      "chunks                     %8llu saved (%s in %.2f s; a shared system prompt's once), %llu loaded (%s "
      "in "
      "%.2f s)\n",
      (unsigned long long)k.saved_chunks, units::format_size(k.saved_bytes).c_str(), k.save_s,
      (unsigned long long)k.loaded_chunks, units::format_size(k.loaded_bytes).c_str(), k.load_s);
  std::printf("lookups                    %8llu, %.0f us each\n\n", (unsigned long long)k.lookups,
              k.lookups ? k.lookup_s * 1e6 / k.lookups : 0.0);
  std::printf("per restored token          us/token   x kvstash\n");
  std::printf("kvstash over %-13s %9.2f       1.00x\n", std::string(to_string(o.transport)).c_str(),
              us_per_token_kvstash);
  if (redis_get.is_ok()) {
    std::printf("redis-bytes (GET a chunk)  %9.2f   %8.2fx\n", us_per_token_redis,
                us_per_token_kvstash > 0 ? us_per_token_redis / us_per_token_kvstash : 0);
  } else {
    std::printf("redis-bytes: %s\n", redis_get.status().to_string().c_str());
  }
  std::printf("recompute at %6.0f tok/s  %9.2f   %8.2fx\n", o.prefill_rate, us_per_token_recompute,
              us_per_token_kvstash > 0 ? us_per_token_recompute / us_per_token_kvstash : 0);
  std::printf(
      "\nx kvstash: how many times longer than kvstash's restore. The prefill rate is stated "
      "(--prefill-rate), "
      "not measured; the rest is measured in this run (%.1f s). Every loaded token's KV was checked.\n",
      wall);
  return 0;
}

}  // namespace kvstash::bench
