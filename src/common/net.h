// Host and port text for the addresses kvstash binds and advertises.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/fd.h"
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

// Blocking socket helpers for connection setup (handshakes), each bounded by a deadline.
// `what` names the step in errors: kTimeout "<what> timed out", kUnavailable "<what>: ...".
Status wait_fd(int fd, short events, Deadline deadline, std::string_view what);
Status send_all(int fd, const void* data, std::size_t n, Deadline deadline, std::string_view what);
Status recv_all(int fd, void* data, std::size_t n, Deadline deadline, std::string_view what);

// A non-blocking TCP connection (TCP_NODELAY) to the first address of `hp` that answers.
// Name resolution counts against the deadline too. Errors: kUnavailable (unresolvable,
// refused), kTimeout.
Result<UniqueFd> connect_tcp(const HostPort& hp, Deadline deadline);

// The numeric addresses of `host` (itself when it is one), resolved within the deadline.
// Errors: kUnavailable (unresolvable), kTimeout.
Result<std::vector<std::string>> resolve(const std::string& host, Deadline deadline);

}  // namespace kvstash::net
