// Private to `kvstash-bench store`: its rows and the class that measures each backend
// (store_bench.cc: the Store and the output; store_redis_bench.cc: the Redis-bytes baseline).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvstash/store.h"
#include "measure.h"
#include "sessions.h"
#include "store_bench.h"

namespace kvstash::bench {

struct OpStats {
  std::vector<double> latency_us;      // one per operation
  std::vector<double> metadata_us;     // kvstash: time in Redis round trips, per operation
  std::uint64_t round_trips = 0;       // kvstash: Redis round trips, summed
  std::uint64_t node_round_trips = 0;  // kvstash: lease exchanges with memory nodes, summed
  std::vector<double> node_us;         // kvstash: time in them, per operation
  std::uint64_t bytes = 0;
  double seconds = 0;  // summed over the operations: the ops run one after another
  // kvstash: this client's heap and stacks (RssAnon) after its rounds, store still open.
  std::uint64_t client_anon_bytes = 0;
};

struct Row {
  std::string backend;
  std::string op;  // "put", "get"
  bool kvstash = false;
  OpStats stats;
  bool verified = false;
  std::string error;    // the run failed (exit code 1)
  std::string skipped;  // not measured, and why (not a failure)
};

inline double gbps(const OpStats& s) {
  return s.seconds > 0 ? static_cast<double>(s.bytes) / s.seconds / 1e9 : 0;
}

class StoreBench {
 public:
  StoreBench(const StoreBenchOptions& o, Sessions& sessions) : o_(o), s_(sessions), progress_(!o.json) {}

  std::pair<Row, Row> measure_redis(const std::string& url, std::uint64_t backend_index);
  std::pair<Row, Row> measure_store(const std::string& backend, TransportKind kind, const StoreOptions& so,
                                    std::uint64_t backend_index);
  void print(const Row& r, const std::optional<double>& redis_gbps);
  // Single-core memcpy of one session's bytes, measured in this run: the shm rows' limit.
  void set_memcpy_gbps(double g) { memcpy_gbps_ = g; }
  // The largest RssAnon seen after a backend's rounds.
  std::uint64_t client_anon() const { return client_anon_; }

 private:
  const StoreBenchOptions& o_;
  Sessions& s_;
  Progress progress_;
  double memcpy_gbps_ = 0;
  std::uint64_t client_anon_ = 0;
};

}  // namespace kvstash::bench
