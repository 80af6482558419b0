// What a listener does with peers that have not proven the cluster token yet (tcp, verbs):
// GuessThrottle makes guessing the token cost time.
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
#include <mutex>
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

}  // namespace kvstash::admission
