// The kvstash CLI's shared pieces: the options every subcommand takes (which cell, how to
// reach its Redis), the lazily opened connections (the cell's and the store's), exit codes,
// errors that say how to fix them, and output (aligned tables for people, JSON for scripts).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kvstash/status.h"

namespace CLI {
class App;
}
namespace kvstash {
class Store;
namespace metadata {
class Cell;
class CellAdmin;
class RedisClient;
struct QuotaUse;
}  // namespace metadata
}  // namespace kvstash

namespace kvstash::cli {

// Exit codes (docs/cli.md).
inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitNotFound = 3;

struct Globals {
  std::string redis_url = "redis://127.0.0.1:6379/0";  // --redis, KVSTASH_REDIS_URL
  std::string password_file;                           // --redis-password-file
  std::string token_file;                              // --cluster-token-file
  bool token_file_given = false;                       // even as an empty path: refused
  std::string cell = "default";
  bool json = false;
  std::string timeout = "10s";
};

// What the command line asked for; the connections open on first use.
class Session {
 public:
  explicit Session(const Globals& g);
  ~Session();
  const Globals& globals() const { return g_; }
  bool json() const { return g_.json; }
  // The cell's connection: its admin() catalog for the operator's views and changes, its
  // catalog() for show, rm and touch, its redis() for plain commands (doctor).
  // kInvalidArgument with --cell all (for_each_cell runs a command on each).
  Result<metadata::Cell*> cell();
  // With --cell all, a store over the cell directory's cells.
  Result<Store*> store();
  // A connection for the cell directory (metadata/cell_directory.h).
  Result<metadata::RedisClient*> directory();
  bool all_cells() const { return g_.cell == kAllCells; }
  static constexpr std::string_view kAllCells = "all";
  // The Redis URL with any password replaced by "***".
  std::string redis_display() const;
  std::chrono::milliseconds timeout() const;

 private:
  // The Redis password and the cluster token, read once, when the cell is first needed.
  // kInvalidArgument for a token file that is unreadable, empty or not private (mode & 077),
  // and for KVSTASH_CLUSTER_TOKEN set but empty.
  Status credentials();
  const Globals& g_;
  std::string password_;
  std::string token_;
  bool have_credentials_ = false;
  std::unique_ptr<metadata::Cell> cell_;
  std::unique_ptr<metadata::RedisClient> directory_;
  std::unique_ptr<Store> store_;
};

// A subcommand's work, run after the command line parsed; returns the exit code.
using Action = std::function<int()>;
// Each file of the CLI adds its subcommands; the one chosen sets `action`.
struct Registry {
  CLI::App& app;
  Session& session;
  Action& action;
};
void add_cluster_commands(Registry& r);  // status, nodes, node show/rm, drain
void add_object_commands(Registry& r);   // ls, show, rm, touch, evict, get, put
void add_doctor_command(Registry& r);
void add_plan_command(Registry& r);
void add_cells_command(Registry& r);  // cells, cells set, cells settle
void add_quota_commands(Registry& r);  // quota, quota set/rm/recount
void add_explain_command(Registry& r);  // explain: why a key or a prompt missed
void add_events_command(Registry& r);   // events, events on/off/serve: KV events for routers

// The cell's quotas as `kvstash quota --json` and `kvstash status --json` show them, and one
// quota as a line of `kvstash status` (quotas.cc).
nlohmann::json quotas_json(const std::vector<metadata::QuotaUse>& quotas);
std::string quota_line(const metadata::QuotaUse& quota);

// A cell's memory as `kvstash status` counts it (cluster.cc): capacity and use of every node
// not gone, free bytes of the nodes that take new objects (up), how many nodes are in each
// state (up, draining, leaving, dead, gone).
struct CellMemory {
  std::uint64_t capacity = 0, used = 0, free = 0;
  std::map<std::string, int> states;
};
Result<CellMemory> cell_memory(metadata::CellAdmin& admin);

// `fn` on the session's cell; with --cell all, on every cell the cell directory lists, each
// under a "== cell NAME ==" heading (with --json: one document, {"cells": {NAME: ...}}).
// Returns the first nonzero exit code of the cells', else 0.
int for_each_cell(Session& s, const std::function<int(Session&)>& fn);

// The server's version ("7.2.4", from INFO server); "?" when it does not say.
std::string redis_version(metadata::RedisClient& r);

// Prints "kvstash: <doing>: <what went wrong>" and a line on how to fix it to stderr (`fix`,
// else one chosen by the status code); returns the exit code for the status (3 not found,
// 2 invalid argument, else 1).
int fail(const Status& s, std::string_view doing, const Session* session = nullptr,
         std::string_view fix = {});

// Aligned columns for people: numbers right-aligned, the rest left.
class Table {
 public:
  explicit Table(std::vector<std::string> header);
  void row(std::vector<std::string> cells);
  bool empty() const { return rows_.empty(); }
  std::string str() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// "12s", "29m 58s", "3h 4m", "2d 1h"; "-" for a negative duration.
std::string format_duration(std::chrono::milliseconds d);
// A wall-clock time in ms since the epoch, as "2026-11-29 17:45:02 UTC".
std::string format_time(std::int64_t ms_since_epoch);
// "1.50 GB" (decimal), for capacity planning figures.
std::string format_gb(double bytes);

// A progress bar on stderr, drawn only when stderr is a terminal.
class Progress {
 public:
  Progress(std::string label, std::uint64_t total);
  ~Progress();
  void update(std::uint64_t done, std::string_view note = {});

 private:
  std::string label_;
  std::uint64_t total_;
  bool tty_;
};

}  // namespace kvstash::cli
