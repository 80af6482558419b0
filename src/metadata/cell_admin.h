// The operator's catalog: looking at a cell and acting on it as a whole (the kvstash CLI,
// docs/cli.md). Nodes (list, records, cordon, release, forget), objects without touching them
// (scan, describe), the cell's counters, eviction on request and the cell's rkey scope.
// Looking never changes what it looks at: describe takes no read lease and touches no LRU
// place.
//
// Its audience is the operator; the client's scripts are in catalog.h (the CLI's show, rm and
// touch use those), the memory node's in node_catalog.h, and metadata::Cell (cell.h) hands
// out all three over one connection. Changes go through the cell's Lua scripts only (atomic,
// timed by Redis's clock); replies are parsed defensively (kCorrupt for anything malformed).
//
// Thread safety: as the RedisClient it uses (one thread at a time); every call blocks on one
// Redis round trip (two when Redis had to load the script).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/object.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

class CellAdmin {
 public:
  // Over `redis`, which must outlive it; `cell` names the cell (key prefix kvs:{kvs:<cell>}).
  explicit CellAdmin(RedisClient& redis, std::string cell = "default");

  const std::string& prefix() const { return prefix_; }

  // --- The cell ------------------------------------------------------------------------
  Result<CellSummary> summary();
  // The cell's rkey scope (kConnection when unset); kCorrupt for a value this build does not
  // know. set_rkey_scope changes it for clients that open their store from then on.
  Result<RkeyScope> rkey_scope();
  Status set_rkey_scope(RkeyScope scope);
  // The cell's eviction policy (docs/operations.md, "Choosing an eviction policy") and its
  // state; set_policy changes it ("lru", "arc" or "turn-ttl"; kInvalidArgument for another)
  // and returns the state after. `clock_rate`: turn-ttl's seconds per second of Redis time (a
  // replay that runs a trace `clock_rate` times as fast keeps the policy's times the trace's).
  Result<EvictionPolicyState> policy();
  Result<EvictionPolicyState> set_policy(std::string_view name, double clock_rate = 1);

  // --- Nodes ---------------------------------------------------------------------------
  // Every node the cell knows (live, draining, dead, not yet forgotten), sorted.
  Result<std::vector<std::string>> known_nodes();
  // The nodes in the cell's heartbeat set (alive or past their deadline, not yet reclaimed).
  Result<std::vector<std::string>> list_nodes();
  // One node's record; kNotFound for an unknown node.
  Result<NodeStatus> node_status(std::string_view id);
  // Free pages of one node. kNotFound for an unknown node.
  Result<std::uint64_t> free_pages(std::string_view node);
  // An operator's drain: no new pages on the node, its objects stay until they leave on
  // their own. Returns the node's object count; kNotFound for an unknown node.
  Result<std::uint64_t> cordon_node(std::string_view id);
  // Releases the objects of the node's incarnation `epoch` now (kvstash drain --release; what
  // the node does itself when it leaves: NodeCatalog::drain_node). Returns how many.
  Result<std::uint64_t> drain_node(std::string_view id, std::string_view epoch);
  // Drops what a dead node left behind (its objects are released). Returns how many objects;
  // kNotFound for an unknown node, kInvalidArgument while it is alive.
  Result<std::uint64_t> forget_node(std::string_view id);

  // --- Objects -------------------------------------------------------------------------
  // One SCAN step over object keys matching the glob `pattern` ("*" for all), from `cursor`
  // ("0" to start); `count` is SCAN's hint.
  Result<ObjectScan> scan_objects(std::string_view pattern, std::string_view cursor, std::uint32_t count);
  // One SSCAN step over the keys of the objects with a page on node `id`.
  Result<ObjectScan> scan_node_objects(std::string_view id, std::string_view cursor, std::uint32_t count);
  // Objects by key, in order; a key without an object has exists = false. `now_ms`, when
  // given, receives Redis's clock.
  Result<std::vector<ObjectInfo>> describe(std::span<const std::string> keys, std::int64_t* now_ms = nullptr);
  // Least recently used objects no reader leases, idle for at least `idle` (0: any), until
  // `max_bytes` (0: no bound) or `limit` objects are chosen; released unless `dry_run`.
  Result<std::vector<EvictedObject>> evict_lru(std::chrono::milliseconds idle, std::uint64_t max_bytes,
                                               bool dry_run, std::uint32_t limit,
                                               std::int64_t* now_ms = nullptr);
  // Makes `bytes` of room: evicts unleased objects, in the order of the cell's policy, until
  // that much came free (all or nothing).
  Result<EvictCounts> evict(std::uint64_t bytes);

 private:
  RedisClient& redis_;
  std::string prefix_;  // kvs:{kvs:<cell>}
};

}  // namespace kvstash::metadata
