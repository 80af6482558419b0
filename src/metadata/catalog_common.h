// Internal to src/metadata: what the three catalogs (catalog.h, node_catalog.h, cell_admin.h)
// share. Strict readers of script replies (a malformed or foreign reply is kCorrupt, never a
// crash), and the calls more than one audience makes: the schema check, the cell's rkey
// scope, a node's record, a node's drain. Nothing outside src/metadata includes this file.
//
// Thread safety: the functions keep no state; those taking a RedisClient use it as its own
// contract says (one thread at a time).
#pragma once

#include <span>

#include <hiredis/hiredis.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/object.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"

namespace kvstash::metadata::detail {

// A duration as the scripts take it: whole milliseconds, in decimal.
inline std::string ms(std::chrono::milliseconds d) { return std::to_string(d.count()); }

// A blocking command's timeout as Redis takes it (BLPOP, BRPOP): seconds, to the millisecond,
// at least 1 ms (0 would block for ever).
inline std::string wait_seconds(std::chrono::milliseconds d) {
  const auto m = std::max<std::int64_t>(1, d.count());
  return std::to_string(m / 1000) + "." + std::to_string(1000 + m % 1000).substr(1);
}

// A reply element read as text (a string or a status); empty for anything else.
inline std::string_view text_of(const redisReply* r) {
  if (r == nullptr || (r->type != REDIS_REPLY_STRING && r->type != REDIS_REPLY_STATUS)) return {};
  return {r->str, r->len};
}

// `s` as a number, all of it; nullopt for anything else (empty, trailing bytes, overflow).
template <typename T>
std::optional<T> number(std::string_view s, int base = 10) {
  T v{};
  if (s.empty()) return std::nullopt;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

// A reply element read as an integer reply or as decimal text, strictly.
inline std::optional<std::int64_t> integer_of(const redisReply* r) {
  if (r == nullptr) return std::nullopt;
  if (r->type == REDIS_REPLY_INTEGER) return r->integer;
  return number<std::int64_t>(text_of(r));
}

// kCorrupt with "metadata: " in front of `what`.
Status corrupt(std::string_view what);

// A record's space-separated node list.
std::vector<std::string> split_nodes(std::string_view nodes);

// Reads a placement from a script's reply: the page size, extents, lease deadline and nodes
// (id, address, key, ...) at the given elements. kCorrupt for a malformed one, or one whose
// extents name a node it does not list.
Result<Placement> parse_placement(std::span<const redisReply* const> r, std::size_t first, std::size_t extents_at,
                                  std::size_t deadline_at, std::size_t nodes_at);
// The elements of an array reply (or of an array inside one), for the readers above.
inline std::span<const redisReply* const> items_of(const redisReply* r) {
  if (r == nullptr || r->type != REDIS_REPLY_ARRAY) return {};
  return {const_cast<const redisReply* const*>(r->element), r->elements};
}

// --- Calls more than one audience makes ----------------------------------------------------
// kCorrupt when the cell was written by a schema this build does not know.
Status check_schema(RedisClient& redis, const std::string& prefix);
// The cell's rkey scope (kConnection when unset); kCorrupt for a value this build does not know.
Result<RkeyScope> rkey_scope(RedisClient& redis, const std::string& prefix);
// One node's record (node_status.lua); kNotFound for an unknown node.
Result<NodeStatus> node_status(RedisClient& redis, const std::string& prefix, std::string_view id);
// drain_node.lua: the node takes no new pages and its objects are dropped. Returns how many.
Result<std::uint64_t> drain_node(RedisClient& redis, const std::string& prefix, std::string_view id,
                                 std::string_view epoch);

}  // namespace kvstash::metadata::detail
