// The references every kvstash-bench row is compared with, measured in the same run.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvstash::bench {

// Single-core memcpy of `size` bytes between two private buffers, GB/s (1e9 bytes/s).
double memcpy_gbps(std::size_t size, double seconds);

// The sink side of the raw socket stream: accepts on 127.0.0.1:0 in a background thread
// and returns the port. Each message is a u64 length then the bytes; it answers one byte.
std::uint16_t start_socket_sink();

// One plain TCP stream to a sink on loopback: `total` bytes sent `chunk` bytes per send(), GB/s.
double socket_stream_gbps(std::uint16_t port, std::size_t chunk, std::size_t total);

}  // namespace kvstash::bench
