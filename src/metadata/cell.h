// A connection to a cell: one Redis connection, opened from the options every user of a cell
// has (the Redis URL with its ACL user, the password, the timeouts, the cell's name), and the
// catalogs over it, one per audience:
//
//   catalog()       the client's: puts, gets, stat, remove, touch, contains_prefix (catalog.h)
//   node_catalog()  the memory node's: register, heartbeat, reclaim, drain (node_catalog.h)
//   admin()         the operator's: nodes, scans, describe, eviction, cell counters (cell_admin.h)
//
// Users pick the catalog of their audience: the store the client's (through a CellPool,
// cell_pool.h, when several threads need connections), kvstashd the node's, the kvstash CLI
// the operator's (and the client's for show, rm and touch).
//
// Thread safety: as its RedisClient: one thread at a time, for the Cell and every catalog it
// hands out together. The catalogs live as long as the Cell.
#pragma once

#include <memory>
#include <string>

#include "kvstash/status.h"
#include "metadata/catalog.h"
#include "metadata/cell_admin.h"
#include "metadata/node_catalog.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

struct CellOptions {
  // How to reach the cell's Redis: the URL (redis://[user:password@]host:port/db or
  // unix://[user:password@]/path?db=N; an ACL user goes in the URL), a password that overrides
  // the URL's, the connect and command timeouts, the reconnect budget (redis_client.h).
  RedisOptions redis;
  // The cell's name: every key of the cell starts with kvs:{kvs:<cell>}.
  std::string cell = "default";
};

class Cell {
 public:
  // Connects (AUTH, SELECT) and sends nothing else: the schema is checked when the caller
  // asks (check_schema). Errors: RedisClient::connect's (kInvalidArgument for a bad URL,
  // kUnavailable, kPermissionDenied, kTimeout).
  static Result<std::unique_ptr<Cell>> open(const CellOptions& options);
  Cell(const Cell&) = delete;
  Cell& operator=(const Cell&) = delete;

  const std::string& name() const { return name_; }
  // kvs:{kvs:<name>}
  const std::string& prefix() const { return catalog_.prefix(); }

  // kCorrupt when the cell was written by a schema this build does not know; clients and
  // nodes check it before anything else (docs/metadata.md, Versioning).
  Status check_schema();

  RedisClient& redis() { return *redis_; }
  Catalog& catalog() { return catalog_; }
  NodeCatalog& node_catalog() { return node_catalog_; }
  CellAdmin& admin() { return admin_; }

 private:
  Cell(std::unique_ptr<RedisClient> redis, std::string name);

  std::unique_ptr<RedisClient> redis_;  // before the catalogs, which refer to it
  std::string name_;
  Catalog catalog_;
  NodeCatalog node_catalog_;
  CellAdmin admin_;
};

}  // namespace kvstash::metadata
