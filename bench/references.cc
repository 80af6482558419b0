#include "references.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "kvstash/memory.h"

namespace kvstash::bench {
namespace {

using Clock = std::chrono::steady_clock;

bool read_full(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t k = ::recv(fd, c, n, 0);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

bool write_full(int fd, const void* p, std::size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

void serve(int fd) {
  // Each message: u64 buffer size, u64 total; the bytes land in a buffer of that size,
  // cycling through it, the way a transfer of that size lands in registered memory.
  std::unique_ptr<Buffer> buf;
  for (;;) {
    std::uint64_t hdr[2];
    if (!read_full(fd, hdr, sizeof hdr) || hdr[0] == 0) break;
    if (!buf || buf->size() != hdr[0]) {
      auto b = Buffer::allocate(hdr[0], {.shareable = false});
      if (!b.is_ok()) break;
      buf = std::make_unique<Buffer>(std::move(b).value());
    }
    std::size_t pos = 0;
    for (std::uint64_t left = hdr[1]; left > 0;) {
      std::size_t n = std::min<std::uint64_t>(left, buf->size() - pos);
      ssize_t k = ::recv(fd, buf->data() + pos, n, 0);
      if (k <= 0) goto done;
      left -= static_cast<std::uint64_t>(k);
      pos = (pos + static_cast<std::size_t>(k)) % buf->size();
    }
    char ack = 1;
    if (!write_full(fd, &ack, 1)) break;
  }
done:
  ::close(fd);
}

}  // namespace

double memcpy_gbps(std::size_t size, double seconds) {
  auto src = Buffer::allocate(size, {.shareable = false}).value();
  auto dst = Buffer::allocate(size, {.shareable = false}).value();
  std::memset(src.data(), 1, size);
  std::memcpy(dst.data(), src.data(), size);  // fault the pages in before timing
  std::size_t reps = 0;
  auto start = Clock::now();
  double elapsed = 0;
  do {
    std::memcpy(dst.data(), src.data(), size);
    ++reps;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds || reps < 3);
  return static_cast<double>(size) * static_cast<double>(reps) / elapsed / 1e9;
}

std::uint16_t start_socket_sink(const std::string& host) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) return 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 8) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    return 0;
  }
  std::thread([fd] {
    for (;;) {
      int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      std::thread(serve, c).detach();
    }
  }).detach();
  return ntohs(a.sin_port);
}

double socket_stream_gbps(const std::string& host, std::uint16_t port, std::size_t size, std::size_t total) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) return 0;
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return 0;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto src = Buffer::allocate(size, {.shareable = false}).value();
  std::memset(src.data(), 7, size);
  // A warm-up message lets the receiver allocate and fault in its buffer before timing.
  auto send_message = [&](std::uint64_t bytes) {
    std::uint64_t hdr[2] = {size, bytes};
    bool ok = write_full(fd, hdr, sizeof hdr);
    for (std::uint64_t sent = 0; ok && sent < bytes;) {
      std::size_t n = std::min<std::uint64_t>(bytes - sent, size);
      ok = write_full(fd, src.data(), n);
      sent += n;
    }
    char ack;
    return ok && read_full(fd, &ack, 1);
  };
  bool ok = send_message(size);
  auto start = Clock::now();
  ok = ok && send_message(total);
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  ::close(fd);
  return ok ? static_cast<double>(total) / elapsed / 1e9 : 0;
}

double socket_roundtrip_us(const std::string& host, std::uint16_t port, std::size_t size, double seconds) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (fd < 0 || ::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // One message per round trip, header and payload in one buffer (one send), as a request
  // that carries its bytes goes out.
  std::vector<char> message(16 + size, 7);
  const std::uint64_t hdr[2] = {size, size};
  std::memcpy(message.data(), hdr, sizeof hdr);
  std::vector<double> rtts;
  bool ok = true;
  const auto start = Clock::now();
  while (ok && (std::chrono::duration<double>(Clock::now() - start).count() < seconds || rtts.size() < 10)) {
    const auto t0 = Clock::now();
    char ack;
    ok = write_full(fd, message.data(), message.size()) && read_full(fd, &ack, 1);
    rtts.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  ::close(fd);
  if (!ok) return 0;
  std::nth_element(rtts.begin(), rtts.begin() + static_cast<std::ptrdiff_t>(rtts.size() / 2), rtts.end());
  return rtts[rtts.size() / 2];
}

}  // namespace kvstash::bench
