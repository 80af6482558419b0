// Host and port text for the addresses kvstash binds and advertises.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvstash/status.h"

namespace kvstash::net {

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
};

// "host:port", "[v6]:port". kInvalidArgument naming the text otherwise.
Result<HostPort> parse_host_port(std::string_view s);

}  // namespace kvstash::net
