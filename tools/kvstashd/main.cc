// kvstashd: a kvstash memory node. Donates DRAM to a cell, serves it one-sided, keeps its
// place in Redis, exposes /metrics and /healthz, and drains on SIGTERM.
#include <signal.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>

#include "common/log.h"
#include "common/net.h"
#include "common/system.h"
#include "common/units.h"
#include "kvstash/types.h"
#include "metadata/cell_directory.h"
#include "metadata/redis_client.h"
#include "node/admin_server.h"
#include "node/memory_node.h"
#include "service_notify.h"

namespace {

using namespace kvstash;

// A secret from the file an option names, or a usage error saying what is wrong with it.
std::string read_secret(const std::string& option, Result<std::string> secret) {
  if (!secret.is_ok()) throw CLI::ValidationError(option, secret.status().message());
  return std::move(secret).value();
}

// Warns on stderr and in the log: a setting that works but exposes or endangers the node.
void warn_loudly(const std::string& what) {
  std::cerr << "kvstashd: WARNING: " << what << "\n";
  KVSTASH_LOG_WARN("kvstashd: {}", what);
}

// Raises the soft RLIMIT_NOFILE to the hard limit (the usual soft 1,024 is below what the
// connection caps allow) and returns the soft limit now in force.
rlim_t raise_fd_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 1024;
  if (r.rlim_cur < r.rlim_max) {
    rlimit want = r;
    want.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) r = want;
  }
  return r.rlim_cur;
}

bool loopback_host(const std::string& listen) {
  auto hp = net::parse_host_port(listen);
  if (!hp.is_ok()) return false;
  const std::string& h = hp->host;
  return h.rfind("127.", 0) == 0 || h == "::1" || h == "[::1]" || h == "localhost";
}

// 2: the command line or configuration is wrong; 1: the node could not start or run.
int fail(const Status& s, std::string_view what) {
  std::cerr << "kvstashd: " << what << ": " << s.to_string() << "\n";
  return s.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "kvstashd: a kvstash memory node. Donates DRAM to a cell of memory nodes; clients write and read it "
      "one-sided (RDMA, shared memory, or the TCP transport), while Redis holds only the metadata."};
  app.set_config("--config", "", "Read options from this TOML or INI file (keys are the long option names)");
  app.get_config_formatter_base()->arrayDelimiter(',');
  app.allow_config_extras(false);  // a misspelt key in the file is an error, not a silent default

  node::MemoryNodeOptions opts;
  std::string capacity = "1GiB", page_size = "4MiB", huge = "auto", transports = "all";
  std::string heartbeat = "3s", reclaim = "1s", rotation = "1m", admin = "127.0.0.1:9745", join = "30s";
  std::string password_file, token_file;
  bool emulated_rma = false;
  std::uint32_t max_connections = 1024, max_unproven = 64;

  app.add_option("--redis", opts.redis_url,
                 "The cell's Redis: redis://[user:password@]host:port/db, unix://[user:password@]/path, "
                 "redis+sentinel://[user:password@]sentinel[:port],.../service[/db] or "
                 "redis+cluster://[user:password@]node[:port],...; rediss://... (and rediss+sentinel, "
                 "rediss+cluster) for TLS, "
                 "with ?ca=FILE&cert=FILE&key=FILE&sni=NAME; ?redirect=HOST[:PORT],... for the servers a "
                 "sentinel may name. "
                 "The password is better passed by KVSTASH_REDIS_PASSWORD or --redis-password-file")
      ->envname("KVSTASH_REDIS_URL")
      ->capture_default_str();
  app.add_option("--redis-password-file", password_file,
                 "File holding the Redis password (ACL user's or AUTH)");
  app.add_option("--cell", opts.cell,
                 "Cell name: independent groups of nodes can share one Redis; `auto`: the cell of the cell "
                 "directory (`kvstash cells`) whose live nodes donate the least memory")
      ->capture_default_str();
  app.add_option("--node-id", opts.node_id,
                 "Stable id of this node in the cell, [A-Za-z0-9._-] (default: the host name)");
  app.add_option("--capacity", capacity, "DRAM donated to the cell (e.g. 8GiB), rounded down to whole pages")
      ->capture_default_str();
  app.add_option("--page-size", page_size,
                 "Unit of allocation, a power of two; every node of a cell must use the same "
                 "(docs/operations.md explains the default)")
      ->capture_default_str();
  app.add_option("--huge-pages", huge,
                 "Back the pool with 2 MiB huge pages: auto (when reserved), on (required), off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_option("--transports", transports,
                 "Transports serving the pool: all, or a list of shm,tcp,ucx,verbs")
      ->capture_default_str();
  app.add_option(
         "--listen", opts.engine.tcp.listen,
         "tcp transport: address to serve on (host:port, port 0 = any free port); the verbs transport's "
         "queue-pair setup listens on the same host. Loopback by default: serving a network is an explicit "
         "choice")
      ->capture_default_str();
  app.add_option("--advertise", opts.engine.tcp.advertise,
                 "tcp transport: address clients should connect to");
  app.add_option(
         "--tls-cert", opts.engine.tcp.tls.cert_file,
         "tcp transport: PEM certificate chain (leaf first) to serve TLS with; with --tls-key the node "
         "serves TLS only, and clients need the CA (KVSTASH_TLS_CA, TcpOptions::tls.ca_file)")
      ->check(CLI::ExistingFile);
  app.add_option(
         "--tls-key", opts.engine.tcp.tls.key_file,
         "tcp transport: PEM private key of --tls-cert; refused when group or others may read it (chmod 600)")
      ->check(CLI::ExistingFile);
  app.add_option(
         "--tls-ca", opts.engine.tcp.tls.client_ca_file,
         "tcp transport: PEM CA bundle clients' certificates must chain to (mutual TLS); needs --tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--tcp-io-threads", opts.engine.tcp.io_threads,
                 "tcp transport: socket I/O threads; 0 = one on hosts of up to 4 cores, two above")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  std::uint64_t busy_poll_us = 0;
  app.add_option(
         "--busy-poll-us", busy_poll_us,
         "Latency mode for hosts with cores to spare: tcp I/O threads spin this many microseconds after "
         "their last event before they sleep (a core each while busy); 0 = off")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  app.add_option("--shm-socket-dir", opts.engine.shm.socket_dir,
                 "shm transport: directory of the UNIX socket (default $XDG_RUNTIME_DIR/kvstash)");
  CLI::Option* token_option = app.add_option(
      "--cluster-token-file", token_file,
      "File holding the cluster token every tcp and verbs peer must prove it knows (else "
      "KVSTASH_CLUSTER_TOKEN). Refused when group or others may read or write it (chmod 600), or when it "
      "is empty. Clients need the same token");
  app.add_option("--max-connections", max_connections,
                 "tcp and verbs: connections that proved the cluster token served at once (each transport); "
                 "a client engine opens 4 tcp streams, and one queue pair per device pair")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option(
         "--max-unproven-connections", max_unproven,
         "tcp and verbs: connections still in the handshake (not yet proven) served at once; when they "
         "are all taken the oldest is dropped for a newcomer, so a flood of them cannot keep clients "
         "with the token out")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_flag("--ucx-allow-emulated-rma", emulated_rma,
               "Serve the pool through UCX even without RDMA hardware, where UCX cannot enforce remote keys "
               "(tests and benchmarks only)");
  app.add_option("--admin", admin,
                 "Address of the /metrics and /healthz HTTP endpoint (port 0 = free port, off = none)")
      ->capture_default_str();
  app.add_option("--heartbeat-ttl", heartbeat,
                 "A node silent for this long is declared dead and its objects dropped; it beats every third")
      ->capture_default_str();
  app.add_option("--join-timeout", join,
                 "How long a starting node waits for the cell's Redis while it is unavailable (not up yet, "
                 "failing over) before it exits with Redis's error")
      ->capture_default_str();
  app.add_option("--reclaim-interval", reclaim,
                 "How often this node sweeps the cell for expired objects, abandoned puts and dead nodes")
      ->capture_default_str();
  app.add_option("--grant-key-rotation", rotation,
                 "How long the cell signs this node's grants with one key before the node hands it the "
                 "next (a key copied out of Redis mints grants for at most this plus the longest lease, "
                 "10 minutes); at least 1s")
      ->capture_default_str();
  std::string ssd, ssd_capacity, ssd_low_water = "12.5%", ssd_fault = "none", ssd_recover = "kvp:";
  app.add_option(
      "--ssd", ssd,
      "An NVMe tier under the pool: a file (created, and given --ssd-capacity) or a block device, on a "
      "file system that takes O_DIRECT (`kvstash doctor --ssd PATH` checks). Cold objects move down "
      "to it instead of being evicted, and a get stages them back (docs/nvme-tier.md)");
  app.add_option("--ssd-capacity", ssd_capacity,
                 "Bytes of --ssd to use (e.g. 512GiB); required for a file, default all of a block device");
  app.add_option("--ssd-low-water", ssd_low_water,
                 "Objects move down to --ssd while fewer than this share of the pool's pages are free")
      ->capture_default_str();
  app.add_option(
         "--ssd-recover", ssd_recover,
         "Comma-separated key prefixes whose keys name their content (the KV cache's chunks are "
         "\"kvp:\"): their objects on --ssd are given back to a cell that lost its Redis (docs/metadata.md, "
         "\"A cell that lost its Redis\"); \"\" for none")
      ->capture_default_str();
  app.add_option("--ssd-fault", ssd_fault,
                 "Tests only: the tier's device fails every read or write with EIO (or a write with ENOSPC)")
      ->check(CLI::IsMember({"none", "read-eio", "write-eio", "write-enospc"}))
      ->group("");
  app.footer(
      "Environment: KVSTASH_REDIS_URL, KVSTASH_REDIS_PASSWORD, KVSTASH_CLUSTER_TOKEN, KVSTASH_LOG "
      "(debug|info|warn|error).\n"
      "TLS: --tls-cert and --tls-key make the tcp transport TLS only (the bytes in transit encrypted; "
      "docs/operations.md says what it costs); clients set KVSTASH_TLS_CA or TcpOptions::tls.ca_file.\n"
      "Signals: SIGTERM, SIGINT or SIGHUP drains the node (no new pages, its pool's objects leave the "
      "metadata; those on its --ssd tier stay, for its restart over the same device) and exits 0.\n"
      "Prints `ready node=ID admin=HOST:PORT pages=N page_size=BYTES transports=LIST` on stdout once it "
      "serves, and tells a service manager (READY=1 to $NOTIFY_SOCKET: systemd's Type=notify; "
      "deploy/systemd/kvstashd.service).\n"
      "Example: kvstashd --redis redis://kvstash@10.0.0.5:6379/0 --redis-password-file /etc/kvstash/redis-pw "
      "--cluster-token-file /etc/kvstash/token --capacity 64GiB --listen 10.0.0.7:7400\n"
      "A password written in the --redis URL shows in `ps` and /proc/PID/cmdline to every user of the "
      "host: pass it with --redis-password-file or KVSTASH_REDIS_PASSWORD instead.");

  try {
    app.parse(argc, argv);
    auto cap = units::parse_size(capacity), ps = units::parse_size(page_size);
    if (!cap.is_ok()) throw CLI::ValidationError("--capacity", cap.status().message());
    if (!ps.is_ok()) throw CLI::ValidationError("--page-size", ps.status().message());
    opts.capacity = *cap;
    opts.page_size = *ps;
    const auto duration = [](const char* flag, const std::string& text) {
      auto d = units::parse_duration(text);
      if (!d.is_ok()) throw CLI::ValidationError(flag, d.status().message());
      return *d;
    };
    opts.heartbeat_ttl = duration("--heartbeat-ttl", heartbeat);
    opts.reclaim_interval = duration("--reclaim-interval", reclaim);
    opts.grant_key_rotation = duration("--grant-key-rotation", rotation);
    if (opts.grant_key_rotation < std::chrono::seconds(1))
      throw CLI::ValidationError("--grant-key-rotation", "must be at least 1s");
    opts.join_timeout = duration("--join-timeout", join);
    opts.huge_pages = huge != "off";
    opts.require_huge_pages = huge == "on";
    auto kinds = parse_transport_list(transports);
    if (!kinds.is_ok()) throw CLI::ValidationError("--transports", kinds.status().message());
    opts.engine.transports = std::move(kinds).value();
    opts.engine.ucx.allow_emulated_rma = emulated_rma;
    opts.engine.tcp.max_connections = opts.engine.verbs.max_connections = max_connections;
    opts.engine.tcp.max_unproven_connections = opts.engine.verbs.max_unproven_connections = max_unproven;
    opts.engine.busy_poll = std::chrono::microseconds(busy_poll_us);
    const TcpTlsOptions& tls = opts.engine.tcp.tls;
    if (tls.cert_file.empty() != tls.key_file.empty()) {
      throw CLI::ValidationError("--tls-cert", "--tls-cert and --tls-key go together");
    }
    if (!tls.client_ca_file.empty() && tls.cert_file.empty()) {
      throw CLI::ValidationError("--tls-ca",
                                 "requires clients' certificates only over TLS: give --tls-cert too");
    }
    // The node's private key is held to the token file's rule: private to its owner.
    if (!tls.key_file.empty()) read_secret("--tls-key", sys::read_private_secret_file(tls.key_file));
    if (!ssd.empty()) {
      node::TierOptions tier;
      tier.path = ssd;
      if (!ssd_capacity.empty()) {
        auto c = units::parse_size(ssd_capacity);
        if (!c.is_ok()) throw CLI::ValidationError("--ssd-capacity", c.status().message());
        tier.capacity = *c;
      }
      std::string share = ssd_low_water;
      const bool percent = !share.empty() && share.back() == '%';
      if (percent) share.pop_back();
      char* end = nullptr;
      const double v = std::strtod(share.c_str(), &end);
      tier.low_water = percent ? v / 100 : v;
      if (share.empty() || end == nullptr || *end != '\0' || !(tier.low_water > 0) || tier.low_water >= 1) {
        throw CLI::ValidationError("--ssd-low-water",
                                   "a share of the pool above 0 and below 1, or a percentage");
      }
      if (ssd_fault != "none") {
        const bool write = ssd_fault != "read-eio";
        const int err = ssd_fault == "write-enospc" ? ENOSPC : EIO;
        tier.fault = [write, err](const node::SsdIo& io) { return io.write == write ? err : 0; };
      }
      for (std::size_t at = 0; at < ssd_recover.size();) {
        const std::size_t comma = std::min(ssd_recover.find(',', at), ssd_recover.size());
        if (comma > at) tier.recover_prefixes.push_back(ssd_recover.substr(at, comma - at));
        at = comma + 1;
      }
      opts.tier = std::move(tier);
    } else if (!ssd_capacity.empty()) {
      throw CLI::ValidationError("--ssd-capacity", "needs --ssd");
    }
    // The verbs queue-pair setup listens on the --listen host too (any free port).
    opts.engine.verbs.listen = net::same_host_any_port(opts.engine.tcp.listen);
    if (!password_file.empty()) {
      opts.redis_password = read_secret("--redis-password-file", sys::read_secret_file(password_file));
    } else if (const char* pw = std::getenv("KVSTASH_REDIS_PASSWORD")) {
      opts.redis_password = pw;
    }
    // A token asked for but empty would serve the pool to anyone: refused, never ignored.
    if (token_option->count() > 0) {
      if (token_file.empty()) throw CLI::ValidationError("--cluster-token-file", "names no file");
      opts.engine.cluster_token =
          read_secret("--cluster-token-file", sys::read_private_secret_file(token_file));
      Status ok = sys::check_cluster_token(opts.engine.cluster_token, "the token in " + token_file);
      if (!ok.is_ok()) throw CLI::ValidationError("--cluster-token-file", ok.message());
    } else if (const char* tok = std::getenv("KVSTASH_CLUSTER_TOKEN")) {
      Status ok = sys::check_cluster_token(tok, "KVSTASH_CLUSTER_TOKEN");
      if (!ok.is_ok()) throw CLI::ValidationError(ok.message());
      opts.engine.cluster_token = tok;
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  // Signals are taken synchronously by the main thread: block them before any thread starts
  // so every thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);  // no reload: a hang-up must not kill the node undrained
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Every connection the caps allow holds a descriptor: raise the soft limit to the hard one,
  // and say so when even that cannot hold them all (accepts would then fail, and the
  // transports pause their accept loops instead of serving).
  {
    const rlim_t limit = raise_fd_limit();
    auto serves = [&](TransportKind k) {
      return opts.engine.transports.empty() ||
             std::find(opts.engine.transports.begin(), opts.engine.transports.end(), k) !=
                 opts.engine.transports.end();
    };
    std::uint64_t need = 128;  // Redis, the pool, the process's own
    std::string parts;
    for (TransportKind k : {TransportKind::kTcp, TransportKind::kVerbs}) {
      if (!serves(k)) continue;
      need += std::uint64_t{max_connections} + max_unproven;
      parts += std::string(to_string(k)) + " " + std::to_string(max_connections + max_unproven) + ", ";
    }
    if (serves(TransportKind::kShm)) {
      need += 1024 + 64;
      parts += "shm 1088, ";
    }
    if (admin != "off") {
      need += 64;
      parts += "admin 64, ";
    }
    if (limit != RLIM_INFINITY && need > limit) {
      warn_loudly("the connection caps (" + parts + "and about 128 of its own) need about " +
                  std::to_string(need) + " file descriptors, but RLIMIT_NOFILE allows " +
                  std::to_string(limit) +
                  " (raised to the hard limit already): raise it (ulimit -n, LimitNOFILE= in the unit) or "
                  "lower --max-connections / --max-unproven-connections");
    }
  }
  const bool network = std::find(opts.engine.transports.begin(), opts.engine.transports.end(),
                                 TransportKind::kTcp) != opts.engine.transports.end() ||
                       std::find(opts.engine.transports.begin(), opts.engine.transports.end(),
                                 TransportKind::kVerbs) != opts.engine.transports.end() ||
                       opts.engine.transports.empty();
  if (network && opts.engine.cluster_token.empty() && !loopback_host(opts.engine.tcp.listen)) {
    warn_loudly("serving " + opts.engine.tcp.listen +
                " without a cluster token: anyone who can reach that address and read the node's keys "
                "can read and write the pool. Give --cluster-token-file (or KVSTASH_CLUSTER_TOKEN)");
  }

  // A password in a URL typed on the command line is every local user's to read.
  if (auto url = metadata::RedisUrl::parse(opts.redis_url); url.is_ok() && !url->password.empty()) {
    for (int i = 1; i < argc; ++i) {
      if (std::string_view(argv[i]).find(opts.redis_url) != std::string_view::npos) {
        warn_loudly(
            "the --redis URL on the command line holds a password, which `ps` and /proc/PID/cmdline "
            "show to every user of this host: pass it with --redis-password-file or "
            "KVSTASH_REDIS_PASSWORD, and the URL without it (or in KVSTASH_REDIS_URL)");
        break;
      }
    }
  }
  if (opts.cell == "auto") {
    metadata::RedisOptions redis;
    redis.url = opts.redis_url;
    redis.password = opts.redis_password;
    auto cell = metadata::least_loaded_cell(redis);
    if (!cell.is_ok()) return fail(cell.status(), "--cell auto: cannot pick a cell");
    KVSTASH_LOG_INFO("--cell auto: joining cell {}, the least loaded of the cell directory's", *cell);
    opts.cell = *cell;
  }

  auto node = node::MemoryNode::start(opts);
  if (!node.is_ok()) return fail(node.status(), "cannot start the memory node");

  std::unique_ptr<node::AdminServer> server;
  std::string admin_address = "off";
  if (admin != "off") {
    node::MemoryNode* n = node->get();
    auto s = node::AdminServer::start(
        admin, {.metrics = [n] { return n->metrics(); }, .health = [n] { return n->health(); }});
    if (!s.is_ok()) return fail(s.status(), "cannot serve the admin endpoint");
    server = std::move(s).value();
    admin_address = server->address();
  }

  if ((*node)->transports().find("ucx") != std::string::npos) {
    // UCX checks neither the cluster token (it never runs with one) nor leases: whoever reads
    // the node's packed key in Redis reaches the whole pool, unfenced.
    warn_loudly(
        "the pool is served over UCX, which cannot check a cluster token or leases: anyone who "
        "can read this node's record in Redis can read and write the whole pool. Serve it over "
        "verbs and tcp with a cluster token instead (--transports shm,tcp,verbs)");
  }

  std::cout << "ready node=" << (*node)->id() << " admin=" << admin_address
            << " pages=" << (*node)->page_count() << " page_size=" << (*node)->page_size()
            << " transports=" << (*node)->transports() << std::endl;
  kvstashd::notify_service_manager("READY=1\nSTATUS=serving node " + (*node)->id() + ", " +
                                   std::to_string((*node)->page_count()) + " pages over " +
                                   (*node)->transports());

  int sig = 0;
  sigwait(&stop_signals, &sig);
  KVSTASH_LOG_INFO("kvstashd: signal {}, draining", sig);
  kvstashd::notify_service_manager("STOPPING=1\nSTATUS=draining");
  auto dropped = (*node)->drain();
  if (!dropped.is_ok()) {
    // The cell still forgets us: the heartbeat stops and the deadline passes.
    std::cerr << "kvstashd: drain failed, the node will be declared dead after its heartbeat TTL: "
              << dropped.status().to_string() << "\n";
  }
  server.reset();
  node->reset();
  return 0;
}
