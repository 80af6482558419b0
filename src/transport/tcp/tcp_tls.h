// TLS under the tcp transport: OpenSSL over the connection's own non-blocking socket.
//
// The datapath keeps its shape: where it makes a non-blocking syscall on a plain connection it
// calls TlsSession instead, which answers the same way (bytes moved; 0 when the peer closed;
// -1 with errno EAGAIN when the socket must become ready, read_wants() or write_wants() saying for what,
// since a TLS read may need to write and a write to read; -1 with another errno when the connection is over,
// error_text() saying why). No byte of a caller's buffer is touched outside a call, so the target's Guards
// keep their meaning.
//
// Before the TLS handshake a TLS target sends a ServerHello whose magic is kTlsServerMagic, in
// the clear: a plain client learns at once that it needs TLS, and a TLS client meeting a plain
// target reads kServerMagic there and gives up, both with kUnsupported, instead of each side
// waiting for the other until a timeout.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "kvstash/transfer.h"
#include "kvstash/types.h"

struct ssl_st;
struct ssl_ctx_st;

namespace kvstash::transport::tcp {

inline constexpr std::uint32_t kTlsServerMagic = 0x4c54564b;  // "KVTL": TLS follows

// An SSL_CTX: a serving one (certificate, key, optional client CA) or a connecting one (CA,
// optional client certificate). TLS 1.2 at least, 1.3 preferred; no renegotiation, no session
// tickets. Immutable once made; shared by every session made from it, on any thread.
class TlsContext {
 public:
  // Errors: kInvalidArgument naming the option and OpenSSL's reason (a file missing,
  // unreadable, not PEM, or a key that does not match its certificate).
  static Result<std::shared_ptr<TlsContext>> serving(const TcpTlsOptions& options);
  static Result<std::shared_ptr<TlsContext>> connecting(const TcpTlsOptions& options);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  ssl_ctx_st* get() const { return ctx_; }
  const std::string& server_name() const { return server_name_; }

 private:
  explicit TlsContext(ssl_ctx_st* ctx) : ctx_(ctx) {}
  ssl_ctx_st* ctx_;
  std::string server_name_;  // connecting: the name a node's certificate must carry; empty: its host
};

// One TLS connection over a non-blocking socket it does not own (closing the socket is the
// caller's; the session never closes it and sends no close_notify). read/write/readv/writev
// may be called from two threads at once (the initiator's caller thread sends while its strand
// reads): a mutex serializes them, uncontended on the target, whose connection is one strand.
class TlsSession {
 public:
  enum class Wait : std::uint8_t { kRead, kWrite };
  // `peer_name`: connecting sessions check the node's certificate against it (an IP address
  // or a DNS name; SNI carries a DNS name). Errors: kInternal (OpenSSL out of memory).
  static Result<std::unique_ptr<TlsSession>> make(const TlsContext& context, int fd, bool serving,
                                                  std::string_view peer_name = {});
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // The TLS handshake, one non-blocking step: 1 when done, -1 with errno EAGAIN (see write_wants()),
  // or -1 with failure() saying why it failed.
  int handshake();
  // kPermissionDenied: a certificate refused, ours or the peer's; kUnavailable: the peer closed
  // the connection or spoke something else than TLS.
  Status failure() const { return failure_; }

  ssize_t read(void* data, std::size_t n);
  ssize_t write(const void* data, std::size_t n);
  // Into (out of) several buffers in order; stops at the first that is not filled (sent) whole.
  // writev gathers a run of small buffers into one record (a request header with its payload's
  // first bytes), so a small WRITE costs one record and one send, not two. After EAGAIN the
  // next call must offer the same bytes again, from the same offset (every caller does: it
  // moved nothing).
  ssize_t readv(const iovec* iov, std::size_t count);
  ssize_t writev(const iovec* iov, std::size_t count);
  // After EAGAIN from a read (a write, the handshake): what the socket must become ready for.
  // Each side keeps its own, so the reader never waits for what the writer needs.
  Wait read_wants() const { return read_wants_; }
  Wait write_wants() const { return write_wants_; }
  // A write that returned EAGAIN may have sent part of its record already: the stream is no
  // longer at a request boundary.
  bool write_pending() const { return write_pending_; }
  // Why the last call failed (not EAGAIN): OpenSSL's reason, or strerror of errno.
  std::string error_text(int err) const;
  // The negotiated protocol and cipher ("TLSv1.3 TLS_AES_256_GCM_SHA384"), for logs.
  std::string describe() const;

 private:
  TlsSession(ssl_st* ssl, int fd, bool serving) : ssl_(ssl), fd_(fd), serving_(serving) {}
  friend struct SocketBio;
  // Maps a call's result (<= 0) onto the errno convention, noting in `wants` what to wait
  // for; needs mu_.
  ssize_t failed(int ret, Wait& wants);
  ssize_t write_locked(const void* data, std::size_t n);

  ssl_st* ssl_;
  int fd_;
  bool serving_;
  // Set while a write has more records to send after the one going out: its send() carries
  // MSG_MORE, so the kernel packs records into full segments instead of pushing each.
  bool more_ = false;
  std::mutex mu_;
  Wait read_wants_ = Wait::kRead;
  Wait write_wants_ = Wait::kWrite;
  bool write_pending_ = false;
  std::string last_error_;
  Status failure_;
  // writev's gathered record, kept until OpenSSL took it (a retry must offer the same bytes).
  static constexpr std::size_t kStageBytes = 16384;  // one full TLS record
  std::unique_ptr<std::byte[]> stage_;
  std::size_t staged_ = 0;
};

// The connecting side's handshake on a socket whose plain kvstash handshake has not begun:
// reads the target's preamble, runs TLS, and returns the session, within `deadline`. Errors:
// kUnsupported (the target serves plain tcp), kPermissionDenied (a certificate refused),
// kTimeout, kUnavailable.
Result<std::unique_ptr<TlsSession>> connect_tls(const TlsContext& context, int fd, std::string_view peer_name,
                                                Deadline deadline);
// Sends or receives exactly n bytes through `session` within `deadline` (the token handshake
// inside TLS). Errors: kTimeout, kUnavailable, kPermissionDenied (an alert about our
// certificate, which TLS 1.3 delivers only after the handshake).
Status tls_send_all(TlsSession& session, int fd, const void* data, std::size_t n, Deadline deadline);
Status tls_recv_all(TlsSession& session, int fd, void* data, std::size_t n, Deadline deadline);

}  // namespace kvstash::transport::tcp
