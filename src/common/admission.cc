#include "common/admission.h"

#include <algorithm>
#include <type_traits>

namespace kvstash::admission {

const char* describe(Verdict v) {
  switch (v) {
    case Verdict::kAdmit: return "admitted";
    case Verdict::kPeerBackoff: return "the address failed the cluster-token handshake recently (backing off)";
    case Verdict::kListenerBackoff:
      return "too many failed cluster-token handshakes on this listener (backing off; addresses that "
             "proved the token recently still get in)";
  }
  return "?";
}

void GuessThrottle::refill(Clock::time_point now) {
  if (refilled_ == Clock::time_point{}) refilled_ = now;
  const double seconds = std::chrono::duration<double>(now - refilled_).count();
  if (seconds <= 0) return;
  tokens_ = std::min(options_.burst, tokens_ + seconds * options_.per_second);
  refilled_ = now;
}

Verdict GuessThrottle::admit(std::string_view peer, Clock::time_point now) {
  std::lock_guard lock(mu_);
  refill(now);
  const std::string key(peer);
  if (auto it = failing_.find(key); it != failing_.end()) {
    if (now < it->second.until) return Verdict::kPeerBackoff;
    if (now - it->second.last > options_.forget_after) failing_.erase(it);
  }
  if (tokens_ >= 1) return Verdict::kAdmit;
  if (auto it = proven_.find(key); it != proven_.end() && now - it->second < options_.known_for) {
    return Verdict::kAdmit;
  }
  return Verdict::kListenerBackoff;
}

template <typename Map>
void GuessThrottle::bound(Map& map, Clock::time_point now) {
  if (map.size() < options_.max_addresses) return;
  // Forget the entries that no longer matter, then, if that was not enough, any half: the
  // listener-wide allowance still bounds the guesses of addresses forgotten this way.
  std::erase_if(map, [&](const auto& e) {
    if constexpr (std::is_same_v<typename Map::mapped_type, Failing>) {
      return now >= e.second.until && now - e.second.last > options_.forget_after;
    } else {
      return now - e.second >= options_.known_for;
    }
  });
  for (auto it = map.begin(); map.size() >= options_.max_addresses / 2 && it != map.end();) it = map.erase(it);
}

bool GuessThrottle::may_check(std::string_view peer, bool* spent, Clock::time_point now) {
  std::lock_guard lock(mu_);
  *spent = false;
  if (auto it = proven_.find(std::string(peer)); it != proven_.end() && now - it->second < options_.known_for) {
    return true;
  }
  refill(now);
  if (tokens_ < 1) return false;
  tokens_ -= 1;
  *spent = true;
  return true;
}

void GuessThrottle::failed(std::string_view peer, Clock::time_point now) {
  std::lock_guard lock(mu_);
  const std::string key(peer);
  proven_.erase(key);
  if (failing_.find(key) == failing_.end()) bound(failing_, now);
  Failing& f = failing_[key];
  if (f.failures != 0 && now - f.last > options_.forget_after) f.failures = 0;
  f.failures = std::min<std::uint32_t>(f.failures + 1, options_.free_failures + 32);
  f.last = now;
  if (f.failures <= options_.free_failures) return;
  auto backoff = options_.first_backoff;
  for (std::uint32_t i = options_.free_failures + 1; i < f.failures && backoff < options_.max_backoff; ++i) {
    backoff *= 2;
  }
  f.until = now + std::min(backoff, options_.max_backoff);
}

void GuessThrottle::proven(std::string_view peer, bool spent, Clock::time_point now) {
  std::lock_guard lock(mu_);
  if (spent) {
    refill(now);
    tokens_ = std::min(options_.burst, tokens_ + 1);
  }
  const std::string key(peer);
  failing_.erase(key);
  if (proven_.find(key) == proven_.end()) bound(proven_, now);
  proven_[key] = now;
}

}  // namespace kvstash::admission
