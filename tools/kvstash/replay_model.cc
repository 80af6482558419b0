// The in-process cache a trace replays through (replay_model.h).
#include "tools/kvstash/replay_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <queue>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "kvstash/store.h"

namespace kvstash::replay {

const char* policy_name(ReplayPolicy policy) {
  switch (policy) {
    case ReplayPolicy::kBelady: return "belady";
    case ReplayPolicy::kS3Fifo: return "s3-fifo";
    case ReplayPolicy::kArc: return "arc";
    case ReplayPolicy::kTurnTtl: return "turn-ttl";
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

std::size_t blocks_kept(const TraceRequest& r, std::uint32_t block_tokens, ReplaySaves saves) {
  if (saves == ReplaySaves::kEveryBlock) return r.blocks.size();
  return std::min<std::size_t>(r.blocks.size(), r.input_tokens / block_tokens);
}

std::vector<double> request_times(std::span<const TraceRequest> trace) {
  std::vector<double> out;
  out.reserve(trace.size());
  for (const TraceRequest& r : trace) {
    const double at = (static_cast<double>(r.at_ms) - static_cast<double>(trace.front().at_ms)) / 1000;
    // A millisecond apart: more than a request's blocks' microseconds (TurnTtlCache).
    out.push_back(out.empty() ? at : std::max(at, out.back() + 1e-3));
  }
  return out;
}

std::uint64_t prefix_tokens(const TraceRequest& r, std::size_t blocks, std::uint32_t block_tokens) {
  return std::min<std::uint64_t>(r.input_tokens, std::uint64_t{block_tokens} * blocks);
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

// Learned keep-times by conversation turn (kTurnTtl). Once a block is stored nothing new is
// learned about it until it is used again, so the best an online policy can do for a class of
// blocks is to keep them for some time T (Beckmann and Sanchez's argument for hit density).
// This policy learns, per class, how many tokens a keep-time T would hit and what it would cost
// in block-seconds, from a sample of the blocks' reuse gaps, and every 30 s chooses the
// times that fill the capacity with the most hits (a greedy walk over each class's concave
// hull: a fractional knapsack, the split class keeping some of its keys for the longer time).
// A block's priority is the time it is due to go; the lowest goes first; a parent is due a
// microsecond after its child, so it outlives it.
//
// The class of a request's blocks: its conversation's turn (1 + the turn of the block its
// prefix ends in, or of the first missing block if a ghost remembers it), up to 5; the prompt's
// length (under 16 blocks, under 48, longer); and whether it is the prompt's last block.
class TurnTtlCache {
 public:
  explicit TurnTtlCache(std::uint64_t capacity) : capacity_(capacity) {
    for (double t = 5; t <= kMaxGap; t *= 1.25) grid_.push_back(t);
  }
  bool contains(std::uint64_t block) const { return priority_.contains(block); }

  // One request at `now` (request_times): `blocks` are those it looks up and saves, `hit` of
  // them found. Counts saves and evictions into `out`, a held block put again as `saves` says.
  void request(const TraceRequest& r, double now, std::span<const std::uint64_t> blocks, std::size_t hit,
               std::uint32_t block_tokens, ReplaySaves saves, ModelResult& out) {
    if (!started_) {
      start_ = solved_ = now;
      started_ = true;
    }
    if (!blocks.empty() && now - solved_ >= kSolveEvery) {  // at a use, as in the cell
      solved_ = now;
      mature(now);
      solve(now);
    }
    const std::size_t n = blocks.size();
    int turn = 1;
    if (auto g = hit < n ? ghost_.find(blocks[hit]) : ghost_.end(); g != ghost_.end()) {
      turn = 1 + g->second.first;
    } else if (hit > 0) {
      turn = 1 + turn_.at(blocks[hit - 1]);
    }
    const std::uint64_t split_key = hit < n ? blocks[hit] : (n > 0 ? blocks[n - 1] : 0);
    const int length_class = n < 16 ? 0 : n < 48 ? 1 : 2;
    for (std::size_t j = 0; j < n; ++j) {
      const std::uint64_t b = blocks[j];
      const int cls = (std::min(turn, 5) - 1) * 6 + length_class * 2 + (j + 1 == n ? 1 : 0);
      if (sampled(b)) {
        if (auto m = tracked_.find(b); m != tracked_.end()) {
          pending_.push({m->second.first, m->second.second, now - m->second.first,
                         static_cast<double>(block_tokens_of(r, j, block_tokens))});
        }
        tracked_[b] = {now, cls};
        tracked_order_.push_back({now, b});
      }
      const double due = now + keep_time(cls, split_key) - 1e-6 * static_cast<double>(j);
      const bool held = contains(b);
      if (j < hit) {
        raise(b, due);
        continue;
      }
      if (held && saves == ReplaySaves::kConnector && priority_.size() >= capacity_) {
        evict_one(out.evictions);  // the new copy's page first
      }
      if (contains(b)) {
        if (saves == ReplaySaves::kConnector) ++out.blocks_saved;
        raise(b, due);
        continue;
      }
      if (capacity_ == 0) continue;
      ++out.blocks_saved;
      if (priority_.size() >= capacity_) evict_one(out.evictions);
      turn_[b] = turn;
      set(b, due);
    }
    for (std::uint64_t b : blocks) {
      if (contains(b)) ghost_.erase(b);
    }
  }

 private:
  static constexpr double kMaxGap = 900;     // s: a reuse gap counts once this old (or never)
  static constexpr double kHalfLife = 1800;  // s: weights of older samples decay (e-folding)
  static constexpr double kSolveEvery = 30;  // s
  // Evicted blocks whose turn is remembered, per block of capacity: a conversation back after
  // its blocks went (kept for 0 s: evicted at once) still counts its turn. (Twice: 2,000 blocks
  // of the production trace hit 1.44x LRU's tokens; four times 1.58x, eight 1.60x.)
  static constexpr std::uint64_t kGhosts = 4;
  static constexpr int kClasses = 5 * 6;

  struct Pending {  // a sampled use, waiting until its reuse gap is known
    double at;
    int cls;
    double gap;     // < 0: not used again within kMaxGap
    double tokens;  // what the reuse hit
    bool operator>(const Pending& o) const { return at > o.at; }
  };
  struct Stats {  // per class, by gap bin: weighted tokens hit, gaps, reuses; and all samples
    std::vector<double> hits, gaps, reuses;
    double samples = 0;
  };

  // As the cell's clients sample and draw (KeepHint): one block in KeepHint::kSampleOneIn.
  static bool sampled(std::uint64_t block) { return KeepHint{.key_hash = block}.sampled(); }
  double weight(double t) const { return std::exp((t - start_) / kHalfLife); }

  void set(std::uint64_t b, double due) {
    const std::uint64_t seq = ++seq_;
    priority_[b] = {due, seq};
    heap_.push({due, seq, b});
  }
  void raise(std::uint64_t b, double due) {  // a use never lowers a block's priority
    if (priority_.at(b).first >= due) return;
    set(b, due);
  }
  void evict_one(std::uint64_t& evictions) {
    while (!heap_.empty()) {
      const auto [due, seq, b] = heap_.top();
      heap_.pop();
      auto it = priority_.find(b);
      if (it == priority_.end() || it->second.second != seq) continue;  // stale
      priority_.erase(it);
      remember(b, turn_.at(b));
      turn_.erase(b);
      ++evictions;
      return;
    }
  }
  // A FIFO of the evicted blocks' turns, kGhosts times as long as the capacity; one remembered
  // again keeps its place.
  void remember(std::uint64_t b, int turn) {
    if (auto [it, added] = ghost_.try_emplace(b, turn, ghost_seq_ + 1); !added) {
      it->second.first = turn;
    } else {
      ghost_order_.emplace_back(b, ++ghost_seq_);
    }
    while (ghost_.size() > kGhosts * capacity_ && !ghost_order_.empty()) {
      const auto [old, seq] = ghost_order_.front();
      ghost_order_.pop_front();
      if (auto it = ghost_.find(old); it != ghost_.end() && it->second.second == seq) ghost_.erase(it);
    }
  }

  double keep_time(int cls, std::uint64_t key) const {
    if (cls == split_class_) {
      return KeepHint{.split_hash = key}.draw() < split_share_ * 65536 ? split_long_ : split_short_;
    }
    return keep_[cls];
  }

  // Samples older than kMaxGap: their reuse within it is known (or known not to have come).
  void mature(double now) {
    const double limit = now - kMaxGap;
    while (!tracked_order_.empty() && tracked_order_.front().first < limit) {
      const auto [at, b] = tracked_order_.front();
      tracked_order_.pop_front();
      auto m = tracked_.find(b);
      if (m != tracked_.end() && m->second.first == at) {
        pending_.push({at, m->second.second, -1, 0});
        tracked_.erase(m);
      }
    }
    while (!pending_.empty() && pending_.top().at <= limit) {
      const Pending p = pending_.top();
      pending_.pop();
      Stats& st = stats_[p.cls];
      if (st.hits.empty())
        st.hits.assign(grid_.size(), 0), st.gaps.assign(grid_.size(), 0), st.reuses.assign(grid_.size(), 0);
      const double w = weight(p.at);
      st.samples += w;
      if (p.gap < 0) continue;
      const auto bin =
          static_cast<std::size_t>(std::lower_bound(grid_.begin(), grid_.end(), p.gap) - grid_.begin());
      if (bin >= grid_.size()) continue;
      st.hits[bin] += w * p.tokens;
      st.gaps[bin] += w * p.gap;
      st.reuses[bin] += w;
    }
  }

  // The keep-times: per class, the points (cost in block-seconds, tokens hit) of each time on
  // the grid, their upper concave hull, and the hull's segments taken by slope while the
  // budget (the sampled capacity over the weighted time seen) lasts.
  void solve(double now) {
    const double limit = now - kMaxGap;
    if (limit <= start_) return;
    const double budget =
        static_cast<double>(capacity_) / KeepHint::kSampleOneIn * kHalfLife * (weight(limit) - 1);
    struct Point {
      double cost, hits, keep;
    };
    struct Segment {
      double slope, cost;
      int cls;
      double from, to;
    };
    std::vector<Segment> segments;
    double spent = 0;
    keep_.fill(0);
    split_class_ = -1;
    for (int cls = 0; cls < kClasses; ++cls) {
      const Stats& st = stats_[cls];
      if (st.hits.empty()) continue;
      std::vector<Point> hull;
      double hits = 0, gaps = 0, reuses = 0;
      for (std::size_t i = 0; i < grid_.size(); ++i) {
        hits += st.hits[i];
        gaps += st.gaps[i];
        reuses += st.reuses[i];
        const Point p{gaps + (st.samples - reuses) * grid_[i], hits, grid_[i]};
        if (!hull.empty() && p.hits <= hull.back().hits + 1e-12) continue;
        while (hull.size() >= 2) {
          const Point& a = hull[hull.size() - 2];
          const Point& b = hull.back();
          if ((b.hits - a.hits) * (p.cost - a.cost) > (p.hits - a.hits) * (b.cost - a.cost)) break;
          hull.pop_back();
        }
        hull.push_back(p);
      }
      if (hull.empty()) continue;
      spent += hull.front().cost;
      keep_[cls] = hull.front().keep;
      for (std::size_t i = 1; i < hull.size(); ++i) {
        const double cost = hull[i].cost - hull[i - 1].cost;
        segments.push_back({(hull[i].hits - hull[i - 1].hits) / std::max(cost, 1e-9), cost, cls,
                            hull[i - 1].keep, hull[i].keep});
      }
    }
    std::sort(segments.begin(), segments.end(),
              [](const Segment& a, const Segment& b) { return a.slope > b.slope; });
    for (const Segment& s : segments) {
      if (spent + s.cost <= budget) {
        spent += s.cost;
        keep_[s.cls] = s.to;
        continue;
      }
      split_class_ = s.cls;
      split_short_ = s.from;
      split_long_ = s.to;
      split_share_ = (budget - spent) / s.cost;
      break;
    }
  }

  std::uint64_t capacity_;
  std::vector<double> grid_{0.0};  // keep-times: 0, then 5 s growing by a quarter to kMaxGap
  bool started_ = false;
  double start_ = 0, solved_ = 0;
  std::uint64_t seq_ = 0;
  std::unordered_map<std::uint64_t, std::pair<double, std::uint64_t>> priority_;  // block -> (due, seq)
  std::priority_queue<std::tuple<double, std::uint64_t, std::uint64_t>,
                      std::vector<std::tuple<double, std::uint64_t, std::uint64_t>>, std::greater<>>
      heap_;                                     // (due, seq, block), stale entries skipped
  std::unordered_map<std::uint64_t, int> turn_;  // block -> its conversation's turn
  std::unordered_map<std::uint64_t, std::pair<int, std::uint64_t>> ghost_;  // evicted block -> (turn, seq)
  std::deque<std::pair<std::uint64_t, std::uint64_t>> ghost_order_;         // (block, seq), oldest first
  std::uint64_t ghost_seq_ = 0;
  std::unordered_map<std::uint64_t, std::pair<double, int>> tracked_;  // sampled block -> (last use, class)
  std::deque<std::pair<double, std::uint64_t>> tracked_order_;
  std::priority_queue<Pending, std::vector<Pending>, std::greater<>> pending_;
  std::array<Stats, kClasses> stats_;
  std::array<double, kClasses> keep_{};
  int split_class_ = -1;
  double split_short_ = 0, split_long_ = 0, split_share_ = 0;
};

std::unique_ptr<Cache> make_cache(ReplayPolicy policy, std::uint64_t capacity) {
  switch (policy) {
    case ReplayPolicy::kBelady: return std::make_unique<BeladyCache>(capacity);
    case ReplayPolicy::kS3Fifo: return std::make_unique<S3FifoCache>(capacity);
    case ReplayPolicy::kArc: return std::make_unique<ArcCache>(capacity);
    case ReplayPolicy::kTurnTtl:  // a request at a time: replay_model runs it apart
    case ReplayPolicy::kLru: break;
  }
  return std::make_unique<LruCache>(capacity);
}

// The request's leading blocks (of its first `kept`) that `held` finds, counted into `out`: its
// prompt and blocks, the hit's blocks and tokens. Returns the hit's length.
template <typename Held>
std::size_t count_prefix(const TraceRequest& r, std::size_t kept, std::uint32_t block_tokens,
                         ModelResult& out, Held held) {
  std::size_t hit = 0;
  while (hit < kept && held(r.blocks[hit])) ++hit;
  out.prompt_tokens += r.input_tokens;
  out.block_uses += r.blocks.size();
  out.hit_blocks += hit;
  out.hit_tokens += prefix_tokens(r, hit, block_tokens);
  return hit;
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
  if (policy == ReplayPolicy::kTurnTtl) {
    TurnTtlCache cache(capacity_blocks);
    const std::vector<double> times = request_times(trace);
    for (std::size_t i = 0; i < trace.size(); ++i) {
      const TraceRequest& r = trace[i];
      const std::span<const std::uint64_t> kept(r.blocks.data(), blocks_kept(r, block_tokens, saves));
      const std::size_t hit =
          count_prefix(r, kept.size(), block_tokens, out, [&](std::uint64_t b) { return cache.contains(b); });
      cache.request(r, times[i], kept, hit, block_tokens, saves, out);
    }
    return out;
  }
  const std::unique_ptr<Cache> cache = make_cache(policy, capacity_blocks);
  for (std::size_t i = 0; i < trace.size(); ++i) {
    const TraceRequest& r = trace[i];
    const std::size_t kept = blocks_kept(r, block_tokens, saves);
    const std::size_t hit =
        count_prefix(r, kept, block_tokens, out, [&](std::uint64_t b) { return cache->contains(b); });
    for (std::size_t b = 0; b < kept; ++b) {
      const std::uint64_t block = r.blocks[b];
      const std::uint64_t next = policy == ReplayPolicy::kBelady ? next_use[i][b] : kNever;
      if (b < hit) {
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

TierResult replay_tiers(std::span<const TraceRequest> trace, std::uint64_t pool_blocks,
                        std::uint64_t tier_blocks, std::uint32_t block_tokens) {
  TierResult out;
  Ordered pool, tier;  // least recent first
  // Makes room in the pool for one block: its least recent moves down (the tier's least
  // recent going first when the tier is full too).
  auto make_room = [&] {
    if (pool.size() < pool_blocks) return;
    const std::uint64_t down = pool.pop_oldest();
    ++out.total.evictions;
    if (tier_blocks == 0) return;
    if (tier.size() >= tier_blocks) {
      tier.pop_oldest();
      ++out.tier_evictions;
    }
    tier.push_newest(down);
    ++out.written_down;
  };
  auto into_pool = [&](std::uint64_t block) {
    if (pool_blocks == 0) return;
    make_room();
    pool.push_newest(block);
  };
  for (const TraceRequest& r : trace) {
    const std::size_t kept = blocks_kept(r, block_tokens, ReplaySaves::kConnector);
    const std::size_t hit = count_prefix(r, kept, block_tokens, out.total, [&](std::uint64_t b) {
      return pool.contains(b) || tier.contains(b);
    });
    for (std::size_t b = 0; b < kept; ++b) {
      const std::uint64_t block = r.blocks[b];
      if (b < hit) {
        if (pool.contains(block)) {
          pool.make_newest(block);
        } else {  // promoted: read back from the tier into the pool
          ++out.tier_hit_blocks;
          tier.erase(block);
          into_pool(block);
        }
        continue;
      }
      // Saved (a held copy replaced: the new one's page first).
      ++out.total.blocks_saved;
      if (pool.contains(block)) make_room();  // it may be the block itself, moving down
      if (pool.contains(block)) pool.erase(block);
      if (tier.contains(block)) tier.erase(block);
      into_pool(block);
    }
  }
  return out;
}

}  // namespace kvstash::replay
