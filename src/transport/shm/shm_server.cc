// The shm transport's server thread (shm_server.h).
#include "transport/shm/shm_server.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
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

void Server::serve() {
  constexpr std::size_t kMaxConnections = 1024;
  std::vector<UniqueFd> conns;
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_.get(), POLLIN, 0});
    fds.push_back({listen_.get(), static_cast<short>(conns.size() < kMaxConnections ? POLLIN : 0), 0});
    for (const UniqueFd& c : conns) fds.push_back({c.get(), POLLIN | POLLRDHUP, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      KVSTASH_LOG_ERROR("shm: server poll failed: {}", std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) break;
    // Requests first, while fds[i] still lines up with conns[i - 2].
    std::vector<bool> drop(conns.size(), false);
    for (std::size_t i = 0; i < conns.size(); ++i) {
      const short ev = fds[i + 2].revents;
      if ((ev & POLLIN) != 0) {
        drop[i] = !handle(conns[i].get());
      } else if (ev != 0) {
        drop[i] = true;  // hang-up or error
      }
    }
    for (std::size_t i = conns.size(); i-- > 0;) {
      if (drop[i]) conns.erase(conns.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if ((fds[1].revents & POLLIN) != 0) {
      for (;;) {
        UniqueFd c(::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
        if (!c.valid()) break;  // EAGAIN, or a connection that died before we got to it
        Status error;
        const uid_t uid = peer_uid(c.get(), &error);
        if (uid != ::geteuid()) {
          KVSTASH_LOG_WARN("shm: refused a connection from uid {} on {}", uid, socket_path_);
          (void)send_message(
              c.get(),
              encode_reply(MsgType::kRefused, 0, Status::permission_denied("shm peer runs as another user")),
              -1, Clock::now());
          continue;
        }
        conns.push_back(std::move(c));
        if (conns.size() >= kMaxConnections) break;
      }
    }
  }
}

bool Server::handle(int sock) {
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
