#include "metadata/catalog_common.h"

#include <algorithm>

#include "metadata/scripts.h"

namespace kvstash::metadata::detail {

Status corrupt(std::string_view what) {
  std::string msg = "metadata: ";
  msg.append(what);
  return Status::corrupt(std::move(msg));
}

std::vector<std::string> split_nodes(std::string_view nodes) {
  std::vector<std::string> out;
  while (!nodes.empty()) {
    const std::size_t sp = nodes.find(' ');
    if (sp != 0) out.emplace_back(nodes.substr(0, sp));
    nodes = sp == std::string_view::npos ? std::string_view{} : nodes.substr(sp + 1);
  }
  return out;
}

Result<Placement> parse_placement(std::span<const redisReply* const> r, std::size_t first, std::size_t extents_at,
                                  std::size_t deadline_at, std::size_t nodes_at) {
  if (r.size() < nodes_at || r.size() <= std::max({first, extents_at, deadline_at}))
    return corrupt("a placement with too few fields");
  Placement p;
  auto ps = integer_of(r[first]);
  if (!ps || *ps <= 0) return corrupt("the cell has no valid page size");
  p.page_size = static_cast<std::uint64_t>(*ps);
  auto deadline = integer_of(r[deadline_at]);
  if (!deadline || *deadline <= 0) return corrupt("a lease without a valid deadline");
  p.lease_deadline_ms = *deadline;
  p.extents_text = std::string(text_of(r[extents_at]));
  KVSTASH_ASSIGN_OR_RETURN(p.extents, parse_extents(p.extents_text));
  if ((r.size() - nodes_at) % 4 != 0) return corrupt("malformed node list in a placement");
  for (std::size_t i = nodes_at; i < r.size(); i += 4) {
    NodeEndpoint n{std::string(text_of(r[i])), std::string(text_of(r[i + 1])), std::string(text_of(r[i + 2])),
                   std::string(text_of(r[i + 3]))};
    if (n.address.empty() || n.key.empty()) return corrupt("memory node " + n.id + " has no address or key");
    p.nodes.push_back(std::move(n));
  }
  for (const Extent& e : p.extents) {
    bool known = false;
    for (const auto& n : p.nodes) known = known || n.id == e.node;
    if (!known) return corrupt("an extent names node " + e.node + ", which the object does not list");
  }
  return p;
}

Status check_schema(RedisClient& redis, const std::string& prefix) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis.command({"HGET", prefix + ":cell", "schema"}));
  if (r.is_nil()) return {};
  if (r.type() != Reply::Type::kString || number<int>(r.str()) != kSchemaVersion) {
    return corrupt(
        "cell " + prefix + " has schema '" + std::string(r.str()) + "', this build reads " +
        std::to_string(kSchemaVersion) +
        " (schema 4 keeps free pages and reservations as runs of pages, schema 3 changed how objects are "
        "checksummed: empty the cell, or use the build that wrote it)");
  }
  return {};
}

Result<RkeyScope> rkey_scope(RedisClient& redis, const std::string& prefix) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis.command({"HGET", prefix + ":cell", "rkey_scope"}));
  if (r.is_nil()) return RkeyScope::kConnection;
  auto s = r.type() == Reply::Type::kString ? parse_rkey_scope(r.str()) : std::nullopt;
  if (!s) return corrupt("cell " + prefix + " has rkey_scope '" + std::string(r.str()) + "'");
  return *s;
}

Result<NodeStatus> node_status(RedisClient& redis, const std::string& prefix, std::string_view id) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis.eval(scripts::node_status(), {prefix}, {id}));
  if (r.type() != Reply::Type::kArray || r.size() != 19) return corrupt("unexpected reply to node_status");
  NodeStatus s;
  s.state = std::string(text_of(r.element(0)));
  s.epoch = std::string(text_of(r.element(1)));
  s.page_size = static_cast<std::uint64_t>(integer_of(r.element(2)).value_or(0));
  s.page_count = static_cast<std::uint64_t>(integer_of(r.element(3)).value_or(0));
  s.free_pages = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(4)).value_or(0)));
  s.objects = static_cast<std::uint64_t>(integer_of(r.element(5)).value_or(0));
  std::int64_t deadline = integer_of(r.element(6)).value_or(-1), now = integer_of(r.element(7)).value_or(0);
  // Redis's clock is never negative; with both at least 0 the difference cannot overflow.
  if (now < 0) return corrupt("unexpected reply to node_status (clock)");
  s.heartbeat_in_ms = deadline < 0 ? -1 : deadline - now;
  s.reserved_pages = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(8)).value_or(0)));
  s.limbo_pages = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(9)).value_or(0)));
  s.tier_slots = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(10)).value_or(0)));
  s.tier_free_slots = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(11)).value_or(0)));
  s.tier_objects = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(12)).value_or(0)));
  s.recovery.state = std::string(text_of(r.element(13)));
  std::uint64_t* counts[] = {&s.recovery.found, &s.recovery.checked, &s.recovery.bad, &s.recovery.admitted,
                             &s.recovery.refused};
  for (std::size_t i = 0; i < std::size(counts); ++i) {
    *counts[i] = static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(14 + i)).value_or(0)));
  }
  return s;
}

Result<std::uint64_t> drain_node(RedisClient& redis, const std::string& prefix, std::string_view id,
                                 std::string_view epoch) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis.eval(scripts::drain_node(), {prefix}, {id, epoch}));
  return static_cast<std::uint64_t>(r.integer());
}

}  // namespace kvstash::metadata::detail
