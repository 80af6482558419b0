// The in-process cache a trace replays through (replay_model.h).
#include "replay_model.h"

#include <cstdio>
#include <deque>
#include <fstream>
#include <limits>
#include <list>
#include <memory>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

namespace kvstash::bench {

Result<std::vector<TraceRequest>> read_trace(const std::string& path, std::size_t limit) {
  std::ifstream in(path);
  if (!in) return Status::not_found("trace " + path + " cannot be read");
  std::vector<TraceRequest> out;
  std::size_t line_no = 0;
  for (std::string line; std::getline(in, line) && (limit == 0 || out.size() < limit);) {
    ++line_no;
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, false);
    auto bad = [&](const std::string& why) {
      return Status::invalid_argument("trace " + path + " line " + std::to_string(line_no) + ": " + why);
    };
    if (!j.is_object() || !j.contains("hash_ids") || !j["hash_ids"].is_array() ||
        !j.contains("input_length")) {
      return bad("not {\"timestamp\", \"input_length\", \"output_length\", \"hash_ids\"}");
    }
    TraceRequest r;
    r.at_ms = j.value("timestamp", std::uint64_t{0});
    r.input_tokens = j["input_length"].get<std::uint32_t>();
    r.output_tokens = j.value("output_length", std::uint32_t{0});
    for (const auto& id : j["hash_ids"]) {
      if (!id.is_number_unsigned()) return bad("a hash id is not an unsigned integer");
      r.blocks.push_back(id.get<std::uint64_t>());
    }
    out.push_back(std::move(r));
  }
  return out;
}

namespace {

constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();

// Tokens of block `i` of a request: a whole block, or what the prompt has left.
std::uint64_t block_tokens_of(const TraceRequest& r, std::size_t i, std::uint32_t block_tokens) {
  const std::uint64_t before = std::uint64_t{block_tokens} * i;
  if (r.input_tokens <= before) return 0;
  return std::min<std::uint64_t>(block_tokens, r.input_tokens - before);
}

// A cache of blocks under one eviction policy. `next` is the step of the block's next use
// (kNever: none), which only the offline rule reads.
class Cache {
 public:
  virtual ~Cache() = default;
  virtual bool contains(std::uint64_t block) const = 0;
  // A hit, or a block past a request's first miss that the cache holds: used now.
  virtual void use(std::uint64_t block, std::uint64_t next) = 0;
  // A miss saved, evicting first when full (each eviction counted).
  virtual void insert(std::uint64_t block, std::uint64_t next, std::uint64_t& evictions) = 0;
};

// Evicts the block used longest ago.
class LruCache final : public Cache {
 public:
  explicit LruCache(std::uint64_t capacity) : capacity_(capacity) {}
  bool contains(std::uint64_t block) const override { return where_.contains(block); }
  void use(std::uint64_t block, std::uint64_t) override {
    recency_.splice(recency_.end(), recency_, where_.at(block));
  }
  void insert(std::uint64_t block, std::uint64_t, std::uint64_t& evictions) override {
    if (capacity_ == 0) return;
    if (where_.size() >= capacity_) {
      where_.erase(recency_.front());
      recency_.pop_front();
      ++evictions;
    }
    where_.emplace(block, recency_.insert(recency_.end(), block));
  }

 private:
  std::uint64_t capacity_;
  std::list<std::uint64_t> recency_;  // least recent first
  std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> where_;
};

// Offline: evicts the block used farthest ahead, the incoming one included (then it is not kept).
class BeladyCache final : public Cache {
 public:
  explicit BeladyCache(std::uint64_t capacity) : capacity_(capacity) {}
  bool contains(std::uint64_t block) const override { return next_.contains(block); }
  void use(std::uint64_t block, std::uint64_t next) override {
    auto it = next_.find(block);
    ahead_.erase({it->second, block});
    it->second = next;
    ahead_.insert({next, block});
  }
  void insert(std::uint64_t block, std::uint64_t next, std::uint64_t& evictions) override {
    if (capacity_ == 0) return;
    if (next_.size() >= capacity_) {
      auto last = std::prev(ahead_.end());
      if (last->first <= next) return;  // the incoming block is used farthest ahead
      next_.erase(last->second);
      ahead_.erase(last);
      ++evictions;
    }
    next_.emplace(block, next);
    ahead_.insert({next, block});
  }

 private:
  std::uint64_t capacity_;
  std::unordered_map<std::uint64_t, std::uint64_t> next_;    // block -> its next use
  std::set<std::pair<std::uint64_t, std::uint64_t>> ahead_;  // (next use, block)
};

// S3-FIFO (Yang et al., SOSP 2023): a small FIFO (a tenth of the capacity) that new blocks
// enter, a main FIFO for blocks used again while in it (or remembered by the ghost FIFO of
// blocks the small one evicted), each block's use count (up to 3) buying it another pass
// through the main FIFO.
class S3FifoCache final : public Cache {
 public:
  explicit S3FifoCache(std::uint64_t capacity)
      : capacity_(capacity), small_cap_(std::max<std::uint64_t>(1, capacity / 10)) {}
  bool contains(std::uint64_t block) const override { return freq_.contains(block); }
  void use(std::uint64_t block, std::uint64_t) override {
    auto& f = freq_.at(block);
    f = std::min(f + 1, 3);
  }
  void insert(std::uint64_t block, std::uint64_t, std::uint64_t& evictions) override {
    if (capacity_ == 0) return;
    while (freq_.size() >= capacity_) evict(evictions);
    freq_.emplace(block, 0);
    if (ghost_set_.erase(block)) {
      main_.push_back(block);
    } else {
      small_.push_back(block);
    }
  }

 private:
  void evict(std::uint64_t& evictions) {
    if (small_.size() >= small_cap_ || main_.empty()) {
      evict_small(evictions);
    } else {
      evict_main(evictions);
    }
  }
  void evict_small(std::uint64_t& evictions) {
    while (!small_.empty()) {
      const std::uint64_t tail = small_.front();
      small_.pop_front();
      if (freq_.at(tail) > 1) {  // used again while new: it stays, in the main FIFO
        main_.push_back(tail);
        if (main_.size() > capacity_ - small_cap_) evict_main(evictions);
        continue;
      }
      freq_.erase(tail);
      remember(tail);
      ++evictions;
      return;
    }
  }
  void evict_main(std::uint64_t& evictions) {
    while (!main_.empty()) {
      const std::uint64_t tail = main_.front();
      main_.pop_front();
      if (auto& f = freq_.at(tail); f > 0) {
        --f;
        main_.push_back(tail);
        continue;
      }
      freq_.erase(tail);
      ++evictions;
      return;
    }
  }
  void remember(std::uint64_t block) {
    ghost_.push_back(block);
    ghost_set_.insert(block);
    while (ghost_.size() > capacity_ - small_cap_) {
      ghost_set_.erase(ghost_.front());
      ghost_.pop_front();
    }
  }

  std::uint64_t capacity_, small_cap_;
  std::unordered_map<std::uint64_t, int> freq_;     // the blocks held, each with its use count
  std::deque<std::uint64_t> small_, main_, ghost_;  // oldest first
  std::unordered_set<std::uint64_t> ghost_set_;
};

std::unique_ptr<Cache> make_cache(ReplayPolicy policy, std::uint64_t capacity) {
  switch (policy) {
    case ReplayPolicy::kBelady: return std::make_unique<BeladyCache>(capacity);
    case ReplayPolicy::kS3Fifo: return std::make_unique<S3FifoCache>(capacity);
    case ReplayPolicy::kLru: break;
  }
  return std::make_unique<LruCache>(capacity);
}

}  // namespace

ModelResult replay_model(std::span<const TraceRequest> trace, std::uint64_t capacity_blocks,
                         ReplayPolicy policy, std::uint32_t block_tokens) {
  // Each use's next use (a request's index), for Belady: from the end backwards.
  std::vector<std::vector<std::uint64_t>> next_use(trace.size());
  if (policy == ReplayPolicy::kBelady) {
    std::unordered_map<std::uint64_t, std::uint64_t> seen;
    for (std::size_t i = trace.size(); i-- > 0;) {
      next_use[i].resize(trace[i].blocks.size());
      for (std::size_t b = 0; b < trace[i].blocks.size(); ++b) {
        auto it = seen.find(trace[i].blocks[b]);
        next_use[i][b] = it == seen.end() ? kNever : it->second;
      }
      for (auto block : trace[i].blocks) seen[block] = i;
    }
  }
  ModelResult out;
  const std::unique_ptr<Cache> cache = make_cache(policy, capacity_blocks);
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    out.prompt_tokens += r.input_tokens;
    std::size_t hit = 0;
    while (hit < r.blocks.size() && cache->contains(r.blocks[hit])) ++hit;
    out.hit_blocks += hit;
    out.block_uses += r.blocks.size();
    for (std::size_t b = 0; b < r.blocks.size(); ++b) {
      const std::uint64_t next = policy == ReplayPolicy::kBelady ? next_use[i][b] : kNever;
      if (b < hit) {
        out.hit_tokens += block_tokens_of(r, b, block_tokens);
        cache->use(r.blocks[b], next);
      } else if (!cache->contains(r.blocks[b])) {
        ++out.blocks_saved;
        cache->insert(r.blocks[b], next, out.evictions);
      } else {
        cache->use(r.blocks[b], next);  // past the first miss: computed, but the cache holds it
      }
    }
  }
  return out;
}

}  // namespace kvstash::bench

namespace kvstash::bench {

int run_replay(const ReplayBenchOptions& o) {
  auto trace = read_trace(o.trace, o.requests);
  if (!trace.is_ok()) {
    std::fprintf(stderr, "kvstash-bench replay: %s\n", trace.status().to_string().c_str());
    return 2;
  }
  if (!o.json) {
    std::printf("%zu requests of %s, blocks of %u tokens; the in-process model of each policy\n\n",
                trace->size(), o.trace.c_str(), o.block_tokens);
    std::printf("%-10s %-8s %10s %10s %9s %9s %10s %10s\n", "capacity", "policy", "token hit", "block hit",
                "x LRU", "of Belady", "saved", "evictions");
  }
  for (std::uint64_t capacity : o.capacities) {
    const ModelResult lru = replay_model(*trace, capacity, ReplayPolicy::kLru, o.block_tokens);
    const ModelResult s3fifo = replay_model(*trace, capacity, ReplayPolicy::kS3Fifo, o.block_tokens);
    const ModelResult belady = replay_model(*trace, capacity, ReplayPolicy::kBelady, o.block_tokens);
    for (const auto& [name, r] :
         {std::pair{"lru", lru}, std::pair{"s3-fifo", s3fifo}, std::pair{"belady", belady}}) {
      const double x_lru = lru.hit_rate() > 0 ? r.hit_rate() / lru.hit_rate() : 0.0;
      const double of_belady = belady.hit_rate() > 0 ? r.hit_rate() / belady.hit_rate() : 0.0;
      if (o.json) {
        nlohmann::json j{{"capacity_blocks", capacity},
                         {"policy", name},
                         {"token_hit_rate", r.hit_rate()},
                         {"block_hit_rate", r.block_hit_rate()},
                         {"x_lru", x_lru},
                         {"of_belady", of_belady},
                         {"blocks_saved", r.blocks_saved},
                         {"evictions", r.evictions}};
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("%-10llu %-8s %10.3f %10.3f %8.2fx %8.2fx %10llu %10llu\n",
                    static_cast<unsigned long long>(capacity), name, r.hit_rate(), r.block_hit_rate(), x_lru,
                    of_belady, static_cast<unsigned long long>(r.blocks_saved),
                    static_cast<unsigned long long>(r.evictions));
      }
    }
  }
  if (!o.json) {
    std::printf(
        "\ntoken hit: prompt tokens found as a prefix over all prompt tokens; block hit: the same in\n"
        "whole blocks (the trace's README figures); x LRU, of Belady: token hit rate over theirs.\n"
        "Belady's rule is offline (it knows the future): the bound no online policy reaches.\n");
  }
  return 0;
}

}  // namespace kvstash::bench
