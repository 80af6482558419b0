// The shm transport's UNIX sockets: messages with a file descriptor attached (SCM_RIGHTS) on
// SOCK_SEQPACKET, the peer's uid (SO_PEERCRED), connecting within a deadline, and the private
// directory the sockets live in. Every wait is a poll bounded by the caller's deadline.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "common/fd.h"
#include "kvstash/status.h"
#include "kvstash/types.h"

namespace kvstash::transport::shm {

// Sends one message on a SOCK_SEQPACKET socket, with `fd_to_send` attached (SCM_RIGHTS) when
// >= 0. Never blocks past the deadline; a deadline already passed still lets a send that needs
// no waiting go through. kUnavailable once the peer closed the connection.
Status send_message(int sock, std::string_view bytes, int fd_to_send, Deadline deadline);

struct Message {
  std::string bytes;
  UniqueFd fd;  // the first descriptor received; others are closed
};

// Receives one message of at most kMaxMessage bytes (shm_wire.h) and at most one descriptor
// (extra ones are closed at once, so a misbehaving peer cannot make us leak descriptors).
// With `wait` false, returns kTimeout when nothing is queued. kUnavailable once the peer
// closed the connection; kCorrupt for a message (or its control data) that did not fit.
Result<Message> recv_message(int sock, Deadline deadline, bool wait = true);

// The uid of the process at the other end of `sock`; (uid_t)-1 with `*error` set when the
// kernel cannot say.
uid_t peer_uid(int sock, Status* error);

// A non-blocking SOCK_SEQPACKET connection to the socket at `path` (shorter than sun_path),
// retrying while the listener's backlog is full. kUnavailable when nothing listens there,
// kPermissionDenied without access, kTimeout.
Result<UniqueFd> connect_socket(const std::string& path, Deadline deadline);

// ---- the socket directory ------------------------------------------------------------------

// $XDG_RUNTIME_DIR/kvstash when XDG_RUNTIME_DIR is an absolute path, else /tmp/kvstash-<euid>.
std::string default_socket_dir();

// Creates `dir` 0700, or accepts an existing one only if it is a real directory we own;
// permissions wider than 0700 on our own directory are narrowed (with a warning) rather
// than refused, since nobody else can have put anything there that we then trust.
// kPermissionDenied for a symlink, a non-directory or another user's directory.
Status prepare_socket_dir(const std::string& dir);

}  // namespace kvstash::transport::shm
