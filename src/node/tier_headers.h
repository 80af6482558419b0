// The NVMe tier's self-description (docs/nvme-tier.md): where a tier's slots and headers lie
// on its device, and an object's header as bytes. A header says what its slots hold (the
// cell, the key, the put token, size, checksum, layout, expiry, the tier's sum, slot runs) and
// carries a MAC of itself under the node's key, so that a scan after a restart finds every
// header the node wrote whole and nothing else: a torn, overwritten or forged header does not
// verify.
//
// Thread safety: pure functions, and a scan that uses only the device it is given.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::node {

class SsdDevice;

// The device: block 0 its superblock (NodeTier's), then a header place of `header_unit` bytes
// per slot (the header of an object lies at its first slot's), then the slots, of one page
// each. An object's header is written with its slots' bytes; a slot taken by another object
// later has its header overwritten, or its bytes no longer match an older header's sum, so a
// header never needs erasing.
struct TierLayout {
  TierLayout(std::uint64_t capacity, std::uint64_t page_size, std::uint32_t block_size);
  std::uint32_t block_size = 4096;
  std::uint64_t page_size = 0;
  std::uint64_t header_unit = 4096;  // the most bytes one header takes (a whole number of blocks)
  std::uint64_t slots = 0;
  std::uint64_t header_offset(std::uint64_t slot) const { return header_unit * (1 + slot); }
  std::uint64_t slot_offset(std::uint64_t slot) const { return header_unit * (1 + slots) + slot * page_size; }
};

// What one header records: enough to make the object's record again (docs/metadata.md, "A
// cell that lost its Redis").
struct TierHeader {
  std::uint64_t sequence = 0;  // the node's write order: the newer of two headers that overlap
  std::string cell, key, token;
  std::uint64_t size = 0;
  std::string checksum;  // the record's text (`<16 hex digits>/<segment bytes>`)
  std::string layout;
  std::string sum;                                            // the tier's own sum of the bytes (NodeTier)
  std::int64_t expires_ms = 0;                                // Redis time; 0: never
  std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;  // slot runs: first, count

  bool operator==(const TierHeader&) const = default;
};

// The key a node signs its headers with, from its secret (the cluster token); none for an
// empty one.
std::vector<std::uint8_t> tier_header_key(std::string_view secret);

// The header's bytes: a magic, the format version, its length, the fields, and an HMAC-SHA256
// of all of it with `key` (no key: an XXH3, which catches accidents and no forger).
// kInvalidArgument when it would pass `max_bytes` (the layout's header_unit).
Result<std::string> encode_tier_header(const TierHeader& h, std::size_t max_bytes,
                                       std::span<const std::uint8_t> key = {});
// The header at the start of `bytes`, or nullopt when there is none there that verifies (no
// magic, a torn or foreign one, a wrong checksum; with a key, one it did not sign, unkeyed
// ones included).
std::optional<TierHeader> decode_tier_header(std::string_view bytes, std::span<const std::uint8_t> key = {});

// Reads every slot's header place and returns the headers that verify, each with its slot (a
// restart's first step: which of them still name their bytes is the caller's question).
// Errors: the device's.
Result<std::vector<std::pair<TierHeader, std::uint64_t>>> scan_tier_headers(
    SsdDevice& device, const TierLayout& layout, Deadline deadline, std::span<const std::uint8_t> key = {});

}  // namespace kvstash::node
