#include "sessions.h"

#include <cstring>
#include <fstream>
#include <string>

#include "common/units.h"

namespace kvstash::bench {

std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void fill_pattern(std::byte* p, std::size_t n, std::uint64_t backend, std::uint64_t round,
                  std::uint64_t session) {
  std::uint64_t state = (backend << 48) ^ (round << 32) ^ session;
  state = splitmix64(state);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t w = splitmix64(state);
    std::memcpy(p + i, &w, 8);
  }
  if (i < n) {
    const std::uint64_t w = splitmix64(state);
    std::memcpy(p + i, &w, n - i);
  }
}

std::vector<std::uint64_t> session_sizes(const StoreBenchOptions& o) {
  std::vector<std::uint64_t> sizes;
  std::uint64_t state = 0x6b7673746173682dull;  // fixed: runs compare
  for (std::uint32_t s = 0; s < o.sessions; ++s) {
    if (o.object_size != 0) {
      sizes.push_back(o.object_size);
      continue;
    }
    const std::uint64_t span = o.max_tokens - o.min_tokens + 1ull;
    sizes.push_back((o.min_tokens + splitmix64(state) % span) * kKvBytesPerToken);
  }
  return sizes;
}

std::uint64_t round_up(std::uint64_t n, std::uint64_t unit) { return (n + unit - 1) / unit * unit; }

std::uint64_t pages_for(const std::vector<std::uint64_t>& sizes, std::uint64_t page) {
  std::uint64_t n = 0;
  for (auto size : sizes) n += (size + page - 1) / page;
  return n;
}

std::uint64_t mem_available() {
  std::ifstream f("/proc/meminfo");
  for (std::string name; f >> name;) {
    std::uint64_t kib = 0;
    f >> kib;
    if (name == "MemAvailable:") return kib << 10;
    f.ignore(1 << 10, '\n');
  }
  return 0;
}

Status allocate_sessions(Sessions& s) {
  for (auto size : s.sizes) {
    auto b = Buffer::allocate(size);
    if (!b.is_ok()) return b.status().with_context("allocate a session of " + units::format_size(size));
    s.source.push_back(std::move(*b));
  }
  auto r = Buffer::allocate(s.largest);
  if (!r.is_ok()) return r.status().with_context("allocate the restore buffer");
  s.restore = std::move(*r);
  return {};
}

}  // namespace kvstash::bench
