#include "common/net.h"

namespace kvstash::net {

// "host:port", "[v6]:port".
Result<HostPort> parse_host_port(std::string_view s) {
  HostPort hp;
  std::size_t colon;
  if (!s.empty() && s.front() == '[') {
    auto close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      return Status::invalid_argument("malformed address '" + std::string(s) + "'; expected [v6]:port");
    }
    hp.host = std::string(s.substr(1, close - 1));
    colon = close + 1;
  } else {
    colon = s.rfind(':');
    if (colon == std::string_view::npos) {
      return Status::invalid_argument("malformed address '" + std::string(s) + "'; expected host:port");
    }
    hp.host = std::string(s.substr(0, colon));
  }
  auto port = s.substr(colon + 1);
  unsigned long v = 0;
  if (port.empty() || port.size() > 5) v = 1u << 20;
  for (char c : port) v = (c >= '0' && c <= '9') ? v * 10 + static_cast<unsigned>(c - '0') : 1u << 20;
  if (v > 65535 || hp.host.empty()) {
    return Status::invalid_argument("malformed address '" + std::string(s) + "'; expected host:port");
  }
  hp.port = static_cast<std::uint16_t>(v);
  return hp;
}

}  // namespace kvstash::net
