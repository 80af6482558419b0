// The in-process cache a trace replays through (replay_model.h).
#include "replay_model.h"

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

const char* policy_name(ReplayPolicy policy) {
  switch (policy) {
    case ReplayPolicy::kBelady: return "belady";
    case ReplayPolicy::kS3Fifo: return "s3-fifo";
    case ReplayPolicy::kArc: return "arc";
    case ReplayPolicy::kLru: break;
  }
  return "lru";
}

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

// Blocks in an order, oldest first: LRU's recency, ARC's lists and their ghosts.
class Ordered {
 public:
  bool contains(std::uint64_t block) const { return where_.contains(block); }
  std::size_t size() const { return where_.size(); }
  bool empty() const { return where_.empty(); }
  std::uint64_t oldest() const { return order_.front(); }
  void push_newest(std::uint64_t block) { where_.emplace(block, order_.insert(order_.end(), block)); }
  void make_newest(std::uint64_t block) { order_.splice(order_.end(), order_, where_.at(block)); }
  void erase(std::uint64_t block) {
    auto it = where_.find(block);
    order_.erase(it->second);
    where_.erase(it);
  }
  std::uint64_t pop_oldest() {
    const std::uint64_t block = order_.front();
    erase(block);
    return block;
  }

 private:
  std::list<std::uint64_t> order_;
  std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> where_;
};

// A cache of blocks under one eviction policy. `next` is the step of the block's next use
// (kNever: none), which only the offline rule reads.
class Cache {
 public:
  virtual ~Cache() = default;
  virtual bool contains(std::uint64_t block) const = 0;
  virtual std::uint64_t size() const = 0;
  // A hit, or a block past a request's first miss that the cache holds: used now.
  virtual void use(std::uint64_t block, std::uint64_t next) = 0;
  // A block the cache does not hold saved, evicting first when full (each eviction counted).
  virtual void insert(std::uint64_t block, std::uint64_t next, std::uint64_t& evictions) = 0;
  // Evicts the block the policy would evict for a put now (the cache is not empty).
  virtual void evict_one(std::uint64_t& evictions) = 0;
};

// Evicts the block used longest ago.
class LruCache final : public Cache {
 public:
  explicit LruCache(std::uint64_t capacity) : capacity_(capacity) {}
  bool contains(std::uint64_t block) const override { return recency_.contains(block); }
  std::uint64_t size() const override { return recency_.size(); }
  void use(std::uint64_t block, std::uint64_t) override { recency_.make_newest(block); }
  void insert(std::uint64_t block, std::uint64_t, std::uint64_t& evictions) override {
    if (capacity_ == 0) return;
    if (recency_.size() >= capacity_) evict_one(evictions);
    recency_.push_newest(block);
  }
  void evict_one(std::uint64_t& evictions) override {
    recency_.pop_oldest();
    ++evictions;
  }

 private:
  std::uint64_t capacity_;
  Ordered recency_;
};

// Offline: evicts the block used farthest ahead, the incoming one included (then it is not kept).
class BeladyCache final : public Cache {
 public:
  explicit BeladyCache(std::uint64_t capacity) : capacity_(capacity) {}
  bool contains(std::uint64_t block) const override { return next_.contains(block); }
  std::uint64_t size() const override { return next_.size(); }
  void use(std::uint64_t block, std::uint64_t next) override {
    auto it = next_.find(block);
    ahead_.erase({it->second, block});
    it->second = next;
    ahead_.insert({next, block});
  }
  void insert(std::uint64_t block, std::uint64_t next, std::uint64_t& evictions) override {
    if (capacity_ == 0) return;
    if (next_.size() >= capacity_) {
      if (std::prev(ahead_.end())->first <= next) return;  // the incoming block is used farthest ahead
      evict_one(evictions);
    }
    next_.emplace(block, next);
    ahead_.insert({next, block});
  }
  void evict_one(std::uint64_t& evictions) override {
    auto last = std::prev(ahead_.end());
    next_.erase(last->second);
    ahead_.erase(last);
    ++evictions;
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
  std::uint64_t size() const override { return freq_.size(); }
  void use(std::uint64_t block, std::uint64_t) override {
    auto& f = freq_.at(block);
    f = std::min(f + 1, 3);
  }
  void insert(std::uint64_t block, std::uint64_t, std::uint64_t& evictions) override {
    if (capacity_ == 0) return;
    while (freq_.size() >= capacity_) evict_one(evictions);
    freq_.emplace(block, 0);
    if (ghost_set_.erase(block)) {
      main_.push_back(block);
    } else {
      small_.push_back(block);
    }
  }
  void evict_one(std::uint64_t& evictions) override {
    if (small_.size() >= small_cap_ || main_.empty()) {
      evict_small(evictions);
    } else {
      evict_main(evictions);
    }
  }

 private:
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

// ARC (Megiddo and Modha, FAST 2003), as a cell runs it: T1 holds blocks used once lately, T2
// blocks used at least twice, each in LRU order; B1 and B2 remember the blocks evicted from
// each (names only). A new block found in B1 says T1 was too small (its target share p grows),
// one found in B2 that T2 was; either enters T2. An eviction takes T1's least recent block
// while T1 is over p (or T2 is empty), else T2's; the ghosts are then trimmed so that T1 and
// B1 hold at most the capacity, and all four twice it. (The paper evicts inside the miss that
// needs the room; a cell evicts when it reserves pages, before it knows the key: the same
// rule, apart from the paper's tie-break on a B2 hit.)
class ArcCache final : public Cache {
 public:
  explicit ArcCache(std::uint64_t capacity) : c_(capacity) {}
  bool contains(std::uint64_t block) const override { return t1_.contains(block) || t2_.contains(block); }
  std::uint64_t size() const override { return t1_.size() + t2_.size(); }
  void use(std::uint64_t block, std::uint64_t) override {
    if (t1_.contains(block)) {
      t1_.erase(block);
      t2_.push_newest(block);
    } else {
      t2_.make_newest(block);
    }
  }
  void insert(std::uint64_t block, std::uint64_t, std::uint64_t& evictions) override {
    if (c_ == 0) return;
    if (size() >= c_) evict_one(evictions);
    const double c = static_cast<double>(c_);
    if (b1_.contains(block)) {
      p_ = std::min(c, p_ + std::max(1.0, double(b2_.size()) / double(b1_.size())));
      b1_.erase(block);
      t2_.push_newest(block);
    } else if (b2_.contains(block)) {
      p_ = std::max(0.0, p_ - std::max(1.0, double(b1_.size()) / double(b2_.size())));
      b2_.erase(block);
      t2_.push_newest(block);
    } else {
      t1_.push_newest(block);
    }
  }
  void evict_one(std::uint64_t& evictions) override {
    if (!t1_.empty() && (static_cast<double>(t1_.size()) > p_ || t2_.empty())) {
      b1_.push_newest(t1_.pop_oldest());
    } else {
      b2_.push_newest(t2_.pop_oldest());
    }
    ++evictions;
    while (t1_.size() + b1_.size() > c_) b1_.pop_oldest();
    while (size() + b1_.size() + b2_.size() > 2 * c_) b2_.pop_oldest();
  }

 private:
  std::uint64_t c_;
  double p_ = 0;  // T1's target size
  Ordered t1_, t2_, b1_, b2_;
};

std::unique_ptr<Cache> make_cache(ReplayPolicy policy, std::uint64_t capacity) {
  switch (policy) {
    case ReplayPolicy::kBelady: return std::make_unique<BeladyCache>(capacity);
    case ReplayPolicy::kS3Fifo: return std::make_unique<S3FifoCache>(capacity);
    case ReplayPolicy::kArc: return std::make_unique<ArcCache>(capacity);
    case ReplayPolicy::kLru: break;
  }
  return std::make_unique<LruCache>(capacity);
}

// The blocks a request looks up and saves: all, or only the whole ones.
std::size_t blocks_kept(const TraceRequest& r, std::uint32_t block_tokens, ReplaySaves saves) {
  if (saves == ReplaySaves::kEveryBlock) return r.blocks.size();
  return std::min<std::size_t>(r.blocks.size(), r.input_tokens / block_tokens);
}

}  // namespace

ModelResult replay_model(std::span<const TraceRequest> trace, std::uint64_t capacity_blocks,
                         ReplayPolicy policy, std::uint32_t block_tokens, ReplaySaves saves) {
  // Each use's next use (a request's index), for Belady: from the end backwards.
  std::vector<std::vector<std::uint64_t>> next_use(trace.size());
  if (policy == ReplayPolicy::kBelady) {
    std::unordered_map<std::uint64_t, std::uint64_t> seen;
    for (std::size_t i = trace.size(); i-- > 0;) {
      const std::size_t kept = blocks_kept(trace[i], block_tokens, saves);
      next_use[i].resize(kept);
      for (std::size_t b = 0; b < kept; ++b) {
        auto it = seen.find(trace[i].blocks[b]);
        next_use[i][b] = it == seen.end() ? kNever : it->second;
      }
      for (std::size_t b = 0; b < kept; ++b) seen[trace[i].blocks[b]] = i;
    }
  }
  ModelResult out;
  const std::unique_ptr<Cache> cache = make_cache(policy, capacity_blocks);
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const std::size_t kept = blocks_kept(r, block_tokens, saves);
    out.prompt_tokens += r.input_tokens;
    std::size_t hit = 0;
    while (hit < kept && cache->contains(r.blocks[hit])) ++hit;
    out.hit_blocks += hit;
    out.block_uses += r.blocks.size();
    for (std::size_t b = 0; b < kept; ++b) {
      const std::uint64_t block = r.blocks[b];
      const std::uint64_t next = policy == ReplayPolicy::kBelady ? next_use[i][b] : kNever;
      if (b < hit) {
        out.hit_tokens += block_tokens_of(r, b, block_tokens);
        cache->use(block, next);
        continue;
      }
      if (cache->contains(block) && saves == ReplaySaves::kConnector && capacity_blocks > 0 &&
          cache->size() >= capacity_blocks) {
        cache->evict_one(out.evictions);  // the new copy's page, before the old one is freed
      }
      if (!cache->contains(block)) {
        ++out.blocks_saved;
        cache->insert(block, next, out.evictions);
      } else {
        if (saves == ReplaySaves::kConnector) ++out.blocks_saved;
        cache->use(block, next);  // past the first miss: computed, but the cache holds it
      }
    }
  }
  return out;
}

}  // namespace kvstash::bench
