// The checksum's core, compiled twice from this one text: into the host library and into the
// CUDA kernels (every function is __host__ __device__ under nvcc). It needs nothing but
// <cstdint>, so that nvcc, the host compiler and a device stand-in all run the same code.
//
// The checksum ("xxh3 tree", docs/metadata.md) of n bytes is defined in two levels so that
// any number of threads, on a CPU or a GPU, can compute it where the bytes are:
//   block digest  d_i = XXH3-64(bytes [4096 i, 4096 (i + 1)))     (the last block may be short)
//   segment sum       = XXH3-64(le64 d_0 .. d_{k-1}, le64 n)         (k = ceil(n / 4096))
// An object is cut into segments (a KV-cache object: one per layer), and its checksum folds
// the segments' sums the same way: XXH3-64(le64 s_0 .. s_{m-1}, le64 object size).
//
// XXH3-64 (seed 0, the default secret) is written here from its specification, because the
// xxhash library cannot run on a GPU: the digest kernel and the tests' device stand-in run it.
// The host's own block digests come from libxxhash (common/checksum.cc: the same function,
// with SIMD code), and tests/unit/common/checksum_test.cc holds the two equal for every length class and
// alignment. The tree and its folds are this header's on both. Little-endian machines only
// (x86-64, arm64, NVIDIA GPUs).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVSTASH_HD __host__ __device__
#else
#define KVSTASH_HD
#endif

namespace kvstash::sum {

// Bytes per block digest: small enough that a layer of a chunk gives a GPU hundreds of
// independent blocks, large enough that a CPU hashes at full speed (measured: 4 KiB blocks
// hash faster than one long stream on this project's machines).
inline constexpr std::uint64_t kBlockBytes = 4096;

namespace detail {

inline constexpr std::uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr std::uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr std::uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr std::uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr std::uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr std::uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr std::uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;
inline constexpr std::uint64_t kPrimeMx1 = 0x165667919E3779F9ull;
inline constexpr std::uint64_t kPrimeMx2 = 0x9FB21C651E98DF25ull;

inline constexpr int kSecretBytes = 192;
inline constexpr int kStripeBytes = 64;
inline constexpr int kStripesPerBlock = (kSecretBytes - kStripeBytes) / 8;  // 16
inline constexpr int kLongBlockBytes = kStripeBytes * kStripesPerBlock;     // 1024

// XXH3's default secret (part of its specification), once for the host and once in the GPU's
// constant memory; secret() picks the one of the code being compiled.
#define KVSTASH_XXH3_SECRET                                                                               \
  {                                                                                                       \
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, \
        0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb,   \
        0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8,   \
        0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c,   \
        0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71,   \
        0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8,   \
        0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a,   \
        0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea,   \
        0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17,   \
        0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b,   \
        0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45,   \
        0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e          \
  }
inline constexpr unsigned char kSecretHost[kSecretBytes] = KVSTASH_XXH3_SECRET;
#if defined(__CUDACC__)
static __constant__ unsigned char kSecretDevice[kSecretBytes] = KVSTASH_XXH3_SECRET;
#endif
#undef KVSTASH_XXH3_SECRET

KVSTASH_HD static inline const unsigned char* secret() {
#if defined(__CUDA_ARCH__)
  return kSecretDevice;
#else
  return kSecretHost;
#endif
}

// Little-endian loads at any alignment: assembled from bytes on a GPU (which faults on
// unaligned words), one unaligned load on the host (which lets the compiler vectorize the
// stripe loop).
KVSTASH_HD static inline std::uint32_t read32(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
#else
  std::uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
#endif
}
KVSTASH_HD static inline std::uint64_t read64(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const std::uint64_t*>(p);
  return static_cast<std::uint64_t>(read32(p)) | static_cast<std::uint64_t>(read32(p + 4)) << 32;
#else
  std::uint64_t v;
  __builtin_memcpy(&v, p, 8);
  return v;
#endif
}
KVSTASH_HD static inline std::uint64_t rotl64(std::uint64_t v, int r) { return (v << r) | (v >> (64 - r)); }
KVSTASH_HD static inline std::uint32_t swap32(std::uint32_t v) {
  return (v << 24) | ((v << 8) & 0xff0000u) | ((v >> 8) & 0xff00u) | (v >> 24);
}
KVSTASH_HD static inline std::uint64_t swap64(std::uint64_t v) {
  return static_cast<std::uint64_t>(swap32(static_cast<std::uint32_t>(v))) << 32 |
         swap32(static_cast<std::uint32_t>(v >> 32));
}

// The 128-bit product of a and b, its halves xored.
KVSTASH_HD static inline std::uint64_t mul128_fold64(std::uint64_t a, std::uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<std::uint64_t>(p) ^ static_cast<std::uint64_t>(p >> 64);
#endif
}

KVSTASH_HD static inline std::uint64_t xxh64_avalanche(std::uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}
KVSTASH_HD static inline std::uint64_t avalanche(std::uint64_t h) {
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}
KVSTASH_HD static inline std::uint64_t rrmxmx(std::uint64_t h, std::uint64_t len) {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= kPrimeMx2;
  h ^= (h >> 35) + len;
  h *= kPrimeMx2;
  return h ^ (h >> 28);
}
KVSTASH_HD static inline std::uint64_t mix16(const unsigned char* in, const unsigned char* secret) {
  return mul128_fold64(read64(in) ^ read64(secret), read64(in + 8) ^ read64(secret + 8));
}

KVSTASH_HD static inline std::uint64_t hash_0_to_16(const unsigned char* in, std::uint64_t len) {
  const unsigned char* s = secret();
  if (len > 8) {
    const std::uint64_t lo = read64(in) ^ (read64(s + 24) ^ read64(s + 32));
    const std::uint64_t hi = read64(in + len - 8) ^ (read64(s + 40) ^ read64(s + 48));
    return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
  }
  if (len >= 4) {
    const std::uint64_t v = read32(in + len - 4) + (static_cast<std::uint64_t>(read32(in)) << 32);
    return rrmxmx(v ^ (read64(s + 8) ^ read64(s + 16)), len);
  }
  if (len > 0) {
    const std::uint32_t combined =
        static_cast<std::uint32_t>(in[0]) << 16 | static_cast<std::uint32_t>(in[len >> 1]) << 24 |
        static_cast<std::uint32_t>(in[len - 1]) | static_cast<std::uint32_t>(len) << 8;
    return xxh64_avalanche(combined ^ static_cast<std::uint64_t>(read32(s) ^ read32(s + 4)));
  }
  return xxh64_avalanche(read64(s + 56) ^ read64(s + 64));
}

KVSTASH_HD static inline std::uint64_t hash_17_to_128(const unsigned char* in, std::uint64_t len) {
  const unsigned char* s = secret();
  std::uint64_t acc = len * kPrime64_1;
  if (len > 32) {
    if (len > 64) {
      if (len > 96) acc += mix16(in + 48, s + 96) + mix16(in + len - 64, s + 112);
      acc += mix16(in + 32, s + 64) + mix16(in + len - 48, s + 80);
    }
    acc += mix16(in + 16, s + 32) + mix16(in + len - 32, s + 48);
  }
  acc += mix16(in, s) + mix16(in + len - 16, s + 16);
  return avalanche(acc);
}

KVSTASH_HD static inline std::uint64_t hash_129_to_240(const unsigned char* in, std::uint64_t len) {
  const unsigned char* s = secret();
  constexpr int kStartOffset = 3, kLastOffset = 17, kSecretMin = 136;
  std::uint64_t acc = len * kPrime64_1;
  const int rounds = static_cast<int>(len / 16);
  for (int i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i);
  acc = avalanche(acc);
  for (int i = 8; i < rounds; ++i) acc += mix16(in + 16 * i, s + 16 * (i - 8) + kStartOffset);
  acc += mix16(in + len - 16, s + kSecretMin - kLastOffset);
  return avalanche(acc);
}

// One 64-byte stripe into the eight accumulators. Lane i reads words i and i ^ 1 only, so
// a GPU may give each lane its own thread.
KVSTASH_HD static inline void accumulate_stripe(std::uint64_t acc[8], const unsigned char* in,
                                                const unsigned char* s) {
  for (int i = 0; i < 8; ++i) {
    const std::uint64_t v = read64(in + 8 * i);
    const std::uint64_t k = v ^ read64(s + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (k & 0xffffffffu) * (k >> 32);
  }
}

KVSTASH_HD static inline void scramble(std::uint64_t acc[8], const unsigned char* s) {
  for (int i = 0; i < 8; ++i) {
    std::uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= read64(s + 8 * i);
    acc[i] = a * kPrime32_1;
  }
}

KVSTASH_HD static inline std::uint64_t hash_long(const unsigned char* in, std::uint64_t len) {
  const unsigned char* s = secret();
  std::uint64_t acc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                          kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  const std::uint64_t blocks = (len - 1) / kLongBlockBytes;
  for (std::uint64_t b = 0; b < blocks; ++b) {
    const unsigned char* block = in + b * kLongBlockBytes;
    for (int st = 0; st < kStripesPerBlock; ++st)
      accumulate_stripe(acc, block + st * kStripeBytes, s + st * 8);
    scramble(acc, s + kSecretBytes - kStripeBytes);
  }
  const unsigned char* tail = in + blocks * kLongBlockBytes;
  const int stripes = static_cast<int>(((len - 1) - blocks * kLongBlockBytes) / kStripeBytes);
  for (int st = 0; st < stripes; ++st) accumulate_stripe(acc, tail + st * kStripeBytes, s + st * 8);
  constexpr int kLastAccStart = 7, kMergeAccsStart = 11;
  accumulate_stripe(acc, in + len - kStripeBytes, s + kSecretBytes - kStripeBytes - kLastAccStart);
  std::uint64_t h = len * kPrime64_1;
  for (int i = 0; i < 4; ++i) {
    h += mul128_fold64(acc[2 * i] ^ read64(s + kMergeAccsStart + 16 * i),
                       acc[2 * i + 1] ^ read64(s + kMergeAccsStart + 16 * i + 8));
  }
  return avalanche(h);
}

}  // namespace detail

// XXH3-64 of `len` bytes at `in` (seed 0, default secret).
KVSTASH_HD static inline std::uint64_t xxh3_64(const void* data, std::uint64_t len) {
  const auto* in = static_cast<const unsigned char*>(data);
  if (len <= 16) return detail::hash_0_to_16(in, len);
  if (len <= 128) return detail::hash_17_to_128(in, len);
  if (len <= 240) return detail::hash_129_to_240(in, len);
  return detail::hash_long(in, len);
}

// Blocks of an n-byte segment.
KVSTASH_HD static inline std::uint64_t block_count(std::uint64_t n) {
  return (n + kBlockBytes - 1) / kBlockBytes;
}

// Folds k digests and a length into one sum: XXH3-64 over (le64 words[0..k), le64 length).
// `words` must have room for k + 1 entries: words[k] is overwritten with the length, so that
// the fold hashes one contiguous array on any device.
KVSTASH_HD static inline std::uint64_t fold(std::uint64_t* words, std::uint64_t k, std::uint64_t length) {
  words[k] = length;
  return xxh3_64(words, (k + 1) * 8);
}

}  // namespace kvstash::sum
