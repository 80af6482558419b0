// A small synchronous Redis client over hiredis: URL parsing with ACL credentials, deadlines
// on connect and on every command, reconnect with backoff, and Lua scripts run as functions of
// one library (or by SHA where Redis has no Functions), loaded again when Redis lost them.
//
// Thread safety: a RedisClient is one connection; use it from one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/types.h"

struct redisReply;

namespace kvstash::metadata {

// redis://[[user]:password@]host[:port][/db]   (user alone is not accepted: ACL needs both)
// unix://[[user]:password@]/path/to/socket[?db=N]
// redis+sentinel://[[user]:password@]sentinel[:port][,sentinel[:port]...]/service[/db]
//   the master of `service` as Redis Sentinel names it (sentinels listen on 26379 by default);
//   the credentials are the master's
// redis+cluster://[[user]:password@]node[:port][,node[:port]...]
//   a Redis Cluster, reached through any of the nodes listed (6379 by default); the client
//   talks to the master of one hash slot (RedisOptions::cluster_key), following MOVED (and
//   waiting out ASK: a slot in migration)
// rediss://, rediss+sentinel://, rediss+cluster://: the same over TLS, to every server (the
//   master, the sentinels, the cluster's nodes), each of whose certificates must chain to the
//   CA and name the host connected to (or sni=).
// Options after '?', joined by '&', values %-escaped:
//   ca=FILE          (rediss) the CA certificates servers are verified against; default: the
//                    system's
//   cert=FILE&key=FILE  (rediss) this client's certificate chain and key, for a server that
//                    asks for one (Redis's tls-auth-clients)
//   sni=NAME         (rediss) the name sent and checked in every server's certificate, instead
//                    of the host connected to
//   redirect=H1,H2:P hosts (any port) or host:ports a sentinel or cluster node may send this
//                    client to with its password, besides the URL's own
//                    (RedisOptions::redirect_hosts)
//   db=N             (unix:// only) the database
// A password holding '/', '?' or '@' must be %-escaped.
struct RedisUrl {
  bool unix_socket = false;
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string path;  // unix socket
  int db = 0;
  std::string user;  // empty: the default user
  std::string password;
  std::vector<std::pair<std::string, int>> sentinels;      // redis+sentinel://: host, port of each
  std::string service;                                     // redis+sentinel://: the master's name
  std::vector<std::pair<std::string, int>> cluster_nodes;  // redis+cluster://: the seeds
  bool tls = false;                                        // rediss...://
  std::string tls_ca, tls_cert, tls_key, tls_server_name;
  std::vector<std::string> redirect_hosts;  // redirect=

  bool sentinel() const { return !sentinels.empty(); }
  bool cluster() const { return !cluster_nodes.empty(); }

  // Errors: kInvalidArgument naming what is wrong (never echoing the password).
  static Result<RedisUrl> parse(std::string_view url);
  // The URL with the password replaced by "***", for logs and CLI output.
  std::string redacted() const;
  // The options after '?' (parse's part).
  Status parse_options(std::string_view query);
};

class Reply;

struct RedisOptions {
  std::string url = "redis://127.0.0.1:6379/0";
  // Overrides the URL's password when set (keeps secrets out of command lines).
  std::string password;
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds command_timeout{2000};
  // After a broken connection, reconnect attempts back off from `backoff_initial`, doubling
  // up to `backoff_max`, until the command's deadline.
  std::chrono::milliseconds backoff_initial{20};
  std::chrono::milliseconds backoff_max{1000};
  // How long one command may spend reconnecting before it gives up with kUnavailable.
  std::chrono::milliseconds reconnect_budget{5000};
  // redis+sentinel://: the sentinels' password (requirepass in their configuration), when
  // they have one; the URL's credentials are the master's.
  std::string sentinel_password;
  // Runs on every new connection, before any command of the caller's, with a function that
  // sends one command on it (no reconnect); an error fails the connection. Cell uses it to
  // fence a new master after a Sentinel failover.
  using Command = std::function<Result<Reply>(const std::vector<std::string_view>&)>;
  std::function<Status(const Command&)> on_connect;
  // Where a Sentinel (the master it names) or a Redis Cluster node (CLUSTER SLOTS, MOVED) may
  // send this client while it has a password, besides the URL's own hosts (a redis:// URL's
  // host, a cluster's seeds; a sentinel's host is not one: a sentinel names masters, and one
  // naming another port of its own host gets nothing): each a host (any port) or a
  // host:port. Anywhere else is refused with kPermissionDenied before connecting: a lying or
  // taken-over sentinel or node must not collect the password by naming a server of its own.
  // Without a password there is nothing to hand over, and anywhere is followed. The URL's
  // redirect= adds to these.
  std::vector<std::string> redirect_hosts;
  // redis+cluster://: the key whose hash slot every command of this connection addresses (a
  // cell's prefix: the cell's keys share its hash tag). The client connects to that slot's
  // master and follows it when the slot moves.
  std::string cluster_key;
};

// An owned hiredis reply.
class Reply {
 public:
  enum class Type { kString, kArray, kInteger, kNil, kStatus, kError };

  explicit Reply(redisReply* r);
  Reply(Reply&&) noexcept;
  Reply& operator=(Reply&&) noexcept;
  ~Reply();

  Type type() const;
  bool is_nil() const { return type() == Type::kNil; }
  std::int64_t integer() const;  // kInteger, else 0
  std::string_view str() const;  // kString, kStatus, kError
  std::size_t size() const;      // kArray element count
  const redisReply* element(std::size_t i) const;
  const redisReply* raw() const { return r_; }

 private:
  redisReply* r_;
};

// The Status an error reply's text stands for, by its first word: Redis's own codes (NOPERM,
// OOM, LOADING...) and kvstash's scripts' (NOT_FOUND, STALE, NO_SPACE...); kInternal for any
// other. A script that answers per item in an array (end_gets) maps each item's text the same.
Status error_status(std::string_view text);

// The function library a build's scripts are functions of (scripts.cc makes it), loaded whole
// (FUNCTION LOAD) the first time a Redis lacks one of its functions. Its name carries the
// SHA1 of its text, so clients of different builds keep libraries of their own side by side.
struct FunctionLibrary {
  std::string name;
  std::string text;  // "#!lua name=<name>" and the library
};

// A Lua script. Where Redis has Functions (7.0 on) it runs as a function of its library
// (FCALL): the prelude's helpers are compiled once per library, not once per call. Elsewhere,
// or for a script of no library, it runs by SHA1 (EVALSHA of body).
struct Script {
  explicit Script(std::string body);
  Script(std::string body, std::string function, const FunctionLibrary* library);
  std::string body;      // the EVAL text
  std::string sha;       // hex SHA1 of body
  std::string function;  // its name in the library; empty without one
  const FunctionLibrary* library = nullptr;
};

// Runs `script` through `run`: FCALL of its function, loading its library when Redis does not
// know the function (a Redis that restarted empty, or never saw this build), else EVALSHA,
// loading the script on NOSCRIPT (a restart, a failover or SCRIPT FLUSH). A Redis that refuses
// FCALL or FUNCTION LOAD (older than 7.0, or an ACL without them) clears `*functions` (when
// given), so that its caller runs scripts by EVALSHA from then on, and logs it once per
// process. RedisClient::eval, and Cell's on_connect fence, which runs before the connection is
// the client's.
Result<Reply> eval_with(const RedisOptions::Command& run, const Script& script,
                        const std::vector<std::string_view>& keys, const std::vector<std::string_view>& args,
                        bool* functions = nullptr);

class RedisLink;
class TlsClientContext;

class RedisClient {
 public:
  // Connects (and authenticates, and selects the db). Errors: kInvalidArgument (bad URL, TLS
  // files that do not load, TLS against a plain port or plain against a TLS port),
  // kUnavailable (unreachable), kPermissionDenied (wrong password, unknown user, a server
  // certificate that does not verify, a client certificate the server refuses), kTimeout.
  static Result<std::unique_ptr<RedisClient>> connect(const RedisOptions& options);
  ~RedisClient();
  RedisClient(const RedisClient&) = delete;
  RedisClient& operator=(const RedisClient&) = delete;

  // Runs one command, binary-safe. An error reply becomes a Status: NOPERM/WRONGPASS/NOAUTH
  // -> kPermissionDenied, anything else -> kInternal with Redis's text. A broken connection
  // is re-established (with backoff, within reconnect_budget) and the command retried once
  // it is back, so callers must only send commands that are safe to repeat (every kvstash
  // metadata change is an idempotent-by-token script).
  Result<Reply> command(const std::vector<std::string_view>& args);

  // Runs `script` (eval_with).
  Result<Reply> eval(const Script& script, const std::vector<std::string_view>& keys,
                     const std::vector<std::string_view>& args);

  // Bounds every later command, its reconnects included, by `deadline` as well as by the
  // options' timeouts (an operation's deadline, for as long as it borrows this client);
  // nullopt lifts it. A command whose deadline has passed fails with kTimeout unsent.
  void set_deadline(std::optional<Deadline> deadline) { deadline_ = deadline; }
  // The bound set_deadline set; nullopt when there is none.
  std::optional<Deadline> deadline() const { return deadline_; }

  const RedisUrl& url() const { return url_; }
  // How many times the connection was re-established.
  std::uint64_t reconnects() const { return reconnects_; }
  // Whether this client runs scripts as functions (FCALL): false once Redis refused them.
  bool runs_functions() const { return functions_; }

 private:
  RedisClient(RedisOptions options, RedisUrl url);
  Status open();  // connect (through the sentinels, or to the slot's master) + AUTH + SELECT + on_connect
  // Connects to `host`:`port` (or the unix socket), AUTH, SELECT; a sentinel only gets AUTH,
  // with the sentinels' password.
  enum class Server { kRedis, kSentinel };
  Status open_at(const std::string& host, int port, Server to = Server::kRedis);
  // Asks the sentinels in turn for the service's master, connects to it and checks that it is
  // one (a sentinel that has not seen a failover yet still names the old master).
  Status open_through_sentinels();
  // Asks the cluster's nodes in turn (the last master first, then the seeds) which master
  // serves cluster_key's slot, and connects to it.
  Status open_in_cluster();
  // After a MOVED reply (`error` its text): connects to the node it names, the slot's master
  // from now on (on_connect runs).
  Status redirect(std::string_view error);
  // OK, or kPermissionDenied when the client would AUTH to `host`:`port`, which neither the
  // URL nor RedisOptions::redirect_hosts names (`who` named it).
  Status may_follow(const std::string& host, int port, std::string_view who) const;
  Result<Reply> run_once(const std::vector<std::string_view>& args);
  // `limit`, shortened to what is left of the deadline; zero or less once it has passed.
  std::chrono::milliseconds within_deadline(std::chrono::milliseconds limit) const;

  RedisOptions options_;
  RedisUrl url_;
  std::shared_ptr<TlsClientContext> tls_;  // rediss: the CA, certificate and name every connection uses
  std::unique_ptr<RedisLink> link_;        // the connection; null while there is none
  std::uint64_t reconnects_ = 0;
  bool functions_ = true;  // eval_with clears it when Redis refuses Functions
  std::optional<Deadline> deadline_;
  std::size_t sentinel_ = 0;   // the sentinel that answered last
  std::string original_host_;  // the URL's host (url_.host follows redirects)
};

}  // namespace kvstash::metadata
