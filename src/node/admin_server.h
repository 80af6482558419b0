// AdminServer: kvstashd's HTTP/1.1 admin endpoint, for Prometheus scrapes and health probes.
//
// Routes (the query string is ignored for routing):
//   GET /metrics  200, Content-Type "text/plain; version=0.0.4; charset=utf-8", body from
//                 Handlers::metrics
//   GET /healthz  200 with "<reason>\n" when Handlers::health says healthy, else 503 with the same
//   HEAD of both  the GET's status and headers (Content-Length included), no body
//   other paths   404; other methods on the two paths: 405 with "Allow: GET, HEAD"
// Every response carries Content-Length and "Connection: close"; one request per connection.
//
// Limits, each answered and then the connection closed:
//   - a malformed request line or header line: 400; a version other than HTTP/1.x: 505;
//   - a request line over kMaxHeaderBytes: 414; a request head (line plus headers) over it: 431;
//   - a handler that throws: 500, and the server keeps serving;
//   - a client that has not sent a whole request head within the request timeout is dropped
//     without a response; the same timeout then bounds writing the response;
//   - at most kMaxConnections connections are open, so a flood of idle clients cannot use up
//     the daemon's file descriptors, and at most kMaxConnectionsPerPeer from one address (its
//     oldest is dropped for its newest); when all are taken, the oldest one that has been
//     sending its request head for over a second is dropped for the newcomer, else the oldest
//     that has sent it (answered, or not reading its answer), else the oldest. A newcomer is
//     never refused: a health probe, which sends its request at once and reads the answer, gets
//     one whatever the other connections do (unless kMaxConnections newer ones from other
//     addresses arrive before its request does).
// Request bodies are not read (nothing here takes one) and the Host header is not required:
// probes and scrapers differ in what they send and nothing here depends on it.
//
// Threading: the server runs one io thread of its own. Handlers are called on it, one at a
// time, so they need no locking against each other but must be safe against the rest of the
// program; a slow handler delays other requests and the destructor. address() may be called
// from any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "kvstash/status.h"

namespace kvstash::node {

class AdminServer {
 public:
  struct Handlers {
    // The Prometheus exposition text (see MetricsText). Required.
    std::function<std::string()> metrics;
    // Whether the node is healthy, and a one-line reason ("ok", "draining", "redis
    // unreachable"); line breaks in the reason are sent as spaces. Required.
    std::function<std::pair<bool, std::string>()> health;
  };

  static constexpr std::chrono::milliseconds kDefaultRequestTimeout{5000};
  static constexpr std::size_t kMaxHeaderBytes = 8192;
  static constexpr std::size_t kMaxConnections = 64;
  static constexpr std::size_t kMaxConnectionsPerPeer = 16;

  // Binds `listen` ("host:port" with a numeric IPv4 host, or "[v6]:port"; port 0 picks a free
  // port) and starts serving. Blocks only while binding. Returns kInvalidArgument for a
  // malformed address, a non-numeric host or a missing handler; kUnavailable when the address
  // cannot be bound (port taken, address not on this host); kPermissionDenied for a privileged
  // port. Messages name the address.
  static Result<std::unique_ptr<AdminServer>> start(
      std::string_view listen, Handlers handlers,
      std::chrono::milliseconds request_timeout = kDefaultRequestTimeout);

  // Stops listening, closes every open connection and joins the io thread. Does not wait for
  // clients or timeouts, only for a handler call in progress. Must not be called from a handler.
  ~AdminServer();

  AdminServer(const AdminServer&) = delete;
  AdminServer& operator=(const AdminServer&) = delete;

  // The bound address as "host:port" or "[v6]:port", with the real port when 0 was asked.
  std::string address() const;

 private:
  class Impl;
  explicit AdminServer(std::unique_ptr<Impl> impl);

  // Keeps Boost.Asio out of the daemon's includes.
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvstash::node
