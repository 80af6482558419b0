// AdminServer: the accept loop, request-head parsing and routing, all on one io thread.
#include "node/admin_server.h"

#include <cstdint>
#include <cstdio>
#include <ctime>
#include <exception>
#include <map>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "common/asio.h"
#include "common/log.h"

namespace kvstash::node {
namespace {

namespace asio = boost::asio;
using asio::redirect_error;
using asio::use_awaitable;
using asio::ip::tcp;
using boost::system::error_code;

constexpr std::string_view kMetricsContentType = "text/plain; version=0.0.4; charset=utf-8";
constexpr std::string_view kTextContentType = "text/plain; charset=utf-8";
constexpr std::size_t kReadChunk = 4096;
// After a failed accept (out of descriptors, say) the next one would most likely fail the same
// way at once; waiting keeps the io thread from spinning.
constexpr auto kAcceptRetryDelay = std::chrono::milliseconds(100);
// A request head still coming after this long is a slow or silent client's (a probe's comes
// within a round trip), the first to make room for a newcomer.
constexpr auto kHeadGrace = std::chrono::milliseconds(1000);

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
  bool bracketed = false;
};

// "host:port" or "[v6]:port"; the host is checked later, by the address parser.
Result<HostPort> parse_listen(std::string_view s) {
  auto malformed = [&] {
    return Status::invalid_argument("malformed admin listen address '" + std::string(s) +
                                    "'; expected host:port or [v6]:port");
  };
  HostPort hp;
  std::size_t colon;
  if (!s.empty() && s.front() == '[') {
    auto close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') return malformed();
    hp.host = std::string(s.substr(1, close - 1));
    hp.bracketed = true;
    colon = close + 1;
  } else {
    colon = s.rfind(':');
    if (colon == std::string_view::npos) return malformed();
    hp.host = std::string(s.substr(0, colon));
  }
  auto port = s.substr(colon + 1);
  if (hp.host.empty() || port.empty() || port.size() > 5) return malformed();
  unsigned v = 0;
  for (char c : port) {
    if (c < '0' || c > '9') return malformed();
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v > 65535) return malformed();
  hp.port = static_cast<std::uint16_t>(v);
  return hp;
}

std::string format_endpoint(const tcp::endpoint& ep) {
  const auto ip = ep.address();
  std::string host = ip.is_v6() ? "[" + ip.to_string() + "]" : ip.to_string();
  return host + ":" + std::to_string(ep.port());
}

std::string_view reason_phrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 414: return "URI Too Long";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

// IMF-fixdate, which RFC 9110 asks of an origin server with a clock. Written out by hand
// because strftime's day and month names follow the process locale.
std::string http_date() {
  static constexpr const char* kDays[] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
  static constexpr const char* kMonths[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                            "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s, %02d %s %04d %02d:%02d:%02d GMT", kDays[tm.tm_wday % 7], tm.tm_mday,
                kMonths[tm.tm_mon % 12], tm.tm_year + 1900, tm.tm_hour, tm.tm_min, tm.tm_sec);
  return buf;
}

struct Response {
  int status = 200;
  std::string_view content_type = kTextContentType;
  std::string body;
  std::string_view extra_headers;  // whole header lines, each ending in "\r\n"
};

// A short text response whose body is the reason phrase.
Response plain_response(int status) {
  Response r;
  r.status = status;
  r.body = std::string(reason_phrase(status)) + "\n";
  if (status == 405) r.extra_headers = "Allow: GET, HEAD\r\n";
  return r;
}

std::string serialize(const Response& r, bool with_body) {
  std::string out;
  out.reserve(256 + (with_body ? r.body.size() : 0));
  out += "HTTP/1.1 ";
  out += std::to_string(r.status);
  out += ' ';
  out += reason_phrase(r.status);
  out += "\r\nDate: ";
  out += http_date();
  out += "\r\nContent-Type: ";
  out += r.content_type;
  out += "\r\nContent-Length: ";
  out += std::to_string(r.body.size());
  out += "\r\n";
  out += r.extra_headers;
  out += "Connection: close\r\n\r\n";
  if (with_body) out += r.body;
  return out;
}

// RFC 9110 token characters, which make up methods and header names.
bool is_tchar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool is_token(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!is_tchar(c)) return false;
  }
  return true;
}

struct RequestLine {
  std::string method;
  std::string path;  // the target without query or fragment
};

// "METHOD SP target SP HTTP/d.d". Returns 0, or the status to answer with (400 or 505).
int parse_request_line(std::string_view line, RequestLine& out) {
  auto sp1 = line.find(' ');
  if (sp1 == std::string_view::npos) return 400;
  auto sp2 = line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return 400;
  auto method = line.substr(0, sp1);
  auto target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  auto version = line.substr(sp2 + 1);
  if (!is_token(method) || target.empty()) return 400;
  for (char c : target) {
    if (c <= 0x20 || c >= 0x7f) return 400;
  }
  if (version.size() != 8 || !version.starts_with("HTTP/") || version[6] != '.' || version[5] < '0' ||
      version[5] > '9' || version[7] < '0' || version[7] > '9') {
    return 400;
  }
  if (version[5] != '1') return 505;

  // Origin form "/path?query", or the absolute form "http://host/path" that RFC 9112 says a
  // server must accept too.
  if (target.front() != '/') {
    auto scheme = target.find("://");
    if (scheme == std::string_view::npos || !is_token(target.substr(0, scheme))) return 400;
    auto slash = target.find('/', scheme + 3);
    target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
  }
  out.method = std::string(method);
  out.path = std::string(target.substr(0, target.find_first_of("?#")));
  return 0;
}

// "name: value" with a token name and no space before the colon (RFC 9112 5.1 says to reject
// that); obsolete line folding starts with whitespace and is rejected the same way.
bool valid_header_line(std::string_view line) {
  auto colon = line.find(':');
  return colon != std::string_view::npos && is_token(line.substr(0, colon));
}

// Incremental parser of a request head: feed() it what each read returns.
class HeadParser {
 public:
  enum class State { kNeedMore, kComplete, kError };

  State feed(std::string_view data) {
    buf_.append(data);
    std::size_t nl;
    while ((nl = buf_.find('\n', line_start_)) != std::string::npos) {
      std::string_view line(buf_.data() + line_start_, nl - line_start_);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      line_start_ = nl + 1;
      if (!have_request_line_) {
        if (line.empty()) continue;  // RFC 9112 2.2: blank lines before the request line are noise
        if (line_start_ > AdminServer::kMaxHeaderBytes) return fail(414);
        if (int status = parse_request_line(line, request_); status != 0) return fail(status);
        have_request_line_ = true;
      } else if (line.empty()) {
        return line_start_ > AdminServer::kMaxHeaderBytes ? fail(431) : State::kComplete;
      } else if (!valid_header_line(line)) {
        return fail(400);
      }
    }
    if (buf_.size() > AdminServer::kMaxHeaderBytes) return fail(have_request_line_ ? 431 : 414);
    return State::kNeedMore;
  }

  // Complete after kComplete; after kError, filled in if the request line itself was valid.
  const RequestLine& request() const { return request_; }
  // Valid after kError.
  int error_status() const { return error_; }

 private:
  State fail(int status) {
    error_ = status;
    return State::kError;
  }

  std::string buf_;
  std::size_t line_start_ = 0;
  bool have_request_line_ = false;
  RequestLine request_;
  int error_ = 0;
};

struct Connection {
  explicit Connection(tcp::socket s) : socket(std::move(s)), deadline(socket.get_executor()) {}
  tcp::socket socket;
  asio::steady_timer deadline;
  std::uint64_t seq = 0;  // accept order
  std::chrono::steady_clock::time_point accepted = std::chrono::steady_clock::now();
  asio::ip::address peer;
  bool answered = false;  // its request head is in: it is being answered, or has been
};

}  // namespace

class AdminServer::Impl {
 public:
  Impl(Handlers handlers, std::chrono::milliseconds request_timeout)
      : handlers_(std::move(handlers)), request_timeout_(request_timeout) {}

  Status bind(const HostPort& hp, std::string_view listen) {
    error_code ec;
    auto ip = asio::ip::make_address(hp.host, ec);
    // Brackets and IPv6 go together, so "::1:80" cannot be read two ways.
    if (ec || ip.is_v6() != hp.bracketed) {
      return Status::invalid_argument(
          "admin listen address '" + std::string(listen) +
          "': the host must be a numeric IPv4 address or a bracketed IPv6 address");
    }
    tcp::endpoint ep(ip, hp.port);
    acceptor_.open(ep.protocol(), ec);
    // Lets a restarted daemon rebind while its old connections sit in TIME_WAIT; a port with a
    // live listener still fails on Linux.
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (!ec) ep = acceptor_.local_endpoint(ec);
    if (ec == asio::error::access_denied) {
      return Status::permission_denied("admin listen on " + std::string(listen) + ": " + ec.message());
    }
    if (ec) return Status::unavailable("admin listen on " + std::string(listen) + ": " + ec.message());
    address_ = format_endpoint(ep);
    return {};
  }

  Status run() {
    asio::co_spawn(io_, accept_loop(), asio::detached);
    try {
      thread_ = std::thread([this] {
        // An exception escaping a completion handler would end run(); running again keeps the
        // endpoint alive for the next scrape.
        for (;;) {
          try {
            io_.run();
            return;
          } catch (const std::exception& e) {
            KVSTASH_LOG_ERROR("admin {}: io thread caught: {}", address_, e.what());
          }
        }
      });
    } catch (const std::system_error& e) {
      return Status::io_error("admin " + address_ + ": cannot start the io thread: " + e.what());
    }
    return {};
  }

  // Closes the acceptor and every connection on the io thread; each coroutine then sees its
  // operation aborted and ends, so run() returns without waiting for any client or timer.
  void stop() {
    asio::post(io_, [this] {
      stopping_ = true;
      error_code ignored;
      acceptor_.close(ignored);
      retry_timer_.cancel();
      for (Connection* c : live_) {
        c->socket.close(ignored);
        c->deadline.cancel();
      }
    });
    if (thread_.joinable()) thread_.join();
  }

  const std::string& address() const { return address_; }

 private:
  // Holds a connection in live_, for stop() and the connection cap, from accept until its
  // serve() coroutine ends; being a coroutine parameter, it also lets go if that coroutine is
  // destroyed before it starts. On the way out it cancels the deadline, whose pending wait
  // would otherwise hold run() open until it fired.
  class Tracked {
   public:
    Tracked(Impl* impl, std::shared_ptr<Connection> c) : impl_(impl), c_(std::move(c)) {
      impl_->live_.insert(c_.get());
    }
    Tracked(Tracked&& o) noexcept : impl_(o.impl_), c_(std::move(o.c_)) {}
    Tracked& operator=(Tracked&&) = delete;
    ~Tracked() {
      if (!c_) return;  // moved from
      impl_->live_.erase(c_.get());
      impl_->by_age_.erase(c_->seq);
      c_->deadline.cancel();
    }
    const std::shared_ptr<Connection>& connection() const { return c_; }

   private:
    Impl* impl_;
    std::shared_ptr<Connection> c_;
  };

  asio::awaitable<void> accept_loop() {
    while (!stopping_) {
      try {
        tcp::socket sock(io_);
        error_code ec;
        co_await acceptor_.async_accept(sock, redirect_error(use_awaitable, ec));
        if (stopping_) break;
        if (ec) {
          KVSTASH_LOG_WARN_LIMITED("admin {}: accept failed: {}", address_, ec.message());
          retry_timer_.expires_after(kAcceptRetryDelay);
          co_await retry_timer_.async_wait(redirect_error(use_awaitable, ec));
          continue;
        }
        const auto peer = sock.remote_endpoint(ec).address();
        if (ec) continue;  // gone already
        if (Connection* victim = make_room(peer)) {
          KVSTASH_LOG_DEBUG_LIMITED("admin {}: {} connections open ({} from {}): dropping one for a new one",
                                    address_, live_.size(), from(peer), peer.to_string());
          drop(*victim);
        }
        auto conn = std::make_shared<Connection>(std::move(sock));
        conn->seq = ++next_seq_;
        conn->peer = peer;
        by_age_.emplace(conn->seq, conn.get());
        asio::co_spawn(io_, serve(Tracked(this, std::move(conn))), asio::detached);
      } catch (const std::exception& e) {
        KVSTASH_LOG_WARN_LIMITED("admin {}: accept loop caught: {}", address_, e.what());
      }
    }
  }

  asio::awaitable<void> serve(Tracked tracked) {
    if (stopping_) co_return;  // stop() ran between the accept and this start
    const std::shared_ptr<Connection>& conn = tracked.connection();
    try {
      arm_deadline(conn);
      char chunk[kReadChunk];
      error_code ec;
      HeadParser parser;
      auto state = HeadParser::State::kNeedMore;
      while (state == HeadParser::State::kNeedMore) {
        std::size_t n =
            co_await conn->socket.async_read_some(asio::buffer(chunk), redirect_error(use_awaitable, ec));
        // The client left, the deadline closed the socket, or the server is stopping.
        if (ec) co_return;
        state = parser.feed(std::string_view(chunk, n));
      }
      head_done(*conn);

      Response response = state == HeadParser::State::kError ? plain_response(parser.error_status())
                                                             : route(parser.request());
      // The method is known whenever the request line parsed, even if a header was bad.
      const bool with_body = parser.request().method != "HEAD";
      KVSTASH_LOG_DEBUG_LIMITED("admin {}: {} {} -> {}", address_, parser.request().method,
                                parser.request().path, response.status);

      arm_deadline(conn);  // writing the response gets a budget of its own
      std::string out = serialize(response, with_body);
      co_await asio::async_write(conn->socket, asio::buffer(out), redirect_error(use_awaitable, ec));
      if (ec) co_return;
      // FIN after the response, then read until the client closes: closing with unread request
      // bytes (an oversized head, a body) makes the kernel send a reset, which can destroy the
      // response before the client reads it. The deadline bounds the wait.
      conn->socket.shutdown(tcp::socket::shutdown_send, ec);
      while (!ec) {
        co_await conn->socket.async_read_some(asio::buffer(chunk), redirect_error(use_awaitable, ec));
      }
    } catch (const std::exception& e) {
      KVSTASH_LOG_WARN_LIMITED("admin {}: connection caught: {}", address_, e.what());
    }
  }

  Response route(const RequestLine& req) {
    const bool metrics = req.path == "/metrics";
    const bool health = req.path == "/healthz";
    if (!metrics && !health) return plain_response(404);
    if (req.method != "GET" && req.method != "HEAD") return plain_response(405);
    try {
      Response r;
      if (metrics) {
        r.content_type = kMetricsContentType;
        r.body = handlers_.metrics();
        return r;
      }
      auto [healthy, reason] = handlers_.health();
      for (char& c : reason) {
        if (c == '\r' || c == '\n') c = ' ';
      }
      r.status = healthy ? 200 : 503;
      r.body = std::move(reason) + "\n";
      return r;
    } catch (const std::exception& e) {
      KVSTASH_LOG_WARN("admin {}: {} handler threw: {}", address_, req.path, e.what());
    } catch (...) {
      KVSTASH_LOG_WARN("admin {}: {} handler threw a non-standard exception", address_, req.path);
    }
    return plain_response(500);
  }

  // The connection has its request head: it is dropped for a newer one only after every
  // connection still sending one.
  static void head_done(Connection& c) { c.answered = true; }

  std::size_t from(const asio::ip::address& peer) const {
    std::size_t n = 0;
    for (const auto& [seq, c] : by_age_) n += c->peer == peer ? 1 : 0;
    return n;
  }

  // The connection a newcomer from `peer` takes the place of, or null when there is room. A
  // peer holds at most kMaxConnectionsPerPeer: its own oldest goes. When all kMaxConnections
  // are taken: the oldest that has been sending its request head for over kHeadGrace (a probe
  // sends it at once, so only slow or silent clients lose their place); else the oldest with
  // its head in (answered, or not reading its answer); else the oldest of all. A health probe
  // is therefore answered whatever the other connections do, unless kMaxConnections newer ones
  // from other addresses arrive before its request does.
  Connection* make_room(const asio::ip::address& peer) const {
    if (from(peer) >= kMaxConnectionsPerPeer) {
      for (const auto& [seq, c] : by_age_) {
        if (c->peer == peer) return c;
      }
    }
    if (by_age_.size() < kMaxConnections) return nullptr;
    const auto now = std::chrono::steady_clock::now();
    Connection* answered = nullptr;
    for (const auto& [seq, c] : by_age_) {
      if (!c->answered && now - c->accepted > kHeadGrace) return c;
      if (c->answered && answered == nullptr) answered = c;
    }
    return answered != nullptr ? answered : by_age_.begin()->second;
  }

  // Closes `c` now; its serve() coroutine ends and lets it go.
  void drop(Connection& c) {
    error_code ignored;
    by_age_.erase(c.seq);
    c.socket.close(ignored);
    c.deadline.cancel();
  }

  // (Re)starts the connection's deadline; when it passes, the socket is closed, which ends
  // whatever read or write the coroutine is waiting on.
  void arm_deadline(const std::shared_ptr<Connection>& c) {
    c->deadline.expires_after(request_timeout_);
    c->deadline.async_wait([c](error_code ec) {
      if (ec) return;  // re-armed, or the connection ended first
      error_code ignored;
      c->socket.close(ignored);
    });
  }

  Handlers handlers_;
  std::chrono::milliseconds request_timeout_;
  std::string address_;
  bool stopping_ = false;  // io thread only
  // Non-owning: each serve() coroutine's Tracked removes its own entry. Declared
  // before io_ so it outlives anything io_ destroys. io thread only.
  std::unordered_set<Connection*> live_;
  // The connections of live_ not dropped yet, oldest first. io thread only.
  std::map<std::uint64_t, Connection*> by_age_;
  std::uint64_t next_seq_ = 0;
  asio::io_context io_{1};
  tcp::acceptor acceptor_{io_};
  asio::steady_timer retry_timer_{io_};
  std::thread thread_;
};

AdminServer::AdminServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

AdminServer::~AdminServer() { impl_->stop(); }

std::string AdminServer::address() const { return impl_->address(); }

Result<std::unique_ptr<AdminServer>> AdminServer::start(std::string_view listen, Handlers handlers,
                                                        std::chrono::milliseconds request_timeout) {
  if (!handlers.metrics || !handlers.health) {
    return Status::invalid_argument("admin server on '" + std::string(listen) +
                                    "' needs both a metrics and a health handler");
  }
  if (request_timeout <= std::chrono::milliseconds::zero()) {
    return Status::invalid_argument("admin server request timeout must be positive");
  }
  KVSTASH_ASSIGN_OR_RETURN(HostPort hp, parse_listen(listen));
  auto impl = std::make_unique<Impl>(std::move(handlers), request_timeout);
  KVSTASH_RETURN_IF_ERROR(impl->bind(hp, listen));
  KVSTASH_RETURN_IF_ERROR(impl->run());
  KVSTASH_LOG_INFO("admin: serving /metrics and /healthz on {}", impl->address());
  return std::unique_ptr<AdminServer>(new AdminServer(std::move(impl)));
}

}  // namespace kvstash::node
