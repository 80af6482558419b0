// The NVMe tier's self-description (docs/nvme-tier.md): where a tier's slots and headers lie
// on its device, an object's header as bytes, and the header area the node allocates and
// scans. A header says what its slots hold (the cell, the key, the put token, size, checksum,
// layout, slot runs, the epoch and generation they were written under) and carries a checksum
// of itself, so that a scan after a restart finds every header written whole and nothing
// else: a torn or overwritten header does not verify.
//
// Thread safety: TierLayout and the encode/decode functions are pure; a HeaderArea is one
// thread's at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::node {

class SsdDevice;

// The device cut in two: the header area (1/256 of it, whole blocks) at the start, then
// slots of one page each.
struct TierLayout {
  TierLayout(std::uint64_t capacity, std::uint64_t page_size, std::uint32_t block_size);
  std::uint32_t block_size = 4096;
  std::uint64_t page_size = 0;
  std::uint64_t header_blocks = 0;  // blocks of the header area
  std::uint64_t slots = 0;          // whole pages after it
  std::uint64_t header_offset(std::uint64_t block) const { return block * block_size; }
  std::uint64_t slot_offset(std::uint64_t slot) const { return header_blocks * block_size + slot * page_size; }
};

// What one header records.
struct TierHeader {
  std::uint64_t sequence = 0;  // the node's write order: the newer of two headers of a key
  std::string cell, key, token;
  std::uint64_t size = 0;
  std::string checksum;  // the record's text (`<16 hex digits>/<segment bytes>`)
  std::string layout;
  std::string epoch;  // the node's registration the slots were written under
  std::uint64_t generation = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;  // slot runs: first, count

  bool operator==(const TierHeader&) const = default;
};

// The most bytes one header may take (a key of 1 KiB and a layout of 64 KiB fit).
inline constexpr std::size_t kMaxTierHeaderBytes = 80 << 10;

// The header's bytes: a magic, the format version, its length, the fields, and an xxh3 of
// all of it; padded with zeros to whole blocks by the caller. kInvalidArgument when it would
// pass kMaxTierHeaderBytes.
Result<std::string> encode_tier_header(const TierHeader& h);
// The header at the start of `bytes` and how many bytes it took, or nullopt when there is
// none there that verifies (no magic, a torn or foreign one, a wrong checksum).
std::optional<std::pair<TierHeader, std::size_t>> decode_tier_header(std::string_view bytes);

// The header area: which of its blocks hold headers, a header's blocks allocated first-fit.
class HeaderArea {
 public:
  HeaderArea(SsdDevice& device, const TierLayout& layout);

  // Reads the whole area and returns the headers that verify, marking their blocks in use
  // (a restart's first step: which of them the cell still names is the caller's question).
  // Errors: the device's.
  Result<std::vector<std::pair<TierHeader, std::uint64_t>>> scan(Deadline deadline);
  // Writes `h` into blocks of its own; returns the first. kNoSpace when no run of free blocks
  // is long enough; the device's errors (the blocks are free again).
  Result<std::uint64_t> write(const TierHeader& h, Deadline deadline);
  // Frees the header at `first` (its blocks are zeroed on the device first, so that a scan
  // never finds it again). Errors: the device's (the blocks stay in use).
  Status erase(std::uint64_t first, Deadline deadline);
  std::uint64_t used_blocks() const;

 private:
  std::optional<std::uint64_t> allocate(std::uint64_t blocks);
  SsdDevice& device_;
  TierLayout layout_;
  std::vector<std::uint32_t> used_;  // per block: how many blocks its header takes (0: free, or inside one)
  std::vector<bool> in_use_;
};

}  // namespace kvstash::node
