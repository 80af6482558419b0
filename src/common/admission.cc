#include "common/admission.h"

#include <algorithm>
#include <type_traits>

namespace kvstash::admission {

const char* describe(Verdict v) {
  switch (v) {
    case Verdict::kAdmit: return "admitted";
    case Verdict::kPeerBackoff:
      return "the address failed the cluster-token handshake recently (backing off)";
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
  for (auto it = map.begin(); map.size() >= options_.max_addresses / 2 && it != map.end();)
    it = map.erase(it);
}

bool GuessThrottle::may_check(std::string_view peer, bool* spent, Clock::time_point now) {
  std::lock_guard lock(mu_);
  *spent = false;
  if (auto it = proven_.find(std::string(peer));
      it != proven_.end() && now - it->second < options_.known_for) {
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

bool GuessThrottle::known(std::string_view peer, Clock::time_point now) {
  std::lock_guard lock(mu_);
  auto it = proven_.find(std::string(peer));
  return it != proven_.end() && now - it->second < options_.known_for;
}

std::string UnprovenBudget::source_of(std::string_view peer) {
  if (peer.find(':') == std::string_view::npos) return std::string(peer);
  // The first four groups of an IPv6 address (its /64), from its text: "a:b:c:d:..." or with
  // "::" among them, expanded as far as it matters.
  std::string out;
  int groups = 0;
  for (std::size_t at = 0; at < peer.size() && groups < 4;) {
    const std::size_t colon = std::min(peer.find(':', at), peer.size());
    if (colon == at) {  // "::": the rest of the /64 is zeros
      while (groups < 4) out += groups++ ? ":0" : "0";
      break;
    }
    if (groups++) out += ':';
    out.append(peer.substr(at, colon - at));
    at = colon + 1;
  }
  return out + "::/64";
}

std::uint64_t UnprovenBudget::add(std::string_view peer, bool known, std::function<void()> drop) {
  if (places_.size() >= capacity_) {
    // The source with the most places, unknown ones first; among equals, the oldest place.
    const Source* victim = nullptr;
    for (const auto& [key, s] : sources_) {
      if (s.ids.empty() || (s.known && !known)) continue;
      if (victim == nullptr || (victim->known && !s.known) ||
          (victim->known == s.known &&
           (s.ids.size() > victim->ids.size() ||
            (s.ids.size() == victim->ids.size() && *s.ids.begin() < *victim->ids.begin())))) {
        victim = &s;
      }
    }
    if (victim == nullptr) return 0;
    auto it = places_.find(*victim->ids.begin());
    std::function<void()> end = std::move(it->second.drop);
    remove(it->first);
    ++displaced_;
    if (end) end();
  }
  const std::uint64_t id = ++next_;
  std::string source = source_of(peer);
  const std::string key = (known ? "+" : "-") + source;
  Source& s = sources_[key];
  s.known = known;
  s.ids.insert(id);
  places_.emplace(id, Place{key, known, std::move(drop)});
  return id;
}

void UnprovenBudget::remove(std::uint64_t id) {
  auto it = places_.find(id);
  if (it == places_.end()) return;
  auto s = sources_.find(it->second.source_key);
  if (s != sources_.end()) {
    s->second.ids.erase(id);
    if (s->second.ids.empty()) sources_.erase(s);
  }
  places_.erase(it);
}

}  // namespace kvstash::admission
