// The xxh3 tree (common/checksum.h): its XXH3-64 core equals libxxhash for every length class
// and alignment, the sums are what docs/metadata.md defines, and an object's sum does not
// depend on how its bytes were split between calls or which side computed a segment.
#include "common/checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <random>
#include <vector>

namespace kvstash::sum {
namespace {

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(ChecksumTest, TheCoreIsXxh3ForEveryLengthAndAlignment) {
  const auto bytes = random_bytes(3u << 20, 1);
  // 0..4200 covers every path (0, 1-3, 4-8, 9-16, 17-128, 129-240, long with and without a
  // partial 1 KiB block and a partial stripe); offsets 1 and 5 are unaligned loads.
  for (std::size_t offset : {0, 1, 5}) {
    for (std::size_t n = 0; n <= 4200; ++n) {
      ASSERT_EQ(xxh3_64(bytes.data() + offset, n), XXH3_64bits(bytes.data() + offset, n))
          << n << " bytes at offset " << offset;
    }
  }
  for (std::size_t n : {65536ul, 1000003ul, (3ul << 20) - 8}) {
    EXPECT_EQ(xxh3_64(bytes.data() + 3, n), XXH3_64bits(bytes.data() + 3, n)) << n;
  }
}

// The definition, spelled with libxxhash: digests of 4 KiB blocks, folded with the length.
std::uint64_t reference_segment(const unsigned char* p, std::uint64_t n) {
  std::vector<std::uint64_t> words;
  for (std::uint64_t off = 0; off < n; off += 4096)
    words.push_back(XXH3_64bits(p + off, std::min<std::uint64_t>(4096, n - off)));
  words.push_back(n);
  return XXH3_64bits(words.data(), words.size() * 8);
}

TEST(ChecksumTest, SegmentSumsFoldBlockDigestsAndTheLength) {
  const auto bytes = random_bytes(1u << 20, 2);
  for (std::uint64_t n : {0ull, 1ull, 4095ull, 4096ull, 4097ull, 12288ull, 1000000ull}) {
    EXPECT_EQ(segment_sum(bytes.data(), n), reference_segment(bytes.data(), n)) << n;
  }
  std::vector<std::uint64_t> digests;
  for (int i = 0; i < 3; ++i) digests.push_back(xxh3_64(bytes.data() + 4096 * i, 4096));
  EXPECT_EQ(fold_digests(digests, 12288), segment_sum(bytes.data(), 12288));
  // The length is part of the sum: zeros of two lengths differ even within one block.
  const std::vector<unsigned char> zeros(8192, 0);
  EXPECT_NE(segment_sum(zeros.data(), 100), segment_sum(zeros.data(), 101));
}

// The fused pass a shm write makes: the same bytes as memcpy, the same digests as hashing
// them afterwards, for every block count and a short last block, at any alignment.
TEST(ChecksumTest, CopyAndDigestCopiesAndDigestsEveryBlockInOnePass) {
  const auto bytes = random_bytes(1u << 20, 7);
  for (std::uint64_t n :
       {1ull, 4095ull, 4096ull, 4097ull, 8 * 4096ull, 8 * 4096ull + 1, 100000ull, 1000003ull}) {
    for (std::size_t offset : {0, 3}) {
      std::vector<unsigned char> out(n + 8, 0xee);
      std::vector<std::uint64_t> digests(block_count(n) + 1, 0);
      copy_and_digest(out.data() + offset, bytes.data() + offset, n, digests.data());
      EXPECT_EQ(std::memcmp(out.data() + offset, bytes.data() + offset, n), 0) << n;
      EXPECT_EQ(out[offset + n], 0xee) << "wrote past the end";
      for (std::uint64_t b = 0; b < block_count(n); ++b) {
        ASSERT_EQ(digests[b],
                  XXH3_64bits(bytes.data() + offset + b * 4096, std::min<std::uint64_t>(4096, n - b * 4096)))
            << "block " << b << " of " << n;
      }
      EXPECT_EQ(digests[block_count(n)], 0u) << "a digest past the last block";
      EXPECT_EQ(fold(digests.data(), block_count(n), n), segment_sum(bytes.data() + offset, n));
    }
  }
}

// A stream's fused segments: their sums out of one array of block digests, folded in place.
TEST(ChecksumTest, FoldSegmentsGivesEachSegmentsSumFromTheBlockDigests) {
  const auto bytes = random_bytes(1u << 20, 8);
  for (std::uint64_t n : {4096ull, 3 * 4096ull, 3 * 4096ull + 5, 100000ull, 1000003ull}) {
    for (std::uint64_t segment : {4096ull, 3 * 4096ull, 64 * 1024ull}) {
      std::vector<std::uint64_t> digests(block_count(n) + 1);
      for (std::uint64_t b = 0; b < block_count(n); ++b) {
        digests[b] = block_digest(bytes.data() + b * 4096, std::min<std::uint64_t>(4096, n - b * 4096));
      }
      std::vector<std::uint64_t> expected;
      for (std::uint64_t at = 0; at < n; at += segment) {
        expected.push_back(segment_sum(bytes.data() + at, std::min(segment, n - at)));
      }
      EXPECT_EQ(fold_segments(digests.data(), n, segment), expected)
          << n << " bytes, segments of " << segment;
    }
  }
}

TEST(ChecksumTest, AnObjectsSumDoesNotDependOnHowItsBytesWereFed) {
  const std::uint64_t size = 5 * 100000 + 777, segment = 100000;
  const auto bytes = random_bytes(size, 3);
  std::vector<std::uint64_t> words;
  for (std::uint64_t off = 0; off < size; off += segment) {
    words.push_back(reference_segment(bytes.data() + off, std::min(segment, size - off)));
  }
  words.push_back(size);
  const std::uint64_t expected = XXH3_64bits(words.data(), words.size() * 8);

  ObjectHasher whole(segment);
  whole.update(bytes.data(), size);
  EXPECT_EQ(whole.finish(), (ObjectSum{expected, segment}));

  std::mt19937_64 rng(4);
  for (int round = 0; round < 20; ++round) {
    ObjectHasher pieces(segment);
    for (std::uint64_t off = 0; off < size;) {
      const std::uint64_t n = std::min<std::uint64_t>(size - off, rng() % 9000);
      pieces.update(bytes.data() + off, n);
      off += n;
    }
    ASSERT_EQ(pieces.finish().value, expected) << "round " << round;
  }

  // Segments 1 and 3 and the short last one summed "on a device", the rest hashed here.
  ObjectHasher mixed(segment);
  for (std::uint64_t s = 0, off = 0; off < size; ++s, off += segment) {
    const std::uint64_t n = std::min(segment, size - off);
    if (s == 1 || s == 3 || n < segment) {
      ASSERT_TRUE(mixed.add_segment(segment_sum(bytes.data() + off, n), n));
    } else {
      mixed.update(bytes.data() + off, n);
    }
    EXPECT_EQ(mixed.last_segment_sum(), segment_sum(bytes.data() + off, n)) << "segment " << s;
  }
  EXPECT_EQ(mixed.finish().value, expected);
}

TEST(ChecksumTest, ASegmentFromElsewhereMustStartAtABoundaryAndEndTheObjectIfShort) {
  ObjectHasher h(8192);
  const auto bytes = random_bytes(8192, 5);
  h.update(bytes.data(), 100);
  EXPECT_FALSE(h.add_segment(1, 8192)) << "mid-segment";
  h.update(bytes.data() + 100, 8092);
  EXPECT_FALSE(h.add_segment(1, 8193)) << "longer than a segment";
  EXPECT_FALSE(h.add_segment(1, 0));
  EXPECT_TRUE(h.add_segment(1, 10));
  EXPECT_FALSE(h.add_segment(1, 10)) << "a short segment was the last";
  EXPECT_EQ(h.bytes(), 8202u);
}

TEST(ChecksumTest, RecordTextRoundTripsAndRejectsEverythingElse) {
  const ObjectSum s{0x0123456789abcdefull, 4u << 20};
  EXPECT_EQ(to_text(s), "0123456789abcdef/4194304");
  EXPECT_EQ(parse_object_sum(to_text(s)), s);
  for (const char* bad :
       {"", "0123456789abcdef", "0123456789abcdef/", "0123456789abcdef/0", "0123456789abcde/12",
        "0123456789abcdeg/12", "0123456789abcdef/12x", "0123456789abcdef/-1", "0123456789abcdef12"}) {
    EXPECT_FALSE(parse_object_sum(bad).has_value()) << bad;
  }
}

}  // namespace
}  // namespace kvstash::sum
