// Shared by the fuzz targets: a check that turns a broken promise into a crash libFuzzer
// records, quiet logging, open-descriptor counting (a leak LeakSanitizer cannot see), and
// loopback socket helpers with deadlines, so that a target never waits unbounded.
//
// Each target keeps what it serves from (transports, servers, listeners) in a static made
// with `new` and never deleted: libFuzzer exits from inside its loop, and tearing transports
// down during exit would only race their threads. Still reachable, so not a leak to LSan.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "common/log.h"
#include "kvstash/status.h"

namespace kvstash::fuzz {

// A promise the code under test broke: print it and abort, which libFuzzer reports as a crash
// with the input that caused it.
#define FUZZ_CHECK(cond, ...)                                                              \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                   \
      std::fprintf(stderr, "\n");                                                          \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// The value of a set-up step that must work, or a crash that says which one did not.
template <typename T>
T must(Result<T> r, const char* what) {
  FUZZ_CHECK(r.is_ok(), "%s: %s", what, r.status().to_string().c_str());
  return std::move(r).value();
}

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

// A fresh directory for this process's sockets (<tmp>/kvstash-fuzz-<name>-<pid>), removed
// when the process exits.
inline std::filesystem::path scratch_dir(const std::string& name) {
  static std::vector<std::filesystem::path> dirs;
  auto dir =
      std::filesystem::temp_directory_path() / ("kvstash-fuzz-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  if (dirs.empty()) {
    std::atexit([] {
      std::error_code ignored;
      for (const auto& d : dirs) std::filesystem::remove_all(d, ignored);
    });
  }
  dirs.push_back(dir);
  return dir;
}

using Clock = std::chrono::steady_clock;

inline int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left);
}

// A TCP socket connected to 127.0.0.1:port, or -1 with errno set. Closing it resets the
// connection instead of leaving it in TIME_WAIT: at a thousand inputs a second those would
// use up the ephemeral ports within a minute. A refused or unroutable attempt is retried for
// half a second (a port still in TIME_WAIT on the other side refuses now and then). The
// connect is non-blocking, so that libFuzzer's timer signal cannot interrupt it halfway.
inline int connect_loopback(std::uint16_t port) {
  int err = 0;
  for (int attempt = 0; attempt < 50; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    err = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
    if (err == EINPROGRESS || err == EINTR) {
      pollfd p{fd, POLLOUT, 0};
      while (::poll(&p, 1, 5000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof err;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
    if (err == 0) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      linger no_linger{1, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &no_linger, sizeof no_linger);
      return fd;
    }
    ::close(fd);
    if (err != ECONNREFUSED && err != EADDRNOTAVAIL && err != EAGAIN) break;
    ::usleep(10000);
  }
  errno = err;
  return -1;
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

// The next connection on `listener`, going on after a signal; -1 when none came by the deadline.
inline int accept_until(int listener, Clock::time_point deadline) {
  while (wait_for(listener, POLLIN, deadline)) {
    const int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (c >= 0 || (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED)) return c;
  }
  return -1;
}

// One recv() that waits up to the deadline and goes on after a signal: > 0 bytes, 0 at the
// peer's end, -1 on error or at the deadline.
inline ssize_t recv_some(int fd, void* buf, std::size_t n, Clock::time_point deadline) {
  while (wait_for(fd, POLLIN, deadline)) {
    const ssize_t got = ::recv(fd, buf, n, MSG_DONTWAIT);
    if (got >= 0 || (errno != EINTR && errno != EAGAIN)) return got;
  }
  return -1;
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

// Sends `data` while reading whatever comes back (kept in *got up to `keep` bytes, else
// dropped), so that a peer blocked on writing its answers never blocks us in turn. False when the peer closed
// or stopped reading before taking everything, or at the deadline.
inline bool converse(int fd, std::string_view data, Clock::time_point deadline, std::string* got = nullptr,
                     std::size_t keep = 0) {
  char buf[16384];
  while (!data.empty()) {
    pollfd p{fd, POLLIN | POLLOUT, 0};
    int rc = ::poll(&p, 1, ms_left(deadline));
    if (rc == 0) return false;
    if (rc < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if ((p.revents & POLLIN) != 0) {
      ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return false;
      if (n > 0 && got != nullptr && got->size() < keep) {
        got->append(buf, std::min<std::size_t>(static_cast<std::size_t>(n), keep - got->size()));
      }
    }
    if ((p.revents & POLLOUT) != 0) {
      ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        data.remove_prefix(static_cast<std::size_t>(n));
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        return false;
      }
    }
    if ((p.revents & (POLLERR | POLLHUP)) != 0 && (p.revents & POLLIN) == 0) return false;
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
