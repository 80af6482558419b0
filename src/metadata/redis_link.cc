#include "metadata/redis_link.h"

#include <arpa/inet.h>
#include <hiredis/hiredis.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "common/fd.h"
#include "common/net.h"

namespace kvstash::metadata {
namespace {

using Clock = std::chrono::steady_clock;

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

// hiredis and OpenSSL write with write(2): a Redis that went away would raise SIGPIPE and kill
// a process that did not ignore it. Block it in this thread for the call and swallow one that
// our write raised, leaving the process's signal disposition alone.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    already_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!already_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        timespec zero{};
        sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t pipe_, old_;
  bool already_pending_ = false;
};

// ---- plain: hiredis's own connection -----------------------------------------------------

class PlainLink final : public RedisLink {
 public:
  explicit PlainLink(redisContext* c) : c_(c) {}
  ~PlainLink() override { redisFree(c_); }

  Result<Reply> roundtrip(const std::vector<std::string_view>& args, std::chrono::milliseconds timeout) override {
    if (timeout != socket_timeout_) {
      redisSetTimeout(c_, to_timeval(timeout));
      socket_timeout_ = timeout;
    }
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    argv.reserve(args.size());
    lens.reserve(args.size());
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    redisReply* r;
    {
      SigpipeGuard no_sigpipe;
      r = static_cast<redisReply*>(
          redisCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), lens.data()));
    }
    if (r != nullptr) {
      answered_ = true;
      return Reply(r);
    }
    const bool timed_out = c_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK);
    std::string what = c_->errstr;
    if (timed_out) return Status::timeout(what + " (command timed out)");
    // A TLS server answers a plain client with an alert record, whose first byte (0x15) the
    // RESP reader stops at.
    if (what.find("\\x15") != std::string::npos) {
      return Status::invalid_argument(what + " (the server speaks TLS: reach it with a rediss:// URL)");
    }
    // A TLS port closes on a plain client's first bytes, without a word.
    if (!answered_) what.append(" (before any reply: if this is a TLS port, it takes a rediss:// URL)");
    return Status::unavailable(std::move(what));
  }

 private:
  redisContext* c_;
  std::chrono::milliseconds socket_timeout_{-1};  // what the socket's timeout is set to now
  bool answered_ = false;                          // a reply came on this connection
};

// ---- TLS: our socket under OpenSSL, hiredis's RESP writer and reader -----------------------

std::string openssl_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    out.append(out.empty() ? "" : "; ").append(buf);
  }
  return out.empty() ? std::string("no detail from OpenSSL") : out;
}

bool is_ip(const std::string& host) {
  unsigned char buf[sizeof(in6_addr)];
  return inet_pton(AF_INET, host.c_str(), buf) == 1 || inet_pton(AF_INET6, host.c_str(), buf) == 1;
}

}  // namespace

struct TlsClientContext::Impl {
  SSL_CTX* ctx = nullptr;
  std::string server_name;  // sni=: the name every server's certificate must carry
  ~Impl() { SSL_CTX_free(ctx); }
};

TlsClientContext::TlsClientContext(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TlsClientContext::~TlsClientContext() = default;

Result<std::shared_ptr<TlsClientContext>> TlsClientContext::create(const RedisUrl& url) {
  auto impl = std::make_unique<Impl>();
  ERR_clear_error();
  impl->ctx = SSL_CTX_new(TLS_client_method());
  if (impl->ctx == nullptr) return Status::internal("redis TLS: SSL_CTX_new: " + openssl_errors());
  SSL_CTX_set_min_proto_version(impl->ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(impl->ctx, SSL_VERIFY_PEER, nullptr);
  if (url.tls_ca.empty()) {
    if (SSL_CTX_set_default_verify_paths(impl->ctx) != 1) {
      return Status::invalid_argument("redis TLS: the system's CA certificates cannot be loaded (" +
                                      openssl_errors() + "): name a CA file with ?ca=");
    }
  } else if (SSL_CTX_load_verify_locations(impl->ctx, url.tls_ca.c_str(), nullptr) != 1) {
    return Status::invalid_argument("redis TLS: cannot load the CA file " + url.tls_ca + " (" +
                                    openssl_errors() + ")");
  }
  if (url.tls_cert.empty() != url.tls_key.empty()) {
    return Status::invalid_argument("redis TLS: a client certificate (cert=) needs its key (key=), and a key its "
                                    "certificate");
  }
  if (!url.tls_cert.empty()) {
    if (SSL_CTX_use_certificate_chain_file(impl->ctx, url.tls_cert.c_str()) != 1) {
      return Status::invalid_argument("redis TLS: cannot load the certificate " + url.tls_cert + " (" +
                                      openssl_errors() + ")");
    }
    if (SSL_CTX_use_PrivateKey_file(impl->ctx, url.tls_key.c_str(), SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(impl->ctx) != 1) {
      return Status::invalid_argument("redis TLS: cannot load the key " + url.tls_key +
                                      " or it does not match the certificate (" + openssl_errors() + ")");
    }
  }
  impl->server_name = url.tls_server_name;
  return std::shared_ptr<TlsClientContext>(new TlsClientContext(std::move(impl)));
}

namespace {

class TlsLink final : public RedisLink {
 public:
  TlsLink(UniqueFd fd, SSL* ssl, std::string where)
      : fd_(std::move(fd)), ssl_(ssl), reader_(redisReaderCreate()), where_(std::move(where)) {}
  ~TlsLink() override {
    SSL_free(ssl_);  // no close_notify: the socket closes with fd_, and Redis needs none
    if (reader_ != nullptr) redisReaderFree(reader_);
  }

  // The handshake, within the deadline.
  Status handshake(Deadline deadline) {
    for (;;) {
      ERR_clear_error();
      const int rc = SSL_connect(ssl_);
      if (rc == 1) return {};
      KVSTASH_RETURN_IF_ERROR(wait_or_fail(rc, deadline, "the TLS handshake"));
    }
  }

  Result<Reply> roundtrip(const std::vector<std::string_view>& args, std::chrono::milliseconds timeout) override {
    if (reader_ == nullptr) return Status::no_space("redis TLS: cannot allocate a reply reader");
    const Deadline deadline = Clock::now() + timeout;
    std::vector<const char*> argv;
    std::vector<std::size_t> lens;
    argv.reserve(args.size());
    lens.reserve(args.size());
    for (auto a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    char* raw = nullptr;
    const int len = redisFormatCommandArgv(&raw, static_cast<int>(argv.size()), argv.data(), lens.data());
    if (len < 0) return Status::no_space("redis TLS: cannot format a command");
    std::unique_ptr<char, void (*)(char*)> command(raw, redisFreeCommand);

    SigpipeGuard no_sigpipe;
    for (int sent = 0; sent < len;) {
      ERR_clear_error();
      const int n = SSL_write(ssl_, command.get() + sent, len - sent);
      if (n > 0) {
        sent += n;
        continue;
      }
      Status s = wait_or_fail(n, deadline, "sending a command");
      if (!s.is_ok()) return why_closed().value_or(s);
    }
    for (;;) {
      void* reply = nullptr;
      if (redisReaderGetReply(reader_, &reply) != REDIS_OK) {
        return Status::corrupt(where_ + ": the server's reply is not RESP (" + reader_->errstr + ")");
      }
      if (reply != nullptr) return Reply(static_cast<redisReply*>(reply));
      char buf[16384];
      ERR_clear_error();
      const int n = SSL_read(ssl_, buf, sizeof buf);
      if (n > 0) {
        if (redisReaderFeed(reader_, buf, static_cast<std::size_t>(n)) != REDIS_OK) {
          return Status::no_space(where_ + ": cannot buffer the reply");
        }
        continue;
      }
      KVSTASH_RETURN_IF_ERROR(wait_or_fail(n, deadline, "waiting for a reply"));
    }
  }

 private:
  // After a failed write: the alert the server sent before it closed, if it sent one (a
  // refused client certificate arrives so, after the handshake, under TLS 1.3).
  std::optional<Status> why_closed() {
    char buf[512];
    ERR_clear_error();
    const int n = SSL_read(ssl_, buf, sizeof buf);
    if (n > 0 || SSL_get_error(ssl_, n) != SSL_ERROR_SSL) {
      ERR_clear_error();
      return std::nullopt;
    }
    return wait_or_fail(n, Clock::now(), "sending a command");
  }

  // After an SSL call returned `rc`: waits for the socket when OpenSSL wants it, else the
  // failure as a Status.
  Status wait_or_fail(int rc, Deadline deadline, std::string_view doing) {
    const int err = SSL_get_error(ssl_, rc);
    const std::string what = where_ + ": " + std::string(doing);
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      Status s = net::wait_fd(fd_.get(), err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline, what);
      if (s.code() == StatusCode::kTimeout && !SSL_is_init_finished(ssl_)) {
        return Status::timeout(s.message() + " (is the port a TLS port?)");
      }
      return s;
    }
    if (err == SSL_ERROR_ZERO_RETURN) return Status::unavailable(what + ": the server closed the connection");
    const long verify = SSL_get_verify_result(ssl_);
    if (verify != X509_V_OK) {
      ERR_clear_error();
      return Status::permission_denied(what + ": the server's certificate did not verify (" +
                                       X509_verify_cert_error_string(verify) + ")");
    }
    if (err == SSL_ERROR_SYSCALL && ERR_peek_error() == 0) {
      return Status::unavailable(what + ": " +
                                 (errno != 0 ? std::strerror(errno) : "the server closed the connection"));
    }
    const std::string detail = openssl_errors();
    // An alert from the server about our certificate: none, unknown CA, bad, expired...
    if (detail.find("alert certificate") != std::string::npos || detail.find("alert unknown ca") != std::string::npos ||
        detail.find("alert bad certificate") != std::string::npos ||
        detail.find("alert handshake failure") != std::string::npos) {
      return Status::permission_denied(what + ": the server refused this client's certificate (" + detail + ")");
    }
    if (detail.find("wrong version number") != std::string::npos ||
        detail.find("packet length too long") != std::string::npos ||
        detail.find("record layer failure") != std::string::npos) {
      return Status::invalid_argument(what + ": the server does not speak TLS (" + detail +
                                      "): a plain port takes a redis:// URL");
    }
    return Status::unavailable(what + ": " + detail);
  }

  UniqueFd fd_;
  SSL* ssl_;
  redisReader* reader_;
  std::string where_;
};

}  // namespace

Result<std::unique_ptr<RedisLink>> connect_plain(const RedisUrl& url, const std::string& address, int port,
                                                 std::chrono::milliseconds timeout) {
  const timeval tv = to_timeval(timeout);
  redisContext* c = url.unix_socket ? redisConnectUnixWithTimeout(url.path.c_str(), tv)
                                    : redisConnectWithTimeout(address.c_str(), port, tv);
  if (c == nullptr) return Status::no_space("cannot allocate a connection");
  auto link = std::make_unique<PlainLink>(c);
  if (c->err != 0) {
    std::string what = c->errstr;
    if (what.find("timed out") != std::string::npos) return Status::timeout(std::move(what));
    return Status::unavailable(std::move(what));
  }
  return std::unique_ptr<RedisLink>(std::move(link));
}

Result<std::unique_ptr<RedisLink>> connect_tls(TlsClientContext& tls, const std::string& host,
                                               const std::string& address, int port,
                                               std::chrono::milliseconds timeout) {
  const Deadline deadline = Clock::now() + timeout;
  std::string where = "TLS to " + host;
  where.append(":").append(std::to_string(port));
  KVSTASH_ASSIGN_OR_RETURN(UniqueFd fd,
                           net::connect_tcp({address, static_cast<std::uint16_t>(port)}, deadline));
  ERR_clear_error();
  SSL* ssl = SSL_new(tls.impl().ctx);
  if (ssl == nullptr) return Status::no_space(where + ": SSL_new: " + openssl_errors());
  const int fd_number = fd.get();
  auto link = std::make_unique<TlsLink>(std::move(fd), ssl, where);
  SSL_set_fd(ssl, fd_number);
  const std::string& name = tls.impl().server_name.empty() ? host : tls.impl().server_name;
  if (is_ip(name)) {
    X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), name.c_str());
  } else {
    SSL_set_tlsext_host_name(ssl, name.c_str());
    SSL_set1_host(ssl, name.c_str());
  }
  KVSTASH_RETURN_IF_ERROR(link->handshake(deadline));
  // Under TLS 1.3 a server that refuses this client's certificate says so only after the
  // handshake: one round trip (any reply will do, NOAUTH too) makes that a connect's error.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return Status::timeout(where + ": the TLS handshake took the connect's whole time");
  KVSTASH_RETURN_IF_ERROR(link->roundtrip({"PING"}, left).status());
  return std::unique_ptr<RedisLink>(std::move(link));
}

}  // namespace kvstash::metadata
