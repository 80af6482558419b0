#include "service_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

namespace kvstash::kvstashd {

void notify_service_manager(std::string_view state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return;
  const std::string_view where(path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  // An absolute path, or '@' for a name in the abstract namespace (a leading NUL).
  if ((where[0] != '/' && where[0] != '@') || where.size() >= sizeof addr.sun_path) {
    std::cerr << "kvstashd: NOTIFY_SOCKET is neither a path nor an abstract name: " << where << "\n";
    return;
  }
  std::memcpy(addr.sun_path, where.data(), where.size());
  if (where[0] == '@') addr.sun_path[0] = '\0';
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + where.size());
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const ssize_t sent =
      ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&addr), len);
  const int err = errno;
  ::close(fd);
  static bool told = false;
  if (sent < 0 && !told) {
    told = true;
    std::cerr << "kvstashd: cannot tell the service manager (" << where << "): " << std::strerror(err)
              << "\n";
  }
}

}  // namespace kvstash::kvstashd
