// kvstash status, nodes, node show, node rm, drain: the cell and its memory nodes.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli.h"
#include "common/units.h"
#include "kvstash/store.h"
#include "metadata/cell.h"
#include "metadata/quotas.h"

namespace kvstash::cli {
namespace {

using metadata::NodeStatus;
using nlohmann::json;

struct Node {
  std::string id;
  NodeStatus s;
  // up, draining, dead (heartbeat past, or declared dead), gone.
  std::string state() const {
    if (s.state == "gone" || s.state == "dead") return s.state;
    return s.heartbeat_in_ms < 0 ? "dead" : s.state;
  }
  std::uint64_t capacity() const { return s.page_size * s.page_count; }
  std::uint64_t free() const { return s.page_size * std::min(s.free_pages, s.page_count); }
  std::uint64_t used() const { return capacity() - free(); }
  // Its NVMe tier (0: none).
  std::uint64_t tier_capacity() const { return s.page_size * s.tier_slots; }
  std::uint64_t tier_used() const {
    return s.page_size * (s.tier_slots - std::min(s.tier_free_slots, s.tier_slots));
  }
};

Result<std::vector<Node>> load_nodes(metadata::CellAdmin& c) {
  KVSTASH_ASSIGN_OR_RETURN(auto ids, c.known_nodes());
  std::vector<Node> out;
  for (const auto& id : ids) {
    auto s = c.node_status(id);
    if (s.status().code() == StatusCode::kNotFound) continue;  // forgotten meanwhile
    if (!s.is_ok()) return s.status();
    out.push_back({id, *s});
  }
  return out;
}

json node_json(const Node& n) {
  return {{"id", n.id},
          {"state", n.state()},
          {"epoch", n.s.epoch},
          {"page_size", n.s.page_size},
          {"pages", n.s.page_count},
          {"free_pages", n.s.free_pages},
          {"capacity_bytes", n.capacity()},
          {"used_bytes", n.used()},
          {"free_bytes", n.free()},
          {"objects", n.s.objects},
          {"object_pages", n.s.object_pages()},
          {"reserved_pages", n.s.reserved_pages},
          {"limbo_pages", n.s.limbo_pages},
          {"tier_slots", n.s.tier_slots},
          {"tier_free_slots", n.s.tier_free_slots},
          {"tier_objects", n.s.tier_objects},
          {"tier_capacity_bytes", n.tier_capacity()},
          {"tier_used_bytes", n.tier_used()},
          {"tier_recovery",
           {{"state", n.s.recovery.state},
            {"found", n.s.recovery.found},
            {"checked", n.s.recovery.checked},
            {"bad", n.s.recovery.bad},
            {"admitted", n.s.recovery.admitted},
            {"refused", n.s.recovery.refused}}},
          {"heartbeat_in_ms", n.s.heartbeat_in_ms}};
}

// A tier's last recovery into the cell (docs/metadata.md, "A cell that lost its Redis"), or
// "" when none ran.
std::string recovery_text(const NodeStatus::Recovery& r) {
  if (r.state.empty()) return "";
  if (r.state == "pending") return "pending (the cell started the tier over; the node offers what it holds)";
  return r.state + ": " + std::to_string(r.checked) + " of " + std::to_string(r.found) +
         " objects on the device checked, " + std::to_string(r.admitted) + " admitted, " +
         std::to_string(r.bad) + " not matching their sum, " + std::to_string(r.refused) +
         " refused (newer under the key, expired, a copy)";
}

// "used/capacity" of a node's NVMe tier, or "-" without one.
std::string tier_cell(const Node& n) {
  if (n.s.tier_slots == 0) return "-";
  return units::format_size(n.tier_used()) + "/" + units::format_size(n.tier_capacity());
}

std::string percent(std::uint64_t part, std::uint64_t whole) {
  if (whole == 0) return "-";
  char b[16];
  std::snprintf(b, sizeof b, "%.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
  return b;
}

std::string heartbeat(const Node& n) {
  if (n.state() == "gone") return "-";
  if (n.s.heartbeat_in_ms < 0) return "missed";
  return "in " + format_duration(std::chrono::milliseconds(n.s.heartbeat_in_ms));
}

Table nodes_table(const std::vector<Node>& nodes) {
  Table t({"NODE", "STATE", "CAPACITY", "USED", "FREE", "USED%", "OBJECTS", "RESERVED", "LIMBO", "NVME",
           "HEARTBEAT"});
  for (const auto& n : nodes) {
    t.row({n.id, n.state(), units::format_size(n.capacity()), units::format_size(n.used()),
           units::format_size(n.free()), percent(n.used(), n.capacity()), std::to_string(n.s.objects),
           units::format_size(n.s.reserved_pages * n.s.page_size),
           units::format_size(n.s.limbo_pages * n.s.page_size), tier_cell(n), heartbeat(n)});
  }
  return t;
}

CellMemory tally(const std::vector<Node>& nodes) {
  CellMemory m;
  for (const auto& n : nodes) {
    ++m.states[n.state()];
    if (n.state() == "gone") continue;
    m.capacity += n.capacity();
    m.used += n.used();
    m.free += n.state() == "up" ? n.free() : 0;  // draining and dead nodes take no new pages
  }
  return m;
}

json policy_json(const metadata::EvictionPolicyState& p) {
  json j{{"name", p.name}};
  if (p.name == "arc") {
    j["t1"] = p.t1;
    j["t2"] = p.t2;
    j["b1"] = p.b1;
    j["b2"] = p.b2;
    j["t1_target"] = p.t1_target;
  } else if (p.name == "turn-ttl") {
    j["ordered"] = p.ordered;
    j["ghosts"] = p.ghosts;
    j["clock_rate"] = p.clock_rate;
  }
  return j;
}

// "arc: 812 objects used once lately (target 640), 1,210 used again; remembers 800 + 1,500
// evicted keys", "turn-ttl: ...", or "lru: ...".
std::string policy_text(const metadata::EvictionPolicyState& p) {
  if (p.name == "turn-ttl") {
    return fmt::format(
        "turn-ttl: {} objects kept for times learned per class of use, the one due first goes first; "
        "remembers "
        "the turns of {} evicted keys{}",
        p.ordered, p.ghosts, p.clock_rate != 1 ? fmt::format(" (its clock at {}x)", p.clock_rate) : "");
  }
  if (p.name != "arc") return p.name + ": the least recently used object goes first";
  return fmt::format(
      "arc: {} objects used once lately (target {:.0f}), {} used again; remembers {} + {} evicted keys", p.t1,
      p.t1_target, p.t2, p.b1, p.b2);
}

int status(Session& s) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  metadata::CellAdmin& admin = (*cell)->admin();
  auto nodes = load_nodes(admin);
  if (!nodes.is_ok()) return fail(nodes.status(), "reading the nodes", &s);
  auto sum = admin.summary();
  if (!sum.is_ok()) return fail(sum.status(), "reading the cell", &s);
  auto [cap, used, free, states] = tally(*nodes);
  const std::string version = redis_version((*cell)->redis());
  auto scope = admin.rkey_scope();
  if (!scope.is_ok()) return fail(scope.status(), "reading the cell", &s);
  auto quotas = metadata::CellQuotas((*cell)->redis(), admin.prefix()).list();
  if (!quotas.is_ok()) return fail(quotas.status(), "reading the quotas", &s);
  auto policy = admin.policy();
  if (!policy.is_ok()) return fail(policy.status(), "reading the eviction policy", &s);
  if (s.json()) {
    json j{{"redis", {{"url", s.redis_display()}, {"version", version}}},
           {"cell", s.globals().cell},
           {"page_size", sum->page_size},
           {"nodes", json::array()},
           {"capacity_bytes", cap},
           {"used_bytes", used},
           {"free_bytes", free},
           {"objects", sum->objects},
           {"stored_bytes", sum->bytes},
           {"hits", sum->hits},
           {"misses", sum->misses},
           {"evicted", sum->evicted},
           {"expired", sum->expired},
           {"tier",
            {{"objects", sum->tier_objects},
             {"capacity_bytes", sum->tier_slots * sum->page_size},
             {"free_bytes", sum->tier_free_slots * sum->page_size},
             {"written_down", sum->written_down},
             {"promoted", sum->promoted},
             {"hits", sum->tier_hits},
             {"evicted", sum->tier_evicted},
             {"lost", sum->tier_lost}}},
           {"rkey_scope", to_string(*scope)},
           {"eviction_policy", policy_json(*policy)},
           {"quotas", quotas_json(*quotas)}};
    for (const auto& n : *nodes) j["nodes"].push_back(node_json(n));
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  std::cout << "redis     " << s.redis_display() << " (Redis " << version << "), cell " << s.globals().cell
            << "\n";
  std::cout << "nodes     " << nodes->size();
  const char* sep = ": ";
  for (const char* st : {"up", "draining", "leaving", "dead", "gone"}) {
    if (states.count(st) == 0) continue;
    std::cout << sep << states[st] << " " << st;
    sep = ", ";
  }
  std::cout << "\n";
  std::cout << "capacity  " << units::format_size(cap) << ", used " << units::format_size(used) << " ("
            << percent(used, cap) << "), free for new objects " << units::format_size(free) << "\n";
  std::cout << "objects   " << sum->objects << ", " << units::format_size(sum->bytes) << " stored";
  if (sum->page_size > 0) std::cout << " in pages of " << units::format_size(sum->page_size);
  std::cout << "\n";
  std::cout << "gets      " << sum->hits << " hits, " << sum->misses << " misses (hit ratio "
            << percent(sum->hits, sum->hits + sum->misses) << "); " << sum->evicted << " evicted, "
            << sum->expired << " expired\n";
  if (sum->tier_slots > 0) {
    const std::uint64_t tier_cap = sum->tier_slots * sum->page_size;
    const std::uint64_t tier_used =
        (sum->tier_slots - std::min(sum->tier_free_slots, sum->tier_slots)) * sum->page_size;
    std::cout << "nvme      " << sum->tier_objects << " objects, " << units::format_size(tier_used) << " of "
              << units::format_size(tier_cap) << " (" << percent(tier_used, tier_cap) << "); "
              << sum->written_down << " moved down, " << sum->promoted << " promoted for " << sum->tier_hits
              << " gets, " << sum->tier_evicted << " evicted there, " << sum->tier_lost << " lost\n";
    // Recoveries under way: a cell that lost its Redis getting its objects back.
    for (const auto& n : *nodes) {
      if (n.s.recovery.state == "pending" || n.s.recovery.state == "running") {
        std::cout << "recovery  " << n.id << " " << recovery_text(n.s.recovery) << "\n";
      }
    }
  }
  std::cout << "rkey      " << to_string(*scope) << " scope (kvstash rkey-scope)\n";
  std::cout << "policy    " << policy_text(*policy) << " (kvstash policy)\n";
  for (std::size_t i = 0; i < quotas->size(); ++i) {
    std::cout << (i == 0 ? "quotas    " : "          ") << quota_line((*quotas)[i]) << "\n";
  }
  if (!nodes->empty()) std::cout << "\n" << nodes_table(*nodes).str();
  return kExitOk;
}

int list_nodes(Session& s) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  auto nodes = load_nodes((*cell)->admin());
  if (!nodes.is_ok()) return fail(nodes.status(), "reading the nodes", &s);
  if (s.json()) {
    json j = json::array();
    for (const auto& n : *nodes) j.push_back(node_json(n));
    std::cout << j.dump(2) << "\n";
  } else if (nodes->empty()) {
    std::cout << "no memory nodes in cell " << s.globals().cell << " (start kvstashd --redis "
              << s.redis_display() << ")\n";
  } else {
    std::cout << nodes_table(*nodes).str();
  }
  return kExitOk;
}

Result<Node> one_node(Session& s, const std::string& id) {
  KVSTASH_ASSIGN_OR_RETURN(metadata::Cell * c, s.cell());
  auto st = c->admin().node_status(id);
  if (st.status().code() == StatusCode::kNotFound) {
    return Status::not_found("no memory node '" + id + "' in cell " + s.globals().cell);
  }
  KVSTASH_RETURN_IF_ERROR(st.status());
  return Node{id, *st};
}

int show_node(Session& s, const std::string& id) {
  auto n = one_node(s, id);
  if (!n.is_ok()) return fail(n.status(), "node show", &s);
  if (s.json()) {
    std::cout << node_json(*n).dump(2) << "\n";
    return kExitOk;
  }
  Table t({"FIELD", "VALUE"});
  t.row({"node", n->id});
  t.row({"state", n->state()});
  t.row({"epoch", n->s.epoch});
  t.row({"capacity", units::format_size(n->capacity()) + " (" + std::to_string(n->s.page_count) +
                         " pages of " + units::format_size(n->s.page_size) + ")"});
  t.row({"used", units::format_size(n->used()) + " (" + percent(n->used(), n->capacity()) + ")"});
  t.row({"free", units::format_size(n->free()) + " (" + std::to_string(n->s.free_pages) + " pages)"});
  t.row({"objects", std::to_string(n->s.objects) + " (" + std::to_string(n->s.object_pages()) + " pages)"});
  t.row({"reserved", units::format_size(n->s.reserved_pages * n->s.page_size) + " (" +
                         std::to_string(n->s.reserved_pages) + " pages of pending puts and reservations)"});
  t.row({"limbo", units::format_size(n->s.limbo_pages * n->s.page_size) + " (" +
                      std::to_string(n->s.limbo_pages) +
                      " pages freed, not yet reusable: read leases, fences)"});
  if (n->s.tier_slots > 0) {
    t.row({"nvme", units::format_size(n->tier_used()) + " of " + units::format_size(n->tier_capacity()) +
                       " (" + std::to_string(n->s.tier_objects) + " objects, " +
                       std::to_string(n->s.tier_free_slots) + " of " + std::to_string(n->s.tier_slots) +
                       " slots free)"});
    if (!n->s.recovery.state.empty()) t.row({"recovery", recovery_text(n->s.recovery)});
  } else {
    t.row({"nvme", "none (kvstashd --ssd)"});
  }
  t.row({"heartbeat", heartbeat(*n)});
  std::cout << t.str();
  return kExitOk;
}

int remove_node(Session& s, const std::string& id, bool yes) {
  auto n = one_node(s, id);
  if (!n.is_ok()) return fail(n.status(), "node rm", &s);
  if (n->state() != "dead" && n->state() != "gone") {
    return fail(Status::invalid_argument("node " + id + " is " + n->state() +
                                         ": only a dead node's leftovers can be removed (stop its kvstashd, "
                                         "or `kvstash drain " +
                                         id + "` first)"),
                "node rm", &s);
  }
  if (!yes) {
    std::cout << "would forget node " << id << " (" << n->state() << ") and release its " << n->s.objects
              << " objects; run again with --yes to do it\n";
    return kExitOk;
  }
  auto released = (*s.cell())->admin().forget_node(id);
  if (!released.is_ok()) return fail(released.status(), "node rm", &s);
  if (s.json()) {
    std::cout << json{{"node", id}, {"released_objects", *released}}.dump(2) << "\n";
  } else {
    std::cout << "forgot node " << id << ", released " << *released << " objects\n";
  }
  return kExitOk;
}

struct DrainOptions {
  std::string id, wait_for = "1h";
  bool wait = false, release = false, move = false, yes = false;
};

// Moves one object off a draining node: read it through the data path, write it again (only
// `up` nodes take new pages) unless somebody replaced it meanwhile (kStale then: the newer
// object stays wherever its writer put it). kNotFound when it left on its own.
Status move_object(Store& store, const std::string& key) {
  KVSTASH_ASSIGN_OR_RETURN(ObjectInfo st, store.stat(key));
  std::string buf(st.size, '\0');
  Slice slice{buf.data(), buf.size()};
  KVSTASH_ASSIGN_OR_RETURN(ObjectInfo got, store.get(key, {&slice, 1}));
  PutOptions po;
  po.object_layout = got.object_layout;
  po.if_version = got.version;
  if (st.ttl) po.ttl = std::max(*st.ttl, std::chrono::milliseconds(1));
  return store.put(key, {&slice, 1}, po);
}

int drain(Session& s, const DrainOptions& o) {
  const std::string& id = o.id;
  auto n = one_node(s, id);
  if (!n.is_ok()) return fail(n.status(), "drain", &s);
  if (n->state() == "dead" || n->state() == "gone") {
    return fail(
        Status::invalid_argument("node " + id + " is " + n->state() + ": use `kvstash node rm " + id + "`"),
        "drain", &s);
  }
  if (o.release && o.move) {
    return fail(Status::invalid_argument("--release drops the objects, --move keeps them: choose one"),
                "drain", &s);
  }
  const std::string objects = std::to_string(n->s.objects) + " objects";
  if (!o.yes) {
    std::cout << "would drain node " << id << ": no new objects on it; its " << objects
              << (o.release ? " released now"
                  : o.move  ? " moved to the other nodes"
                            : " stay readable until they expire or are evicted")
              << "; run again with --yes to do it\n";
    return kExitOk;
  }
  metadata::CellAdmin& c = (*s.cell())->admin();
  auto before = c.cordon_node(id);
  if (!before.is_ok()) return fail(before.status(), "drain", &s);
  std::uint64_t released = 0, moved = 0, changed = 0, gone = 0;
  if (o.release) {
    auto r = c.drain_node(id, n->s.epoch);
    if (!r.is_ok()) return fail(r.status(), "drain", &s);
    released = *r;
  }
  if (o.move && *before > 0) {
    auto store = s.store();
    if (!store.is_ok()) return fail(store.status(), "opening the store", &s);
    Progress bar("moving off " + id, *before);
    std::string cursor = "0";
    do {
      auto page = c.scan_node_objects(id, cursor, 256);
      if (!page.is_ok()) return fail(page.status(), "drain --move", &s);
      cursor = page->cursor;
      for (const auto& key : page->keys) {
        Status st = move_object(**store, key);
        if (st.is_ok()) {
          ++moved;
        } else if (st.code() == StatusCode::kStale) {
          ++changed;
        } else if (st.code() == StatusCode::kNotFound) {
          ++gone;
        } else {
          return fail(st.with_context("moving " + key), "drain --move", &s,
                      st.code() == StatusCode::kNoSpace
                          ? "the other nodes are full: add a node, `kvstash evict`, or finish with --release"
                          : std::string_view{});
        }
        bar.update(moved + changed + gone, std::to_string(moved) + " moved");
      }
    } while (cursor != "0");
  }
  auto now = c.node_status(id);
  if (!now.is_ok()) return fail(now.status(), "drain", &s);
  std::uint64_t left = now->objects;
  if (o.wait && left > 0) {
    auto limit = units::parse_duration(o.wait_for);
    if (!limit.is_ok()) return fail(limit.status(), "drain --wait-timeout", &s);
    const auto deadline = std::chrono::steady_clock::now() + *limit;
    Progress bar("draining " + id, left);
    const std::uint64_t start = left;
    while (left > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      auto st = c.node_status(id);
      if (!st.is_ok()) return fail(st.status(), "drain", &s);
      left = st->objects;
      bar.update(start - std::min(left, start), std::to_string(left) + " objects left");
    }
  }
  if (s.json()) {
    std::cout << json{{"node", id},
                      {"state", "draining"},
                      {"released_objects", released},
                      {"moved_objects", moved},
                      {"changed_objects", changed},
                      {"objects_left", left}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "node " << id << " is draining: no new objects";
    if (o.release) std::cout << "; released " << released << " objects";
    if (o.move) {
      std::cout << "; moved " << moved << " objects";
      if (changed > 0) std::cout << " (" << changed << " were rewritten meanwhile and left to their writers)";
    }
    std::cout << "; " << left << " objects left\n";
  }
  if (o.wait && left > 0) {
    return fail(Status::timeout(std::to_string(left) + " objects still on node " + id +
                                " after --wait-timeout " + o.wait_for),
                "drain", &s,
                "objects leave as they expire, are evicted or removed: wait longer, `kvstash drain " + id +
                    " --yes --move` to move them, or --release to drop them now");
  }
  return kExitOk;
}

// Shows the cell's eviction policy, or sets it.
int policy(Session& s, const std::string& want, bool yes) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  metadata::CellAdmin& admin = (*cell)->admin();
  auto now = admin.policy();
  if (!now.is_ok()) return fail(now.status(), "reading the eviction policy", &s);
  const bool change = !want.empty() && want != now->name;
  if (change && yes) {
    now = admin.set_policy(want);
    if (!now.is_ok()) return fail(now.status(), "setting the eviction policy", &s);
  }
  if (s.json()) {
    json j = policy_json(*now);
    j["changed"] = change && yes;
    std::cout << j.dump(2) << "\n";
    return kExitOk;
  }
  if (change && !yes) {
    std::cout << "would set the eviction policy from " << now->name << " to " << want
              << (want == "arc" ? " (the objects stored until then go first)" : "") << "; --yes to do it\n";
  } else {
    std::cout << (change ? "eviction policy set to " : "eviction policy ") << policy_text(*now) << "\n";
  }
  return kExitOk;
}

// Shows the cell's rkey scope, or sets it (clients read it when they open their store).
int rkey_scope(Session& s, const std::string& want, bool yes) {
  auto cell = s.cell();
  if (!cell.is_ok()) return fail(cell.status(), "connecting to Redis", &s);
  metadata::CellAdmin& admin = (*cell)->admin();
  auto now = admin.rkey_scope();
  if (!now.is_ok()) return fail(now.status(), "reading the cell", &s);
  std::optional<RkeyScope> next;
  if (!want.empty()) next = parse_rkey_scope(want);
  if (next && *next != *now && yes) {
    Status set = admin.set_rkey_scope(*next);
    if (!set.is_ok()) return fail(set, "setting the rkey scope", &s);
  }
  const bool changed = next && *next != *now && yes;
  if (s.json()) {
    std::cout << json{{"rkey_scope", to_string(changed ? *next : *now)}, {"changed", changed}}.dump(2)
              << "\n";
    return kExitOk;
  }
  if (!next || *next == *now) {
    std::cout << "rkey scope: " << to_string(*now)
              << (*now == RkeyScope::kConnection
                      ? " (verbs: one window per connection over each pool; no round trip to a node per "
                        "operation)\n"
                      : " (verbs: a window per operation over its pages; a round trip to the node each)\n");
  } else if (!yes) {
    std::cout << "would set the rkey scope from " << to_string(*now) << " to " << to_string(*next)
              << " (clients opening their store from then on follow it); --yes to do it\n";
  } else {
    std::cout << "rkey scope set to " << to_string(*next)
              << ": clients that open their store from now on use it\n";
  }
  return kExitOk;
}

}  // namespace

Result<CellMemory> cell_memory(metadata::CellAdmin& admin) {
  KVSTASH_ASSIGN_OR_RETURN(auto nodes, load_nodes(admin));
  return tally(nodes);
}

void add_cluster_commands(Registry& r) {
  Session& s = r.session;
  struct Options {
    std::string show_id, rm_id;
    bool rm_yes = false;
    DrainOptions drain;
    std::string scope;
    bool scope_yes = false;
    std::string policy;
    bool policy_yes = false;
  };
  auto o = std::make_shared<Options>();  // outlives parsing: the callbacks hold it

  auto* st =
      r.app.add_subcommand("status", "The cell at a glance: Redis, nodes, capacity, objects, hit ratio");
  st->footer("Examples:\n  kvstash status\n  kvstash status --json | jq .free_bytes");
  st->final_callback([&r, &s] { r.action = [&s] { return for_each_cell(s, status); }; });

  auto* nodes =
      r.app.add_subcommand("nodes", "List memory nodes: state, capacity, used, free, objects, heartbeat");
  nodes->footer("Examples:\n  kvstash nodes\n  kvstash nodes --json");
  nodes->final_callback([&r, &s] { r.action = [&s] { return list_nodes(s); }; });

  auto* node = r.app.add_subcommand("node", "One memory node: show, rm");
  node->require_subcommand(1);
  auto* show = node->add_subcommand("show", "One node in detail");
  show->add_option("ID", o->show_id, "Node id")->required();
  show->footer("Examples:\n  kvstash node show node-7");
  show->final_callback([&r, &s, o] { r.action = [&s, o] { return show_node(s, o->show_id); }; });
  auto* rm =
      node->add_subcommand("rm", "Forget a dead node: release its objects, drop its record from the cell");
  rm->add_option("ID", o->rm_id, "Node id")->required();
  rm->add_flag("--yes,-y", o->rm_yes, "Do it (without: say what would be done)");
  rm->footer("Examples:\n  kvstash node rm node-7          # dry run\n  kvstash node rm node-7 --yes");
  rm->final_callback([&r, &s, o] { r.action = [&s, o] { return remove_node(s, o->rm_id, o->rm_yes); }; });

  auto* dr = r.app.add_subcommand("drain",
                                  "Stop new placements on a node; optionally wait for its objects to leave");
  dr->add_option("ID", o->drain.id, "Node id")->required();
  dr->add_flag("--wait", o->drain.wait,
               "Wait (with a progress bar on a terminal) until its objects expired, were evicted or removed");
  dr->add_option("--wait-timeout", o->drain.wait_for, "Give up waiting after this long")
      ->capture_default_str();
  dr->add_flag("--release", o->drain.release,
               "Release its objects now (readers get not found and recompute)");
  dr->add_flag("--move", o->drain.move,
               "Move its objects to the other nodes now (read, rewrite unless replaced meanwhile)");
  dr->add_flag("--yes,-y", o->drain.yes, "Do it (without: say what would be done)");
  dr->footer(
      "Examples:\n  kvstash drain node-7 --yes\n  kvstash drain node-7 --yes --wait --wait-timeout 30m\n"
      "  kvstash drain node-7 --yes --move\n  kvstash drain node-7 --yes --release");
  dr->final_callback([&r, &s, o] { r.action = [&s, o] { return drain(s, o->drain); }; });

  auto* rk = r.app.add_subcommand(
      "rkey-scope",
      "Show or set how clients key the pools over verbs: per connection (no round trip to a node per "
      "operation; the default) or per lease (a window over each operation's pages)");
  rk->add_option("SCOPE", o->scope, "connection or lease")->check(CLI::IsMember({"connection", "lease"}));
  rk->add_flag("--yes,-y", o->scope_yes, "Do it (without: say what would change)");
  rk->footer(
      "docs/architecture.md explains the trade.\n\nExamples:\n  kvstash rkey-scope\n  kvstash rkey-scope "
      "lease "
      "--yes");
  rk->final_callback([&r, &s, o] { r.action = [&s, o] { return rkey_scope(s, o->scope, o->scope_yes); }; });

  auto* pol = r.app.add_subcommand(
      "policy",
      "Show or set which object a full pool evicts first: lru (the least recently used; the default), arc "
      "(ARC: recency and frequency lists whose split adapts to the keys evicted from each) or turn-ttl "
      "(each use keeps a KV cache's chunk for a time learned per conversation turn and prompt length; "
      "needs the engines' keep hints)");
  pol->add_option("POLICY", o->policy, "lru, arc or turn-ttl")
      ->check(CLI::IsMember({"lru", "arc", "turn-ttl"}));
  pol->add_flag("--yes,-y", o->policy_yes, "Do it (without: say what would change)");
  pol->footer(
      "docs/operations.md (\"Choosing an eviction policy\") compares them on a production trace; "
      "kvstash-bench replay measures them on yours.\n\nExamples:\n  kvstash policy\n  kvstash policy arc "
      "--yes\n  kvstash policy turn-ttl --yes");
  pol->final_callback([&r, &s, o] { r.action = [&s, o] { return policy(s, o->policy, o->policy_yes); }; });
}

}  // namespace kvstash::cli
