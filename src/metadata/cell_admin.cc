#include "metadata/cell_admin.h"

#include <algorithm>
#include <charconv>

#include "metadata/catalog_common.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {
namespace {

using detail::corrupt;
using detail::integer_of;
using detail::number;
using detail::text_of;

// `text` with SCAN's glob characters escaped, so that it matches itself only.
std::string glob_literal(std::string_view text) {
  std::string out;
  for (char ch : text) {
    if (ch == '*' || ch == '?' || ch == '[' || ch == ']' || ch == '\\') out += '\\';
    out += ch;
  }
  return out;
}

// A SCAN or SSCAN reply: the next cursor and the members, each with `strip` removed from its
// front (members without it are skipped).
Result<ObjectScan> parse_scan(const Reply& r, std::string_view strip = {}) {
  if (r.type() != Reply::Type::kArray || r.size() != 2 || r.element(1)->type != REDIS_REPLY_ARRAY) {
    return corrupt("unexpected reply to a SCAN");
  }
  ObjectScan out;
  out.cursor = std::string(text_of(r.element(0)));
  const redisReply* members = r.element(1);
  for (std::size_t i = 0; i < members->elements; ++i) {
    const std::string_view m = text_of(members->element[i]);
    if (m.size() > strip.size() && m.substr(0, strip.size()) == strip)
      out.keys.emplace_back(m.substr(strip.size()));
  }
  return out;
}

std::vector<std::string> ids_of(const Reply& r) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < r.size(); ++i) out.emplace_back(text_of(r.element(i)));
  return out;
}

}  // namespace

CellAdmin::CellAdmin(RedisClient& redis, std::string cell) : redis_(redis), prefix_(cell_prefix(cell)) {}

Result<CellSummary> CellAdmin::summary() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::cell_summary(), {prefix_}, {}));
  if (r.type() != Reply::Type::kArray || r.size() < 3 || r.size() % 2 != 1) {
    return corrupt("unexpected reply to cell_summary");
  }
  CellSummary c;
  c.page_size = static_cast<std::uint64_t>(integer_of(r.element(0)).value_or(0));
  c.objects = static_cast<std::uint64_t>(integer_of(r.element(1)).value_or(0));
  c.now_ms = integer_of(r.element(2)).value_or(0);
  for (std::size_t i = 3; i + 1 < r.size(); i += 2) {
    const std::string_view field = text_of(r.element(i));
    // P:stats' counters come as text, the tier's sums as integers.
    const auto v =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, integer_of(r.element(i + 1)).value_or(0)));
    if (field == "bytes") c.bytes = v;
    if (field == "hits") c.hits = v;
    if (field == "misses") c.misses = v;
    if (field == "evicted") c.evicted = v;
    if (field == "expired") c.expired = v;
    if (field == "tier_objects") c.tier_objects = v;
    if (field == "tier_slots") c.tier_slots = v;
    if (field == "tier_free") c.tier_free_slots = v;
    if (field == "written_down") c.written_down = v;
    if (field == "promoted") c.promoted = v;
    if (field == "tier_hits") c.tier_hits = v;
    if (field == "tier_evicted") c.tier_evicted = v;
    if (field == "tier_lost") c.tier_lost = v;
  }
  return c;
}

namespace {

Result<EvictionPolicyState> policy_state_of(const Reply& r) {
  if (r.type() != Reply::Type::kArray || r.size() != 9) return corrupt("unexpected reply to set_policy");
  const auto real = [&](std::size_t i) {
    const std::string_view text = text_of(r.element(i));
    double x = 0;
    return std::from_chars(text.data(), text.data() + text.size(), x).ec == std::errc() ? x : 0.0;
  };
  EvictionPolicyState p;
  p.name = std::string(text_of(r.element(0)));
  p.t1 = static_cast<std::uint64_t>(integer_of(r.element(1)).value_or(0));
  p.t2 = static_cast<std::uint64_t>(integer_of(r.element(2)).value_or(0));
  p.b1 = static_cast<std::uint64_t>(integer_of(r.element(3)).value_or(0));
  p.b2 = static_cast<std::uint64_t>(integer_of(r.element(4)).value_or(0));
  p.t1_target = real(5);
  p.ordered = static_cast<std::uint64_t>(integer_of(r.element(6)).value_or(0));
  p.ghosts = static_cast<std::uint64_t>(integer_of(r.element(7)).value_or(0));
  p.clock_rate = real(8);
  return p;
}

}  // namespace

Result<EvictionPolicyState> CellAdmin::policy() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::set_policy(), {prefix_}, {std::string_view()}));
  return policy_state_of(r);
}

Result<EvictionPolicyState> CellAdmin::set_policy(std::string_view name, double clock_rate) {
  if (!(clock_rate > 0)) return Status::invalid_argument("set_policy: the clock rate must be above 0");
  const std::string rate = std::to_string(clock_rate);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::set_policy(), {prefix_}, {name, rate}));
  return policy_state_of(r);
}

Result<RkeyScope> CellAdmin::rkey_scope() { return detail::rkey_scope(redis_, prefix_); }

Status CellAdmin::set_rkey_scope(RkeyScope scope) {
  return redis_.command({"HSET", prefix_ + ":cell", "rkey_scope", to_string(scope)}).status();
}

Result<std::vector<std::string>> CellAdmin::known_nodes() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::known_nodes(), {prefix_}, {}));
  return ids_of(r);
}

Result<std::vector<std::string>> CellAdmin::list_nodes() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::list_nodes(), {prefix_}, {}));
  return ids_of(r);
}

Result<NodeStatus> CellAdmin::node_status(std::string_view id) {
  return detail::node_status(redis_, prefix_, id);
}

Result<std::uint64_t> CellAdmin::free_pages(std::string_view node) {
  KVSTASH_ASSIGN_OR_RETURN(NodeStatus s, node_status(node));
  return s.free_pages;
}

Result<std::uint64_t> CellAdmin::cordon_node(std::string_view id) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::cordon_node(), {prefix_}, {id}));
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to cordon_node");
  return static_cast<std::uint64_t>(integer_of(r.element(1)).value_or(0));
}

Result<std::uint64_t> CellAdmin::drain_node(std::string_view id, std::string_view epoch) {
  return detail::drain_node(redis_, prefix_, id, epoch);
}

Result<std::uint64_t> CellAdmin::forget_node(std::string_view id) {
  auto r = redis_.eval(scripts::forget_node(), {prefix_}, {id});
  if (!r.is_ok()) return r.status();
  return static_cast<std::uint64_t>(integer_of(r->raw()).value_or(0));
}

Result<ObjectScan> CellAdmin::scan_objects(std::string_view pattern, std::string_view cursor,
                                           std::uint32_t count) {
  const std::string head = prefix_ + ":obj:";
  const std::string match = glob_literal(head) + std::string(pattern.empty() ? "*" : pattern);
  const std::string n = std::to_string(count == 0 ? 100 : count);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"SCAN", cursor, "MATCH", match, "COUNT", n}));
  return parse_scan(r, head);
}

Result<ObjectScan> CellAdmin::scan_node_objects(std::string_view id, std::string_view cursor,
                                                std::uint32_t count) {
  const std::string set = prefix_ + ":objs:" + std::string(id), n = std::to_string(count == 0 ? 100 : count);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"SSCAN", set, cursor, "COUNT", n}));
  return parse_scan(r);
}

Result<std::vector<ObjectInfo>> CellAdmin::describe(std::span<const std::string> keys, std::int64_t* now_ms) {
  std::vector<std::string_view> args(keys.begin(), keys.end());
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::describe_objects(), {prefix_}, args));
  constexpr std::size_t kFields = 8;
  if (r.type() != Reply::Type::kArray || r.size() != 1 + kFields * keys.size()) {
    return corrupt("unexpected reply to describe_objects");
  }
  if (now_ms != nullptr) *now_ms = integer_of(r.element(0)).value_or(0);
  std::vector<ObjectInfo> out;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto at = [&](std::size_t f) { return text_of(r.element(1 + i * kFields + f)); };
    ObjectInfo o;
    o.key = keys[i];
    o.exists = !at(0).empty();
    if (o.exists) {
      auto size = number<std::uint64_t>(at(0));
      if (!size) return corrupt("object " + keys[i] + " has a malformed record");
      o.size = *size;
      o.created_ms = number<std::int64_t>(at(1)).value_or(0);
      o.expires_ms = number<std::int64_t>(at(2)).value_or(0);
      o.last_access_ms = number<std::int64_t>(at(3)).value_or(0);
      o.nodes = detail::split_nodes(at(4));
      o.checksum = sum::parse_object_sum(at(5));
      o.readers = static_cast<std::uint64_t>(integer_of(r.element(1 + i * kFields + 6)).value_or(0));
      o.tier = std::string(at(7));
    }
    out.push_back(std::move(o));
  }
  return out;
}

Result<std::vector<EvictedObject>> CellAdmin::evict_lru(std::chrono::milliseconds idle,
                                                        std::uint64_t max_bytes, bool dry_run,
                                                        std::uint32_t limit, std::int64_t* now_ms) {
  const std::string i = detail::ms(idle), b = std::to_string(max_bytes),
                    l = std::to_string(limit == 0 ? 1 : limit);
  KVSTASH_ASSIGN_OR_RETURN(Reply r,
                           redis_.eval(scripts::evict_lru(), {prefix_}, {i, b, dry_run ? "1" : "0", l}));
  if (r.type() != Reply::Type::kArray || r.size() % 3 != 1) return corrupt("unexpected reply to evict_lru");
  if (now_ms != nullptr) *now_ms = integer_of(r.element(0)).value_or(0);
  std::vector<EvictedObject> out;
  for (std::size_t k = 1; k + 2 < r.size(); k += 3) {
    out.push_back({std::string(text_of(r.element(k))),
                   number<std::uint64_t>(text_of(r.element(k + 1))).value_or(0),
                   integer_of(r.element(k + 2)).value_or(0)});
  }
  return out;
}

Result<EvictCounts> CellAdmin::evict(std::uint64_t bytes) {
  std::string b = std::to_string(bytes);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::evict(), {prefix_}, {b}));
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to evict");
  return EvictCounts{static_cast<std::uint64_t>(integer_of(r.element(0)).value_or(0)),
                     static_cast<std::uint64_t>(integer_of(r.element(1)).value_or(0))};
}

}  // namespace kvstash::metadata
