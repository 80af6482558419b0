// kvstash-history's cell: where its processes run (loopback, or the hosts scripts/netns-cell
// made) and its Redis (one server, or a master, replicas and sentinels), with the faults the
// nemesis does to them.
#pragma once

#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "history/codec.h"
#include "kvstash/status.h"
#include "metadata/redis_client.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::history {

using namespace std::chrono_literals;

// Where the cell's processes run: all on this host's loopback, or (--netns P) on the hosts
// scripts/netns-cell made: network namespaces P-h<i>, each with address 10.231.0.<10+i> on
// one bridge in P-sw, this process in P-ctl. Redis (a master, two replicas, three
// sentinels) runs on hosts 0-2, the clients too, the memory nodes on hosts 3 and up: every
// client reaches every node across the bridge, over tcp.
struct Hosts {
  std::string prefix;
  int count = 1;

  bool netns() const { return !prefix.empty(); }
  std::string ns(int host) const { return std::string(prefix).append("-h").append(std::to_string(host)); }
  std::string addr(int host) const {
    return netns() ? std::string("10.231.0.").append(std::to_string(10 + host)) : std::string("127.0.0.1");
  }
  std::vector<std::string> wrapper(int host) const {
    if (!netns()) return {};
    return {"ip", "netns", "exec", ns(host)};
  }
  int redis_host(int i) const { return netns() ? i % 3 : 0; }
  int client_host(int i) const { return netns() ? i % 3 : 0; }
  int node_host(int i) const { return netns() ? 3 + i % std::max(1, count - 3) : 0; }
};

// Runs a command (ip, tc) to its end; false when it failed.
bool run_command(std::vector<std::string> argv);

// The cell's Redis: one server, or (sentinel) servers, one master and the rest replicating
// it, and sentinels over them: on loopback two servers and one sentinel; on the netns hosts a
// master and two replicas on hosts 0-2 and a sentinel on each (quorum 2).
class CellRedis {
 public:
  static Result<std::unique_ptr<CellRedis>> start(bool sentinel, const Hosts& hosts) {
    auto r = std::unique_ptr<CellRedis>(new CellRedis);
    r->hosts_ = hosts;
    if (!sentinel) {
      KVSTASH_ASSIGN_OR_RETURN(
          auto one, harness::LocalRedis::start({.host = hosts.addr(0), .wrapper = hosts.wrapper(0)}));
      r->servers_.push_back(std::move(one));
      return r;
    }
    // As docs/operations.md asks of Sentinel deployments: a master without a replica in sync
    // refuses writes, so one that comes back empty before Sentinel demotes it takes none.
    const std::vector<std::string> guarded{"--min-replicas-to-write", "1", "--min-replicas-max-lag", "2"};
    const int servers = hosts.netns() ? 3 : 2;
    const int sentinels = hosts.netns() ? 3 : 1;
    for (int i = 0; i < servers; ++i) {
      std::vector<std::string> args = guarded;
      if (i > 0) {
        args.insert(args.end(),
                    {"--replicaof", r->servers_[0]->host(), std::to_string(r->servers_[0]->port())});
      }
      const int host = hosts.redis_host(i);
      KVSTASH_ASSIGN_OR_RETURN(
          auto server, harness::LocalRedis::start(
                           {.extra_args = args, .host = hosts.addr(host), .wrapper = hosts.wrapper(host)}));
      r->servers_.push_back(std::move(server));
    }
    for (int i = 0; i < sentinels; ++i) {
      const int host = hosts.redis_host(i);
      KVSTASH_ASSIGN_OR_RETURN(auto sentinel,
                               harness::LocalRedis::start({.sentinel_for = r->servers_[0]->port(),
                                                           .sentinel_host = r->servers_[0]->host(),
                                                           .quorum = sentinels / 2 + 1,
                                                           .service = "history",
                                                           .host = hosts.addr(host),
                                                           .wrapper = hosts.wrapper(host)}));
      r->sentinels_.push_back(std::move(sentinel));
    }
    // A failover needs the replicas in sync and known to the sentinels.
    KVSTASH_ASSIGN_OR_RETURN(auto watcher, r->ask_sentinel());
    for (auto end = Clock::now() + 30s;; std::this_thread::sleep_for(100ms)) {
      auto replicas = watcher->command({"SENTINEL", "replicas", "history"});
      int in_sync = 0;
      for (std::size_t k = 0; replicas.is_ok() && k < replicas->size(); ++k) {
        const redisReply* fields = replicas->element(k);
        for (std::size_t i = 0; i + 1 < fields->elements; i += 2) {
          if (std::string_view(fields->element[i]->str) == "master-link-status" &&
              std::string_view(fields->element[i + 1]->str) == "ok") {
            ++in_sync;
          }
        }
      }
      if (in_sync == servers - 1) return r;
      if (Clock::now() > end) return Status::unavailable("the sentinel never saw the replicas in sync");
    }
  }

  // How many servers replicate the master (0: a single server).
  int replicas() const { return sentinels_.empty() ? 0 : static_cast<int>(servers_.size()) - 1; }

  std::string url() const {
    if (sentinels_.empty()) return servers_[0]->url();
    std::string url = "redis+sentinel://";
    for (std::size_t i = 0; i < sentinels_.size(); ++i) {
      url.append(i > 0 ? "," : "")
          .append(sentinels_[i]->host())
          .append(":")
          .append(std::to_string(sentinels_[i]->port()));
    }
    return url.append("/history/0");
  }

  // Single: restarts Redis empty. Sentinel: kills the master, waits for the failover (the
  // sentinels naming another master, up to 10 s), and brings the killed server back, empty
  // (the sentinels make it a replica).
  // Returns the fault's name.
  Result<std::string> fault(std::mt19937_64& rng) {
    if (sentinels_.empty()) {
      KVSTASH_RETURN_IF_ERROR(servers_[0]->restart());
      return std::string("redis restarted empty");
    }
    KVSTASH_ASSIGN_OR_RETURN(auto watcher, ask_sentinel());
    KVSTASH_ASSIGN_OR_RETURN(auto master,
                             watcher->command({"SENTINEL", "get-master-addr-by-name", "history"}));
    if (master.size() != 2) return Status::internal("the sentinel names no master");
    const std::string host(master.element(0)->str);
    const int port = std::atoi(master.element(1)->str);
    auto victim =
        std::ranges::find_if(servers_, [&](const auto& s) { return s->host() == host && s->port() == port; });
    if (victim == servers_.end()) return Status::internal("the sentinel names a master that is none of ours");
    std::printf("  at %" PRId64 " ms: killing the master %s:%d\n", now_ns() / 1000000, host.c_str(), port);
    (*victim)->kill();
    // The failover: until the sentinels name another master (or 10 s). Back before that, the
    // killed server would be a master again, empty, with the sentinels halfway through
    // promoting a replica: two masters until they agree, which is Sentinel's own fault to
    // heal, not the cell's.
    for (auto give_up = Clock::now() + 10s; Clock::now() < give_up; std::this_thread::sleep_for(100ms)) {
      auto now_master = ask_sentinel();
      if (!now_master.is_ok()) continue;
      auto named = (*now_master)->command({"SENTINEL", "get-master-addr-by-name", "history"});
      if (named.is_ok() && named->size() == 2 &&
          (std::string(named->element(0)->str) != host || std::atoi(named->element(1)->str) != port)) {
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 1500)(rng)));
    KVSTASH_RETURN_IF_ERROR((*victim)->restart());
    return std::string("redis master killed (failover)");
  }

 private:
  CellRedis() = default;
  // A plain connection to a sentinel that answers.
  Result<std::unique_ptr<metadata::RedisClient>> ask_sentinel() const {
    Status last = Status::unavailable("no sentinel");
    for (const auto& sentinel : sentinels_) {
      auto c = metadata::RedisClient::connect({.url = std::string("redis://")
                                                          .append(sentinel->host())
                                                          .append(":")
                                                          .append(std::to_string(sentinel->port()))});
      if (c.is_ok()) return c;
      last = c.status();
    }
    return last;
  }
  Hosts hosts_;
  std::vector<std::unique_ptr<harness::LocalRedis>> servers_;
  std::vector<std::unique_ptr<harness::LocalRedis>> sentinels_;
};

// The network nemesis of the netns hosts: a host's link down (a partition from every other
// host), or its link degraded for `lasting` (netem, or a slow link and nftables' loss where the
// kernel has no netem). Returns the fault's name; empty when the commands failed.
std::string network_fault(const Hosts& hosts, int host, bool partition, std::chrono::milliseconds lasting);

}  // namespace kvstash::history
