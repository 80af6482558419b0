#include "common/net.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

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

std::string same_host_any_port(std::string_view host_port) {
  std::string out(host_port.substr(0, host_port.rfind(':')));
  out += ":0";
  return out;
}

Status wait_fd(int fd, short events, Deadline deadline, std::string_view what) {
  for (;;) {
    // Rounded up: a wait ends at the deadline, never up to a millisecond before it.
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      std::string m(what);
      return Status::timeout(m.append(" timed out"));
    }
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (n > 0) return {};
    if (n < 0 && errno != EINTR) return Status::from_errno("poll", errno);
  }
}

Status send_all(int fd, const void* data, std::size_t n, Deadline deadline, std::string_view what) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    KVSTASH_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, deadline, what));
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      std::string m(what);
      return Status::unavailable(m.append(": ").append(std::strerror(errno)));
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return {};
}

Status recv_all(int fd, void* data, std::size_t n, Deadline deadline, std::string_view what) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    KVSTASH_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline, what));
    ssize_t k = ::recv(fd, p, n, 0);
    if (k == 0) {
      std::string m(what);
      return Status::unavailable(m.append(": the peer closed the connection"));
    }
    if (k < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      std::string m(what);
      return Status::unavailable(m.append(": ").append(std::strerror(errno)));
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return {};
}

namespace {

using AddrInfo = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// getaddrinfo on a thread of its own, waited for up to the deadline: a name server that does
// not answer must not hold the caller past it (getaddrinfo has no timeout of its own). A
// lookup that outlives its caller finishes, and frees its result, on its thread.
Result<AddrInfo> lookup(const std::string& host, const std::string& port, int flags, Deadline deadline) {
  struct Query {
    std::mutex mu;
    std::condition_variable done_cv;
    bool done = false;
    int rc = 0;
    addrinfo* res = nullptr;
    ~Query() {
      if (res != nullptr) freeaddrinfo(res);
    }
  };
  auto q = std::make_shared<Query>();
  std::thread([q, host, port, flags] {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = flags;
    addrinfo* res = nullptr;
    const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    std::lock_guard lock(q->mu);
    q->rc = rc;
    q->res = res;
    q->done = true;
    q->done_cv.notify_all();
  }).detach();
  std::unique_lock lock(q->mu);
  if (!q->done_cv.wait_until(lock, deadline, [&] { return q->done; })) {
    return Status::timeout("resolving '" + host + "' timed out");
  }
  if (q->rc != 0) return Status::unavailable("cannot resolve '" + host + "': " + gai_strerror(q->rc));
  return AddrInfo(std::exchange(q->res, nullptr), freeaddrinfo);
}

// `host`'s addresses for `port`. A numeric host needs no name server: answered here, without
// a thread; a name goes through lookup(), within the deadline.
Result<AddrInfo> addresses(const std::string& host, const std::string& port, Deadline deadline) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) == 0) return AddrInfo(res, freeaddrinfo);
  return lookup(host, port, AI_NUMERICSERV, deadline);
}

}  // namespace

Result<std::vector<std::string>> resolve(const std::string& host, Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(AddrInfo found, addresses(host, "0", deadline));
  std::vector<std::string> out;
  for (addrinfo* ai = found.get(); ai != nullptr; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* a = ai->ai_family == AF_INET6
                        ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr)
                        : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr);
    if (inet_ntop(ai->ai_family, a, text, sizeof text) != nullptr &&
        std::find(out.begin(), out.end(), text) == out.end()) {
      out.emplace_back(text);
    }
  }
  if (out.empty()) return Status::unavailable("no address for '" + host + "'");
  return out;
}

Result<UniqueFd> connect_tcp(const HostPort& hp, Deadline deadline) {
  const std::string port = std::to_string(hp.port);
  KVSTASH_ASSIGN_OR_RETURN(AddrInfo found, addresses(hp.host, port, deadline));
  Status last = Status::unavailable("no address for '" + hp.host + "'");
  for (addrinfo* ai = found.get(); ai != nullptr; ai = ai->ai_next) {
    UniqueFd s(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (s.get() < 0) return Status::from_errno("socket", errno);
    if (::connect(s.get(), ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last = Status::unavailable("connect " + hp.host + ":" + port + ": " + std::strerror(errno));
      continue;
    }
    KVSTASH_RETURN_IF_ERROR(wait_fd(s.get(), POLLOUT, deadline, "connect"));
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      last = Status::unavailable("connect " + hp.host + ":" + port + ": " + std::strerror(err));
      continue;
    }
    int one = 1;
    setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return s;
  }
  return last;
}

}  // namespace kvstash::net
