// kvstashd's admin HTTP endpoint (src/node/admin_server.cc) as a scraper or a stranger on the
// network reaches it: a real AdminServer serves /metrics and /healthz on loopback, and each
// input is what one client connection sends, cut into up to four writes (the request-head
// parser is fed whatever each read returns). The server must answer with one well-formed
// response whose status fits the request (200, 404, 405 or 503 for a head it parsed, else
// 400, 414, 431 or 505; nothing when the client stopped before finishing its head) and close
// the connection within 5 s of the client's last byte.
//
// Input: byte 0 holds three 2-bit fractions (bits 0-1, 2-3, 4-5) that say where the rest is
// cut; each cut is a separate send, the client's bytes are then followed by its FIN.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>

#include "fuzz_util.h"
#include "node/admin_server.h"

namespace kvstash {
namespace {

std::uint16_t port_of(const std::string& address) {
  return static_cast<std::uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
}

node::AdminServer& server() {
  static std::unique_ptr<node::AdminServer>* s = [] {
    fuzz::quiet_logs();
    node::AdminServer::Handlers h;
    h.metrics = [] { return std::string("# TYPE kvstash_up gauge\nkvstash_up 1\n"); };
    h.health = [] { return std::make_pair(true, std::string("ok")); };
    return new std::unique_ptr<node::AdminServer>(
        fuzz::must(node::AdminServer::start("127.0.0.1:0", h, std::chrono::seconds(5)), "admin server"));
  }();
  return **s;
}

}  // namespace
}  // namespace kvstash

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kvstash;
  static const std::uint16_t port = port_of(server().address());
  if (size == 0) return -1;
  const std::uint8_t cuts = data[0];
  const std::string_view request(reinterpret_cast<const char*>(data) + 1, size - 1);

  const int fd = fuzz::connect_loopback(port);
  FUZZ_CHECK(fd >= 0, "cannot connect to the admin server: %s", std::strerror(errno));
  const auto deadline = fuzz::Clock::now() + std::chrono::seconds(5);
  std::string response;
  std::size_t at = 0;
  bool open = true;
  for (int i = 0; i < 3 && open && at < request.size(); ++i) {
    const std::size_t q = (cuts >> (2 * i)) & 3;
    const std::size_t end = std::min(request.size(), at + (request.size() - at) * q / 4);
    if (end == at) continue;
    open = fuzz::converse(fd, request.substr(at, end - at), deadline, &response, 4096);
    at = end;
    std::this_thread::yield();
  }
  if (open) (void)fuzz::converse(fd, request.substr(at), deadline, &response, 4096);
  ::shutdown(fd, SHUT_WR);
  const auto ended = fuzz::drain(fd, fuzz::Clock::now() + std::chrono::seconds(5), &response, 4096);
  ::close(fd);
  FUZZ_CHECK(ended == fuzz::Drain::kClosed,
             "the admin server kept the connection open 5 s after the client's last byte");

  if (response.empty()) return 0;  // the head never ended: the server answers nothing
  FUZZ_CHECK(response.rfind("HTTP/1.1 ", 0) == 0 && response.size() >= 12, "not an HTTP/1.1 response: %.40s",
             response.c_str());
  static const std::set<std::string> kStatuses = {"200", "400", "404", "405", "414", "431", "503", "505"};
  FUZZ_CHECK(kStatuses.count(response.substr(9, 3)) == 1, "unexpected status %s",
             response.substr(9, 3).c_str());
  FUZZ_CHECK(response.find("\r\nContent-Length: ") != std::string::npos &&
                 response.find("\r\nConnection: close\r\n\r\n") != std::string::npos,
             "a response without Content-Length or Connection: close");
  return 0;
}
