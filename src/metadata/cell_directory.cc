#include "metadata/cell_directory.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cstdlib>

#include "metadata/cell.h"
#include "metadata/records.h"

namespace kvstash::metadata {
namespace {

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s.append(s.empty() ? "" : ",").append(n);
  return s;
}

// KEYS[1] the directory; ARGV[1] the new set. The old set becomes `previous` unless it is
// the same set. Returns the epoch.
const Script& set_script() {
  static const Script script(R"(
local old = redis.call('HGET', KEYS[1], 'cells') or ''
if old == ARGV[1] then return tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') end
redis.call('HSET', KEYS[1], 'cells', ARGV[1], 'previous', old)
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
)");
  return script;
}

}  // namespace

std::vector<std::string> CellDirectory::every_cell() const {
  std::vector<std::string> all = cells;
  for (const auto& p : previous) {
    if (std::ranges::find(all, p) == all.end()) all.push_back(p);
  }
  return all;
}

bool valid_cell_name(std::string_view name) { return valid_node_id(name); }

Result<std::vector<std::string>> parse_cell_list(std::string_view text) {
  std::vector<std::string> names;
  for (std::size_t from = 0; from <= text.size() && !text.empty();) {
    const std::size_t comma = std::min(text.find(',', from), text.size());
    std::string name(text.substr(from, comma - from));
    if (!valid_cell_name(name)) {
      return Status::invalid_argument("bad cell name '" + name + "': 1-64 of [A-Za-z0-9._-]");
    }
    if (std::ranges::find(names, name) != names.end()) {
      return Status::invalid_argument("cell '" + name + "' is listed twice");
    }
    names.push_back(std::move(name));
    from = comma + 1;
  }
  return names;
}

Result<std::optional<CellDirectory>> read_cell_directory(RedisClient& redis) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r,
                           redis.command({"HMGET", kCellDirectoryKey, "cells", "previous", "epoch"}));
  if (r.type() != Reply::Type::kArray || r.size() != 3)
    return Status::corrupt("cell directory: malformed reply");
  auto text = [&](std::size_t i) {
    const redisReply* e = r.element(i);
    return e->str != nullptr ? std::string_view(e->str, e->len) : std::string_view();
  };
  if (text(0).empty()) return std::optional<CellDirectory>();
  CellDirectory d;
  auto cells = parse_cell_list(text(0));
  auto previous = parse_cell_list(text(1));
  if (!cells.is_ok() || !previous.is_ok()) {
    return Status::corrupt("cell directory " + std::string(kCellDirectoryKey) + ": " +
                           (cells.is_ok() ? previous.status() : cells.status()).message());
  }
  d.cells = std::move(cells).value();
  d.previous = std::move(previous).value();
  d.epoch = std::strtoll(std::string(text(2)).c_str(), nullptr, 10);
  return std::optional<CellDirectory>(std::move(d));
}

Result<CellDirectory> set_cell_directory(RedisClient& redis, const std::vector<std::string>& cells) {
  if (cells.empty()) return Status::invalid_argument("a cell directory needs at least one cell");
  KVSTASH_ASSIGN_OR_RETURN(auto checked, parse_cell_list(join(cells)));
  const std::string list = join(checked);
  KVSTASH_RETURN_IF_ERROR(redis.eval(set_script(), {kCellDirectoryKey}, {list}).status());
  KVSTASH_ASSIGN_OR_RETURN(auto d, read_cell_directory(redis));
  if (!d) return Status::corrupt("cell directory: gone right after it was written");
  return std::move(*d);
}

Status settle_cell_directory(RedisClient& redis) {
  return redis.command({"HSET", kCellDirectoryKey, "previous", ""}).status();
}

Result<std::string> least_loaded_cell(const RedisOptions& redis) {
  RedisOptions to_directory = redis;
  to_directory.cluster_key = kCellDirectoryKey;
  KVSTASH_ASSIGN_OR_RETURN(auto client, RedisClient::connect(to_directory));
  KVSTASH_ASSIGN_OR_RETURN(auto d, read_cell_directory(*client));
  if (!d)
    return Status::not_found("the Redis holds no cell directory to pick a cell from (kvstash cells set ...)");
  std::string best;
  std::uint64_t best_bytes = 0, best_nodes = 0;
  for (const auto& name : d->cells) {
    CellOptions one;
    one.redis = redis;
    one.cell = name;
    KVSTASH_ASSIGN_OR_RETURN(auto cell, Cell::open(one));
    KVSTASH_ASSIGN_OR_RETURN(auto ids, cell->admin().list_nodes());
    std::uint64_t bytes = 0, nodes = 0;
    for (const auto& id : ids) {
      auto st = cell->admin().node_status(id);
      if (!st.is_ok() || st->state != "up" || st->heartbeat_in_ms < 0) continue;
      ++nodes;
      bytes += st->page_count * st->page_size;
    }
    if (best.empty() || bytes < best_bytes || (bytes == best_bytes && nodes < best_nodes)) {
      best = name;
      best_bytes = bytes;
      best_nodes = nodes;
    }
  }
  return best;
}

}  // namespace kvstash::metadata
