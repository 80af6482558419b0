// tests/harness/local_cluster.h: what a kvstash cell needs, started on loopback by one process.
//
// kvstash-bench and the integration tests start a private redis-server and memory nodes
// (kvstashd) with these classes, use them, and stop them again. Everything they start listens
// on 127.0.0.1 only, lives in private temporary directories, and dies with the process that
// started it: children get PR_SET_PDEATHSIG(SIGKILL), and every destructor kills and reaps.
//
//   auto redis = LocalRedis::start({}).value();
//   auto node = LocalNode::start({.redis_url = redis->url(), .capacity = "256MiB"}).value();
//   auto store = Store::open({.redis_url = redis->url()}).value();
//   ...                                  // destroy node before redis: it says goodbye to it
//
// Thread safety: none of these objects may be used from two threads at once. Note that the
// kernel delivers PR_SET_PDEATHSIG when the *thread* that started a child exits: start
// children from a thread that outlives them (the main thread, a test body).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"
#include "tests/harness/child_process.h"

namespace kvstash::harness {

// ---- LocalRedis ---------------------------------------------------------------------------

struct LocalRedisOptions {
  // More redis-server arguments, each argv word separate: {"--maxmemory", "64mb"}. They
  // come last, so they override the defaults below.
  std::vector<std::string> extra_args;
  // appendonly yes (appendfsync always: an acknowledged write survives SIGKILL), in the
  // private directory, so restart() keeps the data. Without it, no RDB or AOF at all.
  bool persistence = false;
  // requirepass: clients must AUTH with it.
  std::string password;
  // The redis-server executable (PATH lookup unless it contains a '/').
  std::string redis_server = "redis-server";
  // How long start() and restart() wait for it to answer.
  std::chrono::milliseconds ready_timeout{10000};
  // Nonzero: run a Redis Sentinel instead, watching the master on <sentinel_host>:<this
  // port> as `service` (quorum `quorum`, down after 300 ms, failover timeout 3 s); url() is
  // then the redis+sentinel:// URL clients use. Persistence and password do not apply.
  int sentinel_for = 0;
  std::string sentinel_host = "127.0.0.1";
  int quorum = 1;
  std::string service = "kvstash";
  // The address it binds and is probed at: loopback, unless it runs in a network namespace
  // (`wrapper`) with an address of its own (then with protected-mode off: it binds only that
  // address).
  std::string host = "127.0.0.1";
  // A Redis Cluster node: its port leaves room for the cluster bus (port + 10000, also free).
  bool cluster_bus = false;
  // Words in front of the command line: {"ip", "netns", "exec", "h1"} runs it in netns h1
  // (which execs it: the pid stays the server's).
  std::vector<std::string> wrapper;
};

// A free TCP port on 127.0.0.1 right now (someone may take it before it is bound: callers
// retry). 0 on failure.
int free_port();

// A private redis-server on a free loopback port: bound to 127.0.0.1, working directory (and
// log file) in a private mkdtemp directory removed at stop().
class LocalRedis {
 public:
  // Starts it and waits until it answers (a PING, or NOAUTH, which also means it is up; and
  // it is this server, not another one that holds the port: its INFO names our pid). A port
  // taken between picking and binding is retried with another one, up to 5 times.
  // Errors: kUnavailable (redis-server not found, exited at start, did not answer in time;
  // the message quotes the end of its log), kIoError (temporary directory).
  static Result<std::unique_ptr<LocalRedis>> start(LocalRedisOptions options = {});
  ~LocalRedis();
  LocalRedis(const LocalRedis&) = delete;
  LocalRedis& operator=(const LocalRedis&) = delete;

  // "redis://HOST:PORT/0" (no credentials: pass password() separately); for a sentinel,
  // "redis+sentinel://HOST:PORT/<service>/0".
  std::string url() const;
  int port() const { return port_; }
  const std::string& host() const { return options_.host; }
  const std::string& password() const { return options_.password; }
  pid_t pid() const { return child_.pid(); }
  bool running() const { return child_.running(); }
  // The private directory (data and redis.log).
  const std::string& dir() const { return dir_; }

  // SIGKILLs the server and starts it again on the same port: with persistence it comes back
  // with its data, otherwise empty. Errors as start(); kUnavailable when the port was taken
  // meanwhile (the URL cannot change under the clients).
  Status restart();
  // SIGKILLs the server and leaves it down (its port and directory kept for restart()).
  void kill() { child_.kill(); }
  // SIGKILLs the server and removes its directory. Idempotent; the destructor calls it.
  void stop();

 private:
  explicit LocalRedis(LocalRedisOptions options) : options_(std::move(options)) {}
  // One attempt on port_: the child runs and answers, or an error (port_taken set when the
  // port belongs to another process, so another port may work).
  Status launch(Deadline deadline, bool* port_taken);
  std::string log_tail() const;
  bool log_says_ready() const;

  LocalRedisOptions options_;
  std::string dir_;
  int port_ = 0;
  ChildProcess child_;
};

// ---- LocalRedisCluster --------------------------------------------------------------------

struct LocalRedisClusterOptions {
  int masters = 3;
  int replicas_per_master = 1;
  // cluster-node-timeout: how long a master is unreachable before its replica takes over.
  std::chrono::milliseconds node_timeout{1000};
  // More arguments for every server.
  std::vector<std::string> extra_args;
};

// A private Redis Cluster on loopback: masters and replicas, each a LocalRedis with
// cluster-enabled, the slots spread over the masters by `redis-cli --cluster create` (which
// takes three masters or more), or one master alone holding every slot.
class LocalRedisCluster {
 public:
  // Starts the servers, forms the cluster and waits until every node says cluster_state:ok.
  // Errors: LocalRedis::start's; kUnavailable when the cluster does not form in 30 s.
  static Result<std::unique_ptr<LocalRedisCluster>> start(LocalRedisClusterOptions options = {});

  // redis+cluster://127.0.0.1:P1,127.0.0.1:P2,... (every server as a seed).
  std::string url() const;
  std::size_t size() const { return servers_.size(); }
  LocalRedis& server(std::size_t i) { return *servers_[i]; }
  // The server that is the master of `key`'s hash slot now, as a live node says; kUnavailable
  // when no node answers or none serves the slot.
  Result<std::size_t> master_of(std::string_view key);
  // Waits until every running server says cluster_state:ok (a failover or a resharding ended).
  Status wait_healthy(Deadline deadline);

 private:
  LocalRedisCluster() = default;
  std::vector<std::unique_ptr<LocalRedis>> servers_;
};

// ---- LocalNode ----------------------------------------------------------------------------

struct LocalNodeOptions {
  // The kvstashd executable; empty: find_tool("kvstashd").
  std::string kvstashd;
  std::string redis_url;
  // Passed in the child's environment (KVSTASH_REDIS_PASSWORD), never on its command line.
  std::string redis_password;
  // Pool size and page size as kvstashd parses them ("1GiB"); empty page size: its default.
  std::string capacity = "1GiB";
  std::string page_size;
  // Empty: kvstashd's default (the host name).
  std::string node_id;
  // More kvstashd arguments ({"--transports", "tcp"}). `--admin 127.0.0.1:0` is added
  // unless these contain --admin.
  std::vector<std::string> extra_args;
  // How long to wait for the ready line.
  std::chrono::milliseconds ready_timeout{15000};
  // Words in front of the command line: {"ip", "netns", "exec", "h1"} runs it in netns h1.
  std::vector<std::string> wrapper;
};

// A memory node (kvstashd) started as a child process, ready once it registered its pool in
// Redis and printed `ready node=<id> admin=<host:port> pages=<n> page_size=<bytes>`. Its
// configuration comes from LocalNodeOptions alone: this process's KVSTASH_REDIS_URL,
// KVSTASH_REDIS_PASSWORD and KVSTASH_CLUSTER_TOKEN are not passed on (a developer's shell
// must not change what a test or benchmark starts); KVSTASH_LOG is.
class LocalNode {
 public:
  // Errors: kNotFound (no kvstashd executable), kUnavailable (it exited before it was
  // ready: the message carries its exit status; its own error went to our stderr),
  // kTimeout (no ready line in time: it is killed), kCorrupt (a malformed ready line).
  static Result<std::unique_ptr<LocalNode>> start(LocalNodeOptions options);
  // stop().
  ~LocalNode();
  LocalNode(const LocalNode&) = delete;
  LocalNode& operator=(const LocalNode&) = delete;

  const std::string& node_id() const { return node_id_; }
  const std::string& admin() const { return admin_; }  // host:port of its admin endpoint
  std::uint64_t pages() const { return pages_; }
  std::uint64_t page_size() const { return page_size_; }
  pid_t pid() const { return child_.pid(); }
  bool running() const { return child_.running(); }

  // SIGTERM (graceful drain) and wait: the exit status (0 after a clean drain), or nullopt
  // when it still runs at the deadline (then kill() or wait again).
  std::optional<int> terminate(Deadline deadline);
  // SIGKILL and reap: a crash, as far as the cell can tell. Returns the status.
  int kill();
  // terminate() with a 10 s deadline, then kill() if it is still running. Idempotent.
  void stop();

 private:
  LocalNode() = default;

  ChildProcess child_;
  std::string node_id_;
  std::string admin_;
  std::uint64_t pages_ = 0;
  std::uint64_t page_size_ = 0;
};

// ---- find_tool ----------------------------------------------------------------------------

// Where a kvstash executable is: $KVSTASH_<NAME> (upper case, '-' -> '_': KVSTASH_KVSTASHD)
// when set; else next to this executable in the build tree (<exe dir>/../tools/<name>/<name>:
// build/bench/kvstash-bench -> build/tools/kvstashd/kvstashd, and likewise from build/tests);
// else installed side by side (<exe dir>/<name>); else `name` itself, for a PATH lookup.
std::string find_tool(std::string_view name);

}  // namespace kvstash::harness
