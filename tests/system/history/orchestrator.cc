#include "history/orchestrator.h"

//   kvstash-history --minutes 30 --json r.json what scripts/chaos runs
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <hiredis/hiredis.h>

#include "kvstash/status.h"
#include "kvstash/store.h"
#include "metadata/cell_admin.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"
#include "node/ssd_device.h"
#include "tests/harness/local_cluster.h"
#include "watchdog.h"

#include "history/cell.h"
#include "history/checker.h"
#include "history/client.h"
#include "history/codec.h"

namespace kvstash::history {

using namespace std::chrono_literals;
using nlohmann::json;

// Every page of every live node accounted for, once the cell is quiet (no pending put, no
// zombie, no sweep left): each page a node handed out (below its next_page) is in a run on its
// free list or in exactly one object's run, and no page is both or twice; each object's run
// still holds its generation at its first page, and the node's free_pages counts its free
// list. Problems as text; empty when all hold.
const metadata::Script& accounting_script() {
  static const metadata::Script script(R"(
local P = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local busy = redis.call('ZCARD', P .. ':pending') + redis.call('ZCARD', P .. ':zombies') + redis.call('LLEN', P .. ':sweep')
if busy > 0 then return {'busy'} end
local problems = {'ok'}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
  local owner, held, free = {}, 0, 0
  local gk = P .. ':gen:' .. id
  local function hold(first, count, what, gen)
    local g = tonumber(redis.call('HGET', gk, first) or '0')
    if gen ~= nil and g ~= gen then
      problems[#problems + 1] = 'node ' .. id .. ' page ' .. first .. ': ' .. what .. ' names generation ' .. gen .. ', the page has ' .. g
    end
    for page = first, first + count - 1 do
      if owner[page] then
        problems[#problems + 1] = 'node ' .. id .. ' page ' .. page .. ': held by ' .. owner[page] .. ' and by ' .. what
        return
      end
      owner[page] = what
      held = held + 1
    end
  end
  for _, e in ipairs(redis.call('LRANGE', P .. ':free:' .. id, 0, -1)) do
    local first, count = string.match(e, '^(%d+),?(%d*)$')
    count = tonumber(count) or 1
    hold(tonumber(first), count, 'the free list', nil)
    free = free + count
  end
  local counted = tonumber(redis.call('HGET', P .. ':node:' .. id, 'free_pages') or '0')
  if counted ~= free then
    problems[#problems + 1] = 'node ' .. id .. ': free_pages says ' .. counted .. ', its free list holds ' .. free
  end
  for _, key in ipairs(redis.call('SMEMBERS', P .. ':objs:' .. id)) do
    local ext = redis.call('HGET', P .. ':obj:' .. key, 'extents')
    if not ext then
      problems[#problems + 1] = 'node ' .. id .. ': its objects name ' .. key .. ', which has no record'
    else
      for node, page, gen, count in string.gmatch(ext, '([^,;]+),(%d+),(%d+),?(%d*)') do
        if node == id then hold(tonumber(page), tonumber(count) or 1, 'object ' .. key, tonumber(gen)) end
      end
    end
  end
  local handed = tonumber(redis.call('HGET', P .. ':node:' .. id, 'next_page') or '0')
  for page, what in pairs(owner) do
    if page >= handed then
      problems[#problems + 1] = 'node ' .. id .. ' page ' .. page .. ': held by ' .. what .. ', but never handed out'
    end
  end
  if held ~= handed then
    problems[#problems + 1] = 'node ' .. id .. ': ' .. held .. ' of the ' .. handed .. ' pages it handed out are accounted for'
  end
end
return problems
)");
  return script;
}

// Waits, up to `limit`, until `nodes` memory nodes are in the cell again (after a Redis fault
// they register anew with the master that serves now) and that master takes writes. Whether
// both hold.
bool wait_cell_whole(const std::string& url, int nodes, int replicas, std::chrono::seconds limit) {
  const std::string key = metadata::cell_prefix("default") + ":nodes";
  for (auto end = Clock::now() + limit; Clock::now() < end; std::this_thread::sleep_for(200ms)) {
    auto redis = metadata::RedisClient::connect({.url = url});
    if (!redis.is_ok()) continue;
    // Live ones: a heartbeat deadline still ahead on the Redis that serves now.
    auto t = (*redis)->command({"TIME"});
    if (!t.is_ok() || t->size() < 2) continue;
    const std::string now_ms =
        std::to_string(std::stoll(std::string(t->element(0)->str, t->element(0)->len)) * 1000 +
                       std::stoll(std::string(t->element(1)->str, t->element(1)->len)) / 1000);
    auto n = (*redis)->command({"ZCOUNT", key, now_ms, "+inf"});
    if (!n.is_ok() || n->integer() < nodes) continue;
    // And every replica back in sync with the master. Under min-replicas-to-write the master
    // refuses writes (NOREPLICAS) while no replica is in sync; right after a failover the one
    // replica that is may be the server that just came back, while the other still waits for
    // its full resync: a master that took one write then can refuse the next for seconds.
    // The failover is over once replication is whole again.
    auto info = (*redis)->command({"INFO", "replication"});
    if (!info.is_ok()) continue;
    int online = 0;
    const std::string_view text = info->str();
    for (auto at = text.find("state=online"); at != std::string_view::npos;
         at = text.find("state=online", at + 1))
      ++online;
    if (online < replicas) continue;
    if ((*redis)->command({"SET", "kvstash-history:probe", now_ms}).is_ok()) return true;
  }
  return false;
}

// The cell's NVMe tier counters (P:stats) now; empty when Redis does not answer.
// Sets the cell's eviction policy (kvstash policy): at the start, and again after a Redis that
// came back empty forgot it.
Status set_policy(const std::string& url, const std::string& policy) {
  KVSTASH_ASSIGN_OR_RETURN(auto redis, metadata::RedisClient::connect({.url = url}));
  return metadata::CellAdmin(*redis).set_policy(policy).status();
}

std::map<std::string, std::uint64_t> tier_counters(const std::string& url) {
  static const char* const kFields[] = {"written_down", "promoted",     "tier_hits",
                                        "tier_lost",    "tier_evicted", "recovered"};
  std::map<std::string, std::uint64_t> out;
  auto redis = metadata::RedisClient::connect({.url = url});
  if (!redis.is_ok()) return out;
  const std::string key = metadata::cell_prefix("default") + ":stats";
  std::vector<std::string_view> args{"HMGET", key};
  for (const char* f : kFields) args.push_back(f);
  auto r = (*redis)->command(args);
  if (!r.is_ok() || r->size() != std::size(kFields)) return out;
  for (std::size_t i = 0; i < std::size(kFields); ++i) {
    const redisReply* e = r->element(i);
    out[kFields[i]] =
        e != nullptr && e->type == REDIS_REPLY_STRING ? std::stoull(std::string(e->str, e->len)) : 0;
  }
  return out;
}

std::vector<std::string> account_pages(const std::string& url) {
  const std::string prefix = metadata::cell_prefix("default");
  // Put leases (3 s) and read leases (2 s) end, the nodes' reclaim (every 200 ms) frees
  // what they held and sweeps what dead incarnations left; a failover the nemesis began
  // before it stopped completes.
  Result<std::unique_ptr<metadata::RedisClient>> redis = Status::unavailable("not connected");
  for (auto end = Clock::now() + 60s;; std::this_thread::sleep_for(500ms)) {
    if (!redis.is_ok()) redis = metadata::RedisClient::connect({.url = url});
    if (!redis.is_ok()) {
      if (Clock::now() < end) continue;
      return {"page accounting: " + redis.status().to_string()};
    }
    auto r = (*redis)->eval(accounting_script(), {prefix}, {});
    if (!r.is_ok()) {
      if (Clock::now() < end) continue;
      return {"page accounting: " + r.status().to_string()};
    }
    std::vector<std::string> out;
    for (std::size_t i = 0; i < r->size(); ++i) out.emplace_back(r->element(i)->str, r->element(i)->len);
    if (out.empty()) return {"page accounting: an empty reply"};
    if (out.front() == "busy" && Clock::now() < end) continue;
    if (out.front() == "busy")
      return {"page accounting: puts, zombies or sweeps still pending 60 s after the run"};
    out.erase(out.begin());
    return out;
  }
}

int run(const RunConfig& rc, const std::string& self) {
  Report report;
  const Hosts hosts{rc.netns, rc.netns.empty() ? 1 : rc.hosts};
  auto redis = CellRedis::start(rc.redis_mode == "sentinel", hosts);
  if (!redis.is_ok()) {
    std::cerr << "history: " << redis.status().to_string() << "\n";
    return 2;
  }
  const std::string url = (*redis)->url();
  // `initial`: before the run, where a node that does not start is a setup failure.
  auto tier_file = [&](int i) { return rc.ssd_dir + "/h" + std::to_string(i) + ".tier"; };
  auto start_node = [&](int i, bool initial = false,
                        const std::string& ssd_fault = "none") -> std::unique_ptr<harness::LocalNode> {
    std::vector<std::string> args{
        "--heartbeat-ttl", "2s", "--reclaim-interval", "200ms", "--ucx-allow-emulated-rma",
        "--huge-pages",    "off"};
    if (!rc.ssd_dir.empty()) {
      args.insert(args.end(), {"--ssd", tier_file(i), "--ssd-capacity", "64MiB", "--ssd-fault", ssd_fault,
                               "--ssd-recover", "kvp:"});
    }
    if (hosts.netns()) {
      const std::string at = hosts.addr(hosts.node_host(i));
      args.insert(args.end(), {"--listen", at + ":0", "--admin", at + ":0", "--transports", "tcp"});
    }
    // kvstashd exits when it cannot register (Redis mid-failover, its host partitioned);
    // like a supervisor, start it again for a while.
    Result<std::unique_ptr<harness::LocalNode>> n = Status::unavailable("not started");
    for (auto give_up = Clock::now() + 30s; Clock::now() < give_up; std::this_thread::sleep_for(500ms)) {
      n = harness::LocalNode::start({.redis_url = url,
                                     .capacity = rc.capacity,
                                     .page_size = "1MiB",
                                     .node_id = "h" + std::to_string(i),
                                     .extra_args = args,
                                     .wrapper = hosts.wrapper(hosts.node_host(i))});
      if (n.is_ok() || n.status().code() != StatusCode::kUnavailable) break;
    }
    if (!n.is_ok() && !initial && n.status().code() == StatusCode::kUnavailable) {
      // An outcome, not a failure: the cell's Redis had no master it could register with
      // (the nemesis's failovers and partitions); the nemesis tries again later.
      std::printf("  node h%d could not rejoin for 30 s: %s\n", i, n.status().to_string().c_str());
      ++report.faults["node restart put off: no Redis master for 30 s"];
      return nullptr;
    }
    if (!n.is_ok()) {
      report.failures.push_back("node h" + std::to_string(i) + ": " + n.status().to_string());
      return nullptr;
    }
    return std::move(n).value();
  };
  std::vector<std::unique_ptr<harness::LocalNode>> nodes;
  for (int i = 0; i < rc.nodes; ++i) {
    nodes.push_back(start_node(i, /*initial=*/true));
    if (!nodes.back()) {
      std::cerr << "history: " << report.failures.back() << "\n";
      return 2;
    }
  }

  if (Status s = set_policy(url, rc.policy); !s.is_ok()) {
    std::cerr << "history: setting the eviction policy: " << s.to_string() << "\n";
    return 2;
  }
  std::mt19937_64 rng(rc.seed);
  const std::int64_t run_start = now_ns();
  std::vector<harness::ChildProcess> clients;
  std::vector<std::string> logs;
  for (std::size_t i = 0; i < rc.transports.size(); ++i) {
    const std::string log = rc.dir + "/client-" + std::to_string(i) + "-" + rc.transports[i] + ".log";
    logs.push_back(log);
    std::vector<std::string> argv = hosts.wrapper(hosts.client_host(static_cast<int>(i)));
    argv.insert(argv.end(), {self,           "--client",
                             "--redis",      url,
                             "--transport",  rc.transports[i],
                             "--id",         std::to_string(i + 1),
                             "--threads",    std::to_string(rc.threads),
                             "--seconds",    std::to_string(rc.seconds),
                             "--seed",       std::to_string(rc.seed + i + 1),
                             "--log",        log,
                             "--rkey-scope", rc.rkey_scope,
                             "--avoid-ms",   std::to_string(rc.avoid_ms)});
    auto child = harness::ChildProcess::start({.argv = argv, .capture_stdout = false});
    if (!child.is_ok()) {
      std::cerr << "history: client: " << child.status().to_string() << "\n";
      return 2;
    }
    clients.push_back(std::move(child).value());
  }

  // The nemesis, on this thread (children die with the thread that started them).
  const auto end = Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(rc.seconds * 1000));
  auto pick = [&](int n) { return static_cast<int>(std::uniform_int_distribution<int>(0, n - 1)(rng)); };
  auto ms = [&](int lo, int hi) {
    return std::chrono::milliseconds(std::uniform_int_distribution<int>(lo, hi)(rng));
  };
  auto last_redis_restart = Clock::now();
  std::map<std::string, std::uint64_t> tier_before;  // the tiers' counters before Redis faults
  const auto began = Clock::now();
  // Each nemesis action as a window [start, end] named by what it did, for the phases.
  std::vector<std::tuple<std::int64_t, std::int64_t, std::string>> windows;
  auto quiet_now = [&] {
    if (rc.quiet_seconds <= 0 || rc.quiet_every <= rc.quiet_seconds) return false;
    const double t = std::chrono::duration<double>(Clock::now() - began).count();
    return std::fmod(t, rc.quiet_every) >= rc.quiet_every - rc.quiet_seconds;
  };
  while (rc.nemesis && Clock::now() + 5s < end) {
    std::this_thread::sleep_for(ms(500, 2500));
    if (quiet_now()) {
      // A quiet phase: every node up, no fault, so that the checker holds the cell to its
      // fault-free promises (puts succeed) for a while in every run.
      for (int i = 0; i < rc.nodes; ++i) {
        if (nodes[i]) continue;
        const std::int64_t t0 = now_ns();
        nodes[i] = start_node(i);
        if (nodes[i]) ++report.faults["node restarted"];
        windows.emplace_back(t0, now_ns(), "node restarted");
      }
      continue;
    }
    const int victim = pick(rc.nodes);
    const std::int64_t fault_start = now_ns();
    const std::map<std::string, std::uint64_t> faults_before = report.faults;
    const auto record = [&] {
      std::string what;
      for (const auto& [name, count] : report.faults) {
        auto it = faults_before.find(name);
        if (it != faults_before.end() && it->second == count) continue;
        what += (what.empty() ? "" : ", ") + name;
      }
      if (!what.empty()) windows.emplace_back(fault_start, now_ns(), what);
    };
    // 0-5 a pause, 6-8 a kill -9, 9 a Redis fault, 10 a partition, 11 a degraded link. Across
    // hosts, the network and the master get a larger share.
    constexpr int kAcrossHosts[] = {0, 1, 3, 4, 6, 7, 9, 9, 10, 10, 11, 11};
    // With tiers, 12 bytes overwritten or the file cut short under a node, 13 a node over a
    // device that fails its reads for a while.
    constexpr int kWithTiers[] = {0, 2, 4, 6, 7, 9, 12, 12, 12, 13, 13};
    const int action = rc.faults == "kill"    ? 6
                       : rc.faults == "redis" ? 9
                       : rc.faults == "net"   ? 10 + pick(2)
                       : rc.faults == "ssd"   ? 12 + pick(2)
                       : hosts.netns()        ? kAcrossHosts[pick(12)]
                       : !rc.ssd_dir.empty()  ? kWithTiers[pick(11)]
                                              : pick(10);
    if (!nodes[victim]) {
      nodes[victim] = start_node(victim);
      ++report.faults["node restarted"];
      record();
      continue;
    }
    if (action == 12) {  // the tier's bytes changed under the node: junk, or the file cut short
      const std::string path = tier_file(victim);
      const int fd = ::open(path.c_str(), O_WRONLY);
      bool done = fd >= 0;
      if (done && pick(3) == 0) {
        // Cut short: everything past a random point of the first half is gone.
        done = ::ftruncate(fd, static_cast<off_t>(1 + pick(32)) << 20) == 0;
        ++report.faults["tier file cut short under a node"];
      } else if (done) {
        std::string junk(static_cast<std::size_t>(64 + pick(4032)) << 10, '\0');
        for (char& c : junk) c = static_cast<char>(pick(256));
        const off_t at = (static_cast<off_t>(1) << 20) + (static_cast<off_t>(pick(60 << 8)) << 12);
        done = ::pwrite(fd, junk.data(), junk.size(), at) == static_cast<ssize_t>(junk.size());
        ++report.faults["tier bytes overwritten under a node"];
      }
      if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
      }
      if (!done) report.failures.push_back("tier fault on " + path + ": " + std::strerror(errno));
    } else if (action == 13) {  // a node restarted over a device whose reads fail, then healed
      nodes[victim]->kill();
      nodes[victim] = start_node(victim, false, "read-eio");
      ++report.faults["node restarted over a device failing its reads"];
      std::this_thread::sleep_for(ms(1000, 3000));
      if (nodes[victim]) nodes[victim]->kill();
      nodes[victim] = start_node(victim);
      if (nodes[victim]) ++report.faults["node restarted"];
    } else if (action >= 10) {  // a host partitioned, or its link degraded, for a while
      const int host = pick(hosts.count);
      const std::string fault = network_fault(hosts, host, action == 10, ms(1000, 4000));
      if (fault.empty())
        report.failures.push_back("network fault on host " + std::to_string(host) + " failed");
      ++report.faults[fault.empty() ? std::string("network fault failed") : fault];
    } else if (action < 6) {  // a pause: half of them past the 2 s heartbeat TTL
      const auto pause = action < 3 ? ms(500, 1800) : ms(2200, 4000);
      ::kill(nodes[victim]->pid(), SIGSTOP);
      std::this_thread::sleep_for(pause);
      ::kill(nodes[victim]->pid(), SIGCONT);
      ++report.faults[pause > 2s ? "node paused past its heartbeat TTL" : "node paused"];
    } else if (action < 9) {  // a crash, and a restart of the same id a little later
      nodes[victim]->kill();
      nodes[victim].reset();
      ++report.faults["node killed (SIGKILL)"];
      std::this_thread::sleep_for(ms(200, 1500));
      nodes[victim] = start_node(victim);
      if (nodes[victim]) ++report.faults["node restarted"];
    } else if (Clock::now() - last_redis_restart > (rc.faults == "redis" ? 5s : hosts.netns() ? 8s : 15s)) {
      // Redis restarts empty, or its master dies, now and then. (The tiers' counters go with
      // an emptied Redis: keep what they said.)
      if (!rc.ssd_dir.empty()) {
        for (const auto& [k, v] : tier_counters(url)) tier_before[k] += v;
      }
      auto fault = (*redis)->fault(rng);
      if (!fault.is_ok()) report.failures.push_back("redis fault: " + fault.status().to_string());
      ++report.faults[fault.is_ok() ? *fault : std::string("redis fault failed")];
      if (fault.is_ok()) std::printf("  at %" PRId64 " ms: %s\n", now_ns() / 1000000, fault->c_str());
      // The fault lasts until the cell is whole again (the phases settle from then on).
      if (fault.is_ok() && !wait_cell_whole(url, rc.nodes, (*redis)->replicas(), 30s)) {
        std::printf("  at %" PRId64
                    " ms: the cell was not whole (nodes rejoined, replicas in sync, master taking writes) "
                    "after 30 s\n",
                    now_ns() / 1000000);
      }
      if (rc.policy != "lru") (void)set_policy(url, rc.policy);  // a Redis that came back empty forgot it
      last_redis_restart = Clock::now();
    }
    record();
  }
  const std::int64_t run_end = run_start + static_cast<std::int64_t>(rc.seconds * 1e9);
  for (auto& n : nodes) {
    if (n) ::kill(n->pid(), SIGCONT);
  }
  for (std::size_t i = 0; i < clients.size(); ++i) {
    auto status = clients[i].wait(end + 60s);
    if (!status) {
      clients[i].kill();
      report.failures.push_back("client " + rc.transports[i] + " hung past the run's end (killed)");
    } else if (*status != 0) {
      report.failures.push_back("client " + rc.transports[i] + " exited with status " +
                                std::to_string(*status));
    }
  }
  // Every page accounted for, with the nemesis stopped (restart nodes it left down first).
  for (int i = 0; i < rc.nodes; ++i) {
    if (!nodes[i]) nodes[i] = start_node(i);
  }
  report.pages = account_pages(url);
  for (const auto& p : report.pages) report.failures.push_back("PAGES " + p);
  std::map<std::string, std::uint64_t> tier;
  if (!rc.ssd_dir.empty()) {
    tier = tier_before;
    for (const auto& [k, v] : tier_counters(url)) tier[k] += v;
    // A run over tiers that never moved an object down and back proved nothing about them.
    if (tier["written_down"] == 0 || tier["promoted"] == 0) {
      report.failures.push_back("the tiers were not exercised: " + std::to_string(tier["written_down"]) +
                                " objects moved down, " + std::to_string(tier["promoted"]) + " promoted");
    }
    for (int i = 0; i < rc.nodes; ++i) ::unlink(tier_file(i).c_str());
  }
  nodes.clear();
  std::vector<std::pair<std::int64_t, std::int64_t>> losses;
  if (!rc.ssd_dir.empty()) {
    for (const auto& [from, to, what] : windows) {
      if (what.find("redis") != std::string::npos) losses.emplace_back(from, to);
    }
  }
  check(logs, report, losses);

  std::uint64_t total = 0;
  for (const auto& [k, v] : report.ops) total += v;
  std::uint64_t faults = 0;
  for (const auto& [k, v] : report.faults) faults += v;
  json j;
  j["seconds"] = rc.seconds;
  j["seed"] = rc.seed;
  j["transports"] = rc.transports;
  j["nodes"] = rc.nodes;
  j["ops"] = total;
  j["ops_by_kind"] = report.ops;
  j["gets_checked"] = report.gets_checked;
  j["gets_recovered"] = report.gets_recovered;
  j["faults"] = faults;
  j["faults_by_kind"] = report.faults;
  if (!tier.empty()) j["tier"] = tier;
  j["wrong_bytes"] = report.wrong.size();
  j["overdue"] = report.overdue.size();
  j["violations"] = report.wrong;
  j["overdue_ops"] = report.overdue;
  j["failures"] = report.failures;
  j["page_problems"] = report.pages;
  std::uint64_t puts = 0, puts_ok = 0;
  for (const auto& [k, v] : report.ops) {
    if (k.starts_with("put ") && k != "put stream dropped") puts += v;
    if (k == "put ok") puts_ok += v;
  }
  j["put_success"] = puts > 0 ? static_cast<double>(puts_ok) / static_cast<double>(puts) : 0.0;
  // Put success per phase; in the quiet ones (no fault, the cell settled) the cell is held to
  // its promise that a full cell keeps taking puts: 99% of them succeed.
  const std::vector<Phase> phases = phases_of(run_start, run_end, windows, report.put_calls);
  std::uint64_t quiet_puts = 0, quiet_ok = 0;
  j["phases"] = json::array();
  std::uint64_t excused = 0;
  for (const Phase& ph : phases) {
    if (ph.faults.empty()) quiet_puts += ph.puts, quiet_ok += ph.puts_ok;
    if (ph.faults.empty() && rc.excuse_quiet_timeouts) {
      const auto t = ph.failed.find(static_cast<int>(StatusCode::kTimeout));
      if (t != ph.failed.end()) excused += t->second;
    }
    j["phases"].push_back({{"from_s", static_cast<double>(ph.from_ns - run_start) / 1e9},
                           {"to_s", static_cast<double>(ph.to_ns - run_start) / 1e9},
                           {"faults", ph.faults},
                           {"puts", ph.puts},
                           {"put_success", ph.success()}});
  }
  quiet_puts -= excused;
  const double quiet_success =
      quiet_puts == 0 ? 1.0 : static_cast<double>(quiet_ok) / static_cast<double>(quiet_puts);
  j["quiet_timeouts_excused"] = excused;
  j["quiet_puts"] = quiet_puts;
  j["quiet_put_success"] = quiet_success;
  if (quiet_puts >= kMinQuietPuts && quiet_success < kQuietPutSuccess) {
    char line[200];
    std::snprintf(line, sizeof line,
                  "put success %.2f%% in the fault-free phases (%" PRIu64 " puts), below %.0f%%",
                  100 * quiet_success, quiet_puts, 100 * kQuietPutSuccess);
    report.failures.push_back(line);
  }
  std::cout << "history: " << total << " ops, " << report.gets_checked << " gets checked ("
            << report.gets_recovered << " of recoverable keys brought back by a Redis loss), " << faults
            << " faults injected, " << report.wrong.size() << " wrong bytes, " << report.overdue.size()
            << " past their deadline, " << report.failures.size() << " failures\n";
  if (puts > 0)
    std::printf("  puts OK: %" PRIu64 " of %" PRIu64 " (%.1f%%)\n", puts_ok, puts, 100.0 * puts_ok / puts);
  for (const Phase& ph : phases) {
    std::string what = ph.faults.empty() ? "quiet" : "disturbed:";
    for (std::size_t i = 0; i < ph.faults.size() && i < 3; ++i) what += (i == 0 ? " " : ", ") + ph.faults[i];
    if (ph.faults.size() > 3) what += ", ...";
    std::string failed;
    for (const auto& [code, n] : ph.failed)
      failed += (failed.empty() ? "; failed: " : ", ") + code_name(code) + " " + std::to_string(n);
    std::printf("  phase %5.1f-%5.1f s: puts OK %" PRIu64 " of %" PRIu64 " (%.1f%%), %s%s\n",
                static_cast<double>(ph.from_ns - run_start) / 1e9,
                static_cast<double>(ph.to_ns - run_start) / 1e9, ph.puts_ok, ph.puts, 100 * ph.success(),
                what.c_str(), failed.c_str());
    if (!ph.faults.empty()) continue;
    for (const auto& [code, why] : ph.first_why)
      std::printf("    first %s: %s\n", code_name(code).c_str(), why.c_str());
  }
  if (quiet_puts < kMinQuietPuts) {
    std::printf("  (fewer than %" PRIu64 " puts in quiet phases: their success is reported, not held)\n",
                kMinQuietPuts);
  }
  if (rc.excuse_quiet_timeouts) {
    std::printf("  (quiet phases held to %.0f%% without their %" PRIu64
                " kTimeouts: --excuse-quiet-timeouts)\n",
                100 * kQuietPutSuccess, excused);
  }
  for (const auto& [k, v] : report.ops) std::cout << "  " << k << ": " << v << "\n";
  for (const auto& [k, v] : report.faults) std::cout << "  fault " << k << ": " << v << "\n";
  for (const auto& [k, v] : tier) std::cout << "  tier " << k << ": " << v << "\n";
  for (const auto& w : report.wrong) std::cout << "  WRONG BYTES " << w << "\n";
  for (std::size_t i = 0; i < std::min<std::size_t>(report.overdue.size(), 20); ++i) {
    std::cout << "  OVERDUE " << report.overdue[i] << "\n";
  }
  for (const auto& f : report.failures) std::cout << "  FAILURE " << f << "\n";
  if (!rc.json_path.empty()) std::ofstream(rc.json_path) << j.dump(2) << "\n";
  const bool clean = report.wrong.empty() && report.overdue.empty() && report.failures.empty();
  return clean && report.gets_checked > 0 ? 0 : 1;
}

}  // namespace kvstash::history
