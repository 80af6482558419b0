// The cell directory: which cells a deployment of several has, kept in Redis for clients
// (StoreOptions::cell_directory), memory nodes (kvstashd --cell auto) and the CLI (`kvstash
// cells`) to read. One hash, `kvs:{kvs-directory}:cells` (its own hash tag: in a Redis Cluster
// it lives in one slot, apart from every cell's):
//
//   cells     the cells new puts route to, comma-separated
//   previous  the cells before the last change: gets look in their choice first, until an
//             operator settles the change (the old cells drained: their objects expired, were
//             evicted or removed); empty when settled
//   epoch     bumped by every change
//
// Changing the set moves no bytes: rendezvous hashing sends a key to a new cell only when the
// new cell wins it (metadata/cell_routes.h).
//
// Thread safety: as the RedisClient passed in.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata {

inline constexpr std::string_view kCellDirectoryKey = "kvs:{kvs-directory}:cells";

struct CellDirectory {
  std::vector<std::string> cells;
  std::vector<std::string> previous;
  std::int64_t epoch = 0;

  // `cells`, then the cells of `previous` not among them: every cell that may hold objects.
  std::vector<std::string> every_cell() const;
};

// A cell name a directory accepts: 1-64 of [A-Za-z0-9._-].
bool valid_cell_name(std::string_view name);

// "a,b,c" into names; kInvalidArgument naming a bad one (or a repeated one).
Result<std::vector<std::string>> parse_cell_list(std::string_view text);

// The directory; nullopt when the Redis holds none (a deployment of one cell). kCorrupt when
// the hash is malformed.
Result<std::optional<CellDirectory>> read_cell_directory(RedisClient& redis);

// Makes `cells` the directory's set; the set it replaces becomes `previous` (replacing an
// unsettled one). Returns the new directory. kInvalidArgument for an empty or bad set.
Result<CellDirectory> set_cell_directory(RedisClient& redis, const std::vector<std::string>& cells);

// Forgets `previous`: gets look only in the current set's choice from now on.
Status settle_cell_directory(RedisClient& redis);

// The cell of the directory (its current set) whose live nodes donate the least memory (ties:
// fewer live nodes, then the first listed): where `kvstashd --cell auto` joins. `redis` is how
// to reach the Redis (its cluster_key is set here). kNotFound without a directory.
Result<std::string> least_loaded_cell(const RedisOptions& redis);

}  // namespace kvstash::metadata
