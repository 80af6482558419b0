#include "metadata/catalog.h"

#include <algorithm>
#include <charconv>

#include "metadata/catalog_common.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {

using detail::corrupt;
using detail::integer_of;
using detail::ms;
using detail::number;
using detail::text_of;

Catalog::Catalog(RedisClient& redis, std::string cell) : redis_(redis), prefix_(cell_prefix(cell)) {}

Status Catalog::check_schema() { return detail::check_schema(redis_, prefix_); }

Result<RkeyScope> Catalog::rkey_scope() { return detail::rkey_scope(redis_, prefix_); }

namespace {

// The script's arguments `args`, then the nodes to avoid: id, pool key, id, pool key...
std::vector<std::string_view> with_avoided(std::vector<std::string_view> args,
                                           std::span<const NodeEndpoint> avoid) {
  for (const NodeEndpoint& n : avoid) {
    args.push_back(n.id);
    args.push_back(n.key);
  }
  return args;
}

// What a commit script replies once the object is published: OK, or this when the commit's
// event data was recorded too (lua/prelude/publish.lua, committed_reply).
constexpr std::string_view kAnnounced = "OK announced";

// One status per item of a script that answers per item (end_gets, commit_reserveds): OK (or
// kAnnounced), or the text an error reply would have carried.
Result<std::vector<Status>> statuses_of(const Reply& r, std::size_t items, std::string_view script,
                                        std::vector<bool>* announced = nullptr) {
  if (r.type() != Reply::Type::kArray || r.size() != items)
    return corrupt("unexpected reply to " + std::string(script));
  std::vector<Status> out;
  out.reserve(items);
  if (announced != nullptr) announced->assign(items, false);
  for (std::size_t i = 0; i < items; ++i) {
    const std::string_view text = text_of(r.element(i));
    const bool with_event = text == kAnnounced;
    if (with_event && announced != nullptr) (*announced)[i] = true;
    out.push_back(text == "OK" || with_event ? Status::ok() : error_status(text));
  }
  return out;
}

// A commit script's reply as a status; `announced` (when given) whether its event data was
// recorded.
Status committed(Result<Reply> r, bool* announced) {
  if (announced != nullptr) *announced = false;
  KVSTASH_RETURN_IF_ERROR(r.status());
  if (announced != nullptr) *announced = text_of(r->raw()) == kAnnounced;
  return Status::ok();
}

// The event data of `key` that a commit (empty: none) or an announce (`required`) records.
Status check_event(std::string_view key, std::string_view event, bool required = false) {
  if ((required && event.empty()) || event.size() > kMaxEventData) {
    return Status::invalid_argument("event data of " + std::string(key) + " must be " +
                                    (required ? "1.." : "at most ") + std::to_string(kMaxEventData) +
                                    " bytes");
  }
  return Status::ok();
}

}  // namespace

Result<Placement> Catalog::begin_copy(std::string_view token, std::string_view key, std::uint64_t size,
                                      std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid,
                                      std::span<const NodeEndpoint> apart) {
  std::string placement = "one-node";
  for (const NodeEndpoint& a : apart) placement += " " + a.id;
  return place_put(token, key, size, lease, avoid, placement);
}

Result<Placement> Catalog::place_put(std::string_view token, std::string_view key, std::uint64_t size,
                                     std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid,
                                     const std::string& placement) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  std::string n = std::to_string(size), l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::begin_put(), {prefix_},
                                                with_avoided({token, key, n, l, placement}, avoid)));
  if (r.type() != Reply::Type::kArray || r.size() < 3) return corrupt("unexpected reply to begin_put");
  // page_size, extents, deadline, nodes...
  KVSTASH_ASSIGN_OR_RETURN(Placement p, detail::parse_placement(detail::items_of(r.raw()), 0, 1, 2, 3));
  if (p.extents.size() != pages_for(size, p.page_size)) {
    return corrupt("begin_put returned the wrong number of pages");
  }
  return p;
}

Status Catalog::commit_put(std::string_view token, std::string_view key, const sum::ObjectSum& checksum,
                           std::string_view layout, std::chrono::milliseconds ttl,
                           const std::optional<std::string>& if_version, std::uint32_t copies,
                           std::string_view keep, std::int64_t commit_by_ms, std::string_view event,
                           bool* announced) {
  KVSTASH_RETURN_IF_ERROR(check_event(key, event));
  std::string sum = sum::to_text(checksum), t = ms(ttl), n = std::to_string(copies);
  std::string by = std::to_string(commit_by_ms);
  // "" unconditional, "!" no object, "=<token>" that object.
  const std::string cond = !if_version ? "" : if_version->empty() ? "!" : "=" + *if_version;
  return committed(
      redis_.eval(scripts::commit_put(), {prefix_}, {token, key, sum, layout, t, cond, n, keep, by, event}),
      announced);
}

Result<std::uint64_t> Catalog::abort_put(std::string_view token, std::span<const std::string> fenced) {
  std::vector<std::string_view> args{token};
  for (const auto& id : fenced) args.push_back(id);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::abort_put(), {prefix_}, args));
  return static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.integer()));
}

Result<Placement> Catalog::reserve_pages(std::string_view token, std::uint64_t size, std::uint64_t extra,
                                         std::chrono::milliseconds lease, std::span<const NodeEndpoint> avoid,
                                         std::string_view for_key) {
  std::string n = std::to_string(size), x = std::to_string(extra), l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::reserve_pages(), {prefix_},
                                                with_avoided({token, n, x, l, for_key}, avoid)));
  if (r.type() != Reply::Type::kArray || r.size() < 3) return corrupt("unexpected reply to reserve_pages");
  KVSTASH_ASSIGN_OR_RETURN(Placement p, detail::parse_placement(detail::items_of(r.raw()), 0, 1, 2, 3));
  const std::uint64_t need = pages_for(size, p.page_size);
  if (p.extents.size() < need || p.extents.size() > need + extra / std::max<std::uint64_t>(p.page_size, 1)) {
    return corrupt("reserve_pages returned " + std::to_string(p.extents.size()) + " pages for " +
                   std::to_string(need) + " needed");
  }
  return p;
}

Status Catalog::commit_reserved(const ReservedPages& pages, std::string_view token, std::string_view key,
                                std::uint64_t size, const sum::ObjectSum& checksum, std::string_view layout,
                                std::chrono::milliseconds ttl, const std::optional<std::string>& if_version,
                                std::uint32_t copies, std::string_view keep, std::int64_t commit_by_ms,
                                std::string_view event, bool* announced) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  KVSTASH_RETURN_IF_ERROR(check_event(key, event));
  std::string first = std::to_string(pages.first), count = std::to_string(pages.count);
  std::string n = std::to_string(size), sum = sum::to_text(checksum), t = ms(ttl), c = std::to_string(copies);
  std::string by = std::to_string(commit_by_ms);
  const std::string cond = !if_version ? "" : if_version->empty() ? "!" : "=" + *if_version;
  return committed(
      redis_.eval(scripts::commit_reserved(), {prefix_},
                  {pages.reservation, first, count, token, key, n, sum, layout, t, cond, c, keep, by, event}),
      announced);
}

Result<std::vector<Status>> Catalog::commit_reserveds(std::span<const ReservedCommit> puts,
                                                      std::vector<bool>* announced) {
  // The texts the arguments view, kept while the script runs.
  std::vector<std::string> texts;
  texts.reserve(puts.size() * 8);
  std::vector<std::string_view> args;
  args.reserve(puts.size() * 14);
  for (const ReservedCommit& p : puts) {
    KVSTASH_RETURN_IF_ERROR(validate_object_key(p.key));
    KVSTASH_RETURN_IF_ERROR(check_event(p.key, p.event));
    const std::size_t at = texts.size();
    texts.push_back(std::to_string(p.pages.first));
    texts.push_back(std::to_string(p.pages.count));
    texts.push_back(std::to_string(p.size));
    texts.push_back(sum::to_text(p.checksum));
    texts.push_back(ms(p.ttl));
    texts.push_back(!p.if_version ? "" : p.if_version->empty() ? "!" : "=" + *p.if_version);
    texts.push_back(std::to_string(p.copies));
    texts.push_back(std::to_string(p.commit_by_ms));
    args.insert(args.end(),
                {p.pages.reservation, texts[at], texts[at + 1], p.token, p.key, texts[at + 2], texts[at + 3],
                 p.layout, texts[at + 4], texts[at + 5], texts[at + 6], p.keep, texts[at + 7], p.event});
  }
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::commit_reserveds(), {prefix_}, args));
  return statuses_of(r, puts.size(), "commit_reserveds", announced);
}

bool Catalog::condition_failed(const Status& commit) {
  // condition_fails (lua/prelude/publish.lua) words it so.
  return commit.code() == StatusCode::kStale &&
         commit.message().find("changed since the version this put was based on") != std::string::npos;
}

bool Catalog::pages_held(const Status& refusal) {
  // allocate and quota_fit (lua/prelude/placement.lua, eviction.lua) word it so.
  return refusal.code() == StatusCode::kNoSpace &&
         refusal.message().find("NO_SPACE for now:") != std::string::npos;
}

Result<std::uint64_t> Catalog::abort_reserved(const ReservedPages& pages,
                                              std::span<const std::string> fenced) {
  std::string first = std::to_string(pages.first), count = std::to_string(pages.count);
  std::vector<std::string_view> args{pages.reservation, first, count};
  for (const auto& id : fenced) args.push_back(id);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::abort_reserved(), {prefix_}, args));
  return static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.integer()));
}

Result<std::uint64_t> Catalog::release_reservation(std::string_view reservation, std::uint64_t from,
                                                   bool drop) {
  std::string f = std::to_string(from);
  KVSTASH_ASSIGN_OR_RETURN(
      Reply r, redis_.eval(scripts::release_reservation(), {prefix_}, {reservation, f, drop ? "1" : "0"}));
  return static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.integer()));
}

namespace {

// A read lease from begin_get's reply, or one item of begin_gets': page_size, token, size,
// extents, checksum, layout, deadline, nodes...
Result<ReadLease> read_lease_of(std::span<const redisReply* const> r, std::string_view key) {
  if (r.size() == 3 && text_of(r[0]) == "PROMOTING") {
    ReadLease g;
    g.promoting_node = std::string(text_of(r[1]));
    g.object_token = std::string(text_of(r[2]));
    if (!valid_node_id(g.promoting_node))
      return corrupt("object " + std::string(key) + " is on a malformed node");
    return g;
  }
  if (r.size() < 7) return corrupt("unexpected reply to begin_get");
  ReadLease g;
  g.object_token = std::string(text_of(r[1]));
  auto size = number<std::uint64_t>(text_of(r[2]));
  auto sum = sum::parse_object_sum(text_of(r[4]));
  if (g.object_token.empty() || !size) {
    return corrupt("object " + std::string(key) + " has a malformed record (size or token)");
  }
  if (!sum) {
    return corrupt("object " + std::string(key) + " has checksum '" + std::string(text_of(r[4])) +
                   "', not the \"<hex>/<segment>\" of schema " + std::to_string(kSchemaVersion) +
                   " (written by an older build?)");
  }
  g.size = *size;
  g.checksum = *sum;
  g.layout = std::string(text_of(r[5]));
  auto p = detail::parse_placement(r, 0, 3, 6, 7);
  if (!p.is_ok()) return corrupt("object " + std::string(key) + ": " + p.status().message());
  g.placement = std::move(p).value();
  if (g.placement.extents.size() != pages_for(g.size, g.placement.page_size)) {
    return corrupt("object " + std::string(key) + " has " + std::to_string(g.placement.extents.size()) +
                   " extents for " + std::to_string(g.size) + " bytes");
  }
  return g;
}

}  // namespace

Result<ReadLease> Catalog::begin_get(std::string_view key, std::string_view reader,
                                     std::chrono::milliseconds lease, bool promote, std::string_view keep) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  std::string l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(
      Reply r, redis_.eval(scripts::begin_get(), {prefix_}, {key, reader, l, promote ? "0" : "1", keep}));
  if (r.type() != Reply::Type::kArray) return corrupt("unexpected reply to begin_get");
  return read_lease_of(detail::items_of(r.raw()), key);
}

Result<std::vector<Result<ReadLease>>> Catalog::begin_gets(std::span<const std::string> keys,
                                                           std::span<const std::string> readers,
                                                           std::chrono::milliseconds lease,
                                                           std::span<const std::string> keep) {
  if (readers.size() != keys.size()) return Status::invalid_argument("begin_gets: one reader per key");
  if (!keep.empty() && keep.size() != keys.size())
    return Status::invalid_argument("begin_gets: one hint per key");
  for (const auto& k : keys) KVSTASH_RETURN_IF_ERROR(validate_object_key(k));
  std::string l = ms(lease);
  std::vector<std::string_view> args{l};
  args.reserve(1 + 3 * keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    args.insert(args.end(), {keys[i], readers[i], keep.empty() ? std::string_view() : keep[i]});
  }
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::begin_gets(), {prefix_}, args));
  if (r.type() != Reply::Type::kArray || r.size() != keys.size())
    return corrupt("unexpected reply to begin_gets");
  std::vector<Result<ReadLease>> out;
  out.reserve(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const auto item = detail::items_of(r.element(i));
    if (item.empty()) {
      out.push_back(Status::not_found("no object " + keys[i]));
    } else {
      out.push_back(read_lease_of(item, keys[i]));
    }
  }
  return out;
}

Status Catalog::wait_promotion(const ReadLease& promoting, std::chrono::milliseconds wait) {
  const std::string list = prefix_ + ":woken:" + promoting.object_token;
  return redis_.command({"BLPOP", list, detail::wait_seconds(wait)}).status();
}

Status Catalog::end_get(std::string_view reader, const ReadLease& lease) {
  const EndedRead read{std::string(reader), lease.object_token, lease.placement.extents_text};
  KVSTASH_ASSIGN_OR_RETURN(std::vector<Status> ended, end_gets({&read, 1}));
  return std::move(ended.front());
}

Result<std::vector<Status>> Catalog::end_gets(std::span<const EndedRead> reads) {
  std::vector<std::string_view> args;
  args.reserve(reads.size() * 3);
  for (const EndedRead& r : reads) args.insert(args.end(), {r.reader, r.object_token, r.extents_text});
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::end_gets(), {prefix_}, args));
  return statuses_of(r, reads.size(), "end_gets");
}

Result<ObjectRecord> Catalog::stat(std::string_view key) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::stat(), {prefix_}, {key}));
  if (r.type() != Reply::Type::kArray || r.size() != 8) return corrupt("unexpected reply to stat");
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
  o.nodes = detail::split_nodes(text_of(r.element(4)));
  o.ttl_ms = integer_of(r.element(5)).value_or(-1);
  o.version = std::string(text_of(r.element(6)));
  o.tier = std::string(text_of(r.element(7)));
  return o;
}

Status Catalog::remove(std::string_view key, bool corrupt) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  return redis_.eval(scripts::remove(), {prefix_}, {key, corrupt ? "corrupt" : "removed"}).status();
}

Status Catalog::touch(std::string_view key, std::chrono::milliseconds ttl) {
  KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
  std::string t = ms(ttl);
  return redis_.eval(scripts::touch(), {prefix_}, {key, t}).status();
}

std::string keep_hint_text(const std::optional<KeepHint>& hint) {
  if (!hint) return {};
  char clock[32];
  const auto [end, ec] = std::to_chars(clock, clock + sizeof clock, std::max(hint->looked_up, 0.0));
  return std::to_string(std::max<std::uint32_t>(hint->turn, 1)) + ' ' + std::to_string(hint->chunks) + ' ' +
         std::to_string(hint->index) + ' ' + std::to_string(hint->tokens) + ' ' +
         (hint->sampled() ? '1' : '0') + ' ' + std::to_string(hint->draw()) + ' ' +
         (ec == std::errc() ? std::string(clock, end) : "0");
}

namespace {

// contains_prefix.lua's arguments: the mode ("count" or "tiers"), then the keys, each checked.
Result<std::vector<std::string_view>> prefix_args(std::string_view mode, std::span<const std::string> keys) {
  std::vector<std::string_view> args{mode};
  args.reserve(keys.size() + 1);
  for (const auto& k : keys) {
    KVSTASH_RETURN_IF_ERROR(validate_object_key(k));
    args.push_back(k);
  }
  return args;
}

}  // namespace

Result<std::size_t> Catalog::contains_prefix(std::span<const std::string> keys) {
  if (keys.empty()) return std::size_t{0};
  KVSTASH_ASSIGN_OR_RETURN(auto args, prefix_args("count", keys));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::contains_prefix(), {prefix_}, args));
  // Callers index their chunks with it: a count past the keys asked about is a foreign reply.
  if (r.type() != Reply::Type::kInteger || r.integer() < 0 ||
      static_cast<std::uint64_t>(r.integer()) > keys.size()) {
    return corrupt("unexpected reply to contains_prefix");
  }
  return static_cast<std::size_t>(r.integer());
}

Result<PrefixLookup> Catalog::lookup_prefix(std::span<const std::string> keys) {
  if (keys.empty()) return PrefixLookup{};
  KVSTASH_ASSIGN_OR_RETURN(auto args, prefix_args("turn", keys));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::contains_prefix(), {prefix_}, args));
  const std::optional<std::int64_t> hit =
      r.type() == Reply::Type::kArray && r.size() == 3 ? integer_of(r.element(0)) : std::nullopt;
  const std::optional<std::int64_t> turn = hit ? integer_of(r.element(1)) : std::nullopt;
  if (!hit || !turn || *hit < 0 || static_cast<std::uint64_t>(*hit) > keys.size() || *turn < 1) {
    return corrupt("unexpected reply to contains_prefix");
  }
  const std::string_view clock_text = text_of(r.element(2));
  double clock = 0;
  if (std::from_chars(clock_text.data(), clock_text.data() + clock_text.size(), clock).ec != std::errc()) {
    return corrupt("unexpected reply to contains_prefix");
  }
  return PrefixLookup{static_cast<std::size_t>(*hit),
                      static_cast<std::uint32_t>(std::min<std::int64_t>(*turn, 1 << 20)), clock};
}

Result<std::vector<bool>> Catalog::prefix_tiers(std::span<const std::string> keys) {
  std::vector<bool> out;
  if (keys.empty()) return out;
  KVSTASH_ASSIGN_OR_RETURN(auto args, prefix_args("tiers", keys));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::contains_prefix(), {prefix_}, args));
  if (r.type() != Reply::Type::kArray || r.size() > keys.size())
    return corrupt("unexpected reply to contains_prefix");
  for (std::size_t i = 0; i < r.size(); ++i) {
    const std::string_view t = text_of(r.element(i));
    if (t != "ssd" && t != "dram") return corrupt("contains_prefix named tier '" + std::string(t) + "'");
    out.push_back(t == "ssd");
  }
  return out;
}

Result<std::vector<bool>> Catalog::contains_each(std::span<const std::string> keys) {
  std::vector<bool> out;
  if (keys.empty()) return out;
  KVSTASH_ASSIGN_OR_RETURN(auto args, prefix_args("each", keys));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::contains_prefix(), {prefix_}, args));
  if (r.type() != Reply::Type::kArray || r.size() != keys.size())
    return corrupt("unexpected reply to contains_each");
  for (std::size_t i = 0; i < r.size(); ++i) {
    const std::optional<std::int64_t> present = integer_of(r.element(i));
    if (!present || (*present != 0 && *present != 1)) return corrupt("unexpected reply to contains_each");
    out.push_back(*present == 1);
  }
  return out;
}

Result<std::optional<std::size_t>> Catalog::announce(
    std::span<const std::pair<std::string, std::string>> items) {
  std::vector<std::string_view> args;
  args.reserve(items.size() * 2);
  for (const auto& [key, ev] : items) {
    KVSTASH_RETURN_IF_ERROR(validate_object_key(key));
    KVSTASH_RETURN_IF_ERROR(check_event(key, ev, /*required=*/true));
    args.push_back(key);
    args.push_back(ev);
  }
  if (args.empty()) return std::optional<std::size_t>{0};
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::announce(), {prefix_}, args));
  if (r.type() != Reply::Type::kInteger || r.integer() < -1 ||
      r.integer() > static_cast<std::int64_t>(items.size())) {
    return corrupt("unexpected reply to announce");
  }
  if (r.integer() < 0) return std::optional<std::size_t>{};
  return std::optional<std::size_t>{static_cast<std::size_t>(r.integer())};
}

Result<std::vector<NodeEndpoint>> Catalog::live_nodes() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::live_nodes(), {prefix_}, {}));
  if (r.type() != Reply::Type::kArray || r.size() % 3) return corrupt("unexpected reply to live_nodes");
  std::vector<NodeEndpoint> out;
  for (std::size_t i = 0; i < r.size(); i += 3) {
    out.push_back({std::string(text_of(r.element(i))), std::string(text_of(r.element(i + 1))),
                   std::string(text_of(r.element(i + 2)))});
    if (!valid_node_id(out.back().id) || out.back().address.empty() || out.back().key.empty()) {
      return corrupt("live_nodes named a malformed node");
    }
  }
  return out;
}

Result<Catalog::PoolGrant> Catalog::grant_pool(std::string_view node, TransferOp op, std::int64_t deadline_ms,
                                               std::chrono::milliseconds ttl) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::grant_pool(), {prefix_},
                                                {std::string(node), op == TransferOp::kWrite ? "w" : "r",
                                                 std::to_string(std::max<std::int64_t>(0, deadline_ms)),
                                                 std::to_string(ttl.count())}));
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to grant_pool");
  auto deadline = integer_of(r.element(0));
  if (!deadline || *deadline <= 0) return corrupt("grant_pool gave no valid deadline");
  return PoolGrant{std::string(text_of(r.element(1))), *deadline};
}

// ---- Handoffs -----------------------------------------------------------------------------

namespace {
// Names and readers: 1..256 printable bytes, no spaces (they are parts of keys and fields).
Status validate_handoff_word(std::string_view what, std::string_view w) {
  if (w.empty() || w.size() > 256)
    return Status::invalid_argument(std::string(what) + " must be 1..256 bytes");
  for (char c : w) {
    if (c <= ' ' || c > '~')
      return Status::invalid_argument(std::string(what) + " must be printable, no spaces");
  }
  return {};
}

std::string handoff_key(const std::string& prefix, std::string_view name) {
  return prefix + ":handoff:" + std::string(name);
}

}  // namespace

Status Catalog::publish_handoff(std::string_view name, std::string_view descriptor,
                                std::span<const std::string> readers, std::chrono::milliseconds ttl) {
  KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's name", name));
  if (ttl.count() <= 0) return Status::invalid_argument("a handoff's ttl must be > 0");
  std::string t = ms(ttl);
  std::vector<std::string_view> args{name, t, descriptor};
  for (const auto& r : readers) {
    KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's reader", r));
    args.push_back(r);
  }
  return redis_.eval(scripts::publish_handoff(), {prefix_}, args).status();
}

Result<std::string> Catalog::handoff(std::string_view name) {
  KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's name", name));
  const std::string key = handoff_key(prefix_, name);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"HGET", key, "d"}));
  if (r.is_nil()) return Status::not_found("no handoff " + std::string(name) + " (ended or expired)");
  if (r.type() != Reply::Type::kString) return corrupt("unexpected reply to HGET of a handoff");
  return std::string(r.str());
}

Result<bool> Catalog::end_handoff(std::string_view name, std::string_view reader) {
  KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's name", name));
  KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's reader", reader));
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::end_handoff(), {prefix_}, {name, reader}));
  if (r.type() != Reply::Type::kInteger) return corrupt("unexpected reply to end_handoff");
  return r.integer() == 1;
}

Result<bool> Catalog::handoff_pending(std::string_view name, std::string_view reader) {
  KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's name", name));
  KVSTASH_RETURN_IF_ERROR(validate_handoff_word("a handoff's reader", reader));
  const std::string key = handoff_key(prefix_, name), field = "r:" + std::string(reader);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"HEXISTS", key, field}));
  if (r.type() != Reply::Type::kInteger) return corrupt("unexpected reply to HEXISTS of a handoff");
  return r.integer() == 1;
}

}  // namespace kvstash::metadata
