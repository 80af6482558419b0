// kvstash/object.h: what a cell records of an object and how it keeps it, the words the
// store's API (kvstash/store.h) and the cell's metadata share: an object's description, where
// it is, how a use of it is kept (turn-ttl's hints) and how a client keys a node's pool.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvstash {

// How a client keys a memory node's pool where leasing asks the node (verbs binds a memory
// window per lease): per operation, or once per connection (docs/architecture.md, "The
// node's CPU and the rkey scope"). A cell's policy (its `rkey_scope`; `kvstash rkey-scope`).
enum class RkeyScope : std::uint8_t {
  // Windows over the whole pool, one for reads and one for writes per connection, taken
  // again off the hot path: no round trip to the node and none of its CPU per operation. A
  // write window carries the Redis deadline of the put that took it as its fence tag and
  // serves only puts whose own deadline is at least that, so a node fenced past a failed
  // put's deadline has no window left that could write into its pages.
  kConnection,
  // A window per operation over exactly the object's pages, bound by the node on request: a
  // key confines its holder to the pages it leased, for the operation's time.
  kLease,
};
std::string_view to_string(RkeyScope s);  // "connection", "lease"
std::optional<RkeyScope> parse_rkey_scope(std::string_view s);

// How a use of a prompt's chunk is kept where the cell's eviction policy is turn-ttl
// (docs/operations.md, "Choosing an eviction policy"): its class, from the request it belongs
// to. KV caches fill it from their prefix lookup (Store::lookup_prefix gives the turn); other
// policies ignore it, and a use without one is kept as LRU keeps it.
struct KeepHint {
  std::uint32_t turn = 1;    // the request's conversation turn (PrefixLookup::turn)
  std::uint32_t chunks = 0;  // the prompt's chunks the request looks up and saves
  std::uint32_t index = 0;   // this chunk's place among them
  std::uint32_t tokens = 0;  // the tokens the chunk holds
  // A hash of this chunk's key (one chunk in eight is sampled to learn reuse gaps from), and
  // of the request's first missing chunk's (or its last): which of the two keep-times a split
  // class gives the request.
  std::uint64_t key_hash = 0;
  std::uint64_t split_hash = 0;
  // The cell's clock when the request looked its prefix up (PrefixLookup::clock): its uses all
  // count from then, so that the order of its chunks is the prompt's however long its loads
  // and saves take (never later than the use, nor a minute before it). 0: when the cell sees
  // the use.
  double looked_up = 0;

  // Whether this chunk is one the cell learns from (one in kSampleOneIn), and the request's
  // draw (0 to 65535) between a split class's two keep-times: Fibonacci hashing of the hashes.
  static constexpr std::uint32_t kSampleOneIn = 8;
  bool sampled() const;
  std::uint32_t draw() const;
  // A key's hash for key_hash and split_hash (XXH3-64 of its bytes): the same in every process,
  // so every engine samples the same chunks (Python: kvstash.keep_key_hash).
  static std::uint64_t hash_key(std::string_view key);
};

// A prefix lookup's answer (Store::lookup_prefix).
struct PrefixLookup {
  std::size_t hit = 0;     // leading keys present (contains_prefix)
  std::uint32_t turn = 1;  // the request's conversation turn, as turn-ttl counts it (KeepHint)
  double clock = 0;        // turn-ttl's clock when the cell answered (KeepHint::looked_up); else 0
};

// Where an object is (Store::prefix_tiers): in a memory node's pool, or on its NVMe tier.
enum class Tier : std::uint8_t { kDram, kSsd };

struct ObjectInfo {
  std::uint64_t size = 0;
  std::string object_layout;  // PutOptions::object_layout
  // The bytes' checksum: the xxh3 tree (docs/metadata.md) over segments of
  // `checksum_segment` bytes.
  std::uint64_t checksum = 0;
  std::uint64_t checksum_segment = 0;
  std::uint64_t pages = 0;
  std::vector<std::string> nodes;                // memory nodes holding it
  std::optional<std::chrono::milliseconds> ttl;  // time left; none: no expiry (stat only)
  // Which put wrote these bytes: changes whenever the object is replaced (PutOptions::if_version).
  std::string version;
};

}  // namespace kvstash
