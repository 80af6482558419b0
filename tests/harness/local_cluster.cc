#include "tests/harness/local_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "common/fd.h"
#include "metadata/redis_client.h"

namespace kvstash::harness {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// ---- LocalRedis ---------------------------------------------------------------------------

int free_port() {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    return 0;
  }
  return ntohs(a.sin_port);
}

namespace {

// Whether `port` on 127.0.0.1 is free right now.
bool port_free(int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  return fd.get() >= 0 && ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
}

// A port for a Redis Cluster node: at most 55535, it and port + 10000 (the cluster bus) free
// now, below the kernel's ephemeral range. 0 when 200 tries found none.
int free_cluster_port() {
  static std::atomic<unsigned> spread{static_cast<unsigned>(::getpid()) * 7919u};
  for (int tries = 0; tries < 200; ++tries) {
    const int port = 20000 + static_cast<int>(spread.fetch_add(7919u) % 10000u);
    if (port_free(port) && port_free(port + 10000)) return port;
  }
  return 0;
}

std::string resp_command(const std::vector<std::string_view>& args) {
  // append(), not operator+: GCC 12 at -O3 warns falsely (-Wrestrict) on "*" + std::string.
  std::string s = "*";
  s.append(std::to_string(args.size())).append("\r\n");
  for (auto a : args) s.append("$").append(std::to_string(a.size())).append("\r\n").append(a).append("\r\n");
  return s;
}

enum class Probe {
  kNoAnswer,  // nothing listening (yet), or no reply
  kLoading,   // up, still loading its data
  kUp,        // a Redis is up, INFO refused: whose it is, its log says
  kOurs,      // up, and INFO names our pid
  kOther,     // another redis-server holds the port
};

// Asks the server on `port` who it is and whether it is done loading: AUTH when we have a
// password, then INFO server persistence. Each exchange is bounded by a 1 s socket timeout.
Probe probe_redis(const std::string& host, int port, const std::string& password, pid_t pid) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Probe::kNoAnswer;
  timeval tv{1, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) return Probe::kNoAnswer;
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return Probe::kNoAnswer;

  std::string in;
  auto send_all = [&](const std::string& s) {
    return ::send(fd.get(), s.data(), s.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(s.size());
  };
  // One reply: a status/error/integer line, or a bulk string (its payload returned).
  auto read_reply = [&](std::string* reply) -> bool {
    auto fill = [&] {
      char buf[4096];
      const ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
      if (n <= 0) return false;
      in.append(buf, static_cast<std::size_t>(n));
      return true;
    };
    std::size_t eol;
    while ((eol = in.find("\r\n")) == std::string::npos) {
      if (!fill()) return false;
    }
    std::string head = in.substr(0, eol);
    if (head.empty() || head[0] != '$') {
      *reply = head;
      in.erase(0, eol + 2);
      return true;
    }
    const long len = std::strtol(head.c_str() + 1, nullptr, 10);
    if (len < 0) {
      *reply = head;
      in.erase(0, eol + 2);
      return true;
    }
    while (in.size() < eol + 2 + static_cast<std::size_t>(len) + 2) {
      if (!fill()) return false;
    }
    reply->assign(1, '$');
    reply->append(in, eol + 2, static_cast<std::size_t>(len));
    in.erase(0, eol + 2 + static_cast<std::size_t>(len) + 2);
    return true;
  };

  std::string reply;
  if (!password.empty()) {
    if (!send_all(resp_command({"AUTH", password})) || !read_reply(&reply)) return Probe::kNoAnswer;
    if (reply.rfind("-LOADING", 0) == 0) return Probe::kLoading;
  }
  if (!send_all(resp_command({"INFO", "server", "persistence"})) || !read_reply(&reply)) {
    return Probe::kNoAnswer;
  }
  if (reply.rfind("-LOADING", 0) == 0) return Probe::kLoading;
  // An error (NOAUTH from another password-protected server, INFO renamed away) means a
  // Redis is up, maybe not ours; anything else is not Redis at all.
  if (!reply.empty() && reply[0] == '-') return Probe::kUp;
  if (reply.empty() || reply[0] != '$') return Probe::kNoAnswer;
  const auto at = reply.find("\nprocess_id:");
  if (at == std::string::npos) return Probe::kUp;
  const long server_pid = std::strtol(reply.c_str() + at + 12, nullptr, 10);
  if (server_pid != pid) return Probe::kOther;
  if (reply.find("\nloading:1") != std::string::npos) return Probe::kLoading;
  return Probe::kOurs;
}

}  // namespace

Result<std::unique_ptr<LocalRedis>> LocalRedis::start(LocalRedisOptions options) {
  std::unique_ptr<LocalRedis> redis(new LocalRedis(std::move(options)));
  std::error_code ec;
  std::string tmpl = (fs::temp_directory_path(ec) / "kvstash-redis-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) return Status::from_errno("mkdtemp " + tmpl, errno);
  redis->dir_ = tmpl;
  if (!redis->options_.password.empty()) {
    // requirepass in a 0600 file of the private (0700) directory: off the command line,
    // where any local user's `ps` would show it.
    const std::string conf = redis->dir_ + "/redis.conf";
    UniqueFd fd(::open(conf.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (fd.get() < 0) return Status::from_errno("create " + conf, errno);
    std::string line = "requirepass \"";
    for (char c : redis->options_.password) {
      if (c == '"' || c == '\\') line.push_back('\\');
      line.push_back(c);
    }
    line += "\"\n";
    if (::write(fd.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      return Status::from_errno("write " + conf, errno);
    }
  }
  Status last;
  for (int attempt = 0; attempt < 5; ++attempt) {
    redis->port_ = redis->options_.cluster_bus ? free_cluster_port() : free_port();
    if (redis->port_ == 0) return Status::unavailable("no free TCP port on 127.0.0.1");
    bool port_taken = false;
    last = redis->launch(deadline_after(redis->options_.ready_timeout), &port_taken);
    if (last.is_ok()) return redis;
    if (!port_taken) break;
  }
  return last;  // ~LocalRedis removes the directory
}

LocalRedis::~LocalRedis() { stop(); }

std::string LocalRedis::url() const {
  std::string url = options_.sentinel_for != 0 ? "redis+sentinel://" : "redis://";
  url.append(options_.host).append(":").append(std::to_string(port_));
  if (options_.sentinel_for != 0) url.append("/").append(options_.service);
  return url.append("/0");
}

Status LocalRedis::launch(Deadline deadline, bool* port_taken) {
  *port_taken = false;
  const std::string port = std::to_string(port_);
  std::vector<std::string> argv = options_.wrapper;
  argv.push_back(options_.redis_server);
  const bool sentinel = options_.sentinel_for != 0;
  if (sentinel) {
    // Its configuration file comes first, and Sentinel rewrites it: kept across restarts.
    const std::string conf = dir_ + "/sentinel.conf";
    if (!fs::exists(conf)) {
      const std::string& s = options_.service;
      std::ofstream(conf) << "sentinel monitor " << s << " " << options_.sentinel_host << " "
                          << options_.sentinel_for << " " << options_.quorum << "\n"
                          << "sentinel down-after-milliseconds " << s << " 300\n"
                          << "sentinel failover-timeout " << s << " 3000\n";
    }
    argv.insert(argv.end(), {conf, "--sentinel"});
  } else if (!options_.password.empty()) {
    argv.push_back(dir_ + "/redis.conf");  // the config file comes first
  }
  const std::string log = dir_ + "/redis.log";
  for (const char* a : {"--port", port.c_str(), "--bind", options_.host.c_str(), "--dir", dir_.c_str(),
                        "--logfile", log.c_str(), "--daemonize", "no"}) {
    argv.emplace_back(a);
  }
  // Bound to an address other than loopback (in a network namespace a test made, say), it
  // must answer clients there: protected mode would refuse everyone but loopback.
  if (options_.host != "127.0.0.1") argv.insert(argv.end(), {"--protected-mode", "no"});
  if (sentinel) {
    // no data of its own
  } else if (options_.persistence) {
    argv.insert(argv.end(), {"--save", "", "--appendonly", "yes", "--appendfsync", "always"});
  } else {
    argv.insert(argv.end(), {"--save", "", "--appendonly", "no"});
  }
  argv.insert(argv.end(), options_.extra_args.begin(), options_.extra_args.end());

  {
    // A fresh log per attempt: "Ready to accept connections" must be this server's.
    std::ofstream truncate(dir_ + "/redis.log", std::ios::trunc);
  }
  auto child = ChildProcess::start({.argv = argv, .capture_stdout = false});
  if (!child.is_ok()) {
    if (child.status().code() == StatusCode::kNotFound) {
      return Status::unavailable(options_.redis_server +
                                 " not found: install Redis (Debian: apt-get install redis-server) or put "
                                 "redis-server in PATH");
    }
    return Status::unavailable("cannot start " + options_.redis_server + ": " + child.status().to_string());
  }
  child_ = std::move(*child);
  auto backoff = 5ms;
  for (;;) {
    if (auto status = child_.wait(Clock::now())) {
      const std::string tail = log_tail();
      *port_taken = tail.find("Address already in use") != std::string::npos;
      return Status::unavailable("redis-server " + describe_status(*status) + " at start on " +
                                 options_.host + ":" + port +
                                 (tail.empty() ? " (see its errors above)" : ": " + tail));
    }
    switch (probe_redis(options_.host, port_, options_.password, child_.pid())) {
      case Probe::kOurs: return {};
      case Probe::kUp:
        // Ours only if it says so: another server may hold the port while ours fails to bind.
        if (log_says_ready()) return {};
        break;
      case Probe::kOther:
        child_.kill();
        *port_taken = true;
        return Status::unavailable("port " + port + " on " + options_.host +
                                   " is taken by another redis-server");
      case Probe::kLoading:
      case Probe::kNoAnswer: break;
    }
    if (Clock::now() >= deadline) {
      child_.kill();
      const std::string tail = log_tail();
      return Status::unavailable("redis-server did not answer on " + options_.host + ":" + port + " within " +
                                 std::to_string(options_.ready_timeout.count()) + " ms" +
                                 (tail.empty() ? "" : ": " + tail));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, 50ms);
  }
}

bool LocalRedis::log_says_ready() const {
  std::ifstream f(dir_ + "/redis.log");
  for (std::string line; std::getline(f, line);) {
    if (line.find("Ready to accept connections") != std::string::npos) return true;
  }
  return false;
}

// The last few lines of its log: why it failed, in its own words.
std::string LocalRedis::log_tail() const {
  std::ifstream f(dir_ + "/redis.log");
  std::vector<std::string> lines;
  for (std::string line; std::getline(f, line);) {
    if (line.empty()) continue;
    lines.push_back(line);
    if (lines.size() > 3) lines.erase(lines.begin());
  }
  std::string out;
  for (const auto& l : lines) out.append(out.empty() ? "" : " | ").append(l);
  return out;
}

Status LocalRedis::restart() {
  child_.kill();
  bool port_taken = false;
  Status s = launch(deadline_after(options_.ready_timeout), &port_taken);
  if (!s.is_ok() && port_taken) {
    return Status::unavailable("cannot restart redis-server: port " + std::to_string(port_) +
                               " was taken meanwhile (" + s.message() + ")");
  }
  return s;
}

void LocalRedis::stop() {
  child_.kill();
  if (!dir_.empty()) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    dir_.clear();
  }
}

// ---- LocalRedisCluster --------------------------------------------------------------------

namespace {

// One redis-cli command against a server, its stdout; nullopt when it failed or hung.
std::optional<std::string> redis_cli(const LocalRedis& server, std::vector<std::string> args,
                                     Deadline deadline) {
  std::vector<std::string> argv{"redis-cli", "-h", server.host(), "-p", std::to_string(server.port())};
  argv.insert(argv.end(), args.begin(), args.end());
  auto child = ChildProcess::start({.argv = argv, .discard_stderr = true});
  if (!child.is_ok()) return std::nullopt;
  std::string out;
  while (auto line = child->read_line(deadline)) out.append(*line).append("\n");
  auto status = child->wait(deadline);
  if (!status || *status != 0) return std::nullopt;
  return out;
}

}  // namespace

Result<std::unique_ptr<LocalRedisCluster>> LocalRedisCluster::start(LocalRedisClusterOptions options) {
  std::unique_ptr<LocalRedisCluster> cluster(new LocalRedisCluster());
  std::vector<std::string> args{"--cluster-enabled",      "yes",
                                "--cluster-config-file",  "nodes.conf",
                                "--cluster-node-timeout", std::to_string(options.node_timeout.count())};
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  const int total = options.masters * (1 + options.replicas_per_master);
  std::vector<std::string> create{"--cluster", "create"};
  for (int i = 0; i < total; ++i) {
    KVSTASH_ASSIGN_OR_RETURN(auto server, LocalRedis::start({.extra_args = args, .cluster_bus = true}));
    create.push_back(server->host() + ":" + std::to_string(server->port()));
    cluster->servers_.push_back(std::move(server));
  }
  create.insert(create.end(),
                {"--cluster-replicas", std::to_string(options.replicas_per_master), "--cluster-yes"});
  if (total == 1) {
    // redis-cli creates clusters of three masters or more; one master takes every slot itself.
    if (!redis_cli(*cluster->servers_.front(), {"CLUSTER", "ADDSLOTSRANGE", "0", "16383"},
                   deadline_after(10s))) {
      return Status::unavailable("CLUSTER ADDSLOTSRANGE failed");
    }
  } else if (!redis_cli(*cluster->servers_.front(), create, deadline_after(30s))) {
    return Status::unavailable(
        "redis-cli --cluster create failed (three masters at least; is redis-tools installed?)");
  }
  KVSTASH_RETURN_IF_ERROR(cluster->wait_healthy(deadline_after(30s)));
  return cluster;
}

std::string LocalRedisCluster::url() const {
  std::string url = "redis+cluster://";
  for (std::size_t i = 0; i < servers_.size(); ++i) {
    url.append(i > 0 ? "," : "")
        .append(servers_[i]->host())
        .append(":")
        .append(std::to_string(servers_[i]->port()));
  }
  return url;
}

Status LocalRedisCluster::wait_healthy(Deadline deadline) {
  for (;; std::this_thread::sleep_for(100ms)) {
    bool healthy = true;
    for (const auto& server : servers_) {
      if (!server->running()) continue;
      auto info = redis_cli(*server, {"CLUSTER", "INFO"}, std::min(deadline, deadline_after(2s)));
      healthy = healthy && info && info->find("cluster_state:ok") != std::string::npos;
      // Every master known to be a master by this node too: no failover still in flight.
      auto nodes = healthy ? redis_cli(*server, {"CLUSTER", "NODES"}, deadline_after(2s)) : std::nullopt;
      healthy = healthy && nodes && nodes->find("fail") == std::string::npos;
    }
    if (healthy) return {};
    if (Clock::now() > deadline)
      return Status::unavailable("the Redis Cluster did not become healthy in time");
  }
}

Result<std::size_t> LocalRedisCluster::master_of(std::string_view key) {
  // The client's own slot lookup (CLUSTER SLOTS through a live node) names the master.
  KVSTASH_ASSIGN_OR_RETURN(auto client,
                           metadata::RedisClient::connect({.url = url(), .cluster_key = std::string(key)}));
  for (std::size_t s = 0; s < servers_.size(); ++s) {
    if (servers_[s]->port() == client->url().port) return s;
  }
  return Status::unavailable("the cluster names a master that is none of its servers");
}

// ---- LocalNode ----------------------------------------------------------------------------

Result<std::unique_ptr<LocalNode>> LocalNode::start(LocalNodeOptions options) {
  const std::string exe = options.kvstashd.empty() ? find_tool("kvstashd") : options.kvstashd;
  std::vector<std::string> argv = options.wrapper;
  argv.insert(argv.end(), {exe, "--redis", options.redis_url, "--capacity", options.capacity});
  if (!options.page_size.empty()) argv.insert(argv.end(), {"--page-size", options.page_size});
  if (!options.node_id.empty()) argv.insert(argv.end(), {"--node-id", options.node_id});
  const bool has_admin = std::any_of(options.extra_args.begin(), options.extra_args.end(), [](const auto& a) {
    return a == "--admin" || a.rfind("--admin=", 0) == 0;
  });
  if (!has_admin) argv.insert(argv.end(), {"--admin", "127.0.0.1:0"});
  argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
  ChildOptions co{.argv = argv,
                  .unset_env = {"KVSTASH_REDIS_URL", "KVSTASH_REDIS_PASSWORD", "KVSTASH_CLUSTER_TOKEN"}};
  if (!options.redis_password.empty()) co.env.emplace_back("KVSTASH_REDIS_PASSWORD", options.redis_password);

  auto child = ChildProcess::start(co);
  if (!child.is_ok()) {
    if (child.status().code() == StatusCode::kNotFound) {
      return Status::not_found("kvstashd not found (" + exe +
                               "): build it (meson compile -C build kvstashd) or set KVSTASH_KVSTASHD");
    }
    return child.status().with_context("start kvstashd");
  }
  std::unique_ptr<LocalNode> node(new LocalNode());
  node->child_ = std::move(*child);
  const Deadline deadline = deadline_after(options.ready_timeout);
  for (;;) {
    auto line = node->child_.read_line(deadline);
    if (!line) {
      if (node->child_.eof()) {
        // It closed stdout: it is exiting. Give it a moment to finish before reporting.
        auto status = node->child_.wait(deadline_after(5s));
        if (!status) status = node->child_.kill();
        return Status::unavailable("kvstashd " + describe_status(*status) +
                                   " before it was ready (its error is on stderr above)");
      }
      node->child_.kill();
      return Status::timeout("kvstashd printed no ready line within " +
                             std::to_string(options.ready_timeout.count()) + " ms");
    }
    if (line->rfind("ready ", 0) != 0) continue;  // not for us
    std::istringstream words(line->substr(6));
    for (std::string w; words >> w;) {
      const auto eq = w.find('=');
      if (eq == std::string::npos) continue;
      const std::string key = w.substr(0, eq), value = w.substr(eq + 1);
      if (key == "node") node->node_id_ = value;
      if (key == "admin") node->admin_ = value;
      if (key == "pages") node->pages_ = std::strtoull(value.c_str(), nullptr, 10);
      if (key == "page_size") node->page_size_ = std::strtoull(value.c_str(), nullptr, 10);
    }
    if (node->node_id_.empty() || node->admin_.empty() || node->pages_ == 0 || node->page_size_ == 0) {
      node->child_.kill();
      return Status::corrupt("malformed ready line from kvstashd: '" + *line + "'");
    }
    return node;
  }
}

LocalNode::~LocalNode() { stop(); }

std::optional<int> LocalNode::terminate(Deadline deadline) {
  child_.signal(SIGTERM);
  return child_.wait(deadline);
}

int LocalNode::kill() { return child_.kill(); }

void LocalNode::stop() {
  if (!child_.running()) return;
  if (!terminate(deadline_after(10s))) child_.kill();
}

// ---- find_tool ----------------------------------------------------------------------------

std::string find_tool(std::string_view name) {
  std::string var = "KVSTASH_";
  for (char c : name)
    var.push_back(c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  if (const char* v = std::getenv(var.c_str()); v != nullptr && *v != '\0') return v;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path dir = self.parent_path();
    for (const fs::path& candidate : {dir / ".." / "tools" / name / name, dir / name}) {
      if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0) {
        return candidate.lexically_normal().string();
      }
    }
  }
  return std::string(name);
}

}  // namespace kvstash::harness
