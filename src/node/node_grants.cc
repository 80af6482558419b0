#include "node/node_grants.h"

#include <algorithm>

#include "common/grant.h"
#include "common/ranges.h"

namespace kvstash::node {

namespace {
// How far the cell's clock may run ahead of ours (a thousandth), and what a signing script's
// clock may read beyond the one the node last heard (the script ran after the node's call).
constexpr double kDrift = 1e-3;
constexpr std::chrono::milliseconds kSlack{5000};
constexpr std::int64_t kSlackMs = kSlack.count();

// The word naming the key a grant claims to be signed with (its third; grant.h), unverified.
std::string_view key_word(std::string_view text) {
  for (int skip = 0; skip < 2; ++skip) {
    const auto space = text.find(' ');
    if (space == std::string_view::npos) return {};
    text.remove_prefix(space + 1);
  }
  return text.substr(0, text.find(' '));
}
}  // namespace

NodeGrants::NodeGrants(std::string id, std::uint64_t base, std::uint64_t page_size, std::uint64_t page_count,
                       std::chrono::milliseconds rotation)
    : id_(std::move(id)), base_(base), page_size_(page_size), page_count_(page_count), rotation_(rotation) {}

std::string NodeGrants::rotate(const std::string& epoch) {
  std::lock_guard lock(mu_);
  epoch_ = epoch;
  generation_ = 0;
  offered_.reset();
  keys_.assign(1, Key{epoch, grant::new_key(), std::nullopt, Clock::now()});
  return grant::hex(keys_.front().bytes);
}

std::optional<NodeGrants::NextKey> NodeGrants::next_key() {
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  forget_retired(now);
  if (keys_.empty() || now - keys_.front().since < rotation_) return std::nullopt;
  if (!offered_) {
    offered_ = Key{epoch_ + "/" + std::to_string(++generation_), grant::new_key(), std::nullopt, now};
  }
  return NextKey{grant::hex(offered_->bytes), offered_->word};
}

void NodeGrants::installed(const std::string& word, std::int64_t redis_ms) {
  std::lock_guard lock(mu_);
  if (!offered_ || offered_->word != word || keys_.empty()) return;
  const auto now = Clock::now();
  keys_.front().retired_ms = redis_ms;
  keys_.front().since = now;
  offered_->since = now;
  keys_.insert(keys_.begin(), std::move(*offered_));
  offered_.reset();
  forget_retired(now);
}

void NodeGrants::forget_retired(Clock::time_point now) {
  std::erase_if(keys_,
                [&](const Key& k) { return k.retired_ms && now - k.since > grant::kMaxLease + kSlack; });
}

std::size_t NodeGrants::live_keys() const {
  std::lock_guard lock(mu_);
  return keys_.size() + (offered_ ? 1 : 0);
}

void NodeGrants::set_clock(std::int64_t redis_ms, Clock::time_point asked) {
  std::lock_guard lock(mu_);
  clock_ = std::make_pair(redis_ms, asked);
}

Result<Grant> NodeGrants::check(std::string_view text) const {
  if (text.empty())
    return Status::permission_denied("the node serves leases only under a grant of its cell; none came");
  grant::Terms t;
  {
    std::lock_guard lock(mu_);
    if (keys_.empty()) return Status::permission_denied("the node has not joined its cell yet");
    const std::string_view word = key_word(text);
    const Key* key = offered_ && offered_->word == word ? &*offered_ : nullptr;
    for (const Key& k : keys_) {
      if (!key && k.word == word) key = &k;
    }
    if (!key) {
      if (word.substr(0, word.find('/')) != epoch_) {
        return Status::permission_denied("a grant for an earlier registration of this node (epoch " +
                                         std::string(word) + ")");
      }
      return Status::permission_denied("a grant under key " + std::string(word) +
                                       ", which this node no longer holds (retired, or never its own)");
    }
    KVSTASH_ASSIGN_OR_RETURN(t, grant::verify(key->bytes, text));
    if (t.issuer != id_) return Status::permission_denied("a grant for node " + t.issuer + ", not this one");
    if (key->retired_ms && t.deadline > static_cast<std::uint64_t>(std::max<std::int64_t>(
                                            *key->retired_ms + grant::kMaxLease.count() + kSlackMs, 0))) {
      return Status::permission_denied("a grant under key " + key->word + ", retired at " +
                                       std::to_string(*key->retired_ms) +
                                       " ms of the cell's clock, until later than any lease it signed then");
    }
    if (clock_) {
      const auto& [ms, asked] = *clock_;
      const double elapsed = std::chrono::duration<double, std::milli>(Clock::now() - asked).count();
      const auto latest =
          ms + static_cast<std::int64_t>(elapsed * (1 + kDrift)) + kSlackMs + grant::kMaxLease.count();
      if (t.deadline > static_cast<std::uint64_t>(std::max<std::int64_t>(latest, 0))) {
        return Status::permission_denied("a grant until " + std::to_string(t.deadline) +
                                         " ms of the cell's clock, further than its longest lease (" +
                                         std::to_string(grant::kMaxLease.count() / 1000) +
                                         " s) past its now: no cell signed it so");
      }
    }
  }
  Grant g;
  g.op = t.op;
  g.fence = t.deadline;
  if (t.whole) {
    g.ranges.push_back({base_, page_count_ * page_size_});
    return g;
  }
  for (const auto& [first, count] : t.runs) {
    if (first >= page_count_ || count > page_count_ - first) {
      return Status::permission_denied("a grant past the node's " + std::to_string(page_count_) + " pages");
    }
    g.ranges.push_back({base_ + first * page_size_, count * page_size_});
  }
  rangeset::merge(g.ranges);
  return g;
}

}  // namespace kvstash::node
