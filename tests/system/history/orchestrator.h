// kvstash-history's orchestrator: starts the cell and the client processes, runs the nemesis,
// accounts for every page at the end, and checks the clients' histories.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvstash::history {

struct RunConfig {
  double seconds = 60;
  int nodes = 2;
  std::string capacity = "16MiB";
  std::vector<std::string> transports{"shm", "tcp", "ucx"};
  int threads = 2;
  std::uint64_t seed = 0;
  bool nemesis = true;
  // "mixed": pauses, kills and Redis restarts (failovers); "kill": only kill -9 and restart
  // of a node; "redis": only Redis restarts (failovers).
  std::string faults = "mixed";
  std::string redis_mode = "single";  // "sentinel": a master, a replica and a sentinel
  std::string json_path;
  std::string dir;
  std::string rkey_scope;
  std::string policy = "lru";  // the cell's eviction policy
  int avoid_ms = -1;           // passed to the clients
  // The nemesis rests for the last quiet_seconds of every quiet_every seconds (0: never).
  double quiet_seconds = 15;
  double quiet_every = 45;
  // Puts that ran out of their deadline (50 ms..3 s) do not count against the quiet phases:
  // for a host too slow to keep them (the Soft-RoCE lane's emulated guest), not for the cell.
  bool excuse_quiet_timeouts = false;
  std::string netns;  // the namespaces' prefix (scripts/netns-cell); empty: everything on loopback
  int hosts = 5;      // with netns: how many hosts the script made
  // Give each node an NVMe tier: DIR/h<i>.tier (a file system with O_DIRECT), and the nemesis
  // its faults: bytes overwritten or the file cut short under a node, a node restarted over a
  // device that fails its reads (EIO) for a while.
  std::string ssd_dir;
};

// The run `rc` describes, with client processes of the binary at `self`; 0 when every rule
// held.
int run(const RunConfig& rc, const std::string& self);

}  // namespace kvstash::history
