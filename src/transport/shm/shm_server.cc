// The shm transport's server thread (shm_server.h).
#include "transport/shm/shm_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/log.h"
#include "transport/shm/shm_socket.h"
#include "transport/shm/shm_wire.h"

namespace kvstash::transport::shm {

Server::Server(std::string socket_path, UniqueFd listen, UniqueFd wake, std::shared_ptr<Registry> registry)
    : socket_path_(std::move(socket_path)),
      listen_(std::move(listen)),
      wake_(std::move(wake)),
      registry_(std::move(registry)) {
  thread_ = std::thread([this] { serve(); });
}

Server::~Server() { stop(); }

void Server::stop() {
  if (!thread_.joinable()) return;
  const std::uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof one) != sizeof one) {
    KVSTASH_LOG_ERROR("shm: cannot wake the server thread: {}", std::strerror(errno));
  }
  thread_.join();
  ::unlink(socket_path_.c_str());
}

std::vector<TransportCounter> Server::counters() const {
  auto c = [](const char* name, const char* help, const std::atomic<std::uint64_t>& v) {
    return TransportCounter{TransportKind::kShm, name, help, v.load(std::memory_order_relaxed)};
  };
  return {
      c("connections_refused", "Connections refused: another uid, or the connection cap", refused_),
      c("accept_failures", "accept() failures (out of file descriptors or memory); the listener paused",
        accept_failures_),
      c("handshake_timeouts", "Connections closed for not saying hello in time", hello_timeouts_),
      c("unproven_evicted", "Connections that had not said hello, dropped for newer ones", unproven_evicted_),
  };
}

void Server::serve() {
  struct Conn {
    UniqueFd fd;
    // Until its hello: when it is dropped if still silent. None once it said hello.
    std::optional<Clock::time_point> hello_by;
  };
  std::vector<Conn> conns;
  std::size_t unproven = 0;
  Clock::time_point accept_paused_until{};
  std::vector<pollfd> fds;
  for (;;) {
    const auto now = Clock::now();
    const bool accepting = now >= accept_paused_until && conns.size() - unproven < kMaxConnections;
    Clock::time_point wake_at = now + std::chrono::seconds(60);
    if (now < accept_paused_until) wake_at = std::min(wake_at, accept_paused_until);
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({accepting ? listen_.get() : -1, POLLIN, 0});
    for (const Conn& c : conns) {
      fds.push_back({c.fd.get(), POLLIN | POLLRDHUP, 0});
      if (c.hello_by) wake_at = std::min(wake_at, *c.hello_by);
    }
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now).count();
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<std::int64_t>(ms, 0, 60000))) < 0) {
      if (errno == EINTR) continue;
      KVSTASH_LOG_ERROR("shm: server poll failed: {}", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    // Requests first, while fds[i] still lines up with conns[i - 2].
    const auto after = Clock::now();
    std::vector<bool> drop(conns.size(), false);
    for (std::size_t i = 0; i < conns.size(); ++i) {
      const short ev = fds[i + 2].revents;
      if ((ev & POLLIN) != 0) {
        bool said_hello = false;
        drop[i] = !handle(conns[i].fd.get(), &said_hello);
        if (said_hello && conns[i].hello_by) {
          conns[i].hello_by.reset();
          --unproven;
        }
      } else if (ev != 0) {
        drop[i] = true;  // hang-up or error
      }
      if (!drop[i] && conns[i].hello_by && after >= *conns[i].hello_by) {
        ++hello_timeouts_;
        KVSTASH_LOG_INFO_LIMITED("shm: dropped a connection on {} that did not say hello in time", socket_path_);
        drop[i] = true;
      }
    }
    for (std::size_t i = conns.size(); i-- > 0;) {
      if (!drop[i]) continue;
      if (conns[i].hello_by) --unproven;
      conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if ((fds[1].revents & POLLIN) == 0) continue;
    while (conns.size() - unproven < kMaxConnections) {
      UniqueFd c(::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!c.valid()) {
        const int e = errno;
        if (e == EAGAIN || e == EWOULDBLOCK) break;
        if (e == EINTR || e == ECONNABORTED) continue;
        // Out of descriptors or memory: the pending connection stays queued and accept would
        // fail again at once, so rest instead of spinning (closing connections frees some).
        ++accept_failures_;
        KVSTASH_LOG_WARN_LIMITED("shm: accept on {} failed: {} (pausing {} ms)", socket_path_, std::strerror(e),
                                 kAcceptPause.count());
        accept_paused_until = Clock::now() + kAcceptPause;
        break;
      }
      Status error;
      const uid_t uid = peer_uid(c.get(), &error);
      if (uid != ::geteuid()) {
        ++refused_;
        KVSTASH_LOG_WARN_LIMITED("shm: refused a connection from uid {} on {}", uid, socket_path_);
        (void)send_message(
            c.get(),
            encode_reply(MsgType::kRefused, 0, Status::permission_denied("shm peer runs as another user")), -1,
            Clock::now());
        continue;
      }
      if (unproven >= kMaxUnproven) {
        // The oldest silent connection has had the longest to say hello.
        for (std::size_t i = 0; i < conns.size(); ++i) {
          if (!conns[i].hello_by) continue;
          ++unproven_evicted_;
          conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
          --unproven;
          break;
        }
      }
      conns.push_back({std::move(c), Clock::now() + kHelloTimeout});
      ++unproven;
    }
  }
}

bool Server::handle(int sock, bool* said_hello) {
  auto m = recv_message(sock, Clock::now(), /*wait=*/false);
  if (!m.is_ok()) return m.status().code() == StatusCode::kTimeout;  // spurious wake-up
  // Clients never send descriptors; one that arrived anyway is closed with `m`.
  Request req;
  const Status decoded = decode_request(m->bytes, &req);
  if (decoded.code() == StatusCode::kUnsupported) {  // another version: say so, then hang up
    (void)send_message(sock, encode_reply(req.type, req.id, decoded), -1, Clock::now());
    return false;
  }
  if (!decoded.is_ok()) return false;
  switch (req.type) {
    case MsgType::kHello:
      *said_hello = true;
      return send_message(sock, encode_reply(req.type, req.id, Status::ok(), kKeySlots), registry_->fd(),
                          Clock::now())
          .is_ok();
    case MsgType::kImport: return registry_->reply_import(sock, req.id, req.slot, req.key).is_ok();
    default:
      (void)send_message(sock,
                         encode_reply(req.type, req.id, Status::invalid_argument("unknown shm request")), -1,
                         Clock::now());
      return true;
  }
}

}  // namespace kvstash::transport::shm
