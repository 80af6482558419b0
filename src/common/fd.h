// UniqueFd: the one owner of a POSIX file descriptor in kvstash (sockets, memfds, eventfds,
// pipes, files). Move-only; closes what it holds when destroyed or reset. Not thread-safe:
// like any value, one thread changes it at a time.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <utility>

namespace kvstash {

class UniqueFd {
 public:
  UniqueFd() = default;
  // Takes ownership of `fd`; -1 (what a failed open/socket/accept returns) holds nothing.
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

  // Closes what it holds, then holds `fd`.
  //
  // close() is called once, never again on EINTR: Linux frees the descriptor even when
  // close is interrupted, so a retry could close a descriptor another thread has just been
  // given. errno is kept, so code that reads it after a failed call may drop descriptors
  // (return early, reset) first.
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0 && fd_ != fd) {
      const int saved = errno;
      ::close(fd_);
      errno = saved;
    }
    fd_ = fd;
  }

  // Gives the descriptor up without closing it; holds nothing afterwards.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

}  // namespace kvstash
