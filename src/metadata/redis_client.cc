#include "metadata/redis_client.h"

#include <hiredis/hiredis.h>
#include <openssl/sha.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "common/log.h"
#include "common/net.h"
#include "common/wire.h"
#include "metadata/redis_link.h"

namespace kvstash::metadata {
namespace {

using Clock = std::chrono::steady_clock;

std::optional<std::string> percent_decode(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out.push_back(s[i]);
      continue;
    }
    if (i + 2 >= s.size()) return std::nullopt;
    auto byte = wire::from_hex(s.substr(i + 1, 2));
    if (!byte) return std::nullopt;
    out += *byte;
    i += 2;
  }
  return out;
}

std::optional<int> parse_int(std::string_view s, int lo, int hi) {
  if (s.empty() || s.size() > 9) return std::nullopt;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

}  // namespace

Status error_status(std::string_view text) {
  std::string msg = "redis: " + std::string(text);
  // ACL refusals inside a script arrive as ERR with the reason in the text (7.0: "The user
  // executing the script can't run this command", 7.2: "ACL failure in script").
  if (text.rfind("NOPERM", 0) == 0 || text.rfind("WRONGPASS", 0) == 0 || text.rfind("NOAUTH", 0) == 0 ||
      text.find("invalid password") != std::string_view::npos ||
      text.find("can't run this command") != std::string_view::npos ||
      text.find("ACL failure") != std::string_view::npos || text.find("NOPERM") != std::string_view::npos) {
    return Status::permission_denied(std::move(msg));
  }
  if (text.rfind("OOM", 0) == 0 || text.find("-OOM") != std::string_view::npos) {
    return Status::no_space(msg +
                            " (Redis reached maxmemory: kvstash needs maxmemory-policy noeviction and room)");
  }
  if (text.rfind("NOSCRIPT", 0) == 0) return Status::not_found(std::move(msg));
  // kvstash's own scripts answer with these codes.
  if (text.rfind("NO_SPACE", 0) == 0) return Status::no_space(std::move(msg));
  if (text.rfind("STALE", 0) == 0) return Status::stale(std::move(msg));
  if (text.rfind("IN_USE", 0) == 0) return Status::invalid_argument(std::move(msg));
  if (text.rfind("NOT_FOUND", 0) == 0) return Status::not_found(std::move(msg));
  if (text.rfind("INVALID", 0) == 0) return Status::invalid_argument(std::move(msg));
  if (text.rfind("CORRUPT", 0) == 0) return Status::corrupt(std::move(msg));
  if (text.rfind("TIMEOUT", 0) == 0) return Status::timeout(std::move(msg));
  // A kvstash key holding another type was written by something else (by hand, a foreign
  // tool): the record is not ours to trust.
  if (text.find("WRONGTYPE") != std::string_view::npos) {
    return Status::corrupt(msg + " (a kvstash metadata key holds a foreign value)");
  }
  // NOREPLICAS: a master with min-replicas-to-write and too few replicas (one restarted empty,
  // that Sentinel has not made a replica yet) refuses writes: another master may take them.
  // Redis Cluster: MOVED, which a redis+cluster:// client follows (RedisClient::command) and
  // any other client cannot; ASK and TRYAGAIN (the slot is migrating: a cell's script must see
  // all of the cell's keys, so it waits until the slot has moved) and CLUSTERDOWN (no master
  // for the slot, until a failover ends) pass.
  if (text.rfind("MOVED ", 0) == 0) {
    return Status::invalid_argument(msg + " (a Redis Cluster: reach it with a redis+cluster:// URL)");
  }
  if (text.rfind("LOADING", 0) == 0 || text.rfind("BUSY", 0) == 0 || text.rfind("MASTERDOWN", 0) == 0 ||
      text.rfind("READONLY", 0) == 0 || text.rfind("NOREPLICAS", 0) == 0 || text.rfind("TRYAGAIN", 0) == 0 ||
      text.rfind("ASK ", 0) == 0 || text.rfind("CLUSTERDOWN", 0) == 0) {
    return Status::unavailable(std::move(msg));
  }
  return Status::internal(std::move(msg));
}

// ---- RedisUrl -------------------------------------------------------------------------------

namespace {

constexpr int kSentinelPort = 26379;
constexpr int kRedisPort = 6379;

// h1[:port],h2[:port]... into `out`, each port `default_port` unless named.
Status parse_host_list(std::string_view hosts, int default_port,
                       std::vector<std::pair<std::string, int>>& out);

// host[:port] or [v6]:port into `host`, `port` (kept when the text names none).
Status parse_host_port(std::string_view hostport, std::string& host, int& port) {
  std::string_view port_text;
  if (!hostport.empty() && hostport.front() == '[') {
    auto close = hostport.find(']');
    if (close == std::string_view::npos)
      return Status::invalid_argument("unterminated [IPv6] host in redis URL");
    host = std::string(hostport.substr(1, close - 1));
    if (close + 1 < hostport.size()) {
      if (hostport[close + 1] != ':')
        return Status::invalid_argument("garbage after [IPv6] host in redis URL");
      port_text = hostport.substr(close + 2);
    }
  } else {
    auto colon = hostport.rfind(':');
    host = std::string(hostport.substr(0, colon));
    if (colon != std::string_view::npos) port_text = hostport.substr(colon + 1);
  }
  if (host.empty()) return Status::invalid_argument("redis URL has no host");
  if (!port_text.empty() || hostport.back() == ':') {
    auto p = parse_int(port_text, 1, 65535);
    if (!p) return Status::invalid_argument("bad port in redis URL");
    port = *p;
  }
  return {};
}

std::string host_port_text(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  std::string s = v6 ? "[" : "";
  s.append(host).append(v6 ? "]:" : ":").append(std::to_string(port));
  return s;
}

Status parse_host_list(std::string_view hosts, int default_port,
                       std::vector<std::pair<std::string, int>>& out) {
  for (std::size_t from = 0; from <= hosts.size();) {
    const std::size_t comma = std::min(hosts.find(',', from), hosts.size());
    auto& [host, port] = out.emplace_back(std::string(), default_port);
    KVSTASH_RETURN_IF_ERROR(parse_host_port(hosts.substr(from, comma - from), host, port));
    from = comma + 1;
  }
  return {};
}

std::string host_list_text(const std::vector<std::pair<std::string, int>>& hosts) {
  std::string s;
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    s.append(i > 0 ? "," : "").append(host_port_text(hosts[i].first, hosts[i].second));
  }
  return s;
}

}  // namespace

Result<RedisUrl> RedisUrl::parse(std::string_view url) {
  RedisUrl u;
  std::string_view rest;
  bool sentinel = false, cluster = false;
  if (url.rfind("rediss", 0) == 0) {
    u.tls = true;
    url.remove_prefix(6);
  } else if (url.rfind("redis", 0) == 0) {
    url.remove_prefix(5);
  } else if (url.rfind("unix://", 0) == 0) {
    u.unix_socket = true;
    url.remove_prefix(4);
  }
  if (url.rfind("://", 0) == 0) {
    rest = url.substr(3);
  } else if (!u.unix_socket && url.rfind("+sentinel://", 0) == 0) {
    rest = url.substr(12);
    sentinel = true;
  } else if (!u.unix_socket && url.rfind("+cluster://", 0) == 0) {
    rest = url.substr(11);
    cluster = true;
  } else {
    return Status::invalid_argument(
        "redis URL must start with redis://, redis+sentinel://, redis+cluster://, their TLS forms rediss://, "
        "rediss+sentinel://, rediss+cluster://, or unix://");
  }
  // Credentials end at the last '@' before the path (passwords may contain '@' only
  // percent-encoded, but be lenient).
  if (auto at = rest.rfind('@', rest.find('/')); at != std::string_view::npos) {
    std::string_view cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    auto colon = cred.find(':');
    if (colon == std::string_view::npos) {
      return Status::invalid_argument("redis URL credentials must be user:password or :password");
    }
    auto user = percent_decode(cred.substr(0, colon));
    auto pass = percent_decode(cred.substr(colon + 1));
    if (!user || !pass) return Status::invalid_argument("redis URL credentials have a bad %-escape");
    u.user = *user;
    u.password = *pass;
  }
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    KVSTASH_RETURN_IF_ERROR(u.parse_options(rest.substr(q + 1)));
    rest = rest.substr(0, q);
  }
  if (u.unix_socket) {
    u.path = std::string(rest);
    if (u.path.empty() || u.path.front() != '/') {
      return Status::invalid_argument("unix:// redis URL needs an absolute socket path");
    }
    return u;
  }
  auto slash = rest.find('/');
  std::string_view hosts = rest.substr(0, slash);
  std::string_view path = slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1);
  if (sentinel) {
    // /service[/db]
    auto next = path.find('/');
    u.service = std::string(path.substr(0, next));
    if (u.service.empty()) return Status::invalid_argument("redis+sentinel:// URL names no service (/name)");
    path = next == std::string_view::npos ? std::string_view() : path.substr(next + 1);
    KVSTASH_RETURN_IF_ERROR(parse_host_list(hosts, kSentinelPort, u.sentinels));
    u.host = u.sentinels.front().first;  // until a sentinel names the master
    u.port = u.sentinels.front().second;
  } else if (cluster) {
    if (!path.empty() && path != "0") {
      return Status::invalid_argument("redis+cluster:// URL names a database: a Redis Cluster has only db 0");
    }
    KVSTASH_RETURN_IF_ERROR(parse_host_list(hosts, kRedisPort, u.cluster_nodes));
    u.host = u.cluster_nodes.front().first;  // until a node names the slot's master
    u.port = u.cluster_nodes.front().second;
  } else {
    KVSTASH_RETURN_IF_ERROR(parse_host_port(hosts, u.host, u.port));
  }
  if (!path.empty()) {
    auto db = parse_int(path, 0, 1 << 20);
    if (!db) return Status::invalid_argument("bad database number in redis URL");
    u.db = *db;
  }
  return u;
}

Status RedisUrl::parse_options(std::string_view query) {
  for (std::size_t from = 0; from <= query.size();) {
    const std::size_t amp = std::min(query.find('&', from), query.size());
    const std::string_view option = query.substr(from, amp - from);
    from = amp + 1;
    const auto eq = option.find('=');
    const std::string_view name = option.substr(0, eq);
    const auto value =
        percent_decode(eq == std::string_view::npos ? std::string_view() : option.substr(eq + 1));
    if (!value || value->empty()) {
      return Status::invalid_argument("redis URL option '" + std::string(name) +
                                      "' needs a value (name=value)");
    }
    const bool tls_option = name == "ca" || name == "cert" || name == "key" || name == "sni";
    if (tls_option && !tls) {
      return Status::invalid_argument("redis URL option '" + std::string(name) +
                                      "' configures TLS: it takes a rediss:// URL");
    }
    if (name == "db" && unix_socket) {
      auto n = parse_int(*value, 0, 1 << 20);
      if (!n) return Status::invalid_argument("bad database number in redis URL");
      db = *n;
    } else if (name == "ca") {
      tls_ca = *value;
    } else if (name == "cert") {
      tls_cert = *value;
    } else if (name == "key") {
      tls_key = *value;
    } else if (name == "sni") {
      tls_server_name = *value;
    } else if (name == "redirect") {
      std::vector<std::pair<std::string, int>> hosts;
      KVSTASH_RETURN_IF_ERROR(parse_host_list(*value, 0, hosts));  // 0: no port named, any port
      for (auto& [host, port] : hosts)
        redirect_hosts.push_back(port == 0 ? host : host_port_text(host, port));
    } else {
      return Status::invalid_argument(
          "unknown redis URL option '" + std::string(name) +
          "' (known: ca, cert, key, sni for rediss://; redirect; db for unix://)");
    }
  }
  return {};
}

std::string RedisUrl::redacted() const {
  // Built with append(): GCC 12 at -O3 warns falsely (-Wrestrict) on chains of operator+.
  std::string s = unix_socket ? "unix" : tls ? "rediss" : "redis";
  s.append(sentinel() ? "+sentinel://" : cluster() ? "+cluster://" : "://");
  if (!user.empty() || !password.empty()) s.append(user).append(password.empty() ? "@" : ":***@");
  if (unix_socket) {
    s.append(path);
    if (db != 0) s.append("?db=").append(std::to_string(db));
    return s;
  }
  if (sentinel()) {
    s.append(host_list_text(sentinels)).append("/").append(service);
  } else if (cluster()) {
    return s.append(host_list_text(cluster_nodes));
  } else {
    s.append(host_port_text(host, port));
  }
  s.append("/").append(std::to_string(db));
  return s;
}

// ---- Reply, Script --------------------------------------------------------------------------

Reply::Reply(redisReply* r) : r_(r) {}
Reply::Reply(Reply&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}
Reply& Reply::operator=(Reply&& o) noexcept {
  if (this != &o) {
    if (r_ != nullptr) freeReplyObject(r_);
    r_ = std::exchange(o.r_, nullptr);
  }
  return *this;
}
Reply::~Reply() {
  if (r_ != nullptr) freeReplyObject(r_);
}

Reply::Type Reply::type() const {
  switch (r_->type) {
    case REDIS_REPLY_STRING: return Type::kString;
    case REDIS_REPLY_ARRAY: return Type::kArray;
    case REDIS_REPLY_INTEGER: return Type::kInteger;
    case REDIS_REPLY_STATUS: return Type::kStatus;
    case REDIS_REPLY_ERROR: return Type::kError;
    default: return Type::kNil;
  }
}
std::int64_t Reply::integer() const { return r_->type == REDIS_REPLY_INTEGER ? r_->integer : 0; }
std::string_view Reply::str() const {
  return r_->str != nullptr ? std::string_view(r_->str, r_->len) : std::string_view();
}
std::size_t Reply::size() const { return r_->type == REDIS_REPLY_ARRAY ? r_->elements : 0; }
const redisReply* Reply::element(std::size_t i) const { return i < size() ? r_->element[i] : nullptr; }

Script::Script(std::string b) : body(std::move(b)) {
  unsigned char digest[SHA_DIGEST_LENGTH];
  SHA1(reinterpret_cast<const unsigned char*>(body.data()), body.size(), digest);
  sha = wire::to_hex(std::string_view(reinterpret_cast<const char*>(digest), sizeof digest));
}

Script::Script(std::string b, std::string fn, const FunctionLibrary* lib) : Script(std::move(b)) {
  function = std::move(fn);
  library = lib;
}

// ---- RedisClient ----------------------------------------------------------------------------

RedisClient::RedisClient(RedisOptions options, RedisUrl url)
    : options_(std::move(options)), url_(std::move(url)), original_host_(url_.host) {}

RedisClient::~RedisClient() = default;

Result<std::unique_ptr<RedisClient>> RedisClient::connect(const RedisOptions& options) {
  KVSTASH_ASSIGN_OR_RETURN(RedisUrl url, RedisUrl::parse(options.url));
  if (!options.password.empty()) url.password = options.password;
  if (!url.user.empty() && url.password.empty()) {
    // Connecting as `default` instead would be a silent change of identity.
    return Status::invalid_argument(
        "redis user '" + url.user +
        "' needs a password (in the URL, or KVSTASH_REDIS_PASSWORD / a password file)");
  }
  std::unique_ptr<RedisClient> c(new RedisClient(options, std::move(url)));
  if (c->url_.tls) {
    KVSTASH_ASSIGN_OR_RETURN(c->tls_, TlsClientContext::create(c->url_));
  }
  KVSTASH_RETURN_IF_ERROR(c->open());
  return c;
}

std::chrono::milliseconds RedisClient::within_deadline(std::chrono::milliseconds limit) const {
  if (!deadline_) return limit;
  return std::min(limit, std::chrono::ceil<std::chrono::milliseconds>(*deadline_ - Clock::now()));
}

Status RedisClient::open() {
  link_.reset();
  Status s = url_.sentinel()  ? open_through_sentinels()
             : url_.cluster() ? open_in_cluster()
                              : open_at(url_.host, url_.port);
  if (s.is_ok() && options_.on_connect) {
    s = options_.on_connect([this](const std::vector<std::string_view>& args) { return run_once(args); });
    if (!s.is_ok()) link_.reset();
  }
  return s;
}

Status RedisClient::open_through_sentinels() {
  Status last = Status::unavailable("no sentinel answered");
  for (std::size_t i = 0; i < url_.sentinels.size(); ++i) {
    const std::size_t which = (sentinel_ + i) % url_.sentinels.size();
    const auto& [host, port] = url_.sentinels[which];
    const std::string where = "redis sentinel " + host_port_text(host, port);
    const auto timeout = within_deadline(options_.connect_timeout);
    if (timeout.count() <= 0) return Status::timeout("redis " + url_.redacted() + ": the deadline passed");
    // The sentinel, on a connection of its own: it only names the master.
    Status asked = open_at(host, port, Server::kSentinel);
    Result<Reply> master = asked.is_ok() ? run_once({"SENTINEL", "get-master-addr-by-name", url_.service})
                                         : Result<Reply>(asked);
    link_.reset();
    if (!master.is_ok()) {
      last = master.status().with_context(where);
      continue;
    }
    if (master->type() != Reply::Type::kArray || master->size() != 2 ||
        master->element(0)->type != REDIS_REPLY_STRING || master->element(1)->type != REDIS_REPLY_STRING) {
      last = Status::not_found(where + " knows no master named '" + url_.service + "'");
      continue;
    }
    const std::string master_host(master->element(0)->str, master->element(0)->len);
    const auto master_port =
        parse_int(std::string_view(master->element(1)->str, master->element(1)->len), 1, 65535);
    if (!master_port) {
      last = Status::corrupt(where + " named a master with a bad port");
      continue;
    }
    if (Status allowed = may_follow(master_host, *master_port, where); !allowed.is_ok()) {
      last = allowed;
      continue;
    }
    Status s = open_at(master_host, *master_port);
    // A sentinel that has not seen the failover yet still names the old master, a replica now.
    Result<Reply> role = s.is_ok() ? run_once({"ROLE"}) : Result<Reply>(s);
    if (role.is_ok() && (role->type() != Reply::Type::kArray || role->size() == 0 ||
                         role->element(0)->type != REDIS_REPLY_STRING ||
                         std::string_view(role->element(0)->str, role->element(0)->len) != "master")) {
      role = Status::unavailable(where + " named " + host_port_text(master_host, *master_port) +
                                 ", which is not a master (a failover in progress?)");
    }
    if (role.is_ok()) {
      sentinel_ = which;
      url_.host = master_host;
      url_.port = *master_port;
      return {};
    }
    link_.reset();
    last = role.status();
  }
  return last;
}

Status RedisClient::open_in_cluster() {
  // The master it talked to last, then the seeds.
  std::vector<std::pair<std::string, int>> nodes{{url_.host, url_.port}};
  for (const auto& seed : url_.cluster_nodes) {
    if (seed != nodes.front()) nodes.push_back(seed);
  }
  Status last = Status::unavailable("no Redis Cluster node answered");
  for (const auto& [host, port] : nodes) {
    const std::string where = "redis cluster node " + host_port_text(host, port);
    Status s = open_at(host, port);
    if (s.is_ok() && options_.cluster_key.empty()) return {};
    Result<Reply> slot =
        s.is_ok() ? run_once({"CLUSTER", "KEYSLOT", options_.cluster_key}) : Result<Reply>(s);
    Result<Reply> slots = slot.is_ok() ? run_once({"CLUSTER", "SLOTS"}) : Result<Reply>(slot.status());
    if (!slots.is_ok()) {
      link_.reset();
      last = slots.status().with_context(where);
      continue;
    }
    // CLUSTER SLOTS: [[first, last, [host, port, id, ...], replicas...], ...]
    std::optional<std::pair<std::string, int>> master;
    for (std::size_t i = 0; i < slots->size(); ++i) {
      const redisReply* range = slots->element(i);
      if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 ||
          range->element[2]->type != REDIS_REPLY_ARRAY || range->element[2]->elements < 2 ||
          slot->integer() < range->element[0]->integer || slot->integer() > range->element[1]->integer) {
        continue;
      }
      const redisReply* m = range->element[2];
      std::string m_host(m->element[0]->str != nullptr ? m->element[0]->str : "", m->element[0]->len);
      master.emplace(m_host.empty() ? host : m_host, static_cast<int>(m->element[1]->integer));
    }
    if (!master) {
      link_.reset();
      last = Status::unavailable(where + ": no master serves slot " + std::to_string(slot->integer()) +
                                 " (a failover in progress?)");
      continue;
    }
    if (*master != std::pair{host, port}) {
      s = may_follow(master->first, master->second, where);
      if (s.is_ok()) s = open_at(master->first, master->second);
    }
    if (s.is_ok()) {
      std::tie(url_.host, url_.port) = *master;
      return {};
    }
    last = s.with_context("the master of slot " + std::to_string(slot->integer()));
  }
  return last;
}

Status RedisClient::may_follow(const std::string& host, int port, std::string_view who) const {
  if (url_.password.empty() && options_.password.empty()) return {};
  auto named = [&](const std::vector<std::pair<std::string, int>>& hosts) {
    return std::any_of(hosts.begin(), hosts.end(), [&](const auto& h) { return h.first == host; });
  };
  // A redirect= entry names a host (any port) or a host:port.
  const std::string where = host_port_text(host, port);
  auto listed = [&](const std::vector<std::string>& hosts) {
    return std::find(hosts.begin(), hosts.end(), host) != hosts.end() ||
           std::find(hosts.begin(), hosts.end(), where) != hosts.end();
  };
  // A sentinel's host is where a sentinel runs, not a Redis server the URL vouches for: a
  // sentinel (or whoever took one over) that names another port of its own host gets nothing
  // unless redirect= names it. The URL's own host (redis://) and a cluster's seeds are.
  const bool own_host = url_.sentinels.empty() && (host == original_host_ || named(url_.cluster_nodes));
  if (own_host || listed(options_.redirect_hosts) || listed(url_.redirect_hosts)) return {};
  return Status::permission_denied(
      std::string(who) + " sent this client to " + where +
      ", which the Redis URL does not name: refused, so as not to send the password "
      "there (list the cell's Redis servers in the URL's redirect= option, as host or "
      "host:port)");
}

Status RedisClient::redirect(std::string_view error) {
  // "MOVED <slot> <host>:<port>"; an empty host is this node's.
  // The third word (error_status may have appended a hint after it).
  std::string_view target = error.substr(std::min(error.size(), error.find(' ', error.find(' ') + 1) + 1));
  target = target.substr(0, target.find(' '));
  std::string host = url_.host;
  int port = url_.port;
  if (target.starts_with(':')) {  // the node knows no endpoint of its own: its address
    auto p = parse_int(target.substr(1), 1, 65535);
    if (!p) return Status::corrupt("redis cluster: a redirection to a bad port: " + std::string(error));
    port = *p;
  } else {
    KVSTASH_RETURN_IF_ERROR(parse_host_port(target, host, port).with_context(std::string(error)));
  }
  KVSTASH_LOG_INFO("redis cluster: MOVED (slot now at {})", host_port_text(host, port));
  KVSTASH_RETURN_IF_ERROR(may_follow(host, port, "a MOVED reply"));
  KVSTASH_RETURN_IF_ERROR(open_at(host, port));
  url_.host = host;
  url_.port = port;
  if (!options_.on_connect) return {};
  Status s =
      options_.on_connect([this](const std::vector<std::string_view>& args) { return run_once(args); });
  if (!s.is_ok()) link_.reset();
  return s;
}

Status RedisClient::open_at(const std::string& address, int port, Server to) {
  link_.reset();
  const auto connect_timeout = within_deadline(options_.connect_timeout);
  if (connect_timeout.count() <= 0)
    return Status::timeout("redis " + url_.redacted() + ": the deadline passed");
  std::string numeric = address;
  if (!url_.unix_socket) {
    // hiredis resolves names without a timeout: resolve first, within the connect's time.
    auto addresses = net::resolve(address, Clock::now() + connect_timeout);
    if (!addresses.is_ok()) return addresses.status().with_context("redis " + url_.redacted());
    numeric = addresses->front();
  }
  auto link = tls_ ? connect_tls(*tls_, address, numeric, port, connect_timeout)
                   : connect_plain(url_, numeric, port, connect_timeout);
  if (!link.is_ok()) return link.status().with_context("redis " + url_.redacted());
  link_ = std::move(*link);
  if (to == Server::kSentinel) {
    if (options_.sentinel_password.empty()) return {};
    Status s = run_once({"AUTH", options_.sentinel_password}).status();
    if (!s.is_ok()) link_.reset();
    return s;
  }
  if (!url_.password.empty()) {
    std::vector<std::string_view> auth{"AUTH"};
    if (!url_.user.empty()) auth.push_back(url_.user);
    auth.push_back(url_.password);
    auto r = run_once(auth);
    if (!r.is_ok()) {
      link_.reset();
      if (r.status().code() == StatusCode::kPermissionDenied &&
          r.status().message().find("certificate") == std::string::npos) {
        return Status::permission_denied("redis " + url_.redacted() + " refused the credentials of user '" +
                                         (url_.user.empty() ? std::string("default") : url_.user) + "'");
      }
      return r.status();
    }
  }
  if (url_.db != 0) {
    std::string db = std::to_string(url_.db);
    auto r = run_once({"SELECT", db});
    if (!r.is_ok()) {
      link_.reset();
      return r.status().with_context("redis SELECT " + db);
    }
  }
  return {};
}

Result<Reply> RedisClient::run_once(const std::vector<std::string_view>& args) {
  if (!link_) return Status::unavailable("redis: not connected");
  // The socket's timeout is what is left of the deadline, when that is the shorter.
  const auto timeout = within_deadline(options_.command_timeout);
  if (timeout.count() <= 0) {
    return Status::timeout("redis " + url_.redacted() +
                           ": the operation's deadline passed before the command");
  }
  auto reply = link_->roundtrip(args, timeout);
  if (!reply.is_ok()) {
    // The connection is unusable after an I/O error or timeout (hiredis' rule).
    link_.reset();
    return reply.status().with_context("redis " + url_.redacted());
  }
  if (reply->type() == Reply::Type::kError) return error_status(reply->str());
  return reply;
}

Result<Reply> RedisClient::command(const std::vector<std::string_view>& args) {
  auto give_up = Clock::now() + options_.reconnect_budget;
  if (deadline_) give_up = std::min(give_up, *deadline_);
  auto backoff = options_.backoff_initial;
  constexpr int kMaxRedirects = 5;
  Status last;  // why the last attempt failed, for the final error
  for (int redirects = 0;;) {
    if (link_) {
      auto r = run_once(args);
      if (r.is_ok()) return r;
      last = r.status();
      // A cluster's slot moved to another master: that one from now on. (ASK, a slot in
      // migration, is not followed: the target holds only part of the cell's keys, and a script
      // must see them all. It is retried below, as TRYAGAIN is, until MOVED comes.)
      const Status failed = r.status();  // status() is a copy: `text` must not outlive it
      std::string_view text = failed.message();
      if (text.starts_with("redis: ")) text.remove_prefix(7);
      const bool moved = url_.cluster() && text.rfind("MOVED ", 0) == 0;
      // Retry only what surely did not run: a broken connection or a server still loading.
      if (failed.code() != StatusCode::kUnavailable && !moved) return r;
      if (moved && redirects++ < kMaxRedirects) {
        Status s = redirect(text);
        if (s.is_ok()) continue;
        if (s.code() == StatusCode::kPermissionDenied) return s;
      }
      KVSTASH_LOG_INFO("{}", r.status().to_string());
    }
    if (Clock::now() + backoff > give_up) {
      const std::string why = last.is_ok() ? std::string() : " (last: " + last.message() + ")";
      if (deadline_ && give_up == *deadline_) {
        return Status::timeout("redis " + url_.redacted() + " unreachable until the operation's deadline" +
                               why);
      }
      return Status::unavailable("redis " + url_.redacted() + " unreachable for " +
                                 std::to_string(options_.reconnect_budget.count()) + " ms" + why);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, options_.backoff_max);
    Status s = open();
    if (!s.is_ok()) last = s;
    if (s.is_ok()) {
      ++reconnects_;
      KVSTASH_LOG_INFO("redis {}: reconnected", url_.redacted());
    } else if (s.code() == StatusCode::kPermissionDenied || s.code() == StatusCode::kInvalidArgument) {
      return s;  // credentials changed under us, or TLS meets a plain port: retrying will not help
    }
  }
}

namespace {

// Set once a Redis refused Functions, so that the warning is said once per process.
std::atomic<bool> said_no_functions{false};

// Whether `s` says the server has no Functions or the user may not call or load them (not a
// refusal from inside a function, which names the command the script called).
bool refuses_functions(const Status& s) {
  const std::string& m = s.message();
  return m.find("unknown command 'FCALL'") != std::string::npos ||
         m.find("unknown command 'fcall'") != std::string::npos ||
         m.find("unknown command 'FUNCTION'") != std::string::npos ||
         m.find("to run the 'fcall' command") != std::string::npos ||
         m.find("to run the 'function|load' command") != std::string::npos;
}

Result<Reply> call_script(const RedisOptions::Command& run, std::string_view verb, std::string_view name,
                          const std::vector<std::string_view>& keys,
                          const std::vector<std::string_view>& args) {
  std::string nkeys = std::to_string(keys.size());
  std::vector<std::string_view> argv{verb, name, nkeys};
  argv.insert(argv.end(), keys.begin(), keys.end());
  argv.insert(argv.end(), args.begin(), args.end());
  return run(argv);
}

}  // namespace

Result<Reply> eval_with(const RedisOptions::Command& run, const Script& script,
                        const std::vector<std::string_view>& keys, const std::vector<std::string_view>& args,
                        bool* functions) {
  if (script.library != nullptr && (functions == nullptr || *functions)) {
    auto r = call_script(run, "FCALL", script.function, keys, args);
    // Scripts answer NOT_FOUND themselves too; only Redis's own text means "load the library".
    if (!r.is_ok() && r.status().message().rfind("redis: ERR Function not found", 0) == 0) {
      auto loaded = run({"FUNCTION", "LOAD", script.library->text});
      // Another client may have loaded it in between.
      if (loaded.is_ok() || loaded.status().message().find("already exists") != std::string::npos) {
        r = call_script(run, "FCALL", script.function, keys, args);
      } else {
        r = loaded.status();
      }
    }
    if (r.is_ok() || !refuses_functions(r.status())) return r;
    if (functions != nullptr) *functions = false;
    if (!said_no_functions.exchange(true)) {
      KVSTASH_LOG_WARN(
          "redis refuses Functions ({}): scripts run by EVALSHA, each call running its prelude "
          "again; give the user +fcall and +function|load (Redis 7.0 or later)",
          r.status().message());
    }
  }
  auto r = call_script(run, "EVALSHA", script.sha, keys, args);
  // Scripts answer NOT_FOUND themselves too; only Redis's own NOSCRIPT means "load me".
  if (r.is_ok() || r.status().message().rfind("redis: NOSCRIPT", 0) != 0) return r;
  // NOSCRIPT: Redis restarted, failed over or flushed its scripts. Load and run again.
  KVSTASH_RETURN_IF_ERROR(run({"SCRIPT", "LOAD", script.body}).status());
  return call_script(run, "EVALSHA", script.sha, keys, args);
}

Result<Reply> RedisClient::eval(const Script& script, const std::vector<std::string_view>& keys,
                                const std::vector<std::string_view>& args) {
  return eval_with([this](const std::vector<std::string_view>& argv) { return command(argv); }, script, keys,
                   args, &functions_);
}

}  // namespace kvstash::metadata
