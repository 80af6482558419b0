// The memory node's catalog: how a node (kvstashd, src/node/memory_node.h) keeps its place in
// a cell (docs/metadata.md). It registers its pool under a fresh epoch, heartbeats with the
// fence it has made, runs the cell's reclaim sweep, reads its own record for its metrics, and
// drains and deregisters when it stops.
//
// Its audience is the memory node; the client's scripts are in catalog.h, the operator's in
// cell_admin.h, and metadata::Cell (cell.h) hands out all three over one connection. Every
// call is one Lua script, atomic, timed by Redis's clock; replies are parsed defensively
// (kCorrupt for anything malformed).
//
// Thread safety: as the RedisClient it uses (one thread at a time); every call blocks on one
// Redis round trip (two when Redis had to load the script).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "metadata/records.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

class NodeCatalog {
 public:
  // Over `redis`, which must outlive it; `cell` names the cell (key prefix kvs:{kvs:<cell>}).
  explicit NodeCatalog(RedisClient& redis, std::string cell = "default");

  const std::string& prefix() const { return prefix_; }

  // Creates or refreshes a node. A new epoch drops the objects of the previous incarnation
  // and resets its pool: the caller guarantees that nothing granted under an earlier epoch
  // can still write into the pool (a new process, or the pool deregistered from every
  // transport first). Returns Redis's clock (ms). Errors: kInvalidArgument (bad id, page size
  // differs from the cell's, zero pages), Redis errors.
  Result<std::int64_t> register_node(const NodeRecord& node, std::chrono::milliseconds heartbeat_ttl);
  // Keeps a node alive for `ttl` more and records that it has fenced every lease whose tag
  // (a put's or read's Redis deadline) is at most `fenced_ms`. Returns Redis's clock (ms).
  // kStale when it must register again (another epoch, or its deadline passed). With
  // `next_grant_key` (hex) the cell signs the node's grants with it from now on, naming it
  // `key_word` (`<epoch>/<generation>`; kInvalidArgument otherwise).
  Result<std::int64_t> heartbeat(std::string_view id, std::string_view epoch, std::chrono::milliseconds ttl,
                                 std::int64_t fenced_ms, std::string_view next_grant_key = {},
                                 std::string_view key_word = {});
  // The node takes no new pages and its objects are dropped. Returns how many.
  Result<std::uint64_t> drain_node(std::string_view id, std::string_view epoch);
  // The node leaves the cell (after drain_node).
  Status deregister_node(std::string_view id, std::string_view epoch);
  // The node's record (its free pages and objects for its metrics); kNotFound for an unknown id.
  Result<NodeStatus> node_status(std::string_view id);

  // One bounded sweep of the cell (expired objects, abandoned puts, zombies, dead nodes; at
  // most `limit` items of each kind, so that Redis is held about a millisecond); run it again
  // while the result says `more`. Every node runs it, so pages come back with no client.
  Result<ReclaimCounts> reclaim(std::uint32_t limit = 32);

 private:
  RedisClient& redis_;
  std::string prefix_;  // kvs:{kvs:<cell>}
};

}  // namespace kvstash::metadata
