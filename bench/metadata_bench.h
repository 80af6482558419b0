// `kvstash-bench metadata`: what one Redis gives the metadata plane. By default, operations per
// second with N clients next to redis-benchmark on the same Redis (metadata_load_bench.cc); with
// --scripts, how long each script holds Redis in a cell of many objects (metadata_bench.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvstash::bench {

struct MetadataBenchOptions {
  // The server-time table per script instead of the throughput rows.
  bool scripts = false;
  // Throughput: client counts (one group of rows each) and measuring time per group.
  std::vector<int> clients = {1, 4, 16, 64};
  double seconds = 2;
  // --scripts: one-page objects in the cell (100,000 fill in about ten seconds here).
  std::uint64_t objects = 100000;
  // --scripts: the cell's eviction policy (kvstash policy): what each costs per operation.
  std::string policy = "lru";
  bool json = false;
  // Throughput over a Redis Cluster of these shard counts (one master each, a cell per
  // shard, the clients spread over the cells), instead of against one plain redis-server.
  std::vector<int> shards;
  // Throughput: quotas set on the cell first (docs/operations.md, "Quotas"), one over the hot
  // objects, one over the puts' keys, the rest over prefixes no key has; all with room to
  // spare: what the scripts' accounting costs, without eviction.
  int quotas = 0;
  // Instead: the mix at the first client count, with the features turned on one by one in one
  // run (none, grants, quotas, the arc and turn-ttl policies): what each costs an operation.
  bool features = false;
  // Throughput: the kvstash clients reach Redis over TLS (rediss://, throwaway certificates;
  // redis-benchmark's references stay plain): what TLS to Redis costs the metadata plane.
  bool tls = false;
};

// Starts a private redis-server, prints the table (or JSON), stops it; 0 on success.
int run_metadata(const MetadataBenchOptions& options);

// The two modes, each in its own file.
int run_metadata_scripts(const MetadataBenchOptions& options);
int run_metadata_load(const MetadataBenchOptions& options);
int run_metadata_shards(const MetadataBenchOptions& options);

}  // namespace kvstash::bench
