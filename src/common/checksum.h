// The checksum of kvstash's objects on the host: the "xxh3 tree" of common/checksum_core.h
// (4 KiB block digests folded into segment sums, segment sums folded into the object's sum),
// over host memory. A device computes the same sums with the same core where its bytes are
// (src/kvcache/cuda, the tests' device stand-in) and hands them to ObjectHasher.
//
// Thread safety: functions are pure; an ObjectHasher is one caller's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/checksum_core.h"

namespace kvstash::sum {

// Bytes per checksum segment when the writer does not choose: a get's wave (each wave is
// checked as it lands).
inline constexpr std::uint64_t kDefaultSegmentBytes = 4u << 20;

// One block's digest on the host: XXH3-64 (libxxhash's SIMD code; equal to the core's
// portable xxh3_64, which a device runs).
std::uint64_t block_digest(const void* data, std::uint64_t length);

// Copies `n` bytes from `src` to `dst` and writes the block digest of each 4 KiB of them (the
// last may be short) to digests[0, block_count(n)): one pass over the bytes, a few blocks at
// a time, each hashed from the cache the copy just filled, where a copy and a separate hash
// would read them from memory twice.
void copy_and_digest(void* dst, const void* src, std::uint64_t n, std::uint64_t* digests);

// The sum of one segment in host memory.
std::uint64_t segment_sum(const void* data, std::uint64_t length);

// The sum of a segment whose block digests a device computed.
std::uint64_t fold_digests(std::vector<std::uint64_t> digests, std::uint64_t length);

// The sums of the segments of `length` bytes whose block digests are digests[0,
// block_count(length)), in segments of `segment` bytes (a multiple of kBlockBytes; the last
// may be short). Each segment is folded in place, from the last (a fold overwrites the word
// after its digests, the next segment's first): `digests` needs a spare word past them, and
// is spent.
std::vector<std::uint64_t> fold_segments(std::uint64_t* digests, std::uint64_t length, std::uint64_t segment);

// An object's checksum and the segment size it was computed with, as a record stores it:
// "<16 hex digits>/<segment bytes>".
struct ObjectSum {
  std::uint64_t value = 0;
  std::uint64_t segment = kDefaultSegmentBytes;
  bool operator==(const ObjectSum&) const = default;
};
std::string to_text(const ObjectSum& s);
std::optional<ObjectSum> parse_object_sum(std::string_view text);

// An object's sum, fed in order: host bytes (hashed here) or whole segments' sums computed
// elsewhere. A block that straddles two update() calls is assembled in a 4 KiB stash.
class ObjectHasher {
 public:
  explicit ObjectHasher(std::uint64_t segment_bytes = kDefaultSegmentBytes);

  // Hashes the next `n` bytes of the object.
  void update(const void* data, std::uint64_t n);
  // The next segment, `bytes` long, whose sum was computed where its bytes are. Returns false
  // (and changes nothing) unless the object stands at a segment boundary and `bytes` is a
  // whole segment, or shorter for the object's last (nothing may be fed after that).
  bool add_segment(std::uint64_t segment_sum, std::uint64_t bytes);

  std::uint64_t bytes() const { return total_; }
  std::uint64_t segment_bytes() const { return segment_; }
  // The sum of the latest segment completed (by update or add_segment); nullopt before any.
  std::optional<std::uint64_t> last_segment_sum() const;
  // The object ends here: a short segment being fed is closed, so last_segment_sum() is its.
  void end_object();
  // The sums of the segments completed so far, in order.
  const std::vector<std::uint64_t>& segment_sums() const { return segment_sums_; }
  // Whether the object stands at a segment boundary (bytes() is a multiple of the segment).
  bool at_segment_boundary() const { return in_segment_ == 0; }
  // The object's sum over every byte fed so far (a partial last segment counts as the last).
  ObjectSum finish();

 private:
  void close_segment();

  std::uint64_t segment_;
  std::uint64_t total_ = 0;
  std::uint64_t in_segment_ = 0;             // bytes of the current segment fed
  std::vector<std::uint64_t> digests_;       // of the current segment's whole blocks (+ 1 spare)
  std::vector<std::uint64_t> segment_sums_;  // of the closed segments (+ 1 spare)
  unsigned char stash_[kBlockBytes];         // the current block's bytes, when it straddles
  std::uint64_t stashed_ = 0;
  bool ended_ = false;  // a short segment was added: the object is complete
};

}  // namespace kvstash::sum
