// Shared by the fuzz targets: a check that turns a broken promise into a crash libFuzzer
// records, quiet logging, open-descriptor counting (a leak LeakSanitizer cannot see), and
// blocking loopback socket helpers with deadlines, so that a target never waits unbounded.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "common/log.h"

namespace kvstash::fuzz {

// A promise the code under test broke: print it and abort, which libFuzzer reports as a crash
// with the input that caused it.
#define FUZZ_CHECK(cond, ...)                                             \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s: ", __FILE__, \
                   __LINE__, #cond);                                      \
      std::fprintf(stderr, __VA_ARGS__);                                  \
      std::fprintf(stderr, "\n");                                         \
      std::abort();                                                       \
    }                                                                     \
  } while (0)

// Every malformed input makes the library warn; at thousands of inputs a second that is all a
// run would print. KVSTASH_LOG still wins when set.
inline void quiet_logs() {
  if (std::getenv("KVSTASH_LOG") == nullptr) log::get().set_level(spdlog::level::off);
}

// Descriptors this process has open.
inline int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
    --n;  // the directory's own
  }
  return n;
}

using Clock = std::chrono::steady_clock;

inline int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left);
}

// A connected blocking TCP socket to 127.0.0.1:port, or -1.
inline int connect_loopback(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// Waits for `events` on fd until the deadline; false on timeout.
inline bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    int rc = ::poll(&p, 1, ms_left(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return true;  // let the next call report the error
  }
}

// Sends all of `data` unless the peer stops reading or closes; false then.
inline bool send_all(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    if (!wait_for(fd, POLLOUT, deadline)) return false;
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

// Reads exactly n bytes; false on EOF, error or deadline.
inline bool recv_exact(int fd, void* out, std::size_t n, Clock::time_point deadline) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    if (!wait_for(fd, POLLIN, deadline)) return false;
    ssize_t got = ::recv(fd, p, n, MSG_DONTWAIT);
    if (got > 0) {
      p += got;
      n -= static_cast<std::size_t>(got);
    } else if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

enum class Drain { kClosed, kTimeout };

// Reads (and drops, keeping at most `keep` bytes in *out) until the peer closes or the deadline.
inline Drain drain(int fd, Clock::time_point deadline, std::string* out = nullptr, std::size_t keep = 0) {
  char buf[16384];
  for (;;) {
    if (!wait_for(fd, POLLIN, deadline)) return Drain::kTimeout;
    ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      if (out != nullptr && out->size() < keep) {
        out->append(buf, std::min<std::size_t>(static_cast<std::size_t>(n), keep - out->size()));
      }
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      continue;
    } else {
      return Drain::kClosed;  // EOF or reset
    }
  }
}

}  // namespace kvstash::fuzz
