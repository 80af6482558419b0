#include "metadata/catalog.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <charconv>
#include <optional>

#include "common/wire.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {
namespace {

std::string ms(std::chrono::milliseconds d) { return std::to_string(d.count()); }

// A reply element read as a string or an integer, strictly.
std::string_view text_of(const redisReply* r) {
  if (r == nullptr || (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS)) return {};
  return {r->str, r->len};
}

template <typename T>
std::optional<T> number(std::string_view s, int base = 10) {
  T v{};
  if (s.empty()) return std::nullopt;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

std::optional<std::int64_t> integer_of(const redisReply* r) {
  if (r == nullptr) return std::nullopt;
  if (r->type == REDIS_REPLY_INTEGER) return r->integer;
  return number<std::int64_t>(text_of(r));
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

Status corrupt(std::string_view what) {
  std::string msg = "metadata: ";
  msg.append(what);
  return Status::corrupt(std::move(msg));
}

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

// Pages a `size`-byte object spans; `size + page_size - 1` would wrap for a size near 2^64
// (a corrupt record's) and make zero extents look right.
std::uint64_t pages_for(std::uint64_t size, std::uint64_t page_size) {
  return size / page_size + (size % page_size != 0 ? 1 : 0);
}

bool valid_node_id(std::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// Reads a placement from a script's reply: the page size, extents, lease deadline and nodes
// (id, address, key, ...) at the given elements.
Result<Placement> parse_placement(const Reply& r, std::size_t first, std::size_t extents_at,
                                  std::size_t deadline_at, std::size_t nodes_at) {
  Placement p;
  auto ps = integer_of(r.element(first));
  if (!ps || *ps <= 0) return corrupt("the cell has no valid page size");
  p.page_size = static_cast<std::uint64_t>(*ps);
  auto deadline = integer_of(r.element(deadline_at));
  if (!deadline || *deadline <= 0) return corrupt("a lease without a valid deadline");
  p.lease_deadline_ms = *deadline;
  p.extents_text = std::string(text_of(r.element(extents_at)));
  KVSTASH_ASSIGN_OR_RETURN(p.extents, parse_extents(p.extents_text));
  if ((r.size() - nodes_at) % 3 != 0) return corrupt("malformed node list in a placement");
  for (std::size_t i = nodes_at; i < r.size(); i += 3) {
    NodeEndpoint n{std::string(text_of(r.element(i))), std::string(text_of(r.element(i + 1))),
                   std::string(text_of(r.element(i + 2)))};
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

}  // namespace

Status validate_object_key(std::string_view key) {
  if (key.empty()) return Status::invalid_argument("object key is empty");
  if (key.size() > 1024) return Status::invalid_argument("object key is longer than 1024 bytes");
  return {};
}

Result<std::vector<Extent>> parse_extents(std::string_view text) {
  std::vector<Extent> out;
  while (!text.empty()) {
    std::size_t end = text.find(';');
    std::string_view item = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    std::size_t c1 = item.find(','), c2 = item.rfind(',');
    if (c1 == std::string_view::npos || c1 == c2)
      return corrupt("malformed extent '" + std::string(item) + "'");
    auto page = number<std::uint64_t>(item.substr(c1 + 1, c2 - c1 - 1));
    auto gen = number<std::int64_t>(item.substr(c2 + 1));
    Extent e{std::string(item.substr(0, c1)), page.value_or(0), gen.value_or(0)};
    if (!page || !gen || *gen <= 0 || !valid_node_id(e.node)) {
      return corrupt("malformed extent '" + std::string(item) + "'");
    }
    out.push_back(std::move(e));
  }
  return out;
}

Catalog::Catalog(RedisClient& redis, std::string cell) : redis_(redis), prefix_("kvs:{kvs:" + cell + "}") {}

Status Catalog::check_schema() {
  std::string key = prefix_ + ":cell";
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"HGET", key, "schema"}));
  if (r.is_nil()) return {};
  if (r.type() != Reply::Type::kString || number<int>(r.str()) != kSchemaVersion) {
    return corrupt(
        "cell " + prefix_ + " has schema '" + std::string(r.str()) + "', this build reads " +
        std::to_string(kSchemaVersion) +
        " (schema 3 changed how objects are checksummed: empty the cell, or use the build that wrote it)");
  }
  return {};
}

Result<RkeyScope> Catalog::rkey_scope() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"HGET", prefix_ + ":cell", "rkey_scope"}));
  if (r.is_nil()) return RkeyScope::kConnection;
  auto s = r.type() == Reply::Type::kString ? parse_rkey_scope(r.str()) : std::nullopt;
  if (!s) return corrupt("cell " + prefix_ + " has rkey_scope '" + std::string(r.str()) + "'");
  return *s;
}

Status Catalog::set_rkey_scope(RkeyScope scope) {
  return redis_.command({"HSET", prefix_ + ":cell", "rkey_scope", to_string(scope)}).status();
}

Result<std::int64_t> Catalog::register_node(const NodeRecord& n, std::chrono::milliseconds ttl) {
  if (!valid_node_id(n.id)) {
    return Status::invalid_argument("node id must be 1-64 characters of [A-Za-z0-9._-]");
  }
  if (n.epoch.empty()) return Status::invalid_argument("node epoch must be set");
  std::string size = std::to_string(n.page_size), count = std::to_string(n.page_count), t = ms(ttl);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::register_node(), {prefix_},
                                                {n.id, n.epoch, size, count, n.address, n.key, t}));
  auto now = integer_of(r.raw());
  if (!now) return corrupt("unexpected reply to register_node");
  return *now;
}

Result<std::int64_t> Catalog::heartbeat(std::string_view id, std::string_view epoch,
                                        std::chrono::milliseconds ttl, std::int64_t fenced_ms) {
  std::string t = ms(ttl), f = std::to_string(std::max<std::int64_t>(0, fenced_ms));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::heartbeat(), {prefix_}, {id, epoch, t, f}));
  auto now = integer_of(r.raw());
  if (!now) return corrupt("unexpected reply to heartbeat");
  return *now;
}

Result<std::uint64_t> Catalog::drain_node(std::string_view id, std::string_view epoch) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::drain_node(), {prefix_}, {id, epoch}));
  return static_cast<std::uint64_t>(r.integer());
}

Status Catalog::deregister_node(std::string_view id, std::string_view epoch) {
  return redis_.eval(scripts::deregister_node(), {prefix_}, {id, epoch}).status();
}

Result<NodeStatus> Catalog::node_status(std::string_view id) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::node_status(), {prefix_}, {id}));
  if (r.type() != Reply::Type::kArray || r.size() != 8) return corrupt("unexpected reply to node_status");
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
  return s;
}

Result<std::vector<std::string>> Catalog::list_nodes() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::list_nodes(), {prefix_}, {}));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < r.size(); ++i) out.emplace_back(text_of(r.element(i)));
  return out;
}

Result<std::uint64_t> Catalog::free_pages(std::string_view node) {
  KVSTASH_ASSIGN_OR_RETURN(NodeStatus s, node_status(node));
  return s.free_pages;
}

Result<Placement> Catalog::begin_put(std::string_view token, std::string_view key, std::uint64_t size,
                                     std::chrono::milliseconds lease) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  std::string n = std::to_string(size), l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::begin_put(), {prefix_}, {token, key, n, l}));
  if (r.type() != Reply::Type::kArray || r.size() < 3) return corrupt("unexpected reply to begin_put");
  // page_size, extents, deadline, nodes...
  KVSTASH_ASSIGN_OR_RETURN(Placement p, parse_placement(r, 0, 1, 2, 3));
  if (p.extents.size() != pages_for(size, p.page_size)) {
    return corrupt("begin_put returned the wrong number of pages");
  }
  return p;
}

Status Catalog::commit_put(std::string_view token, std::string_view key, const sum::ObjectSum& checksum,
                           std::string_view layout, std::chrono::milliseconds ttl,
                           const std::optional<std::string>& if_version) {
  std::string sum = sum::to_text(checksum), t = ms(ttl);
  // "" unconditional, "!" no object, "=<token>" that object.
  const std::string cond = !if_version ? "" : if_version->empty() ? "!" : "=" + *if_version;
  return redis_.eval(scripts::commit_put(), {prefix_}, {token, key, sum, layout, t, cond}).status();
}

Result<std::uint64_t> Catalog::abort_put(std::string_view token, std::span<const std::string> fenced) {
  std::vector<std::string_view> args{token};
  for (const auto& id : fenced) args.push_back(id);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::abort_put(), {prefix_}, args));
  return static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.integer()));
}

Result<ReadLease> Catalog::begin_get(std::string_view key, std::string_view reader,
                                     std::chrono::milliseconds lease) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  std::string l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::begin_get(), {prefix_}, {key, reader, l}));
  if (r.type() != Reply::Type::kArray || r.size() < 7) return corrupt("unexpected reply to begin_get");
  // page_size, token, size, extents, checksum, layout, deadline, nodes...
  ReadLease g;
  g.object_token = std::string(text_of(r.element(1)));
  auto size = number<std::uint64_t>(text_of(r.element(2)));
  auto sum = sum::parse_object_sum(text_of(r.element(4)));
  if (g.object_token.empty() || !size) {
    return corrupt("object " + std::string(key) + " has a malformed record (size or token)");
  }
  if (!sum) {
    return corrupt("object " + std::string(key) + " has checksum '" + std::string(text_of(r.element(4))) +
                   "', not the \"<hex>/<segment>\" of schema " + std::to_string(kSchemaVersion) +
                   " (written by an older build?)");
  }
  g.size = *size;
  g.checksum = *sum;
  g.layout = std::string(text_of(r.element(5)));
  auto p = parse_placement(r, 0, 3, 6, 7);
  if (!p.is_ok()) return corrupt("object " + std::string(key) + ": " + p.status().message());
  g.placement = std::move(p).value();
  if (g.placement.extents.size() != pages_for(g.size, g.placement.page_size)) {
    return corrupt("object " + std::string(key) + " has " + std::to_string(g.placement.extents.size()) +
                   " extents for " + std::to_string(g.size) + " bytes");
  }
  return g;
}

Status Catalog::end_get(std::string_view reader, const ReadLease& lease) {
  return redis_
      .eval(scripts::end_get(), {prefix_}, {reader, lease.object_token, lease.placement.extents_text})
      .status();
}

Result<ObjectRecord> Catalog::stat(std::string_view key) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::stat(), {prefix_}, {key}));
  if (r.type() != Reply::Type::kArray || r.size() != 7) return corrupt("unexpected reply to stat");
  ObjectRecord o;
  auto size = number<std::uint64_t>(text_of(r.element(0)));
  auto sum = sum::parse_object_sum(text_of(r.element(1)));
  auto ext = parse_extents(text_of(r.element(3)));
  if (!size || !sum || !ext.is_ok()) return corrupt("object " + std::string(key) + " has a malformed record");
  o.size = *size;
  o.checksum = *sum;
  o.layout = std::string(text_of(r.element(2)));
  o.pages = ext->size();
  o.extents = std::move(ext).value();
  o.nodes = split_nodes(text_of(r.element(4)));
  o.ttl_ms = integer_of(r.element(5)).value_or(-1);
  o.version = std::string(text_of(r.element(6)));
  return o;
}

Status Catalog::remove(std::string_view key) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  return redis_.eval(scripts::remove(), {prefix_}, {key}).status();
}

Status Catalog::touch(std::string_view key, std::chrono::milliseconds ttl) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  std::string t = ms(ttl);
  return redis_.eval(scripts::touch(), {prefix_}, {key, t}).status();
}

Result<std::size_t> Catalog::contains_prefix(std::span<const std::string> keys) {
  if (keys.empty()) return std::size_t{0};
  std::vector<std::string_view> args;
  args.reserve(keys.size());
  for (const auto& k : keys) {
    KVSTASH_RETURN_IF_ERROR(validate_object_key(k));
    args.push_back(k);
  }
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::contains_prefix(), {prefix_}, args));
  // Callers index their chunks with it: a count past the keys asked about is a foreign reply.
  if (r.type() != Reply::Type::kInteger || r.integer() < 0 ||
      static_cast<std::uint64_t>(r.integer()) > keys.size()) {
    return corrupt("unexpected reply to contains_prefix");
  }
  return static_cast<std::size_t>(r.integer());
}

Result<EvictCounts> Catalog::evict(std::uint64_t bytes) {
  std::string b = std::to_string(bytes);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::evict(), {prefix_}, {b}));
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to evict");
  return EvictCounts{static_cast<std::uint64_t>(integer_of(r.element(0)).value_or(0)),
                     static_cast<std::uint64_t>(integer_of(r.element(1)).value_or(0))};
}

Result<ReclaimCounts> Catalog::reclaim(std::uint32_t limit) {
  std::string l = std::to_string(limit == 0 ? 1 : limit);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::reclaim(), {prefix_}, {l}));
  if (r.type() != Reply::Type::kArray || r.size() != 8) return corrupt("unexpected reply to reclaim");
  auto at = [&](std::size_t i) { return static_cast<std::uint64_t>(integer_of(r.element(i)).value_or(0)); };
  return ReclaimCounts{at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7) != 0};
}

Result<std::uint64_t> Catalog::cordon_node(std::string_view id) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::cordon_node(), {prefix_}, {id}));
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to cordon_node");
  return static_cast<std::uint64_t>(integer_of(r.element(1)).value_or(0));
}

Result<std::vector<std::string>> Catalog::known_nodes() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::known_nodes(), {prefix_}, {}));
  std::vector<std::string> out;
  for (std::size_t i = 0; i < r.size(); ++i) out.emplace_back(text_of(r.element(i)));
  return out;
}

Result<std::uint64_t> Catalog::forget_node(std::string_view id) {
  auto r = redis_.eval(scripts::forget_node(), {prefix_}, {id});
  if (!r.is_ok()) return r.status();
  return static_cast<std::uint64_t>(integer_of(r->raw()).value_or(0));
}

Result<CellSummary> Catalog::summary() {
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
    const auto v = static_cast<std::uint64_t>(
        std::max<std::int64_t>(0, number<std::int64_t>(text_of(r.element(i + 1))).value_or(0)));
    if (field == "bytes") c.bytes = v;
    if (field == "hits") c.hits = v;
    if (field == "misses") c.misses = v;
    if (field == "evicted") c.evicted = v;
    if (field == "expired") c.expired = v;
  }
  return c;
}

Result<ObjectScan> Catalog::scan_objects(std::string_view pattern, std::string_view cursor,
                                         std::uint32_t count) {
  const std::string head = prefix_ + ":obj:";
  const std::string match = glob_literal(head) + std::string(pattern.empty() ? "*" : pattern);
  const std::string n = std::to_string(count == 0 ? 100 : count);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"SCAN", cursor, "MATCH", match, "COUNT", n}));
  return parse_scan(r, head);
}

Result<ObjectScan> Catalog::scan_node_objects(std::string_view id, std::string_view cursor,
                                              std::uint32_t count) {
  const std::string set = prefix_ + ":objs:" + std::string(id), n = std::to_string(count == 0 ? 100 : count);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"SSCAN", set, cursor, "COUNT", n}));
  return parse_scan(r);
}

Result<std::vector<ObjectInfo>> Catalog::describe(std::span<const std::string> keys, std::int64_t* now_ms) {
  std::vector<std::string_view> args(keys.begin(), keys.end());
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::describe_objects(), {prefix_}, args));
  constexpr std::size_t kFields = 7;
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
      o.nodes = split_nodes(at(4));
      o.checksum = sum::parse_object_sum(at(5));
      o.readers = static_cast<std::uint64_t>(integer_of(r.element(1 + i * kFields + 6)).value_or(0));
    }
    out.push_back(std::move(o));
  }
  return out;
}

Result<std::vector<EvictedObject>> Catalog::evict_lru(std::chrono::milliseconds idle, std::uint64_t max_bytes,
                                                      bool dry_run, std::uint32_t limit,
                                                      std::int64_t* now_ms) {
  const std::string i = ms(idle), b = std::to_string(max_bytes), l = std::to_string(limit == 0 ? 1 : limit);
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

}  // namespace kvstash::metadata
