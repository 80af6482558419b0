// `kvstash-bench p2p`: point-to-point transfer throughput and latency between two processes.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "kvstash/engine.h"
#include "plot.h"

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
  unsigned busy_poll_us = 0;  // EngineOptions::busy_poll of both processes (0: off)
  std::string plot;       // also draw GB/s over size into this SVG (gnuplot); empty: none
  // Also measure tcp over TLS ("tcp+tls" rows, beside the plain "tcp" ones) against a second
  // tcp listener of the target that serves TLS only. A spawned target gets throwaway
  // credentials; a --peer target its own (p2p-target --tls-cert, --tls-key), whose CA is
  // tls_ca.
  bool tls = false;
  std::string tls_ca;
};

// One row of `p2p`: a transfer measured between the two processes, or a reference measured in
// the same run (transport "memcpy", op "copy"; transport "tcp-socket", op "stream").
struct P2PRow {
  std::string transport;
  std::string op;
  std::size_t size = 0;
  unsigned threads = 1, depth = 1;
  double gbps = 0, p50_us = 0, p99_us = 0;
  double memcpy_gbps = 0, socket_gbps = 0;  // this size's references (transfer rows)
  double pingpong_us = 0;                   // the raw socket round trip of this size (up to 64 KiB)
  double cpu_us_per_op = 0;                 // CPU of both processes per request (0: target not ours)
  bool verified = false;                    // the bytes were written, read back and compared
  std::string error;                        // non-empty: the row was not measured
  bool reference() const { return op == "copy" || op == "stream" || op == "pingpong"; }
};

// Runs the initiator against the target it spawns (this executable, `p2p-target`) or the one in
// options.peer_file: per size the two references, then per transport, size and op a transfer
// row, each passed to on_row as soon as it is measured. Returns every row (failed ones carry
// their error), or the error that stopped the run before any row: no target, no valid lines from
// it, no engine to probe. Blocks for the whole run.
Result<std::vector<P2PRow>> measure_p2p(const P2POptions& options,
                                        const std::function<void(const P2PRow&)>& on_row = {});

// `p2p` row as the one-line JSON object `p2p --json` prints.
std::string to_json_line(const P2PRow& row);

// The rows as plot lines: one solid line per transport and op, one dashed per reference.
std::vector<PlotSeries> p2p_plot_series(const std::vector<P2PRow>& rows);

// Runs measure_p2p and prints its rows (a table, or JSON), then the plot if asked for. Returns an
// exit code: 1 when any row failed or the plot could not be drawn.
int run_p2p(const P2POptions& options);

// The target: serves one region over every transport plus the raw socket sink, prints
// "address HEX", "key HEX", "socket HOST:PORT", and exits when stdin closes. The sink binds
// the host of tcp.listen. A non-empty cluster_token is required from initiators. With
// tcp.tls.cert_file it also serves the region over a second tcp listener (same host, any
// port) that speaks TLS only, and prints its "tls-address HEX" and "tls-key HEX" too.
int run_p2p_target(std::size_t region_bytes, const std::vector<TransportKind>& transports,
                   const TcpOptions& tcp, const std::string& cluster_token, unsigned busy_poll_us = 0);

}  // namespace kvstash::bench
