#include "metadata/tier_catalog.h"

#include <fmt/format.h>

#include "metadata/catalog_common.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {

using detail::corrupt;
using detail::integer_of;
using detail::items_of;
using detail::ms;
using detail::number;
using detail::text_of;

Result<std::vector<PageRun>> parse_runs(std::string_view text, std::string_view node) {
  std::vector<PageRun> out;
  while (!text.empty()) {
    const std::size_t semi = text.find(';');
    std::string_view run = text.substr(0, semi);
    text = semi == std::string_view::npos ? std::string_view{} : text.substr(semi + 1);
    std::string_view f[4];
    std::size_t n = 0;
    while (n < 4) {
      const std::size_t comma = run.find(',');
      f[n++] = run.substr(0, comma);
      if (comma == std::string_view::npos) break;
      run = run.substr(comma + 1);
    }
    const auto first = number<std::uint64_t>(f[1]);
    const auto gen = number<std::int64_t>(f[2]);
    const auto count = n == 4 ? number<std::uint64_t>(f[3]) : std::optional<std::uint64_t>(1);
    if (n < 3 || f[0] != node || !first || !gen || !count || *count == 0 || *first > ~0ull - *count) {
      return corrupt(fmt::format("a run '{}' not of node {}", f[0], node));
    }
    out.push_back({*first, *count});
  }
  return out;
}

namespace {

std::uint64_t pages_in(std::span<const PageRun> runs) {
  std::uint64_t n = 0;
  for (const PageRun& r : runs) n += r.count;
  return n;
}

}  // namespace

TierCatalog::TierCatalog(RedisClient& redis, std::string cell) : redis_(redis), prefix_(cell_prefix(cell)) {}

Result<TierCatalog::WriteDowns> TierCatalog::begin_write_down(std::string_view id, std::string_view epoch,
                                                              std::uint64_t low_water, std::uint64_t high_water,
                                                              std::uint64_t most_pages,
                                                              std::chrono::milliseconds lease) {
  const std::string low = std::to_string(low_water), high = std::to_string(high_water),
                    most = std::to_string(most_pages), l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(Reply r,
                           redis_.eval(scripts::begin_write_down(), {prefix_}, {id, epoch, low, most, l, high}));
  const auto items = items_of(r.raw());
  constexpr std::size_t kFields = 8;
  if (items.empty() || (items.size() - 1) % kFields != 0) return corrupt("unexpected reply to begin_write_down");
  WriteDowns out;
  out.deadline_ms = integer_of(items[0]).value_or(0);
  const std::string slot_node = std::string(id) + "!ssd";
  for (std::size_t i = 1; i < items.size(); i += kFields) {
    WriteDown w;
    w.key = std::string(text_of(items[i]));
    w.token = std::string(text_of(items[i + 1]));
    const auto size = integer_of(items[i + 2]);
    auto pages = parse_runs(text_of(items[i + 3]), id);
    w.slots_text = std::string(text_of(items[i + 4]));
    auto slots = parse_runs(w.slots_text, slot_node);
    w.checksum = std::string(text_of(items[i + 5]));
    w.layout = std::string(text_of(items[i + 6]));
    const auto expires = integer_of(items[i + 7]);
    if (w.key.empty() || w.token.empty() || !size || *size <= 0 || !pages.is_ok() || !slots.is_ok() ||
        pages_in(*pages) != pages_in(*slots) || !expires || *expires < 0) {
      return corrupt("begin_write_down named a malformed object");
    }
    w.size = static_cast<std::uint64_t>(*size);
    w.expires_ms = *expires;
    w.pages = std::move(pages).value();
    w.slots = std::move(slots).value();
    out.objects.push_back(std::move(w));
  }
  return out;
}

Result<std::vector<Status>> TierCatalog::commit_write_down(std::string_view id, std::string_view epoch,
                                                           std::span<const Written> written) {
  std::vector<std::string_view> args{id, epoch};
  for (const Written& w : written) args.insert(args.end(), {w.key, w.token, w.slots_text, w.sum});
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::commit_write_down(), {prefix_}, args));
  if (r.type() != Reply::Type::kArray || r.size() != written.size()) {
    return corrupt("unexpected reply to commit_write_down");
  }
  std::vector<Status> out;
  for (std::size_t i = 0; i < r.size(); ++i) {
    const std::string_view t = text_of(r.element(i));
    out.push_back(t == "OK" ? Status{} : Status::stale(std::string(t)));
  }
  return out;
}

Result<std::uint64_t> TierCatalog::abort_write_down(std::string_view id, std::span<const WriteDown> failed) {
  std::vector<std::string_view> args{id};
  for (const WriteDown& w : failed) args.insert(args.end(), {w.key, w.slots_text});
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::abort_write_down(), {prefix_}, args));
  return static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.integer()));
}

Result<std::optional<TierCatalog::Promotion>> TierCatalog::begin_promote(std::string_view id,
                                                                         std::string_view epoch,
                                                                         std::string_view key,
                                                                         std::string_view put_token,
                                                                         std::chrono::milliseconds lease,
                                                                         bool evict) {
  const std::string l = ms(lease);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::begin_promote(), {prefix_},
                                                {id, epoch, key, put_token, l, evict ? "1" : "0"}));
  if (r.type() != Reply::Type::kArray) {
    if (r.str() == "DONE") return std::optional<Promotion>{};
    return corrupt("unexpected reply to begin_promote");
  }
  const auto items = items_of(r.raw());
  if (items.size() != 6) return corrupt("unexpected reply to begin_promote");
  Promotion p;
  p.key = std::string(key);
  p.put_token = std::string(put_token);
  p.deadline_ms = integer_of(items[0]).value_or(0);
  p.token = std::string(text_of(items[1]));
  const auto size = integer_of(items[2]);
  auto pages = parse_runs(text_of(items[3]), id);
  p.slots_text = std::string(text_of(items[4]));
  auto slots = parse_runs(p.slots_text, std::string(id) + "!ssd");
  p.sum = std::string(text_of(items[5]));
  if (p.token.empty() || !size || *size <= 0 || !pages.is_ok() || !slots.is_ok() ||
      pages_in(*pages) != pages_in(*slots)) {
    return corrupt("begin_promote named a malformed object " + std::string(key));
  }
  p.size = static_cast<std::uint64_t>(*size);
  p.pages = std::move(pages).value();
  p.slots = std::move(slots).value();
  return std::optional<Promotion>(std::move(p));
}

Status TierCatalog::commit_promote(std::string_view id, std::string_view epoch, const Promotion& p) {
  return redis_.eval(scripts::commit_promote(), {prefix_}, {id, epoch, p.key, p.token, p.put_token, p.slots_text})
      .status();
}

Result<bool> TierCatalog::abort_promote(std::string_view id, const Promotion& p, bool bad) {
  KVSTASH_ASSIGN_OR_RETURN(
      Reply r, redis_.eval(scripts::abort_promote(), {prefix_}, {id, p.key, p.token, p.put_token, bad ? "1" : "0"}));
  return r.str() == "DROPPED";
}

Result<std::optional<std::string>> TierCatalog::next_promotion(std::string_view id, std::chrono::milliseconds wait) {
  const std::string list = prefix_ + ":promote:" + std::string(id);
  if (wait.count() <= 0) {
    KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"RPOP", list}));
    if (r.is_nil()) return std::optional<std::string>{};
    if (r.type() != Reply::Type::kString) return corrupt("unexpected reply to RPOP");
    return std::optional<std::string>(std::string(r.str()));
  }
  // Redis ends a blocking command's wait at its timers' pace (10 per second by default): a
  // short wait may last 100 ms. A push ends it at once.
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.command({"BRPOP", list, detail::wait_seconds(wait)}));
  if (r.is_nil()) return std::optional<std::string>{};
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to BRPOP");
  return std::optional<std::string>(std::string(text_of(r.element(1))));
}

Result<bool> TierCatalog::begin_recovery(std::string_view id, std::string_view epoch) {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::recover_tier(), {prefix_}, {id, epoch, "begin"}));
  if (r.str() == "RUN") return true;
  if (r.str() == "NONE") return false;
  return corrupt("unexpected reply to recover_tier begin");
}

Result<std::vector<TierCatalog::Offered>> TierCatalog::offer_recovered(std::string_view id, std::string_view epoch,
                                                                       RecoveryCounts counts,
                                                                       std::span<const Recovered> objects) {
  const std::string f = std::to_string(counts.found), c = std::to_string(counts.checked),
                    b = std::to_string(counts.bad);
  std::vector<std::string> numbers;
  numbers.reserve(2 * objects.size());
  for (const Recovered& o : objects) {
    numbers.push_back(std::to_string(o.size));
    numbers.push_back(std::to_string(o.expires_ms));
  }
  std::vector<std::string_view> args{id, epoch, "offer", f, c, b};
  for (std::size_t i = 0; i < objects.size(); ++i) {
    const Recovered& o = objects[i];
    args.insert(args.end(), {o.key, o.token, numbers[2 * i], o.checksum, o.layout, numbers[2 * i + 1], o.runs, o.sum});
  }
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::recover_tier(), {prefix_}, args));
  if (r.type() != Reply::Type::kArray || r.size() != objects.size()) {
    return corrupt("unexpected reply to recover_tier offer");
  }
  std::vector<Offered> out;
  for (std::size_t i = 0; i < r.size(); ++i) {
    const std::string_view t = text_of(r.element(i));
    if (t == "ADMITTED") out.push_back(Offered::kAdmitted);
    else if (t == "KEPT") out.push_back(Offered::kKept);
    else if (t == "TAKEN") out.push_back(Offered::kTaken);
    else if (t == "EXPIRED") out.push_back(Offered::kExpired);
    else if (t == "COPY") out.push_back(Offered::kCopy);
    else return corrupt("unexpected reply to recover_tier offer");
  }
  return out;
}

Status TierCatalog::end_recovery(std::string_view id, std::string_view epoch, RecoveryCounts counts,
                                 std::string_view claimed) {
  const std::string f = std::to_string(counts.found), c = std::to_string(counts.checked),
                    b = std::to_string(counts.bad);
  KVSTASH_ASSIGN_OR_RETURN(Reply r,
                           redis_.eval(scripts::recover_tier(), {prefix_}, {id, epoch, "end", f, c, b, claimed}));
  if (r.str() != "OK") return corrupt("unexpected reply to recover_tier end");
  return {};
}

}  // namespace kvstash::metadata
