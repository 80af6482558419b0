// Host side of the xxh3 tree (checksum.h): the tree and its folds are the shared core's; each
// 4 KiB block digest is libxxhash's XXH3-64, the same function with SIMD code chosen at run
// time (the core's portable XXH3 runs at 0.7x of it on this project's machines when the bytes
// are in cache). tests/unit/common/checksum_test.cc holds the two equal for every length class.
#include "common/checksum.h"

#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cstring>

namespace kvstash::sum {

std::uint64_t block_digest(const void* data, std::uint64_t length) { return XXH3_64bits(data, length); }

void copy_and_digest(void* dst, const void* src, std::uint64_t n, std::uint64_t* digests) {
  // Chunks of a few blocks: the copy's source lines are still in L1/L2 when they are hashed,
  // and memcpy still moves whole cache lines at full width.
  constexpr std::uint64_t kChunk = 8 * kBlockBytes;
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (std::uint64_t at = 0; at < n; at += kChunk) {
    const std::uint64_t len = std::min(kChunk, n - at);
    std::memcpy(d + at, s + at, len);
    for (std::uint64_t b = 0; b < len; b += kBlockBytes) {
      *digests++ = block_digest(s + at + b, std::min(kBlockBytes, len - b));
    }
  }
}

std::uint64_t segment_sum(const void* data, std::uint64_t length) {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::uint64_t k = block_count(length);
  std::vector<std::uint64_t> words(k + 1);
  for (std::uint64_t i = 0; i < k; ++i) {
    words[i] = block_digest(p + i * kBlockBytes, std::min(kBlockBytes, length - i * kBlockBytes));
  }
  return fold(words.data(), k, length);
}

std::uint64_t fold_digests(std::vector<std::uint64_t> digests, std::uint64_t length) {
  const std::uint64_t k = digests.size();
  digests.push_back(0);
  return fold(digests.data(), k, length);
}

std::vector<std::uint64_t> fold_segments(std::uint64_t* digests, std::uint64_t length,
                                         std::uint64_t segment) {
  const std::uint64_t count = (length + segment - 1) / segment;
  std::vector<std::uint64_t> sums(count);
  for (std::uint64_t i = count; i-- > 0;) {
    const std::uint64_t from = i * segment, bytes = std::min(segment, length - from);
    sums[i] = fold(digests + from / kBlockBytes, block_count(bytes), bytes);
  }
  return sums;
}

std::string to_text(const ObjectSum& s) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 0; i < 16; ++i) out[15 - i] = kDigits[(s.value >> (4 * i)) & 0xf];
  return out + "/" + std::to_string(s.segment);
}

std::optional<ObjectSum> parse_object_sum(std::string_view text) {
  const auto slash = text.find('/');
  if (slash != 16) return std::nullopt;
  ObjectSum s;
  const char* end = text.data() + text.size();
  auto v = std::from_chars(text.data(), text.data() + 16, s.value, 16);
  if (v.ec != std::errc{} || v.ptr != text.data() + 16) return std::nullopt;
  auto g = std::from_chars(text.data() + 17, end, s.segment, 10);
  if (g.ec != std::errc{} || g.ptr != end || s.segment == 0) return std::nullopt;
  return s;
}

ObjectHasher::ObjectHasher(std::uint64_t segment_bytes)
    : segment_(segment_bytes == 0 ? kDefaultSegmentBytes : segment_bytes) {
  digests_.reserve(block_count(std::min<std::uint64_t>(segment_, kDefaultSegmentBytes)) + 1);
}

void ObjectHasher::update(const void* data, std::uint64_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (ended_) return;  // nothing follows a short segment (the store's size check sees to it)
  while (n > 0) {
    // The current block ends at the next 4 KiB of the segment, or at the segment's end.
    const std::uint64_t block_end = std::min(segment_, (in_segment_ / kBlockBytes + 1) * kBlockBytes);
    const std::uint64_t want = block_end - in_segment_;
    if (stashed_ == 0 && n >= want) {
      digests_.push_back(block_digest(p, want));  // a whole block in place: no copy
    } else {
      const std::uint64_t take = std::min(n, want);
      std::memcpy(stash_ + stashed_, p, take);
      stashed_ += take;
      in_segment_ += take;
      total_ += take;
      p += take;
      n -= take;
      if (take < want) return;  // the block continues in the next update
      digests_.push_back(block_digest(stash_, stashed_));
      stashed_ = 0;
      if (in_segment_ == segment_) close_segment();
      continue;
    }
    in_segment_ += want;
    total_ += want;
    p += want;
    n -= want;
    if (in_segment_ == segment_) close_segment();
  }
}

void ObjectHasher::close_segment() {
  if (stashed_ > 0) {
    digests_.push_back(block_digest(stash_, stashed_));
    stashed_ = 0;
  }
  const std::uint64_t k = digests_.size();
  digests_.push_back(0);
  segment_sums_.push_back(fold(digests_.data(), k, in_segment_));
  digests_.clear();
  in_segment_ = 0;
}

bool ObjectHasher::add_segment(std::uint64_t segment_sum, std::uint64_t bytes) {
  if (ended_ || in_segment_ != 0 || bytes == 0 || bytes > segment_) return false;
  segment_sums_.push_back(segment_sum);
  total_ += bytes;
  ended_ = bytes < segment_;  // a short segment is the object's last
  return true;
}

void ObjectHasher::end_object() {
  if (in_segment_ == 0) return;
  close_segment();
  ended_ = true;
}

std::optional<std::uint64_t> ObjectHasher::last_segment_sum() const {
  if (segment_sums_.empty()) return std::nullopt;
  return segment_sums_.back();
}

ObjectSum ObjectHasher::finish() {
  if (in_segment_ != 0) close_segment();
  std::vector<std::uint64_t> words = segment_sums_;
  const std::uint64_t k = words.size();
  words.push_back(0);
  return {fold(words.data(), k, total_), segment_};
}

}  // namespace kvstash::sum
