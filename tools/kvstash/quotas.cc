// kvstash quota: quotas per key prefix (metadata/quotas.h): list, set, rm, recount.
#include <CLI/CLI.hpp>
#include <charconv>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "common/units.h"
#include "metadata/cell.h"
#include "metadata/quotas.h"

namespace kvstash::cli {
namespace {

using metadata::CellQuotas;
using metadata::QuotaUse;
using nlohmann::json;

// "12 of 100", or "12" without a limit; sizes through `show`.
std::string of_limit(std::uint64_t used, std::uint64_t limit, std::string (*show)(std::uint64_t)) {
  return show(used) + (limit == 0 ? std::string() : " of " + show(limit));
}
std::string plain(std::uint64_t n) { return std::to_string(n); }
std::string size(std::uint64_t n) { return units::format_size(n); }

int with_quotas(Session& s, const std::function<int(CellQuotas&)>& fn) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  CellQuotas quotas((*cell)->redis(), (*cell)->admin().prefix());
  return fn(quotas);
}

int list(Session& s) {
  return with_quotas(s, [&](CellQuotas& q) {
    auto all = q.list();
    if (!all.is_ok()) return fail(all.status(), "reading the quotas", &s);
    if (s.json()) {
      std::cout << quotas_json(*all).dump(2) << "\n";
      return kExitOk;
    }
    if (all->empty()) {
      std::cout << "no quotas in cell " << s.globals().cell << " (kvstash quota set PREFIX --bytes SIZE)\n";
      return kExitOk;
    }
    Table t({"PREFIX", "OBJECTS", "BYTES", "RESERVED", "EVICTED", "REFUSED", "NOTE"});
    for (const auto& u : *all) {
      t.row({u.prefix, of_limit(u.objects, u.limits.max_objects, plain),
             of_limit(u.bytes, u.limits.max_bytes, size), size(u.reserved), std::to_string(u.evicted),
             std::to_string(u.refused), u.counting ? "counting not finished: kvstash quota recount" : ""});
    }
    std::cout << t.str();
    return kExitOk;
  });
}

struct SetOptions {
  std::string prefix, objects = "0", bytes = "0";
};

int set(Session& s, const SetOptions& o, bool remove) {
  metadata::QuotaLimits limits;
  if (!remove) {
    std::uint64_t objects = 0;
    const auto [end, ec] = std::from_chars(o.objects.data(), o.objects.data() + o.objects.size(), objects);
    if (ec != std::errc() || end != o.objects.data() + o.objects.size()) {
      return fail(Status::invalid_argument("--objects takes a whole number, not '" + o.objects + "'"),
                  "setting a quota", &s);
    }
    auto bytes = units::parse_size(o.bytes);
    if (!bytes.is_ok()) return fail(bytes.status(), "reading --bytes", &s);
    limits = {objects, *bytes};
    if (limits.max_objects == 0 && limits.max_bytes == 0) {
      return fail(
          Status::invalid_argument("a quota needs --objects or --bytes (to remove one: kvstash quota rm)"),
          "setting a quota", &s);
    }
  }
  return with_quotas(s, [&](CellQuotas& q) {
    Status done =
        q.set(o.prefix, limits, deadline_after(std::max(s.timeout(), std::chrono::milliseconds(60000))));
    if (!done.is_ok()) return fail(done, remove ? "removing a quota" : "setting a quota", &s);
    if (s.json()) {
      std::cout << json{{"prefix", o.prefix},
                        {"max_objects", limits.max_objects},
                        {"max_bytes", limits.max_bytes},
                        {"removed", remove}}
                       .dump(2)
                << "\n";
    } else if (remove) {
      std::cout << "quota of " << o.prefix
                << " removed (its objects stay, counted under a shorter prefix's quota if "
                << "one covers them)\n";
    } else {
      std::cout << "quota of " << o.prefix << ": " << (limits.max_objects ? plain(limits.max_objects) : "any")
                << " objects, " << (limits.max_bytes ? size(limits.max_bytes) : "any size")
                << " (its puts evict its own least recently used objects to stay within it)\n";
    }
    return kExitOk;
  });
}

int recount(Session& s) {
  return with_quotas(s, [&](CellQuotas& q) {
    auto all = q.list();
    if (!all.is_ok()) return fail(all.status(), "reading the quotas", &s);
    auto moved = q.recount({}, deadline_after(std::max(s.timeout(), std::chrono::milliseconds(60000))));
    if (!moved.is_ok()) return fail(moved.status(), "recounting the quotas", &s);
    std::cout << "recounted: " << *moved << " objects' charges moved\n";
    return kExitOk;
  });
}

}  // namespace

nlohmann::json quotas_json(const std::vector<metadata::QuotaUse>& quotas) {
  json j = json::array();
  for (const auto& u : quotas) {
    j.push_back({{"prefix", u.prefix},
                 {"max_objects", u.limits.max_objects},
                 {"max_bytes", u.limits.max_bytes},
                 {"objects", u.objects},
                 {"bytes", u.bytes},
                 {"evicted", u.evicted},
                 {"refused", u.refused},
                 {"reserved", u.reserved},
                 {"counting", u.counting}});
  }
  return j;
}

std::string quota_line(const metadata::QuotaUse& u) {
  std::string line = u.prefix + ": " + of_limit(u.objects, u.limits.max_objects, plain) + " objects, " +
                     of_limit(u.bytes, u.limits.max_bytes, size) + " of the pool";
  if (u.reserved > 0) line.append(", ").append(size(u.reserved)).append(" reserved by puts in flight");
  line.append("; ").append(std::to_string(u.evicted)).append(" evicted, ");
  line.append(std::to_string(u.refused)).append(" refused");
  if (u.counting) line.append(" (counting not finished)");
  return line;
}

void add_quota_commands(Registry& r) {
  Session& s = r.session;
  auto o = std::make_shared<SetOptions>();
  auto* q = r.app.add_subcommand(
      "quota",
      "Quotas per key prefix: how many objects and bytes a tenant's keys may hold (list, set, rm, recount)");
  q->footer(
      "A prefix at its quota evicts its own least recently used objects for its new ones, never another "
      "prefix's; it is refused only when all of them are being read. The longest prefix with a quota governs "
      "a "
      "key.\n\nExamples:\n  kvstash quota\n  kvstash quota set tenant-a/ --bytes 200GiB\n"
      "  kvstash quota set tenant-b/ --objects 100000 --bytes 50GiB\n  kvstash quota rm tenant-b/");
  q->final_callback([&r, &s, q] {
    if (q->get_subcommands().empty()) r.action = [&s] { return list(s); };
  });
  auto* ls = q->add_subcommand("list", "The cell's quotas and what each holds");
  ls->final_callback([&r, &s] { r.action = [&s] { return list(s); }; });
  auto* st =
      q->add_subcommand("set", "Set or change the quota of a key prefix (counts what it holds already)");
  st->add_option("PREFIX", o->prefix, "Key prefix, e.g. tenant-a/")->required();
  st->add_option("--objects", o->objects, "At most this many objects (0: no limit)");
  st->add_option("--bytes", o->bytes,
                 "At most this much of the pool, in whole pages (e.g. 200GiB; 0: no limit)");
  st->final_callback([&r, &s, o] { r.action = [&s, o] { return set(s, *o, false); }; });
  auto* rm = q->add_subcommand("rm", "Remove the quota of a key prefix");
  rm->add_option("PREFIX", o->prefix, "Key prefix")->required();
  rm->final_callback([&r, &s, o] { r.action = [&s, o] { return set(s, *o, true); }; });
  auto* rc = q->add_subcommand("recount",
                               "Charge every object to the quota that governs it (after an interruption)");
  rc->final_callback([&r, &s] { r.action = [&s] { return recount(s); }; });
}

}  // namespace kvstash::cli
