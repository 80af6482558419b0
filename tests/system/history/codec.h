// kvstash-history's bytes: every put's bytes encode (key, put id, offset), so that a get's bytes
// say whose they are; and the keys the clients use (even ones recoverable from a node's tier).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvstash::history {

constexpr std::uint64_t kMagic = 0x6b76737461736821ull;  // "!hsatsvk"
constexpr std::size_t kBlock = 512;                      // one header per block
constexpr int kKeys = 24;

// CLOCK_MONOTONIC in ns: shared by the processes of one host, so clients' logs compare.
std::int64_t now_ns();
// Key k of the run: even ones recoverable ("kvp:", which a node's tier gives back to a cell
// that lost its Redis), odd ones not.
std::string key_name(int k);
bool recoverable(std::string_view key);
std::uint64_t key_hash(std::string_view key);
// Fills `out` with put `put_id`'s bytes of `key`.
void encode(std::string_view key, std::uint64_t put_id, std::span<std::byte> out);

// What a get's bytes hold: one whole put (its id), or a description of what is wrong.
struct Decoded {
  bool whole = false;
  std::uint64_t put_id = 0;
  std::string problem;
};

Decoded decode(std::string_view key, std::span<const std::byte> bytes, std::vector<std::byte>& scratch);

}  // namespace kvstash::history
