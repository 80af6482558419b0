#include "metadata/quotas.h"

#include <algorithm>
#include <chrono>

#include "metadata/catalog_common.h"
#include "metadata/scripts.h"

namespace kvstash::metadata {

using detail::corrupt;
using detail::number;
using detail::text_of;

CellQuotas::CellQuotas(RedisClient& redis, std::string cell_prefix)
    : redis_(redis), prefix_(std::move(cell_prefix)) {}

Status CellQuotas::set(std::string_view prefix, QuotaLimits limits, Deadline deadline) {
  const std::string objects = std::to_string(limits.max_objects), bytes = std::to_string(limits.max_bytes);
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::set_quota(), {prefix_}, {prefix, objects, bytes}));
  if (r.type() != Reply::Type::kArray || r.size() != 2) return corrupt("unexpected reply to set_quota");
  const std::string_view gen = text_of(r.element(0));
  if (text_of(r.element(1)) != "1") return {};
  return recount(gen == "0" ? std::string_view() : gen, deadline).status();
}

Result<std::uint64_t> CellQuotas::recount(std::string_view gen, Deadline deadline) {
  std::string cursor = "0";
  std::uint64_t moved = 0;
  do {
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::timeout("the quotas' recount of the cell's objects did not finish in time (" +
                             std::to_string(moved) + " charges moved so far): run `kvstash quota recount`");
    }
    KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::quota_scan(), {prefix_}, {cursor, gen}));
    if (r.type() != Reply::Type::kArray || r.size() != 3) return corrupt("unexpected reply to quota_scan");
    cursor = std::string(text_of(r.element(0)));
    const auto step = number<std::uint64_t>(text_of(r.element(2)));
    if (cursor.empty() || !step) return corrupt("unexpected reply to quota_scan");
    moved += *step;
  } while (cursor != "0");
  return moved;
}

Result<std::vector<QuotaUse>> CellQuotas::list() {
  KVSTASH_ASSIGN_OR_RETURN(Reply r, redis_.eval(scripts::list_quotas(), {prefix_}, {}));
  constexpr std::size_t kFields = 10;
  if (r.type() != Reply::Type::kArray || r.size() % kFields != 0)
    return corrupt("unexpected reply to list_quotas");
  std::vector<QuotaUse> out;
  for (std::size_t i = 0; i < r.size(); i += kFields) {
    QuotaUse q;
    q.prefix = std::string(text_of(r.element(i)));
    std::uint64_t* fields[] = {&q.limits.max_objects,
                               &q.limits.max_bytes,
                               &q.objects,
                               &q.bytes,
                               &q.evicted,
                               &q.refused,
                               &q.reserved};
    for (std::size_t f = 0; f < std::size(fields); ++f) {
      // Counters are signed in Redis: a negative one (never expected) reads as 0.
      const auto v = number<std::int64_t>(text_of(r.element(i + 2 + f)));
      if (!v) return corrupt("a malformed quota counter of prefix " + q.prefix);
      *fields[f] = static_cast<std::uint64_t>(std::max<std::int64_t>(0, *v));
    }
    q.counting = text_of(r.element(i + 9)) == "1";
    out.push_back(std::move(q));
  }
  std::sort(out.begin(), out.end(), [](const QuotaUse& a, const QuotaUse& b) { return a.prefix < b.prefix; });
  return out;
}

}  // namespace kvstash::metadata
