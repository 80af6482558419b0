// Host and port text for the addresses kvstash binds and advertises.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::net {

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
};

// "host:port", "[v6]:port". kInvalidArgument naming the text otherwise.
Result<HostPort> parse_host_port(std::string_view s);

// "host:0" for "host:port" (also "[v6]:port"): another listener on the same host, any port.
std::string same_host_any_port(std::string_view host_port);

// An owned file descriptor (-1: none).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept;
  ~Fd();
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

// Blocking socket helpers for connection setup (handshakes), each bounded by a deadline.
// `what` names the step in errors: kTimeout "<what> timed out", kUnavailable "<what>: ...".
Status wait_fd(int fd, short events, Deadline deadline, std::string_view what);
Status send_all(int fd, const void* data, std::size_t n, Deadline deadline, std::string_view what);
Status recv_all(int fd, void* data, std::size_t n, Deadline deadline, std::string_view what);

// A non-blocking TCP connection (TCP_NODELAY) to the first address of `hp` that answers.
// Name resolution counts against the deadline too. Errors: kUnavailable (unresolvable,
// refused), kTimeout.
Result<Fd> connect_tcp(const HostPort& hp, Deadline deadline);

// The numeric addresses of `host` (itself when it is one), resolved within the deadline.
// Errors: kUnavailable (unresolvable), kTimeout.
Result<std::vector<std::string>> resolve(const std::string& host, Deadline deadline);

}  // namespace kvstash::net
