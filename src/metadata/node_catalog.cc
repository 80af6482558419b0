#include "metadata/node_catalog.h"

#include <algorithm>

#include "metadata/catalog_common.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {

using detail::corrupt;
using detail::integer_of;
using detail::ms;

NodeCatalog::NodeCatalog(RedisClient& redis, std::string cell) : redis_(redis), prefix_(cell_prefix(cell)) {}

Result<std::int64_t> NodeCatalog::register_node(const NodeRecord& n, std::chrono::milliseconds ttl) {
  if (!valid_node_id(n.id)) {
    return Status::invalid_argument("node id must be 1-64 characters of [A-Za-z0-9._-]");
  }
  if (n.epoch.empty()) return Status::invalid_argument("node epoch must be set");
  std::string size = std::to_string(n.page_size), count = std::to_string(n.page_count), t = ms(ttl);
  std::string slots = std::to_string(n.tier_slots), low = std::to_string(n.tier_low_water);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::register_node(), {prefix_},
                                                {n.id, n.epoch, size, count, n.address, n.key, t, n.grant_key,
                                                 slots, low, n.tier_id}));
  auto now = integer_of(r.raw());
  if (!now) return corrupt("unexpected reply to register_node");
  return *now;
}

Result<std::int64_t> NodeCatalog::heartbeat(std::string_view id, std::string_view epoch,
                                            std::chrono::milliseconds ttl, std::int64_t fenced_ms,
                                            std::string_view next_grant_key, std::string_view key_word) {
  std::string t = ms(ttl), f = std::to_string(std::max<std::int64_t>(0, fenced_ms));
  KVSTASH_ASSIGN_OR_RETURN(
      Reply r, redis_.eval(scripts::heartbeat(), {prefix_}, {id, epoch, t, f, next_grant_key, key_word}));
  auto now = integer_of(r.raw());
  if (!now) return corrupt("unexpected reply to heartbeat");
  return *now;
}

Result<std::uint64_t> NodeCatalog::drain_node(std::string_view id, std::string_view epoch) {
  return detail::drain_node(redis_, prefix_, id, epoch);
}

Status NodeCatalog::deregister_node(std::string_view id, std::string_view epoch) {
  return redis_.eval(scripts::deregister_node(), {prefix_}, {id, epoch}).status();
}

Result<NodeStatus> NodeCatalog::node_status(std::string_view id) {
  return detail::node_status(redis_, prefix_, id);
}

Result<ReclaimCounts> NodeCatalog::reclaim(std::uint32_t limit) {
  std::string l = std::to_string(limit == 0 ? 1 : limit);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::reclaim(), {prefix_}, {l}));
  if (r.type() != Reply::Type::kArray || r.size() != 8) return corrupt("unexpected reply to reclaim");
  auto at = [&](std::size_t i) { return static_cast<std::uint64_t>(integer_of(r.element(i)).value_or(0)); };
  return ReclaimCounts{at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7) != 0};
}

}  // namespace kvstash::metadata
