// Helpers shared by the test suites.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>

namespace kvstash::test {

// Deterministic pseudo-random bytes (splitmix64), so a failure can be reproduced by seed.
inline void fill_random(std::span<std::byte> out, std::uint64_t seed) {
  std::uint64_t x = seed;
  std::size_t i = 0;
  while (i < out.size()) {
    x += 0x9e3779b97f4a7c15ull;
    std::uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::size_t n = std::min(sizeof z, out.size() - i);
    std::memcpy(out.data() + i, &z, n);
    i += n;
  }
}

// Index of the first differing byte, or -1 when equal.
inline long long first_mismatch(const void* a, const void* b, std::size_t n) {
  if (std::memcmp(a, b, n) == 0) return -1;
  auto* x = static_cast<const unsigned char*>(a);
  auto* y = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < n; ++i) {
    if (x[i] != y[i]) return static_cast<long long>(i);
  }
  return -1;
}

// Whether `pred` holds within `limit` (polled every few milliseconds).
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return pred();
}

}  // namespace kvstash::test
