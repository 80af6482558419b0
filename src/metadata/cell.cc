#include "metadata/cell.h"

#include "common/log.h"
#include "metadata/catalog_common.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {
namespace {

// On each connection to a master through Sentinel or in a Cluster, before anything else: tells
// the cell which master it reached (fence_master.lua), so that the first connection to a new
// master after a failover declares the cell's nodes dead before any lease or page of the new
// master is used.
Status fence_new_master(const RedisOptions::Command& run, const std::string& prefix) {
  KVSTASH_ASSIGN_OR_RETURN(Reply info, run({"INFO", "replication"}));
  constexpr std::string_view kField = "master_replid:";
  const std::string_view text = info.str();
  const auto at = text.find(kField);
  if (at == std::string_view::npos) return Status::corrupt("redis: INFO replication names no master_replid");
  const auto from = at + kField.size();
  const std::string_view replid = text.substr(from, text.find_first_of("\r\n", from) - from);
  Result<Reply> fenced = eval_with(run, scripts::fence_master(), {prefix}, {replid});
  if (!fenced.is_ok()) return fenced.status().with_context("redis: fencing the cell against its master");
  if (fenced->integer() == 1) {
    KVSTASH_LOG_WARN("redis: cell {} reached a new master (a failover): its memory nodes register again", prefix);
  }
  return {};
}

}  // namespace

Result<std::unique_ptr<Cell>> Cell::open(const CellOptions& options) {
  RedisOptions redis = options.redis;
  KVSTASH_ASSIGN_OR_RETURN(RedisUrl url, RedisUrl::parse(redis.url));
  // Behind Sentinel or in a Cluster, the master can change, and a replica promoted may have
  // missed the newest writes: each connection to a master checks it is the one the cell knew.
  if (url.sentinel() || url.cluster()) {
    redis.on_connect = [prefix = cell_prefix(options.cell)](const RedisOptions::Command& run) {
      return fence_new_master(run, prefix);
    };
  }
  // In a Cluster, the cell lives in its hash tag's slot: the connection follows that slot.
  if (url.cluster()) redis.cluster_key = cell_prefix(options.cell);
  KVSTASH_ASSIGN_OR_RETURN(auto redis_client, RedisClient::connect(redis));
  return std::unique_ptr<Cell>(new Cell(std::move(redis_client), options.cell));
}

Cell::Cell(std::unique_ptr<RedisClient> redis, std::string name)
    : redis_(std::move(redis)),
      name_(std::move(name)),
      catalog_(*redis_, name_),
      node_catalog_(*redis_, name_),
      admin_(*redis_, name_) {}

Status Cell::check_schema() { return detail::check_schema(*redis_, prefix()); }

}  // namespace kvstash::metadata
