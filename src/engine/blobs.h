// Private to src/engine: the engine's address and remote-key blobs, what Engine::address()
// and MemoryHandle::remote_key() hand out and Engine::connect() and Peer::import_key() take
// back, from a peer or from Redis. Each is a magic, for a key the region's base and length,
// and one part per transport (its kind and that transport's own address or packed key).
//
// Thread safety: pure functions. Fuzzed by tests/fuzz/engine_blobs_fuzz.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/types.h"

namespace kvstash::blobs {

inline constexpr std::uint32_t kAddressMagic = 0x3145564b;  // "KVE1"
inline constexpr std::uint32_t kKeyMagic = 0x314b564b;      // "KVK1"
inline constexpr std::size_t kMaxParts = 16;

using Parts = std::vector<std::pair<TransportKind, std::string>>;

// `magic`, then base and length when `with_range`, then the parts.
std::string encode_parts(std::uint32_t magic, std::uint64_t base, std::uint64_t length, const Parts& parts,
                         bool with_range);

struct Decoded {
  std::uint64_t base = 0;
  std::uint64_t length = 0;
  Parts parts;
};

// nullopt unless `blob` is exactly one record with `magic` and at most kMaxParts parts. Parts
// of transports this build does not have or know (a newer peer's) are kept as they came:
// no transport here claims their kind.
std::optional<Decoded> decode_parts(std::string_view blob, std::uint32_t magic, bool with_range);

}  // namespace kvstash::blobs
