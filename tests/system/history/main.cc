// kvstash-history: a Jepsen-style history checker for the store's first promise, "a get
// returns exactly the bytes its put wrote, or an error", with the checksum off.
//
// The orchestrator starts a private redis-server and several kvstashd with small pools (so
// eviction is routine), then client processes of its own binary (`--client`), each with a
// Store over its own transport (shm, tcp, ucx: clients mix them) and several threads running
// random puts (some with short TTLs, some with two copies), overwrites, gets (some cancelled from another
// thread), removes, touches, contains_prefix and put streams dropped half-way, every one with a random
// deadline. Meanwhile a nemesis stops nodes (SIGSTOP, some past the heartbeat TTL, so the cell
// declares them dead and they rejoin from the same process), kills and restarts them
// (SIGKILL) and restarts Redis empty. With --redis-mode sentinel the cell's Redis is a master, a
// replica and a sentinel, everyone reaches it through a redis+sentinel:// URL, and instead of
// restarting Redis the nemesis kills the master (a failover; the killed one comes back empty
// and the sentinel makes it a replica). Every put's bytes encode (key, put id, offset), so a
// get's bytes say whose they are. Clients log each operation with its invocation and return
// times (CLOCK_MONOTONIC, shared by the processes of one host); at the end the orchestrator
// checks every get that returned OK:
//
//   - its bytes are exactly the whole bytes of one put P of the same key, of the size it
//     reported, and P was not a put stream its client dropped (those never commit);
//   - P was invoked before the get returned;
//   - P was not definitely replaced before the get began: no put or remove of the key that
//     returned OK was invoked after P returned and returned before the get was invoked.
//
// A put that failed may or may not have committed (a lost reply), within its own call: it
// counts as a possible P. With --ssd-dir, half the keys are recoverable ("kvp:"): a Redis loss
// (restarted empty, a failover) may bring back an older put of one from a node's tier, so for
// them a change that a loss may have undone (the loss ended after the change was invoked, and
// began before the get returned) does not count as replacing P; such gets are counted, and
// every other rule holds for them. Anything else is wrong bytes. The run fails on wrong bytes, on an
// operation that outlived its deadline by more than a second, on a client that crashed or
// hung, and on a setup failure.
//
// The nemesis rests for 15 s of every 45 (--quiet-seconds, --quiet-every). The run is cut into
// phases: disturbed (a fault, and 6 s of settling after it; after a Redis fault, 10 s from
// when every node has rejoined; a quiet gap under 5 s between faults counts as disturbed) and
// quiet. Put success is reported
// per phase, and in the quiet phases, where the small pools keep the cell full and evicting,
// the run also fails when fewer than 99% of puts succeed: a full cell keeps taking puts.
//
// Its pieces, by role (tests/system/history/): codec (every put's bytes, the keys), client (the client
// process), checker (the logs against the promise, the phases), cell and nemesis (where the
// processes run, the cell's Redis, the faults), orchestrator (the run), and main (the options).
//
//   kvstash-history --seconds 120              the bounded run scripts/test makes
//   kvstash-history --redis-mode sentinel --faults redis   failovers only
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

#include "history/client.h"
#include "history/orchestrator.h"

int main(int argc, char** argv) {
  using namespace kvstash::history;
  CLI::App app{
      "kvstash-history: a history checker for the store's first promise (see the file's opening comment)"};
  bool client = false;
  ClientConfig cc;
  RunConfig rc;
  double minutes = 0;
  std::string transports = "shm,tcp,ucx";
  bool no_nemesis = false, keep_logs = false;
  app.add_flag("--client", client, "Run as one client process (the orchestrator starts these)");
  app.add_option("--redis", cc.redis_url, "client: the cell's Redis");
  app.add_option("--transport", cc.transport, "client: shm, tcp or ucx");
  app.add_option("--id", cc.id, "client: its number (put ids carry it)");
  app.add_option("--log", cc.log, "client: its history file");
  app.add_option("--threads", rc.threads, "Threads per client process")->capture_default_str();
  app.add_option("--seconds", rc.seconds, "How long the run lasts")->capture_default_str();
  app.add_option("--minutes", minutes, "How long the run lasts, in minutes (overrides --seconds)");
  app.add_option("--seed", rc.seed, "Seed of the nemesis and the clients (default: random)");
  app.add_option("--nodes", rc.nodes, "Memory nodes")->capture_default_str();
  app.add_option("--capacity", rc.capacity, "Pool of each node (small: eviction is routine)")
      ->capture_default_str();
  app.add_option("--transports", transports, "One client process per transport listed")
      ->capture_default_str();
  app.add_option("--json", rc.json_path, "Write the report as JSON here");
  app.add_option("--rkey-scope", rc.rkey_scope, "verbs clients: connection or lease (default: the cell's)")
      ->check(CLI::IsMember({"", "connection", "lease"}));
  app.add_flag("--no-nemesis", no_nemesis, "Inject no faults (a baseline)");
  app.add_option("--quiet-seconds", rc.quiet_seconds,
                 "The nemesis rests this long at the end of every --quiet-every seconds: a fault-free phase, "
                 "where 99% of puts must succeed (0: no rest)")
      ->capture_default_str();
  app.add_option("--quiet-every", rc.quiet_every, "The period of the quiet phases")->capture_default_str();
  app.add_flag("--excuse-quiet-timeouts", rc.excuse_quiet_timeouts,
               "Puts that ran out of their deadline do not count against the quiet phases' 99% (a host too "
               "slow for 50 ms deadlines: the Soft-RoCE lane's emulated guest)");
  app.add_option(
         "--faults", rc.faults,
         "mixed: pauses, kills, Redis faults (and with --netns partitions and degraded links); kill: only "
         "kill -9 and restart nodes; redis: only Redis faults; net: only partitions and degraded links; ssd: "
         "only the tiers' faults (with --ssd-dir)")
      ->check(CLI::IsMember({"mixed", "kill", "redis", "net", "ssd"}))
      ->capture_default_str();
  app.add_option(
         "--redis-mode", rc.redis_mode,
         "single: one redis-server (its fault: a restart, empty); sentinel: a master, a replica and a "
         "sentinel (its fault: the master killed)")
      ->check(CLI::IsMember({"single", "sentinel"}))
      ->capture_default_str();
  app.add_option("--avoid-ms", rc.avoid_ms,
                 "Clients' StoreOptions::avoid_unreachable_nodes in ms (0: off; default: the store's)");
  app.add_flag("--keep-logs", keep_logs, "Keep the clients' histories even when the run is clean");
  app.add_option(
      "--netns", rc.netns,
      "Run on the hosts scripts/netns-cell made (network namespaces PREFIX-h<i>; this process in "
      "PREFIX-ctl): Redis, clients and memory nodes on separate hosts, tcp across them, and network "
      "faults in the nemesis");
  app.add_option("--hosts", rc.hosts, "With --netns: how many hosts there are (at least 4)")
      ->capture_default_str();
  app.add_option("--policy", rc.policy, "The cell's eviction policy (kvstash policy)")
      ->capture_default_str()
      ->check(CLI::IsMember({"lru", "arc", "turn-ttl"}));
  app.add_option(
      "--ssd-dir", rc.ssd_dir,
      "Give each node an NVMe tier, a file DIR/h<i>.tier (a file system with O_DIRECT, not tmpfs), and "
      "the nemesis the tiers' faults: bytes overwritten or the file cut short under a node, a node over "
      "a device failing its reads");
  CLI11_PARSE(app, argc, argv);
  if (client) {
    cc.threads = rc.threads;
    cc.seconds = rc.seconds;
    cc.seed = rc.seed;
    cc.rkey_scope = rc.rkey_scope;
    cc.avoid_ms = rc.avoid_ms;
    return run_client(cc);
  }
  if (minutes > 0) rc.seconds = minutes * 60;
  if (rc.faults == "ssd" && rc.ssd_dir.empty()) {
    std::cerr << "history: --faults ssd needs --ssd-dir\n";
    return 2;
  }
  if (!rc.ssd_dir.empty()) {
    // A file system without O_DIRECT (tmpfs, overlayfs) or a kernel without io_uring: a skip
    // (77), saying why, not a failure.
    const std::string probe = rc.ssd_dir + "/history-probe-" + std::to_string(::getpid());
    const kvstash::Status can = kvstash::node::SsdDevice::open({.path = probe, .capacity = 1 << 20}).status();
    ::unlink(probe.c_str());
    if (can.code() == kvstash::StatusCode::kUnsupported) {
      std::cout << "history: SKIP: no NVMe tier can live in " << rc.ssd_dir << ": " << can.to_string()
                << "\n";
      return 77;
    }
  }
  if (rc.seed == 0) rc.seed = std::random_device{}();
  rc.nemesis = !no_nemesis;
  if (!rc.netns.empty() && app.count("--transports") == 0)
    transports = "tcp,tcp,tcp";  // one client per Redis host
  rc.transports.clear();
  std::stringstream ts(transports);
  for (std::string t; std::getline(ts, t, ',');) {
    if (!t.empty()) rc.transports.push_back(t);
  }
  if (!rc.netns.empty() &&
      (rc.hosts < 4 || std::ranges::any_of(rc.transports, [](const auto& t) { return t != "tcp"; }))) {
    std::cerr << "history: --netns needs at least 4 hosts and only tcp clients (the others cross no host)\n";
    return 2;
  }
  char dir[] = "/tmp/kvstash-history-XXXXXX";
  if (::mkdtemp(dir) == nullptr) {
    std::perror("mkdtemp");
    return 2;
  }
  rc.dir = dir;
  std::cout << "history: " << rc.seconds << " s, seed " << rc.seed << ", logs in " << rc.dir << "\n";
  int rcode = run(rc, std::filesystem::read_symlink("/proc/self/exe").string());
  if (rcode == 0 && !keep_logs) std::filesystem::remove_all(rc.dir);
  return rcode;
}
