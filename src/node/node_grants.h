// A memory node's grant check: the leases it serves must carry a grant its cell signed with
// the key the node handed it at its latest registration (kvstash/grant.h, src/common/grant.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/grant.h"

namespace kvstash::node {

class NodeGrants final : public GrantCheck {
 public:
  // `rotation`: how long the cell signs with one key before the node hands it the next.
  NodeGrants(std::string id, std::uint64_t base, std::uint64_t page_size, std::uint64_t page_count,
             std::chrono::milliseconds rotation = std::chrono::minutes(1));

  // A fresh key for the incarnation `epoch`, in hex for its registration: grants signed for
  // an earlier one stop verifying at once. The cell names it in grants as `epoch`.
  std::string rotate(const std::string& epoch);

  // The key that should replace the cell's current one, when that one has signed for the
  // rotation period: its hex and the word grants name it by (`<epoch>/<generation>`). The same
  // key until installed() (a heartbeat that handed it over may have failed after Redis took
  // it: grants under it verify from the moment it is offered).
  struct NextKey {
    std::string hex;
    std::string word;
  };
  std::optional<NextKey> next_key();

  // The cell took the key named `word` at `redis_ms` of its clock: it signs with it from then
  // on, and the key before it is retired. A retired key verifies only grants whose deadline
  // lies within the cell's longest lease of that moment (those it signed before), and is
  // forgotten once no such grant can be live; one copied from Redis mints nothing after.
  void installed(const std::string& word, std::int64_t redis_ms);

  // The cell's clock: Redis read `redis_ms` no earlier than `asked` (when the call that read it
  // began). From then on a grant whose deadline lies further than grant::kMaxLease past that
  // clock now is refused: the cell signs none (a key leaked with a backup of Redis mints
  // grants for at most the rotation period, each at most that long).
  void set_clock(std::int64_t redis_ms, Clock::time_point asked);

  // The pool ranges of a grant for this node's current incarnation (pages to addresses).
  Result<Grant> check(std::string_view grant) const override;

  // Keys that verify now (the current one, one offered, retired ones still in their window).
  std::size_t live_keys() const;

 private:
  struct Key {
    std::string word;                        // what grants name it by
    std::vector<std::uint8_t> bytes;         // the HMAC key
    std::optional<std::int64_t> retired_ms;  // the cell's clock when the next key replaced it
    Clock::time_point since;                 // offered, or retired
  };
  void forget_retired(Clock::time_point now);

  const std::string id_;
  const std::uint64_t base_, page_size_, page_count_;
  const std::chrono::milliseconds rotation_;
  mutable std::mutex mu_;
  std::string epoch_;             // mu_
  std::uint64_t generation_ = 0;  // mu_: of the newest key
  std::vector<Key> keys_;         // mu_: the current one first, then retired
  std::optional<Key> offered_;    // mu_
  std::optional<std::pair<std::int64_t, Clock::time_point>> clock_;  // mu_
};

}  // namespace kvstash::node
