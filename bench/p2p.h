// `kvstash-bench p2p`: point-to-point transfer throughput and latency between two processes.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "kvstash/engine.h"

namespace kvstash::bench {

struct P2POptions {
  std::vector<TransportKind> transports;  // empty: every transport built in
  std::vector<std::size_t> sizes;         // bytes per request
  std::vector<TransferOp> ops{TransferOp::kWrite, TransferOp::kRead};
  unsigned threads = 1;   // initiator threads submitting concurrently
  unsigned depth = 1;     // requests per batch (in flight per thread)
  double seconds = 0.5;   // measuring time per row
  bool json = false;      // one JSON object per row instead of a table
  std::string token;      // cluster token for tcp
  TcpOptions tcp;         // streams, io threads and slice size for both processes
  ShmOptions shm;         // copy threads and slice size of the initiator
  std::string peer_file;  // read a running p2p-target's three lines from here ("-": stdin)
};

// Runs the initiator and spawns the target (this executable, `p2p-target`). Returns an exit code.
int run_p2p(const P2POptions& options);

// The target: serves one region over every transport plus the raw socket sink, prints
// "address HEX", "key HEX", "socket HOST:PORT", and exits when stdin closes. The sink binds
// the host of tcp.listen. A non-empty cluster_token is required from initiators.
int run_p2p_target(std::size_t region_bytes, const std::vector<TransportKind>& transports,
                   const TcpOptions& tcp, const std::string& cluster_token);

}  // namespace kvstash::bench
