// The references every kvstash-bench row is compared with, measured in the same run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvstash::bench {

// Single-core memcpy of `size` bytes between two private buffers, GB/s (1e9 bytes/s).
double memcpy_gbps(std::size_t size, double seconds);

// The sink side of the raw socket stream: accepts on `host` (numeric IPv4), any free port,
// in a background thread, and returns the port (0 on failure).
std::uint16_t start_socket_sink(const std::string& host);

// One plain TCP stream on loopback to the sink, GB/s: `total` bytes sent from a `size`-byte
// buffer and received into a `size`-byte buffer, so the reference touches the same amount of
// memory as a transfer of that size (a 64 MiB row is not compared with cache-hot buffers).
double socket_stream_gbps(const std::string& host, std::uint16_t port, std::size_t size, std::size_t total);

// A raw request/response on one plain TCP connection to the sink: `size` bytes sent, a 1-byte
// answer awaited, repeated for about `seconds`. The median round trip in microseconds (0 on
// failure): what a small one-sided transfer over tcp is held to.
double socket_roundtrip_us(const std::string& host, std::uint16_t port, std::size_t size, double seconds);

}  // namespace kvstash::bench
