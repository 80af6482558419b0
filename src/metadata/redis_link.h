// One connection to one Redis server, under RedisClient: plain (hiredis's own socket) or TLS
// (a socket of ours under OpenSSL, with hiredis's RESP writer and reader: Debian's hiredis
// 0.14 has no TLS of its own). RedisClient decides where to connect and what to send; a link
// only moves one command and its reply, within a time limit.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

class RedisLink {
 public:
  virtual ~RedisLink() = default;
  // Sends the command and waits for its reply, both within `timeout`. An error reply is a
  // Reply (the caller maps it); any other failure (kTimeout, kUnavailable, kCorrupt for bytes
  // that are not RESP) leaves the link unusable.
  virtual Result<Reply> roundtrip(const std::vector<std::string_view>& args, std::chrono::milliseconds timeout) = 0;
};

// The TLS settings every connection of one client shares: the CA it verifies servers against,
// its own certificate, the name it checks. Loaded once, when the client connects.
class TlsClientContext {
 public:
  // From a rediss:// URL's settings. Errors: kInvalidArgument (a file that cannot be read or
  // does not hold what its option says, a certificate without its key).
  static Result<std::shared_ptr<TlsClientContext>> create(const RedisUrl& url);
  ~TlsClientContext();
  TlsClientContext(const TlsClientContext&) = delete;
  TlsClientContext& operator=(const TlsClientContext&) = delete;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  explicit TlsClientContext(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A plain connection to `address` (numeric) : `port`, or to the URL's unix socket.
// Errors: kUnavailable, kTimeout.
Result<std::unique_ptr<RedisLink>> connect_plain(const RedisUrl& url, const std::string& address, int port,
                                                 std::chrono::milliseconds timeout);

// A TLS connection to `address` (numeric) : `port`, whose certificate must name `host` (the
// name the URL or a redirect gave; the URL's sni= overrides it) and chain to the context's CA.
// Errors: kUnavailable (unreachable, closed), kTimeout, kPermissionDenied (the server's
// certificate did not verify, or it refused ours), kInvalidArgument (the server does not
// speak TLS: a plain port).
Result<std::unique_ptr<RedisLink>> connect_tls(TlsClientContext& tls, const std::string& host,
                                               const std::string& address, int port,
                                               std::chrono::milliseconds timeout);

}  // namespace kvstash::metadata
