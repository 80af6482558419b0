// TLS under the tcp transport: contexts from TcpTlsOptions, sessions over non-blocking sockets.
#include "transport/tcp/tcp_tls.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include <fmt/format.h>

#include "common/net.h"

namespace kvstash::transport::tcp {
namespace {

// OpenSSL's reason for the oldest error on this thread's queue, which it then empties.
std::string openssl_reason() {
  const unsigned long e = ERR_peek_error();
  std::string text;
  if (e != 0) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    text = buf;
  } else {
    text = "no reason given";
  }
  ERR_clear_error();
  return text;
}

// The options' file `path`, named by `option`, loaded by `load` (1 on success).
template <typename Load>
Status load_file(const std::string& path, const char* option, const char* what, Load load) {
  ERR_clear_error();
  if (load(path.c_str()) == 1) return {};
  return Status::invalid_argument(
      fmt::format("TcpTlsOptions::{} ({}): cannot use it as {}: {}", option, path, what, openssl_reason()));
}

// What serving and connecting contexts share: TLS 1.2 and up, no renegotiation, no tickets
// (no session resumption: connections live long), partial writes (a write returns as soon as
// one record is out, so the caller's count of bytes sent stays true) and read-ahead (one
// receive takes several records).
Result<SSL_CTX*> new_context(const SSL_METHOD* method) {
  SSL_CTX* ctx = SSL_CTX_new(method);
  if (ctx == nullptr) return Status::internal("SSL_CTX_new: " + openssl_reason());
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(
      ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_TICKET | SSL_OP_NO_COMPRESSION | SSL_OP_IGNORE_UNEXPECTED_EOF);
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, 64u << 10);
  // AES-128-GCM first: ~8% faster than AES-256 per byte where AES-NI runs both (openssl speed,
  // 16 KiB: 3.5 against 3.3 GB/s on the benchmark host), and the cipher is most of TLS's cost.
  SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256");
  // TLS 1.2 (a peer that cannot do 1.3): forward-secret AEAD suites only.
  if (SSL_CTX_set_cipher_list(ctx, "ECDHE+AESGCM:ECDHE+CHACHA20") != 1) {
    const std::string why = openssl_reason();
    SSL_CTX_free(ctx);
    return Status::internal("SSL_CTX_set_cipher_list: " + why);
  }
  return ctx;
}

struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};

bool is_ip(std::string_view name) {
  std::string s(name);
  if (s.size() > 2 && s.front() == '[' && s.back() == ']') s = s.substr(1, s.size() - 2);
  in6_addr a6;
  in_addr a4;
  return ::inet_pton(AF_INET, s.c_str(), &a4) == 1 || ::inet_pton(AF_INET6, s.c_str(), &a6) == 1;
}

// TLS alerts a peer sends when it refuses our certificate (or sent none it wanted).
bool certificate_alert(int reason) {
  switch (reason) {
    case SSL_R_SSLV3_ALERT_BAD_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_UNSUPPORTED_CERTIFICATE:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_REVOKED:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_EXPIRED:
    case SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN:
    case SSL_R_TLSV1_ALERT_UNKNOWN_CA:
    case SSL_R_TLSV1_ALERT_ACCESS_DENIED:
    case SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED: return true;
    default: return false;
  }
}

}  // namespace

// OpenSSL's records go through this BIO: non-blocking send and recv on the session's socket,
// like OpenSSL's socket BIO, but a record with more of the same write behind it is sent with
// MSG_MORE (a TLS write moves one 16 KiB record per call: pushed one by one, a 4 MiB payload
// is 256 segments, each through loopback's whole receive path).
struct SocketBio {
  static int write(BIO* b, const char* data, int len) {
    auto* s = static_cast<TlsSession*>(BIO_get_data(b));
    BIO_clear_retry_flags(b);
    const ssize_t n = ::send(s->fd_, data, static_cast<std::size_t>(len),
                             MSG_NOSIGNAL | MSG_DONTWAIT | (s->more_ ? MSG_MORE : 0));
    if (n >= 0) return static_cast<int>(n);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_write(b);
    return -1;
  }
  static int read(BIO* b, char* out, int len) {
    auto* s = static_cast<TlsSession*>(BIO_get_data(b));
    BIO_clear_retry_flags(b);
    const ssize_t n = ::recv(s->fd_, out, static_cast<std::size_t>(len), MSG_DONTWAIT);
    if (n >= 0) return static_cast<int>(n);
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) BIO_set_retry_read(b);
    return -1;
  }
  static long ctrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }
  static int create(BIO* b) {
    BIO_set_init(b, 1);
    return 1;
  }
  static BIO_METHOD* method() {
    static BIO_METHOD* const m = [] {
      BIO_METHOD* made = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "kvstash tcp socket");
      if (made != nullptr) {
        BIO_meth_set_write(made, &write);
        BIO_meth_set_read(made, &read);
        BIO_meth_set_ctrl(made, &ctrl);
        BIO_meth_set_create(made, &create);
      }
      return made;
    }();
    return m;
  }
};

Result<std::shared_ptr<TlsContext>> TlsContext::serving(const TcpTlsOptions& o) {
  if (o.key_file.empty())
    return Status::invalid_argument("TcpTlsOptions::cert_file is set without its key_file");
  KVSTASH_ASSIGN_OR_RETURN(SSL_CTX * raw, new_context(TLS_server_method()));
  std::unique_ptr<SSL_CTX, CtxFree> ctx(raw);
  KVSTASH_RETURN_IF_ERROR(load_file(o.cert_file, "cert_file", "a PEM certificate chain", [&](const char* p) {
    return SSL_CTX_use_certificate_chain_file(ctx.get(), p);
  }));
  KVSTASH_RETURN_IF_ERROR(load_file(o.key_file, "key_file", "a PEM private key", [&](const char* p) {
    return SSL_CTX_use_PrivateKey_file(ctx.get(), p, SSL_FILETYPE_PEM);
  }));
  KVSTASH_RETURN_IF_ERROR(load_file(o.key_file, "key_file", "the key of cert_file's certificate",
                                    [&](const char*) { return SSL_CTX_check_private_key(ctx.get()); }));
  if (!o.client_ca_file.empty()) {
    KVSTASH_RETURN_IF_ERROR(
        load_file(o.client_ca_file, "client_ca_file", "a PEM CA bundle",
                  [&](const char* p) { return SSL_CTX_load_verify_locations(ctx.get(), p, nullptr); }));
    // The CA names go to clients, so one holding several certificates picks the right one.
    if (STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(o.client_ca_file.c_str())) {
      SSL_CTX_set_client_CA_list(ctx.get(), names);
    }
    ERR_clear_error();
    SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return std::shared_ptr<TlsContext>(new TlsContext(ctx.release()));
}

Result<std::shared_ptr<TlsContext>> TlsContext::connecting(const TcpTlsOptions& o) {
  if (o.client_cert_file.empty() != o.client_key_file.empty()) {
    return Status::invalid_argument("TcpTlsOptions::client_cert_file and client_key_file go together");
  }
  KVSTASH_ASSIGN_OR_RETURN(SSL_CTX * raw, new_context(TLS_client_method()));
  std::unique_ptr<SSL_CTX, CtxFree> ctx(raw);
  KVSTASH_RETURN_IF_ERROR(load_file(o.ca_file, "ca_file", "a PEM CA bundle", [&](const char* p) {
    return SSL_CTX_load_verify_locations(ctx.get(), p, nullptr);
  }));
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  if (!o.client_cert_file.empty()) {
    KVSTASH_RETURN_IF_ERROR(
        load_file(o.client_cert_file, "client_cert_file", "a PEM certificate chain",
                  [&](const char* p) { return SSL_CTX_use_certificate_chain_file(ctx.get(), p); }));
    KVSTASH_RETURN_IF_ERROR(load_file(
        o.client_key_file, "client_key_file", "a PEM private key",
        [&](const char* p) { return SSL_CTX_use_PrivateKey_file(ctx.get(), p, SSL_FILETYPE_PEM); }));
    KVSTASH_RETURN_IF_ERROR(load_file(o.client_key_file, "client_key_file",
                                      "the key of client_cert_file's certificate",
                                      [&](const char*) { return SSL_CTX_check_private_key(ctx.get()); }));
  }
  auto c = std::shared_ptr<TlsContext>(new TlsContext(ctx.release()));
  c->server_name_ = o.server_name;
  return c;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

Result<std::unique_ptr<TlsSession>> TlsSession::make(const TlsContext& context, int fd, bool serving,
                                                     std::string_view peer_name) {
  ERR_clear_error();
  SSL* ssl = SSL_new(context.get());
  if (ssl == nullptr) return Status::internal("SSL_new: " + openssl_reason());
  std::unique_ptr<TlsSession> s(new TlsSession(ssl, fd, serving));
  BIO* bio = SocketBio::method() != nullptr ? BIO_new(SocketBio::method()) : nullptr;
  if (bio == nullptr) return Status::internal("BIO_new: " + openssl_reason());
  BIO_set_data(bio, s.get());
  SSL_set_bio(ssl, bio, bio);  // the SSL owns it
  if (serving) {
    SSL_set_accept_state(ssl);
    return s;
  }
  SSL_set_connect_state(ssl);
  std::string name(context.server_name().empty() ? peer_name : std::string_view(context.server_name()));
  if (name.empty())
    return Status::invalid_argument("tcp TLS: no name to check the node's certificate against");
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  if (is_ip(name)) {
    if (name.front() == '[') name = name.substr(1, name.size() - 2);
    if (X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) != 1) {
      return Status::invalid_argument("tcp TLS: cannot check a certificate against address " + name);
    }
  } else {
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (SSL_set1_host(ssl, name.c_str()) != 1 || SSL_set_tlsext_host_name(ssl, name.c_str()) != 1) {
      return Status::invalid_argument("tcp TLS: cannot check a certificate against name " + name);
    }
  }
  return s;
}

TlsSession::~TlsSession() { SSL_free(ssl_); }

int TlsSession::handshake() {
  std::lock_guard lock(mu_);
  more_ = false;
  ERR_clear_error();
  const int r = SSL_do_handshake(ssl_);
  if (r == 1) return 1;
  return static_cast<int>(failed(r, write_wants_));
}

ssize_t TlsSession::failed(int ret, Wait& wants) {
  const int saved = errno;
  const int err = SSL_get_error(ssl_, ret);
  switch (err) {
    case SSL_ERROR_WANT_READ:
      wants = Wait::kRead;
      errno = EAGAIN;
      return -1;
    case SSL_ERROR_WANT_WRITE:
      wants = Wait::kWrite;
      errno = EAGAIN;
      return -1;
    case SSL_ERROR_ZERO_RETURN:
      ERR_clear_error();
      failure_ = Status::unavailable("tcp TLS: the peer closed the connection");
      return 0;
    case SSL_ERROR_SYSCALL:
      if (ERR_peek_error() == 0 && saved == 0) {
        failure_ = Status::unavailable("tcp TLS: the peer closed the connection");
        return 0;
      }
      ERR_clear_error();
      failure_ =
          Status::unavailable(std::string("tcp TLS: ") + std::strerror(saved != 0 ? saved : ECONNRESET));
      errno = saved != 0 ? saved : ECONNRESET;
      return -1;
    default: break;
  }
  const long verified = SSL_get_verify_result(ssl_);
  const int reason = ERR_GET_REASON(ERR_peek_error());
  const std::string why = openssl_reason();
  if (verified != X509_V_OK) {
    failure_ = Status::permission_denied(fmt::format("tcp TLS: the {} certificate failed verification: {}",
                                                     serving_ ? "client's" : "node's",
                                                     X509_verify_cert_error_string(verified)));
  } else if (certificate_alert(reason)) {
    failure_ = Status::permission_denied(fmt::format("tcp TLS: the {} refused this {}'s certificate ({})",
                                                     serving_ ? "client" : "node",
                                                     serving_ ? "node" : "client", why));
  } else if (reason == SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE) {
    failure_ = Status::permission_denied(
        "tcp TLS: the client presented no certificate, and this node requires one "
        "(TcpTlsOptions::client_ca_file)");
  } else {
    failure_ = Status::unavailable("tcp TLS: " + why);
  }
  errno = EPROTO;
  return -1;
}

ssize_t TlsSession::read(void* data, std::size_t n) {
  std::lock_guard lock(mu_);
  // One SSL_read yields at most one record (16 KiB): take what is there, up to 256 KiB a call.
  auto* p = static_cast<std::byte*>(data);
  std::size_t got = 0;
  const std::size_t want = std::min<std::size_t>(n, 256u << 10);
  more_ = false;  // a read may answer the peer (a key update): one record, pushed
  while (got < want) {
    ERR_clear_error();
    const int r = SSL_read(ssl_, p + got, static_cast<int>(std::min<std::size_t>(want - got, INT_MAX)));
    if (r > 0) {
      got += static_cast<std::size_t>(r);
      continue;
    }
    if (got > 0) {
      // What failed shows again on the next call; what was read is the caller's first.
      ERR_clear_error();
      break;
    }
    return failed(r, read_wants_);
  }
  return static_cast<ssize_t>(got);
}

ssize_t TlsSession::readv(const iovec* iov, std::size_t count) {
  ssize_t total = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (iov[i].iov_len == 0) continue;
    const ssize_t r = read(iov[i].iov_base, iov[i].iov_len);
    if (r <= 0) return total > 0 ? total : r;
    total += r;
    if (static_cast<std::size_t>(r) < iov[i].iov_len) break;
  }
  return total;
}

ssize_t TlsSession::write(const void* data, std::size_t n) {
  std::lock_guard lock(mu_);
  return write_locked(data, n);
}

ssize_t TlsSession::write_locked(const void* data, std::size_t n) {
  more_ = n > kStageBytes;  // the record going out is not this write's last
  ERR_clear_error();
  const int r = SSL_write(ssl_, data, static_cast<int>(std::min<std::size_t>(n, INT_MAX)));
  if (r > 0) {
    write_pending_ = false;
    return r;
  }
  const ssize_t f = failed(r, write_wants_);
  if (f < 0 && errno == EAGAIN) write_pending_ = true;
  return f;
}

ssize_t TlsSession::writev(const iovec* iov, std::size_t count) {
  std::lock_guard lock(mu_);
  if (staged_ > 0) {
    // A retry: OpenSSL holds (part of) the staged record and must be offered it again.
    const ssize_t r = write_locked(stage_.get(), staged_);
    if (r > 0) staged_ = 0;
    return r;
  }
  while (count > 0 && iov[0].iov_len == 0) {
    ++iov;
    --count;
  }
  if (count == 0) return 0;
  if (count > 1 && iov[0].iov_len < kStageBytes) {
    if (!stage_) stage_ = std::make_unique<std::byte[]>(kStageBytes);
    std::size_t n = 0;
    for (std::size_t i = 0; i < count && n < kStageBytes; ++i) {
      const std::size_t take = std::min(iov[i].iov_len, kStageBytes - n);
      std::memcpy(stage_.get() + n, iov[i].iov_base, take);
      n += take;
    }
    staged_ = n;
    const ssize_t r = write_locked(stage_.get(), staged_);
    if (r > 0 || errno != EAGAIN) staged_ = 0;
    return r;
  }
  return write_locked(iov[0].iov_base, iov[0].iov_len);
}

std::string TlsSession::error_text(int err) const {
  if (!failure_.is_ok()) return failure_.message();
  return std::strerror(err);
}

std::string TlsSession::describe() const {
  return fmt::format("{} {}", SSL_get_version(ssl_), SSL_get_cipher_name(ssl_));
}

namespace {

Status wait_for(TlsSession::Wait what_for, int fd, Deadline deadline, std::string_view what) {
  return net::wait_fd(fd, what_for == TlsSession::Wait::kRead ? POLLIN : POLLOUT, deadline, what);
}

}  // namespace

Result<std::unique_ptr<TlsSession>> connect_tls(const TlsContext& context, int fd, std::string_view peer_name,
                                                Deadline deadline) {
  KVSTASH_ASSIGN_OR_RETURN(auto session, TlsSession::make(context, fd, false, peer_name));
  for (;;) {
    if (session->handshake() == 1) return session;
    if (errno != EAGAIN) return session->failure();
    KVSTASH_RETURN_IF_ERROR(wait_for(session->write_wants(), fd, deadline, "tcp TLS handshake"));
  }
}

Status tls_send_all(TlsSession& session, int fd, const void* data, std::size_t n, Deadline deadline) {
  const auto* p = static_cast<const std::byte*>(data);
  while (n > 0) {
    const ssize_t k = session.write(p, n);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EAGAIN) {
      KVSTASH_RETURN_IF_ERROR(wait_for(session.write_wants(), fd, deadline, "tcp handshake send"));
      continue;
    }
    return session.failure().with_context("tcp handshake send");
  }
  return {};
}

Status tls_recv_all(TlsSession& session, int fd, void* data, std::size_t n, Deadline deadline) {
  auto* p = static_cast<std::byte*>(data);
  while (n > 0) {
    const ssize_t k = session.read(p, n);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EAGAIN) {
      KVSTASH_RETURN_IF_ERROR(wait_for(session.read_wants(), fd, deadline, "tcp handshake receive"));
      continue;
    }
    return session.failure().with_context("tcp handshake receive");
  }
  return {};
}

}  // namespace kvstash::transport::tcp
