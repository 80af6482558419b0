// kvstash cells: the cell directory of a deployment of several cells (show, set, settle), and
// --cell all, which runs status, ls and doctor on each of them.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "common/units.h"
#include "metadata/cell.h"
#include "metadata/cell_directory.h"
#include "metadata/cell_routes.h"

namespace kvstash::cli {

using nlohmann::json;

namespace {

Result<metadata::CellDirectory> read_directory(Session& s) {
  KVSTASH_ASSIGN_OR_RETURN(auto* redis, s.directory());
  KVSTASH_ASSIGN_OR_RETURN(auto d, metadata::read_cell_directory(*redis));
  if (!d) return Status::not_found("this Redis holds no cell directory (a deployment of one cell)");
  return std::move(*d);
}

constexpr std::string_view kNoDirectoryFix = "`kvstash cells set NAME,NAME,...` writes one";

// Objects of `cell` whose key the current set routes to another cell: what a settle would
// hide from gets. Scans the whole cell.
Result<std::uint64_t> strays(Session& per_cell, const metadata::CellDirectory& d, const std::string& cell) {
  KVSTASH_ASSIGN_OR_RETURN(auto* c, per_cell.cell());
  std::uint64_t n = 0;
  std::string cursor = "0";
  do {
    KVSTASH_ASSIGN_OR_RETURN(auto step, c->admin().scan_objects("*", cursor, 500));
    for (const auto& key : step.keys) {
      if (d.cells[metadata::pick_cell(d.cells, metadata::route_of(key))] != cell) ++n;
    }
    cursor = step.cursor;
  } while (cursor != "0");
  return n;
}

int show(Session& s) {
  auto d = read_directory(s);
  if (!d.is_ok()) return fail(d.status(), "reading the cell directory", &s, kNoDirectoryFix);
  json cells = json::array();
  Table t({"CELL", "ROUTES", "NODES UP", "FREE", "OBJECTS", "STRAYS"});
  for (const auto& name : d->every_cell()) {
    Globals g = s.globals();
    g.cell = name;
    Session per(g);
    auto c = per.cell();
    if (!c.is_ok()) return fail(c.status(), "connecting to cell " + name, &s);
    auto sum = (*c)->admin().summary();
    auto memory = cell_memory((*c)->admin());
    if (!sum.is_ok() || !memory.is_ok()) {
      return fail(sum.is_ok() ? memory.status() : sum.status(), "reading cell " + name, &s);
    }
    const std::uint64_t up = static_cast<std::uint64_t>(memory->states["up"]), free = memory->free;
    const bool routes = std::ranges::find(d->cells, name) != d->cells.end();
    const bool was = std::ranges::find(d->previous, name) != d->previous.end();
    std::uint64_t stray = 0;
    if (was) {
      auto n = strays(per, *d, name);
      if (!n.is_ok()) return fail(n.status(), "scanning cell " + name, &s);
      stray = *n;
    }
    cells.push_back({{"cell", name},
                     {"routes", routes},
                     {"previous", was},
                     {"nodes_up", up},
                     {"free_bytes", free},
                     {"objects", sum->objects},
                     {"strays", stray}});
    t.row({name, routes ? (was || d->previous.empty() ? "yes" : "yes (new)") : "no (draining)",
           std::to_string(up), units::format_size(free), std::to_string(sum->objects),
           was ? std::to_string(stray) : "-"});
  }
  if (s.json()) {
    std::cout << json{{"epoch", d->epoch}, {"cells", d->cells}, {"previous", d->previous}, {"detail", cells}}
                     .dump(2)
              << "\n";
    return kExitOk;
  }
  std::cout << "cell directory, epoch " << d->epoch << ": puts route over " << d->cells.size() << " cells";
  if (!d->previous.empty()) {
    std::cout << "; a change is settling: gets look first where the previous " << d->previous.size()
              << " cells put a key";
  }
  std::cout << "\n" << t.str();
  if (!d->previous.empty()) {
    std::cout
        << "STRAYS: objects the current cells route elsewhere; `kvstash cells settle --yes` once none is "
           "left (they expire, are evicted, removed or overwritten)\n";
  }
  return kExitOk;
}

int set(Session& s, const std::string& list, bool yes, bool force) {
  auto cells = metadata::parse_cell_list(list);
  if (!cells.is_ok() || cells->empty()) {
    return fail(cells.is_ok() ? Status::invalid_argument("no cell named") : cells.status(), "cells set", &s);
  }
  auto now = read_directory(s);
  if (!now.is_ok() && now.status().code() != StatusCode::kNotFound) {
    return fail(now.status(), "reading the cell directory", &s);
  }
  if (now.is_ok() && !now->previous.empty() && !force) {
    return fail(
        Status::invalid_argument("the last change has not settled"), "cells set", &s,
        "`kvstash cells` shows what is left in the previous cells; `kvstash cells settle --yes` first, "
        "or --force (gets stop looking where the older set put keys)");
  }
  if (!yes) {
    std::cout << "would route puts over " << list << (now.is_ok() ? " (now: " : "");
    if (now.is_ok()) {
      for (std::size_t i = 0; i < now->cells.size(); ++i) std::cout << (i ? "," : "") << now->cells[i];
      std::cout << ")";
    }
    std::cout
        << "; no bytes move: gets look first in the cell the old set picks until `kvstash cells settle`. "
           "--yes to do it\n";
    return kExitOk;
  }
  auto redis = s.directory();
  if (!redis.is_ok()) return fail(redis.status(), "connecting to Redis", &s);
  auto d = metadata::set_cell_directory(**redis, *cells);
  if (!d.is_ok()) return fail(d.status(), "writing the cell directory", &s);
  if (s.json()) {
    std::cout << json{{"epoch", d->epoch}, {"cells", d->cells}, {"previous", d->previous}}.dump(2) << "\n";
  } else {
    std::cout << "cell directory epoch " << d->epoch << ": puts route over " << list
              << "; clients follow within their refresh (StoreOptions::cell_directory_refresh)\n";
  }
  return kExitOk;
}

int settle(Session& s, bool yes) {
  auto d = read_directory(s);
  if (!d.is_ok()) return fail(d.status(), "reading the cell directory", &s, kNoDirectoryFix);
  std::uint64_t left = 0;
  for (const auto& name : d->previous) {
    Globals g = s.globals();
    g.cell = name;
    Session per(g);
    auto n = strays(per, *d, name);
    if (!n.is_ok()) return fail(n.status(), "scanning cell " + name, &s);
    left += *n;
  }
  if (!yes) {
    std::cout << left << " objects are still in cells the current set does not route them to; settling "
              << (left > 0 ? "hides them from gets" : "loses nothing") << ". --yes to settle\n";
    return kExitOk;
  }
  auto redis = s.directory();
  if (!redis.is_ok()) return fail(redis.status(), "connecting to Redis", &s);
  Status settled = metadata::settle_cell_directory(**redis);
  if (!settled.is_ok()) return fail(settled, "settling the cell directory", &s);
  if (s.json()) {
    std::cout << json{{"settled", true}, {"strays_hidden", left}}.dump(2) << "\n";
  } else {
    std::cout << "settled: gets look only where the current cells route" << (left > 0 ? " (" : "")
              << (left > 0 ? std::to_string(left) + " stray objects are no longer found)" : "") << "\n";
  }
  return kExitOk;
}

}  // namespace

int for_each_cell(Session& s, const std::function<int(Session&)>& fn) {
  if (!s.all_cells()) return fn(s);
  auto d = read_directory(s);
  if (!d.is_ok()) return fail(d.status(), "--cell all: reading the cell directory", &s, kNoDirectoryFix);
  int rc = kExitOk;
  json docs = json::object();
  for (const auto& name : d->every_cell()) {
    Globals g = s.globals();
    g.cell = name;
    Session per(g);
    if (!s.json()) {
      std::cout << "== cell " << name << " ==\n" << std::flush;
      const int one = fn(per);
      if (rc == kExitOk) rc = one;
      continue;
    }
    std::ostringstream out;
    auto* old = std::cout.rdbuf(out.rdbuf());
    const int one = fn(per);
    std::cout.rdbuf(old);
    if (rc == kExitOk) rc = one;
    docs[name] = json::parse(out.str(), nullptr, false);
  }
  if (s.json()) std::cout << json{{"cells", docs}}.dump(2) << "\n";
  return rc;
}

void add_cells_command(Registry& r) {
  Session& s = r.session;
  struct Options {
    std::string list;
    bool yes = false, force = false;
  };
  auto o = std::make_shared<Options>();
  auto* cells =
      r.app.add_subcommand("cells", "The cell directory of a deployment of several cells: show, set, settle");
  cells->footer(
      "Examples:\n  kvstash cells\n  kvstash cells set a,b,c --yes\n  kvstash cells settle --yes\n"
      "  kvstash --cell all status\n\n"
      "Puts route to a cell by rendezvous hashing of their key's route (docs/operations.md, Cells); a change "
      "of the set moves no bytes: gets look first where the previous set put a key until the change is "
      "settled.");
  cells->final_callback([&r, &s, cells] {
    if (cells->get_subcommands().empty()) r.action = [&s] { return show(s); };
  });
  auto* set_cmd =
      cells->add_subcommand("set", "Route puts over these cells (the set they replace keeps serving gets)");
  set_cmd->add_option("cells", o->list, "Comma-separated cell names")->required();
  set_cmd->add_flag("--yes", o->yes, "Do it (else say what would change)");
  set_cmd->add_flag("--force", o->force, "Even while the last change has not settled");
  set_cmd->final_callback([&r, &s, o] { r.action = [&s, o] { return set(s, o->list, o->yes, o->force); }; });
  auto* settle_cmd =
      cells->add_subcommand("settle", "End a change: gets look only where the current cells route");
  settle_cmd->add_flag("--yes", o->yes, "Do it (else count what it would hide)");
  settle_cmd->final_callback([&r, &s, o] { r.action = [&s, o] { return settle(s, o->yes); }; });
}

}  // namespace kvstash::cli
