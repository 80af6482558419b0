// Tests' view of an admin endpoint: one plain HTTP GET, and metric values in its text.
#pragma once

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <utility>

namespace kvstash::test {

// One HTTP/1.1 GET against host:port; returns the status code and body.
inline std::pair<int, std::string> http_get(const std::string& address, const std::string& path) {
  auto colon = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return {-1, ""};
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: test\r\n\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string resp;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) resp.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  if (resp.size() < 12) return {-1, resp};
  auto body = resp.find("\r\n\r\n");
  return {std::stoi(resp.substr(9, 3)), body == std::string::npos ? "" : resp.substr(body + 4)};
}

// The value of an unlabelled metric in Prometheus text, or -1.
inline double metric(const std::string& text, const std::string& name) {
  auto at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

// The value of a metric with exactly these labels (`{transport="verbs",event="x"}`), or -1.
inline double metric(const std::string& text, const std::string& name, const std::string& labels) {
  const std::string line = "\n" + name + labels + " ";
  auto at = text.find(line);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + line.size()));
}

}  // namespace kvstash::test
