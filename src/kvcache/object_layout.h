// Private to src/kvcache: the layout string a chunk's object carries in its Redis record,
// "<layout tag>;xxh3=<16 hex>,<16 hex>,..." (one checksum per layer), written by a save at
// commit and read back by a load from whatever Redis returns.
//
// Thread safety: pure functions. Fuzzed by tests/fuzz/redis_records_fuzz.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvstash::kvcache {

std::string object_layout(const std::string& tag, const std::vector<std::uint64_t>& sums);

// The per-layer checksums of an object's layout, when it is `tag`'s with exactly `layers`
// checksums; nullopt otherwise.
std::optional<std::vector<std::uint64_t>> parse_layout(std::string_view layout, std::string_view tag,
                                                       std::uint32_t layers);

}  // namespace kvstash::kvcache
