// `kvstash-bench peers`: kvstash's p2p rows beside other transfer engines (Mooncake's transfer
// engine, NIXL), measured on the same sizes the same way between two processes on this host.
// The peers run from bench/peers/peer_bench.py with the python of the venv scripts/peers-setup
// makes outside the tree; they are never a build or test dependency.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "kvstash/types.h"

namespace kvstash::bench {

struct PeersOptions {
  std::vector<TransportKind> transports;  // kvstash transports to measure (the CLI's default: tcp, shm)
  std::vector<std::size_t> sizes;         // bytes per request
  std::vector<std::string> engines{"mooncake-tcp", "nixl-ucx", "nixl-ucx-tcp"};  // peer_bench.py's
  double seconds = 0.5;  // measuring time per row, kvstash's and the peers'
  unsigned busy_poll_us = 0;  // kvstash's EngineOptions::busy_poll in both processes (0: off)
  std::string venv;      // the peers' venv (default_peers_venv())
  bool json = false;     // one JSON object per row instead of the table
  std::string plot;      // also draw GB/s over size into this SVG; empty: none
};

// Where scripts/peers-setup puts the venv: $KVSTASH_PEERS_VENV, else ~/.cache/kvstash/peers-venv.
std::string default_peers_venv();

// Measures kvstash (p2p, one thread, batch depth 1) and then each peer engine, and prints one
// table: GB/s per size and op for each, the in-run references, and kvstash's ratio to each peer.
// A peer that is not installed or cannot run here gets a one-line error and the rest runs.
// Returns an exit code: 1 when a kvstash row failed or the plot could not be drawn.
int run_peers(const PeersOptions& options);

}  // namespace kvstash::bench
