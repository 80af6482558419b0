// The shm transport's UNIX sockets (shm_socket.h).
#include "transport/shm/shm_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/log.h"
#include "common/net.h"
#include "transport/shm/shm_wire.h"

namespace kvstash::transport::shm {

Status send_message(int sock, std::string_view bytes, int fd_to_send, Deadline deadline) {
  for (;;) {
    iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (fd_to_send >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd_to_send, sizeof(int));
    }
    const ssize_t n = ::sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n >= 0) return Status::ok();
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      KVSTASH_RETURN_IF_ERROR(net::wait_fd(sock, POLLOUT, deadline, "shm send"));
      continue;
    }
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
      return Status::unavailable("shm peer closed the connection");
    }
    return Status::from_errno("shm sendmsg", errno);
  }
}

Result<Message> recv_message(int sock, Deadline deadline, bool wait) {
  constexpr int kMaxFds = 4;
  for (;;) {
    Message m;
    m.bytes.resize(kMaxMessage);
    iovec iov{m.bytes.data(), m.bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait) return Status::timeout("no message");
        KVSTASH_RETURN_IF_ERROR(net::wait_fd(sock, POLLIN, deadline, "shm receive"));
        continue;
      }
      if (errno == ECONNRESET) return Status::unavailable("shm peer closed the connection");
      return Status::from_errno("shm recvmsg", errno);
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        if (!m.fd.valid()) {
          m.fd.reset(fd);
        } else {
          ::close(fd);
        }
      }
    }
    if (n == 0) return Status::unavailable("shm peer closed the connection");
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      return Status::corrupt("oversized message from shm peer");
    }
    m.bytes.resize(static_cast<std::size_t>(n));
    return m;
  }
}

uid_t peer_uid(int sock, Status* error) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    *error = Status::from_errno("SO_PEERCRED", errno);
    return static_cast<uid_t>(-1);
  }
  return cred.uid;
}

Result<UniqueFd> connect_socket(const std::string& path, Deadline deadline) {
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return Status::from_errno("shm: socket", errno);
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  std::memcpy(sa.sun_path, path.data(), path.size());  // the caller checked: < size
  for (;;) {
    if (::connect(sock.get(), reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0) break;
    if (errno == EINTR) continue;
    if (errno == EAGAIN) {  // the peer's backlog is full: retry each millisecond until the deadline
      if (Clock::now() >= deadline) return Status::timeout("shm: connect " + path);
      ::poll(nullptr, 0, 1);
      continue;
    }
    if (errno == EINPROGRESS) {
      KVSTASH_RETURN_IF_ERROR(net::wait_fd(sock.get(), POLLOUT, deadline, "shm connect"));
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(sock.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err == 0) break;
      errno = err;
    }
    if (errno == ENOENT || errno == ECONNREFUSED) {
      return Status::unavailable("shm: nothing listens at " + path);
    }
    if (errno == EACCES || errno == EPERM) {
      return Status::permission_denied("shm: no access to " + path);
    }
    return Status::from_errno("shm: connect " + path, errno);
  }
  return sock;
}

// ---- the socket directory ------------------------------------------------------------------

std::string default_socket_dir() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/kvstash";
  return "/tmp/kvstash-" + std::to_string(::geteuid());
}

Status prepare_socket_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status::from_errno("shm: cannot create socket directory " + dir, errno);
  }
  UniqueFd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!d.valid()) {
    if (errno == ELOOP || errno == ENOTDIR) {
      return Status::permission_denied("shm: socket directory " + dir +
                                       " is not a directory (or is a symlink)");
    }
    return Status::from_errno("shm: cannot open socket directory " + dir, errno);
  }
  struct stat st {};
  if (::fstat(d.get(), &st) != 0) return Status::from_errno("shm: stat " + dir, errno);
  if (st.st_uid != ::geteuid()) {
    return Status::permission_denied("shm: socket directory " + dir + " is owned by uid " +
                                     std::to_string(st.st_uid) + ", not by us");
  }
  if ((st.st_mode & 077) != 0) {
    KVSTASH_LOG_WARN("shm: socket directory {} had mode {:o}; narrowing it to 0700", dir, st.st_mode & 07777);
    if (::fchmod(d.get(), 0700) != 0) {
      return Status::from_errno("shm: chmod 0700 " + dir, errno);
    }
  }
  return Status::ok();
}

}  // namespace kvstash::transport::shm
