#include "history/codec.h"

//   kvstash-history --minutes 30 --json r.json what scripts/chaos runs
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <hiredis/hiredis.h>

#include "kvstash/status.h"
#include "kvstash/store.h"
#include "metadata/cell_admin.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"
#include "node/ssd_device.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::history {

using namespace std::chrono_literals;
using nlohmann::json;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Even keys are recoverable ("kvp:", which the nodes' tiers give back to a cell that lost its
// Redis: docs/metadata.md), odd ones are not.
std::string key_name(int k) {
  char buf[24];
  std::snprintf(buf, sizeof buf, k % 2 == 0 ? "kvp:h/k%02d" : "h/k%02d", k);
  return buf;
}
bool recoverable(std::string_view key) { return key.starts_with("kvp:"); }

std::uint64_t key_hash(std::string_view key) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : key) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// The bytes put `put_id` writes for `key`: each 512-byte block starts with (magic, key hash,
// put id, offset) and continues with bytes only that put and offset produce.
void encode(std::string_view key, std::uint64_t put_id, std::span<std::byte> out) {
  const std::uint64_t kh = key_hash(key);
  for (std::size_t off = 0; off < out.size(); off += kBlock) {
    const std::size_t n = std::min(kBlock, out.size() - off);
    std::uint64_t words[kBlock / 8];
    words[0] = kMagic;
    words[1] = kh;
    words[2] = put_id;
    words[3] = off;
    std::uint64_t x = put_id * 0x9e3779b97f4a7c15ull ^ (off + 1) * 0xbf58476d1ce4e5b9ull;
    for (std::size_t i = 4; i < kBlock / 8; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      words[i] = x;
    }
    std::memcpy(out.data() + off, words, n);
  }
}

Decoded decode(std::string_view key, std::span<const std::byte> bytes, std::vector<std::byte>& scratch) {
  Decoded d;
  if (bytes.size() < 32) {
    d.problem = "object of " + std::to_string(bytes.size()) + " bytes is too short to hold a header";
    return d;
  }
  std::uint64_t h[4];
  std::memcpy(h, bytes.data(), sizeof h);
  if (h[0] != kMagic || h[1] != key_hash(key) || h[3] != 0) {
    d.problem = "first block is not this key's (foreign or garbage bytes)";
    return d;
  }
  d.put_id = h[2];
  scratch.resize(bytes.size());
  encode(key, d.put_id, scratch);
  if (std::memcmp(scratch.data(), bytes.data(), bytes.size()) == 0) {
    d.whole = true;
    return d;
  }
  for (std::size_t off = 0; off < bytes.size(); off += kBlock) {
    const std::size_t n = std::min(kBlock, bytes.size() - off);
    if (std::memcmp(scratch.data() + off, bytes.data() + off, n) == 0) continue;
    std::ostringstream m;
    m << "torn: put " << d.put_id << "'s bytes, but the block at offset " << off;
    if (n >= 32) {
      std::memcpy(h, bytes.data() + off, sizeof h);
      if (h[0] == kMagic) {
        m << " holds put " << h[2] << " of " << (h[1] == key_hash(key) ? "this key" : "another key")
          << " at offset " << h[3];
      } else {
        m << " holds no header";
      }
    } else {
      m << " differs";
    }
    d.problem = m.str();
    break;
  }
  return d;
}

}  // namespace kvstash::history
