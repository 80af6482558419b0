// kvstash ls, show, rm, touch, evict, get, put: the cell's objects.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "common/units.h"
#include "common/wire.h"
#include "kvstash/store.h"
#include "metadata/cell.h"

namespace kvstash::cli {
namespace {

// A key as people read it: a replica's copy (PutOptions::replicas), "<key>\x1f<i>", shows as
// "<key> (copy i)". JSON keeps the key's bytes.
std::string shown_key(const std::string& key) {
  const auto sep = key.find('\x1f');
  if (sep == std::string::npos) return key;
  return key.substr(0, sep).append(" (copy ").append(key.substr(sep + 1)).append(")");
}

using nlohmann::json;
using std::chrono::milliseconds;

std::string join(const std::vector<std::string>& v, std::string_view sep = ",") {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += sep;
    out += s;
  }
  return out;
}

std::string ttl_text(const metadata::ObjectInfo& o, std::int64_t now) {
  return o.expires_ms == 0 ? "never" : format_duration(milliseconds(o.expires_ms - now));
}

std::string ago(std::int64_t then, std::int64_t now) {
  return then <= 0 ? "-" : format_duration(milliseconds(std::max<std::int64_t>(0, now - then))) + " ago";
}

// kNotFound from the metadata plane carries Redis's reply text; say it in the operator's words.
Status plain(const Status& st, const std::string& key, const Session& s) {
  if (st.code() != StatusCode::kNotFound) return st;
  return Status::not_found("no object '" + key + "' in cell " + s.globals().cell +
                           " (never stored, removed, expired, evicted, or its node died)");
}

json object_json(const metadata::ObjectInfo& o, std::int64_t now) {
  return {{"key", o.key},
          {"size", o.size},
          {"ttl_ms", o.expires_ms == 0 ? -1 : std::max<std::int64_t>(0, o.expires_ms - now)},
          {"created_ms", o.created_ms},
          {"last_access_ms", o.last_access_ms},
          {"idle_ms", std::max<std::int64_t>(0, now - o.last_access_ms)},
          {"nodes", o.nodes},
          {"checksum", o.checksum ? wire::to_hex64(o.checksum->value) : "malformed"},
          {"readers", o.readers},
          {"tier", o.tier}};
}

struct LsOptions {
  std::string pattern = "*";
  std::uint32_t limit = 100;
  std::string sort = "none";
};

int ls(Session& s, const LsOptions& o) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  // SCAN, never KEYS: the cell keeps serving. Unsorted, stop at the limit; sorted, every
  // match is looked at (the limit applies to what is printed).
  std::vector<metadata::ObjectInfo> found;
  std::int64_t now = 0;
  std::string cursor = "0";
  do {
    auto page = (*cell)->admin().scan_objects(o.pattern, cursor, 512);
    if (!page.is_ok()) return fail(page.status(), "ls", &s);
    cursor = page->cursor;
    if (page->keys.empty()) continue;
    auto infos = (*cell)->admin().describe(page->keys, &now);
    if (!infos.is_ok()) return fail(infos.status(), "ls", &s);
    for (auto& i : *infos) {
      if (i.exists) found.push_back(std::move(i));
    }
  } while (cursor != "0" && (o.sort != "none" || found.size() < o.limit));
  if (o.sort == "access") {  // least recently used first: eviction order
    std::ranges::sort(found, {}, &metadata::ObjectInfo::last_access_ms);
  } else if (o.sort == "size") {
    std::ranges::sort(found, std::greater<>{}, &metadata::ObjectInfo::size);
  } else if (o.sort == "key") {
    std::ranges::sort(found, {}, &metadata::ObjectInfo::key);
  }
  const bool more = found.size() > o.limit;
  if (more) found.resize(o.limit);
  if (s.json()) {
    json j = json::array();
    for (const auto& i : found) j.push_back(object_json(i, now));
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  Table t({"KEY", "SIZE", "TTL", "LAST ACCESS", "NODES"});
  for (const auto& i : found) {
    t.row({shown_key(i.key), units::format_size(i.size), ttl_text(i, now), ago(i.last_access_ms, now),
           join(i.nodes)});
  }
  if (t.empty()) {
    std::cout << "no objects match '" << o.pattern << "'\n";
  } else {
    std::cout << t.str();
    if (more) std::cout << "(first " << o.limit << " shown; --limit N for more)\n";
  }
  return kExitOk;
}

// "node-1 pages 3-5 (gen 7), node-2 page 0 (gen 4)": runs of consecutive pages of one node
// and one generation (a page's generation counts its allocations).
std::string extents_text(const std::vector<metadata::Extent>& ex) {
  std::string out;
  for (std::size_t i = 0; i < ex.size();) {
    std::size_t j = i + 1;
    while (j < ex.size() && ex[j].node == ex[i].node && ex[j].page == ex[j - 1].page + 1 &&
           ex[j].generation == ex[i].generation) {
      ++j;
    }
    if (!out.empty()) out += ", ";
    out += ex[i].node;
    out += j - i == 1 ? " page " + std::to_string(ex[i].page)
                      : " pages " + std::to_string(ex[i].page) + "-" + std::to_string(ex[j - 1].page);
    out += " (gen " + std::to_string(ex[i].generation) + ")";
    i = j;
  }
  return out;
}

int show(Session& s, const std::string& key) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  auto rec = (*cell)->catalog().stat(key);
  if (!rec.is_ok()) return fail(plain(rec.status(), key, s), "show", &s);
  std::int64_t now = 0;
  const std::vector<std::string> keys{key};
  auto info = (*cell)->admin().describe(keys, &now);
  if (!info.is_ok()) return fail(info.status(), "show " + key, &s);
  const metadata::ObjectInfo& i = info->front();
  if (s.json()) {
    json j = object_json(i, now);
    j["size"] = rec->size;
    j["checksum"] = wire::to_hex64(rec->checksum.value);
    j["checksum_segment"] = rec->checksum.segment;
    j["layout"] = rec->layout;
    j["pages"] = rec->pages;
    j["extents"] = json::array();
    for (const auto& e : rec->extents)
      j["extents"].push_back({{"node", e.node}, {"page", e.page}, {"generation", e.generation}});
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  Table t({"FIELD", "VALUE"});
  t.row({"key", key});
  t.row({"size", units::format_size(rec->size) + " (" + std::to_string(rec->size) + " bytes)"});
  t.row({"checksum", "xxh3 tree " + wire::to_hex64(rec->checksum.value) + " (segments of " +
                         units::format_size(rec->checksum.segment) + ")"});
  t.row({"ttl", rec->ttl_ms < 0 ? "never expires" : format_duration(milliseconds(rec->ttl_ms))});
  t.row({"created", format_time(i.created_ms)});
  t.row({"last access", format_time(i.last_access_ms) + " (" + ago(i.last_access_ms, now) + ")"});
  t.row({"readers", std::to_string(i.readers)});
  t.row({"layout", rec->layout.empty() ? "-" : rec->layout});
  if (rec->tier == "ssd") {
    t.row({"tier", "nvme: on the NVMe tier of " + (rec->nodes.empty() ? std::string("?") : rec->nodes.front()) +
                       " (a get promotes it back into the pool first)"});
  } else {
    t.row({"tier", "dram"});
    t.row({"extents", std::to_string(rec->pages) + ": " + extents_text(rec->extents)});
  }
  std::cout << t.str();
  return kExitOk;
}

int rm(Session& s, const std::vector<std::string>& keys, bool yes) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  if (!yes) {
    auto infos = (*cell)->admin().describe(keys);
    if (!infos.is_ok()) return fail(infos.status(), "rm", &s);
    std::size_t n = 0;
    for (const auto& i : *infos) n += i.exists;
    std::cout << "would remove " << n << " of " << keys.size() << " objects; run again with --yes to do it\n";
    return n == keys.size() ? kExitOk : kExitNotFound;
  }
  json j = json::array();
  int rc = kExitOk;
  for (const auto& k : keys) {
    Status st = (*cell)->catalog().remove(k);
    j.push_back({{"key", k}, {"status", to_string(st.code())}});
    if (!st.is_ok()) {
      rc = std::max(rc, fail(plain(st, k, s), "rm", &s));
    } else if (!s.json()) {
      std::cout << "removed " << k << "\n";
    }
  }
  if (s.json()) std::cout << j.dump(2) << "\n";
  return rc;
}

int touch(Session& s, const std::vector<std::string>& keys, const std::string& ttl) {
  milliseconds t{0};
  if (ttl != "never" && ttl != "0") {
    auto d = units::parse_duration(ttl);
    if (!d.is_ok()) return fail(d.status(), "touch --ttl", &s);
    t = *d;
  }
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  int rc = kExitOk;
  for (const auto& k : keys) {
    Status st = (*cell)->catalog().touch(k, t);
    if (!st.is_ok()) {
      rc = std::max(rc, fail(plain(st, k, s), "touch", &s));
    } else if (!s.json()) {
      std::cout << k << ": " << (t.count() == 0 ? "never expires" : "expires in " + format_duration(t))
                << "\n";
    }
  }
  if (s.json())
    std::cout << json{{"keys", keys}, {"ttl_ms", t.count() == 0 ? -1 : t.count()}}.dump(2) << "\n";
  return rc;
}

struct EvictOptions {
  std::string older_than, bytes;
  std::uint32_t limit = 10000;
  bool yes = false;
};

int evict(Session& s, const EvictOptions& o) {
  if (o.older_than.empty() && o.bytes.empty()) {
    return fail(Status::invalid_argument("say what to evict: --older-than DURATION and/or --bytes SIZE"),
                "evict", &s);
  }
  milliseconds idle{0};
  std::uint64_t bytes = 0;
  if (!o.older_than.empty()) {
    auto d = units::parse_duration(o.older_than);
    if (!d.is_ok() || d->count() <= 0)
      return fail(
          Status::invalid_argument("--older-than: " + o.older_than + " is not a positive duration (30m, 1h)"),
          "evict", &s);
    idle = *d;
  }
  if (!o.bytes.empty()) {
    auto b = units::parse_size(o.bytes);
    if (!b.is_ok() || *b == 0)
      return fail(Status::invalid_argument("--bytes: " + o.bytes + " is not a positive size (512MiB, 10GiB)"),
                  "evict", &s);
    bytes = *b;
  }
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  std::int64_t now = 0;
  auto chosen = (*cell)->admin().evict_lru(idle, bytes, !o.yes, o.limit, &now);
  if (!chosen.is_ok()) return fail(chosen.status(), "evict", &s);
  std::uint64_t total = 0;
  for (const auto& e : *chosen) total += e.size;
  if (s.json()) {
    json j{{"dry_run", !o.yes}, {"count", chosen->size()}, {"bytes", total}, {"objects", json::array()}};
    for (const auto& e : *chosen) {
      j["objects"].push_back({{"key", e.key}, {"size", e.size}, {"idle_ms", now - e.last_access_ms}});
    }
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  Table t({"KEY", "SIZE", "IDLE"});
  for (const auto& e : *chosen)
    t.row({shown_key(e.key), units::format_size(e.size), ago(e.last_access_ms, now)});
  if (!t.empty()) std::cout << t.str();
  std::cout << (o.yes ? "evicted " : "would evict ") << chosen->size() << " objects, "
            << units::format_size(total) << " (least recently used first, skipping objects being read)";
  std::cout << (o.yes ? "\n" : "; run again with --yes to do it\n");
  return kExitOk;
}

int get(Session& s, const std::string& key, const std::string& out) {
  auto store = s.store();
  if (!store.is_ok()) return fail(store.status(), "opening the store", &s);
  auto info = (*store)->stat(key);
  if (!info.is_ok()) return fail(plain(info.status(), key, s), "get", &s);
  std::string buf(info->size, '\0');
  Slice slice{buf.data(), buf.size()};
  auto got = (*store)->get(key, {&slice, 1});
  if (!got.is_ok()) return fail(plain(got.status(), key, s), "get", &s);
  buf.resize(got->size);
  if (out == "-") {
    std::cout.write(buf.data(), static_cast<std::streamsize>(buf.size()));
    return kExitOk;
  }
  std::ofstream f(out, std::ios::binary | std::ios::trunc);
  if (!f.write(buf.data(), static_cast<std::streamsize>(buf.size())) || !f.flush()) {
    return fail(Status::from_errno("cannot write " + out, errno), "get " + key, &s);
  }
  if (s.json()) {
    std::cout << json{{"key", key},
                      {"file", out},
                      {"size", buf.size()},
                      {"checksum", wire::to_hex64(got->checksum)}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "wrote " << buf.size() << " bytes of " << key << " to " << out << " (checksum verified)\n";
  }
  return kExitOk;
}

int put(Session& s, const std::string& key, const std::string& file, const std::string& ttl,
        const std::string& layout) {
  PutOptions po;
  po.object_layout = layout;
  if (!ttl.empty() && ttl != "never") {
    auto d = units::parse_duration(ttl);
    if (!d.is_ok()) return fail(d.status(), "put --ttl", &s);
    po.ttl = *d;
  }
  std::ifstream f(file, std::ios::binary);
  if (!f) return fail(Status::from_errno("cannot read " + file, errno), "put " + key, &s);
  std::string buf((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (buf.empty())
    return fail(Status::invalid_argument(file + " is empty: objects have at least one byte"), "put " + key,
                &s);
  auto store = s.store();
  if (!store.is_ok()) return fail(store.status(), "opening the store", &s);
  Slice slice{buf.data(), buf.size()};
  Status st = (*store)->put(key, {&slice, 1}, po);
  if (!st.is_ok()) return fail(st, "put " + key, &s);
  if (s.json()) {
    std::cout << json{{"key", key}, {"size", buf.size()}}.dump(2) << "\n";
  } else {
    std::cout << "stored " << buf.size() << " bytes as " << key << "\n";
  }
  return kExitOk;
}

}  // namespace

void add_object_commands(Registry& r) {
  Session& s = r.session;
  struct Options {
    LsOptions ls;
    EvictOptions evict;
    std::string key, file, out, ttl = "never", layout;
    std::vector<std::string> keys;
    bool yes = false;
  };
  auto o = std::make_shared<Options>();  // outlives parsing: the callbacks hold it

  auto* ls_cmd = r.app.add_subcommand("ls", "List objects (SCAN, never KEYS): size, TTL, last access, nodes");
  ls_cmd->add_option("PATTERN", o->ls.pattern, "Glob over object keys")->capture_default_str();
  ls_cmd->add_option("--limit", o->ls.limit, "Print at most N objects")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100'000'000u));
  ls_cmd
      ->add_option("--sort", o->ls.sort,
                   "none (SCAN order), access (least recently used first), size (largest first), key")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "access", "size", "key"}));
  ls_cmd->footer(
      "Examples:\n  kvstash ls\n  kvstash ls 'kvp:*' --sort access --limit 20\n  kvstash ls --sort size "
      "--json");
  ls_cmd->final_callback([&r, &s, o] {
    r.action = [&s, o] { return for_each_cell(s, [o](Session& c) { return ls(c, o->ls); }); };
  });

  auto* show_cmd = r.app.add_subcommand(
      "show", "One object: size, extents and generations, checksum, TTL, layout, last access");
  show_cmd->add_option("KEY", o->key, "Object key")->required();
  show_cmd->footer("Examples:\n  kvstash show session:42\n  kvstash show session:42 --json");
  show_cmd->final_callback([&r, &s, o] { r.action = [&s, o] { return show(s, o->key); }; });

  auto* rm_cmd =
      r.app.add_subcommand("rm", "Remove objects (their pages return to the pool once no reader holds them)");
  rm_cmd->add_option("KEY", o->keys, "Object keys")->required();
  rm_cmd->add_flag("--yes,-y", o->yes, "Do it (without: say what would be removed)");
  rm_cmd->footer(
      "Examples:\n  kvstash rm session:42 --yes\n  kvstash ls 'tmp:*' --json | jq -r '.[].key' | xargs "
      "kvstash rm --yes");
  rm_cmd->final_callback([&r, &s, o] { r.action = [&s, o] { return rm(s, o->keys, o->yes); }; });

  auto* touch_cmd =
      r.app.add_subcommand("touch", "Set objects' time to live from now and mark them recently used");
  touch_cmd->add_option("KEY", o->keys, "Object keys")->required();
  touch_cmd->add_option("--ttl", o->ttl, "Time to live (30m, 2h; never or 0: no expiry)")->required();
  touch_cmd->footer(
      "Examples:\n  kvstash touch session:42 --ttl 30m\n  kvstash touch session:42 --ttl never");
  touch_cmd->final_callback([&r, &s, o] { r.action = [&s, o] { return touch(s, o->keys, o->ttl); }; });

  auto* ev = r.app.add_subcommand("evict", "Evict least recently used objects (dry run unless --yes)");
  ev->add_option("--older-than", o->evict.older_than, "Only objects idle at least this long (1h, 30m)");
  ev->add_option("--bytes", o->evict.bytes, "Stop once this much is chosen (10GiB)");
  ev->add_option("--limit", o->evict.limit, "At most N objects per run")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1'000'000u));
  ev->add_flag("--yes,-y", o->evict.yes, "Do it (without: list what would be evicted)");
  ev->footer(
      "Examples:\n  kvstash evict --older-than 1h\n  kvstash evict --bytes 10GiB --yes\n"
      "  kvstash evict --older-than 30m --bytes 1GiB --yes --json");
  ev->final_callback([&r, &s, o] { r.action = [&s, o] { return evict(s, o->evict); }; });

  auto* get_cmd =
      r.app.add_subcommand("get", "Read an object through the data path into a file (checksum verified)");
  get_cmd->add_option("KEY", o->key, "Object key")->required();
  get_cmd->add_option("-o,--output", o->out, "File to write (- for stdout)")->required();
  get_cmd->footer(
      "Examples:\n  kvstash get session:42 -o /tmp/s42.bin\n  kvstash get session:42 -o - | xxd | head");
  get_cmd->final_callback([&r, &s, o] { r.action = [&s, o] { return get(s, o->key, o->out); }; });

  auto* put_cmd = r.app.add_subcommand("put", "Write a file as an object through the data path (debugging)");
  put_cmd->add_option("KEY", o->key, "Object key")->required();
  put_cmd->add_option("FILE", o->file, "File to store")->required();
  put_cmd->add_option("--ttl", o->ttl, "Time to live (30m; never: no expiry)")->capture_default_str();
  put_cmd->add_option("--layout", o->layout, "Layout text stored with the object");
  put_cmd->footer("Examples:\n  kvstash put test:1 ./blob.bin --ttl 10m");
  put_cmd->final_callback(
      [&r, &s, o] { r.action = [&s, o] { return put(s, o->key, o->file, o->ttl, o->layout); }; });
}

}  // namespace kvstash::cli
