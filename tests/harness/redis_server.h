// A private redis-server for tests: started on a free loopback port (or a unix socket),
// without persistence, stopped (SIGKILL) when the fixture goes. Can be restarted on the
// same port to test reconnects.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace kvstash::test {

class RedisServer {
 public:
  // `extra`: redis-server config arguments, e.g. {"--requirepass", "x"}.
  explicit RedisServer(std::vector<std::string> extra = {}) : extra_(std::move(extra)) {
    for (int attempt = 0; attempt < 5 && pid_ <= 0; ++attempt) {
      port_ = free_port();
      start();
    }
  }
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  bool running() const { return pid_ > 0; }
  int port() const { return port_; }
  std::string url(const std::string& credentials = "") const {
    return "redis://" + (credentials.empty() ? "" : credentials + "@") +
           "127.0.0.1:" + std::to_string(port_) + "/0";
  }
  void stop() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  // Kills the server and starts a fresh one (empty, no scripts) on the same port.
  bool restart() {
    stop();
    start();
    return running();
  }

  // A loopback port nothing listens on now.
  static int free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    ::close(fd);
    return ntohs(a.sin_port);
  }

 private:
  // Ready when it answers PING (or NOAUTH, which also means it is up) on its port.
  bool answers() const {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = false;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      const char ping[] = "PING\r\n";
      char buf[64] = {};
      ok = ::send(fd, ping, sizeof ping - 1, 0) > 0 && ::recv(fd, buf, sizeof buf - 1, 0) > 0;
    }
    ::close(fd);
    return ok;
  }

  void start() {
    std::vector<std::string> args{"redis-server",
                                  "--port",
                                  std::to_string(port_),
                                  "--bind",
                                  "127.0.0.1",
                                  "--save",
                                  "",
                                  "--appendonly",
                                  "no",
                                  "--dir",
                                  "/tmp",
                                  "--logfile",
                                  ""};
    args.insert(args.end(), extra_.begin(), extra_.end());
    pid_ = fork();
    if (pid_ == 0) {
      int devnull = ::open("/dev/null", O_WRONLY);
      dup2(devnull, 1);
      dup2(devnull, 2);
      std::vector<char*> argv;
      for (auto& s : args) argv.push_back(s.data());
      argv.push_back(nullptr);
      execvp("redis-server", argv.data());
      _exit(127);
    }
    for (int i = 0; i < 500; ++i) {
      if (answers()) return;
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) break;  // exited: port taken or bad args
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop();
  }

  std::vector<std::string> extra_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace kvstash::test
