// What a listener does with peers that have not proven the cluster token yet (tcp, verbs):
// GuessThrottle makes guessing the token cost time; UnprovenBudget bounds the handshakes in
// progress without letting a flood displace a slow client's.
//
// Failed proofs put the peer's address in backoff (after a few, each further failure doubling
// it, up to a ceiling). Every proof from an address that has not proven the token recently is checked
// only against a listener-wide allowance (a token bucket, given back when the proof is good):
// once it is spent, such proofs are refused unchecked and such addresses refused at accept
// until it refills. So an online guesser learns the outcome of a few guesses per second
// however many addresses and connections it has, while a client that proved the token before
// keeps getting in during the attack. Connections that never send a proof spend nothing here
// (the transports' unproven budgets bound those).
//
// The token itself is never checked here: the transports run handshake.h and report the
// outcome (failed, proven).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

#include "kvstash/types.h"

namespace kvstash::admission {

struct ThrottleOptions {
  // An address may fail this many proofs without backoff (a few clients started with the
  // wrong token, then the right one, from one host); after the next failure it is backed off
  // first_backoff, and each further failure doubles that up to max_backoff. An address with no
  // failure for `forget_after` starts afresh. Its first failure also makes it an address that
  // has not proven the token, whose proofs the listener-wide allowance bounds.
  std::uint32_t free_failures = 8;
  std::chrono::milliseconds first_backoff{250};
  std::chrono::milliseconds max_backoff{30000};
  std::chrono::milliseconds forget_after{300000};
  // Proofs of not recently proven addresses the whole listener checks: `burst` at once,
  // `per_second` sustained (a good proof gives its share back).
  double per_second = 4;
  double burst = 16;
  // An address that proved the token within this long passes the listener-wide limit.
  std::chrono::milliseconds known_for{3600000};
  // At most this many addresses remembered (failing and proven each); beyond, the oldest
  // entries are forgotten, so a flood of addresses cannot grow the listener's memory.
  std::size_t max_addresses = 4096;
};

enum class Verdict : std::uint8_t {
  kAdmit,
  kPeerBackoff,      // this address failed recently: refused until its backoff ends
  kListenerBackoff,  // the listener's allowance of failed proofs is spent, and the address
                     // has not proven the token recently
};

// A line for a log: why a connection was refused.
const char* describe(Verdict v);

class GuessThrottle {
 public:
  explicit GuessThrottle(ThrottleOptions options = {}) : options_(options), tokens_(options.burst) {}

  // Whether a connection from `peer` (an address without port) may start a handshake now.
  Verdict admit(std::string_view peer, Clock::time_point now = Clock::now());
  // Whether the proof `peer` just sent may be checked now: true for an address that proved
  // the token recently, else only while the listener's allowance lasts (spending one, and
  // setting *spent). False: refuse the proof unchecked, and report it failed().
  bool may_check(std::string_view peer, bool* spent, Clock::time_point now = Clock::now());
  // The peer's proof was wrong, missing, or refused unchecked: backs the address off.
  void failed(std::string_view peer, Clock::time_point now = Clock::now());
  // The peer proved the token: forgets its failures, lets it pass the listener's limit, and
  // gives back what may_check spent (`spent`).
  void proven(std::string_view peer, bool spent, Clock::time_point now = Clock::now());
  // Whether `peer` proved the token within known_for.
  bool known(std::string_view peer, Clock::time_point now = Clock::now());

 private:
  struct Failing {
    std::uint32_t failures = 0;
    Clock::time_point until{};  // refused before this
    Clock::time_point last{};   // the last failure
  };
  void refill(Clock::time_point now);  // needs mu_
  template <typename Map>
  void bound(Map& map, Clock::time_point now);  // needs mu_

  const ThrottleOptions options_;
  std::mutex mu_;
  double tokens_;
  Clock::time_point refilled_{};
  std::unordered_map<std::string, Failing> failing_;
  std::unordered_map<std::string, Clock::time_point> proven_;  // address -> last proof
};

// The handshakes a listener has in progress, at most `capacity`. When it is full, a new one
// takes the place of the oldest handshake of the source that holds the most places (an IPv4
// address, an IPv6 /64), and a source that proved the token recently is displaced only by
// another such: a flood from a few sources displaces its own handshakes, so that a client
// holding one place keeps it for as long as its round trip takes (the transport's handshake
// timeout bounds that), whatever the flood's rate. A flood from more sources than the budget
// has places still displaces unknown clients, never known ones.
//
// Thread safety: none; the listener holds its own lock around every call.
class UnprovenBudget {
 public:
  explicit UnprovenBudget(std::size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // A place for a handshake from `peer` (`known`: it proved the token recently), which `drop`
  // ends; the id to remove() it by, or 0 when the budget is full of places it may not take.
  // A displaced handshake's `drop` is called here.
  std::uint64_t add(std::string_view peer, bool known, std::function<void()> drop);
  // The handshake ended (proven, failed or gone); no-op for an id no longer held.
  void remove(std::uint64_t id);
  std::size_t size() const { return places_.size(); }
  std::uint64_t displaced() const { return displaced_; }

  // The source a peer's address counts under: itself (IPv4), its /64 (IPv6).
  static std::string source_of(std::string_view peer);

 private:
  struct Place {
    std::string source_key;  // in sources_
    bool known = false;
    std::function<void()> drop;
  };
  struct Source {
    std::set<std::uint64_t> ids;  // oldest first
    bool known = false;
  };
  std::size_t capacity_;
  std::uint64_t next_ = 0, displaced_ = 0;
  std::map<std::uint64_t, Place> places_;
  std::unordered_map<std::string, Source> sources_;  // keyed by (known ? "+" : "-") + source
};

}  // namespace kvstash::admission
