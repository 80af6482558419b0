// `kvstash-bench metadata`: how many metadata operations one Redis serves to N clients, next to
// redis-benchmark's plain commands on the same Redis in the same run.
//
// Starts a private redis-server on loopback and registers two fake memory nodes through the real
// node script. Their pools hold 2^30 pages each: pages are handed out lazily (a counter, no free
// list to build), so the pool never fills and no put evicts; eviction's cost is in the --scripts
// table. Then kHotObjects one-page objects are put for the gets to read.
//
// Per client count N: redis-benchmark (-c N, -P 1) runs SET and GET, EVALSHA of a script that
// returns 1 (the floor of any script), and kvstash's contains_prefix (one real script without
// our client) as clients run it (FCALL of its function) and as its EVAL text (EVALSHA: the
// prelude run on every call, where Redis has no Functions); then N threads, each with its own connection and
// Catalog as a store's connection has, run the mix put, get, contains_prefix in turn for --seconds. Latency
// is the client's wall time per operation; round trips per operation are counted by the operation, and for
// the whole mix by Redis itself (INFO commandstats: FCALL and EVALSHA calls, and the redis.call()s run inside
// them); INFO's and getrusage's CPU times say who was busy. Nothing here asserts on time.
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <latch>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/thread_pool.h"
#include "kvstash/store.h"
#include "measure.h"
#include "metadata/cell.h"
#include "metadata/quotas.h"
#include "metadata/read_releases.h"
#include "metadata/records.h"
#include "metadata/scripts.h"
#include "metadata_bench.h"
#include "tests/harness/local_cluster.h"
#include "tests/harness/throwaway_tls.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;
using metadata::Cell;

constexpr std::uint64_t kPage = 4096;
constexpr std::uint64_t kPoolPages = 1ull << 30;  // per fake node: never fills
constexpr std::size_t kHotObjects = 10000;        // what gets and contains_prefix read
constexpr std::size_t kChain = 4;                 // keys per contains_prefix
constexpr std::chrono::milliseconds kLease = 30s;
const sum::ObjectSum kSum{1};  // the records hold it; nothing reads the bytes

// The mix, run in this order by every client (each starting at another place in it).
enum Kind : std::size_t { kPut, kGet, kContains, kKinds };
constexpr std::array<const char*, kKinds> kKindNames = {"kvstash put (commit_reserved)",
                                                        "kvstash get (begin_get + end_gets)",
                                                        "kvstash contains_prefix (4 keys)"};

// How a put of a one-page object talks to Redis, and the only place the load knows it: one
// commit_reserved on a page of the client's reservation, plus a reserve_pages when it ran out.
class PutPath {
 public:
  PutPath(metadata::Catalog& catalog, const std::string& client)
      : catalog_(catalog), token_prefix_("put-" + client + "-") {}

  // Puts `key` (one page, no TTL) as a Store does: a run of the client's page reservation and
  // one commit, or a new reservation first when it ran out. The Redis round trips it took, or
  // the first error.
  Result<std::uint32_t> put(std::string_view key) {
    std::uint32_t trips = 1;
    if (next_page_ >= reserved_) {
      reservation_.assign(token_prefix_).append("r").append(std::to_string(next_++));
      KVSTASH_ASSIGN_OR_RETURN(auto p, catalog_.reserve_pages(reservation_, kPage, reserve_, kLease));
      reserved_ = p.extents.size();
      next_page_ = 0;
      ++trips;
    }
    token_.assign(token_prefix_).append(std::to_string(next_++));
    KVSTASH_RETURN_IF_ERROR(
        catalog_.commit_reserved({reservation_, next_page_++, 1}, token_, key, kPage, kSum, "", 0ms));
    return trips;
  }

 private:
  metadata::Catalog& catalog_;
  const std::uint64_t reserve_ = StoreOptions{}.put_reservation;  // what a Store reserves ahead
  std::string token_prefix_;
  std::string token_, reservation_;
  std::uint64_t next_ = 0;
  std::uint64_t reserved_ = 0, next_page_ = 0;  // pages of the reservation, and the next one to take
};

// Ends the clients' read leases as a Store's releaser does: on a thread and connection of its
// own, the leases that queued while one end_gets ran all in the next.
class Releaser {
 public:
  explicit Releaser(std::unique_ptr<Cell> cell) : cell_(std::move(cell)) {}

  void end(metadata::Catalog::EndedRead read) {
    if (!releases_.add(std::move(read))) return;
    pool_.submit([this] {
      releases_.drain([this](std::span<const metadata::Catalog::EndedRead> batch) {
        auto ended = cell_->catalog().end_gets(batch);
        scripts_.fetch_add(1, std::memory_order_relaxed);
        Status first = ended.is_ok() ? Status::ok() : ended.status();
        for (std::size_t i = 0; ended.is_ok() && i < ended->size() && first.is_ok(); ++i) first = (*ended)[i];
        std::lock_guard lock(mu_);
        if (error_.is_ok()) error_ = first;
      });
    });
  }
  // Waits until every lease handed to end() has been ended.
  void settle() {
    pool_.submit([] {}).wait();
  }
  std::uint64_t scripts() const { return scripts_.load(std::memory_order_relaxed); }
  Status error() const {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  std::unique_ptr<Cell> cell_;
  metadata::ReadReleases releases_;
  std::atomic<std::uint64_t> scripts_{0};
  mutable std::mutex mu_;
  Status error_;        // the first lease that did not end OK
  ThreadPool pool_{1};  // last: its thread goes before what it uses
};

struct Tally {
  std::array<std::vector<double>, kKinds> us;  // client wall time of each operation
  std::array<std::uint64_t, kKinds> round_trips{};
  Status error;  // the first failure: the client stopped there
};

// One client: its own connection and catalog, as a store's connection has.
class Client {
 public:
  // `serial` is unique in the run: its put tokens are never an earlier client's (a reused
  // reservation token is a retry, answered with what that reservation has left), and its keys
  // never an earlier client's objects (a put that replaces an object does more: release).
  Client(std::unique_ptr<Cell> cell, int index, std::uint64_t serial, std::span<const std::string> hot,
         Releaser& releaser)
      : cell_(std::move(cell)),
        releaser_(releaser),
        index_(static_cast<std::size_t>(index)),
        hot_(hot),
        put_(cell_->catalog(), std::to_string(serial)),
        reader_("reader-" + std::to_string(index)),
        key_prefix_("new/" + std::to_string(serial) + "/"),
        rng_(static_cast<std::uint32_t>(index) + 1) {}

  // One operation of each kind, not counted: the connection and Redis's script cache warm.
  void warm() {
    for (std::size_t k = 0; k < kKinds && tally_.error.is_ok(); ++k) {
      if (auto r = run(static_cast<Kind>(k)); !r.is_ok()) tally_.error = r.status();
    }
  }

  // The mix until `stop`, or the first error.
  void run_until(const std::atomic<bool>& stop) {
    for (std::size_t i = index_; tally_.error.is_ok() && !stop.load(std::memory_order_relaxed); ++i) {
      const auto kind = static_cast<Kind>(i % kKinds);
      const Deadline t0 = Clock::now();
      Result<std::uint32_t> trips = run(kind);
      if (!trips.is_ok()) {
        tally_.error = trips.status();
        break;
      }
      tally_.us[kind].push_back(us_since(t0));
      tally_.round_trips[kind] += *trips;
    }
  }

  const Tally& tally() const { return tally_; }

 private:
  Result<std::uint32_t> run(Kind kind) {
    switch (kind) {
      case kPut: key_.assign(key_prefix_).append(std::to_string(next_put_++)); return put_.put(key_);
      case kGet: return get();
      default: return contains();
    }
  }

  // One reader name per get, as a store's get has; its lease ends on the releaser, off the
  // client's path (the releaser's round trips are counted apart).
  Result<std::uint32_t> get() {
    const std::string& key = hot_[rng_() % hot_.size()];
    std::string reader = reader_ + "-" + std::to_string(next_get_++);
    KVSTASH_ASSIGN_OR_RETURN(metadata::ReadLease lease, cell_->catalog().begin_get(key, reader, kLease));
    releaser_.end(
        {std::move(reader), std::move(lease.object_token), std::move(lease.placement.extents_text)});
    return 1u;
  }

  Result<std::uint32_t> contains() {
    const std::size_t first = rng_() % (hot_.size() - kChain + 1);
    KVSTASH_ASSIGN_OR_RETURN(std::size_t n, cell_->catalog().contains_prefix(hot_.subspan(first, kChain)));
    if (n != kChain) {
      return Status::internal("contains_prefix found " + std::to_string(n) + " of " + std::to_string(kChain) +
                              " keys that were put");
    }
    return 1u;
  }

  std::unique_ptr<Cell> cell_;
  Releaser& releaser_;
  std::size_t index_;
  std::span<const std::string> hot_;
  PutPath put_;
  std::string reader_;
  std::string key_prefix_;
  std::string key_;
  std::uint64_t next_put_ = 0, next_get_ = 0;
  std::minstd_rand rng_;
  Tally tally_;
};

// A table row, and a JSON object.
struct Row {
  std::string what;
  int clients = 0;
  double ops_per_s = 0, p50_us = 0, p99_us = 0, round_trips = 0;
  std::string error;     // the row did not run (or not to its end): why
  nlohmann::json extra;  // more for the JSON object
};

// What Redis says it did (INFO), and what this process spent.
struct Counters {
  double requests = 0;    // FCALL, EVALSHA, EVAL, FUNCTION and SCRIPT LOAD calls: the clients' round trips
  double commands = 0;    // total_commands_processed: requests, and what scripts call
  double cpu_s = 0;       // used_cpu_user + used_cpu_sys of redis-server
  double script_us = 0;   // time inside FCALL and EVALSHA
  double self_cpu_s = 0;  // this process (the clients), getrusage
};

// A number in an INFO reply: what follows `field` within the line that starts with `line`
// (both with their leading "\n"; an empty `line`: anywhere), e.g. ("\ncmdstat_evalsha:", "calls=").
double info_number(std::string_view info, std::string_view line, std::string_view field) {
  if (!line.empty()) {
    const std::size_t at = info.find(line);
    if (at == std::string_view::npos) return 0;
    info = info.substr(at + 1, info.find('\r', at + 1) - at - 1);
  }
  const std::size_t at = info.find(field);
  if (at == std::string_view::npos) return 0;
  return std::strtod(std::string(info.substr(at + field.size(), 32)).c_str(), nullptr);
}

Result<Counters> counters(metadata::RedisClient& redis) {
  KVSTASH_ASSIGN_OR_RETURN(metadata::Reply r, redis.command({"INFO", "stats", "cpu", "commandstats"}));
  const std::string_view info = r.str();
  Counters c;
  // total_commands_processed counts what scripts call too: the requests are these.
  for (const char* cmd : {"\ncmdstat_fcall:", "\ncmdstat_evalsha:", "\ncmdstat_eval:",
                          "\ncmdstat_function|load:", "\ncmdstat_script|load:"}) {
    c.requests += info_number(info, cmd, "calls=");
  }
  c.commands = info_number(info, "", "\ntotal_commands_processed:");
  c.cpu_s = info_number(info, "", "\nused_cpu_user:") + info_number(info, "", "\nused_cpu_sys:");
  c.script_us =
      info_number(info, "\ncmdstat_fcall:", "usec=") + info_number(info, "\ncmdstat_evalsha:", "usec=");
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  c.self_cpu_s = seconds(u.ru_utime) + seconds(u.ru_stime);
  return c;
}

// One line of redis-benchmark --csv: "GET","48661.80","0.061","0.008","0.063","0.095","0.127",...
struct BenchLine {
  std::string test;
  double rps = 0, p50_us = 0, p99_us = 0;
};

std::optional<BenchLine> parse_csv_line(const std::string& line) {
  std::vector<std::string> f;
  for (std::size_t i = 0; i < line.size();) {
    if (line[i] != '"') return std::nullopt;
    const std::size_t end = line.find('"', i + 1);
    if (end == std::string::npos) return std::nullopt;
    f.push_back(line.substr(i + 1, end - i - 1));
    i = end + 2;  // past the quote and the comma
  }
  // test, rps, avg, min, p50, p95, p99, max (ms)
  if (f.size() < 7 || f[0] == "test") return std::nullopt;
  return BenchLine{f[0], std::strtod(f[1].c_str(), nullptr), std::strtod(f[4].c_str(), nullptr) * 1000,
                   std::strtod(f[6].c_str(), nullptr) * 1000};
}

// redis-benchmark -c `clients` -n `requests` -P 1 --csv, then `test` (`-t set,get`, or a command
// of its own). Errors: kNotFound when it is not installed, kUnavailable when it failed or gave no
// figures, kTimeout when it ran past its bound (it is killed).
Result<std::vector<BenchLine>> redis_benchmark(int port, int clients, std::uint64_t requests,
                                               const std::vector<std::string>& test, Deadline deadline) {
  harness::ChildOptions co;
  co.argv = {"redis-benchmark",
             "-h",
             "127.0.0.1",
             "-p",
             std::to_string(port),
             "-c",
             std::to_string(clients),
             "-n",
             std::to_string(requests),
             "-P",
             "1",
             "--csv"};
  co.argv.insert(co.argv.end(), test.begin(), test.end());
  auto child = harness::ChildProcess::start(co);
  if (!child.is_ok()) {
    if (child.status().code() == StatusCode::kNotFound) {
      return Status::not_found("redis-benchmark is not installed (Debian package redis-tools)");
    }
    return child.status();
  }
  std::vector<BenchLine> lines;
  while (auto line = child->read_line(deadline)) {
    if (auto l = parse_csv_line(*line)) lines.push_back(std::move(*l));
  }
  if (!child->eof()) {
    child->kill();
    return Status::timeout("redis-benchmark ran past its time bound and was killed");
  }
  const std::optional<int> status = child->wait(deadline);
  if (!status) {
    child->kill();
    return Status::timeout("redis-benchmark ran past its time bound and was killed");
  }
  if (*status != 0 || lines.empty()) {
    return Status::unavailable("redis-benchmark " + harness::describe_status(*status) +
                               (lines.empty() ? " and gave no figures" : ""));
  }
  return lines;
}

// Everything one run shares: Redis, its cell, the hot keys, the options.
class LoadBench {
 public:
  // `cell` is a connection to the cell the clients use, over `redis` (a plain server, or the
  // master of the cell's slot in a cluster), opened from `options`.
  LoadBench(const MetadataBenchOptions& o, harness::LocalRedis& redis, Cell& cell,
            metadata::CellOptions options)
      : o_(o), redis_(redis), cell_(cell), options_(std::move(options)) {}

  Status prepare();
  // The rows of one client count: redis-benchmark's, then the mix's.
  std::vector<Row> measure_group(int clients);
  // --features: redis-benchmark's rows, then the mix's row after each feature is turned on.
  std::vector<Row> measure_features(int clients);
  // The mix's rows alone.
  void kvstash_rows(int clients, std::vector<Row>* rows);

 private:
  Result<std::unique_ptr<Cell>> connect() const { return Cell::open(options_); }
  // Registers the two fake nodes, without grant keys: the cell signs no grants for them.
  Status register_nodes();
  // Hands each node a grant key (the heartbeat of a key rotation): grants are signed from then.
  Status hand_grant_keys();
  // Sets `count` quotas: one over the gets' keys, one over the puts', the rest over prefixes no
  // key has; all with room to spare.
  Status set_quotas(int count);
  void reference_rows(int clients, std::vector<Row>* rows);

  const MetadataBenchOptions& o_;
  harness::LocalRedis& redis_;
  Cell& cell_;
  const metadata::CellOptions options_;
  std::vector<std::string> hot_;
  std::uint64_t next_client_ = 0;  // every client of the run its own serial (Client)
  std::string noop_sha_;
  Status missing_;  // redis-benchmark is not installed
};

Status LoadBench::register_nodes() {
  for (const char* id : {"n1", "n2"}) {
    KVSTASH_RETURN_IF_ERROR(
        cell_.node_catalog().register_node({id, "e1", kPage, kPoolPages, "addr", "key"}, 3600s).status());
  }
  return {};
}

Status LoadBench::hand_grant_keys() {
  // A key handed over by a heartbeat, as a node rotates its key: the nodes' objects stay.
  for (const char* id : {"n1", "n2"}) {
    KVSTASH_RETURN_IF_ERROR(
        cell_.node_catalog().heartbeat(id, "e1", 3600s, 0, std::string(64, 'a'), "e1/1").status());
  }
  return {};
}

Status LoadBench::set_quotas(int count) {
  metadata::CellQuotas quotas(cell_.redis(), cell_.prefix());
  constexpr std::uint64_t kRoom = std::uint64_t{1} << 49;  // never full
  for (int i = 0; i < count; ++i) {
    const std::string prefix = i == 0 ? "hot/" : i == 1 ? "new/" : "tenant-" + std::to_string(i) + "/";
    KVSTASH_RETURN_IF_ERROR(quotas.set(prefix, {0, kRoom}, deadline_after(60s)));
  }
  return {};
}

Status LoadBench::prepare() {
  KVSTASH_RETURN_IF_ERROR(register_nodes());
  if (!o_.features) KVSTASH_RETURN_IF_ERROR(set_quotas(o_.quotas));
  for (std::size_t i = 0; i < kHotObjects; ++i) hot_.push_back("hot/" + std::to_string(i));
  // The hot objects, on a few connections at once, through the put the clients use.
  std::atomic<std::size_t> next{0};
  std::vector<Status> failed(4);
  std::vector<std::thread> fillers;
  for (std::size_t t = 0; t < failed.size(); ++t) {
    fillers.emplace_back([&, t] {
      auto c = connect();
      if (!c.is_ok()) {
        failed[t] = c.status();
        return;
      }
      PutPath put((*c)->catalog(), "fill" + std::to_string(t));
      for (std::size_t i; (i = next++) < hot_.size();) {
        if (auto r = put.put(hot_[i]); !r.is_ok()) {
          failed[t] = r.status();
          return;
        }
      }
    });
  }
  for (auto& t : fillers) t.join();
  for (const Status& s : failed) KVSTASH_RETURN_IF_ERROR(s);
  // Loads the scripts' library (and contains_prefix's EVAL text, into the script cache):
  // redis-benchmark runs them by name and by SHA before any client has.
  KVSTASH_RETURN_IF_ERROR(cell_.catalog().contains_prefix(std::span(hot_).first(kChain)).status());
  KVSTASH_RETURN_IF_ERROR(
      cell_.redis().command({"SCRIPT", "LOAD", metadata::scripts::contains_prefix().body}).status());
  KVSTASH_ASSIGN_OR_RETURN(metadata::Reply sha, cell_.redis().command({"SCRIPT", "LOAD", "return 1"}));
  noop_sha_ = std::string(sha.str());
  return {};
}

void LoadBench::reference_rows(int clients, std::vector<Row>* rows) {
  const metadata::Script& contains = metadata::scripts::contains_prefix();
  // Its -n: one test lasts about one to two seconds (for --seconds 2) at the rates of a small machine.
  const auto requests = static_cast<std::uint64_t>(std::max(10000.0, 25000.0 * o_.seconds));
  struct Test {
    std::vector<std::string> args;
    std::string name;  // the row; "": redis-benchmark's name of each test (SET, GET)
  };
  const std::vector<Test> tests = {
      {{"-t", "set,get"}, ""},
      {{"EVALSHA", noop_sha_, "0"}, "EVALSHA (return 1)"},
      {{"FCALL", contains.function, "1", cell_.prefix(), hot_[0], hot_[1], hot_[2], hot_[3]},
       "FCALL contains_prefix (4)"},
      {{"EVALSHA", contains.sha, "1", cell_.prefix(), hot_[0], hot_[1], hot_[2], hot_[3]},
       "EVALSHA contains_prefix (4)"},
  };
  for (const Test& t : tests) {
    if (interrupted()) break;
    Result<std::vector<BenchLine>> lines =
        missing_.is_ok() ? redis_benchmark(redis_.port(), clients, requests, t.args, deadline_after(60s))
                         : missing_;
    if (!lines.is_ok()) {
      rows->push_back({.what = "redis-benchmark", .clients = clients, .error = lines.status().message()});
      if (lines.status().code() != StatusCode::kNotFound) continue;
      missing_ = lines.status();  // one line per group says so
      break;
    }
    for (const BenchLine& l : *lines) {
      rows->push_back({.what = "redis-benchmark " + (t.name.empty() ? l.test : t.name),
                       .clients = clients,
                       .ops_per_s = l.rps,
                       .p50_us = l.p50_us,
                       .p99_us = l.p99_us,
                       .round_trips = 1});
    }
  }
}

void LoadBench::kvstash_rows(int clients, std::vector<Row>* rows) {
  auto fail = [&](const Status& s) {
    rows->push_back({"kvstash mix", clients, 0, 0, 0, 0, s.to_string(), {}});
  };
  auto releaser_cell = connect();
  if (!releaser_cell.is_ok()) return fail(releaser_cell.status());
  Releaser releaser(std::move(releaser_cell).value());
  std::vector<std::unique_ptr<Client>> cs;
  for (int i = 0; i < clients; ++i) {
    auto c = connect();
    if (!c.is_ok()) return fail(c.status());
    cs.push_back(std::make_unique<Client>(std::move(c).value(), i, next_client_++, hot_, releaser));
  }
  std::atomic<bool> stop{false};
  std::latch ready(clients), go(1);
  std::vector<std::thread> threads;
  for (auto& c : cs) {
    threads.emplace_back([&c, &ready, &go, &stop] {
      c->warm();
      ready.count_down();
      go.wait();
      c->run_until(stop);
    });
  }
  ready.wait();
  auto before = counters(cell_.redis());
  const Deadline t0 = Clock::now();
  go.count_down();
  const Deadline end =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.seconds));
  while (Clock::now() < end && !interrupted())
    std::this_thread::sleep_for(std::min<Clock::duration>(20ms, end - Clock::now()));
  stop = true;
  for (auto& t : threads) t.join();
  const double window_s = us_since(t0) / 1e6;
  releaser.settle();  // its scripts count in Redis's figures as in the rows'
  auto after = counters(cell_.redis());

  Row all{.what = "kvstash mix (all)", .clients = clients};
  std::vector<double> all_us;
  std::uint64_t client_trips = 0;
  for (std::size_t k = 0; k < kKinds; ++k) {
    std::vector<double> us;
    std::uint64_t trips = 0;
    for (const auto& c : cs) {
      us.insert(us.end(), c->tally().us[k].begin(), c->tally().us[k].end());
      trips += c->tally().round_trips[k];
    }
    if (k == kGet) trips += releaser.scripts();
    const auto n = static_cast<double>(us.size());
    rows->push_back({.what = kKindNames[k],
                     .clients = clients,
                     .ops_per_s = n / window_s,
                     .p50_us = percentile(us, 0.5),
                     .p99_us = percentile(us, 0.99),
                     .round_trips = n > 0 ? static_cast<double>(trips) / n : 0});
    all_us.insert(all_us.end(), us.begin(), us.end());
    client_trips += trips;
  }
  if (!releaser.error().is_ok()) all.error = "a read lease did not end: " + releaser.error().to_string();
  for (const auto& c : cs) {
    if (!c->tally().error.is_ok()) {
      all.error = "a client stopped: " + c->tally().error.to_string();
      break;
    }
  }
  const auto ops = static_cast<double>(all_us.size());
  all.ops_per_s = ops / window_s;
  all.p50_us = percentile(all_us, 0.5);
  all.p99_us = percentile(all_us, 0.99);
  all.round_trips = ops > 0 ? static_cast<double>(client_trips) / ops : 0;
  if (before.is_ok() && after.is_ok() && ops > 0) {
    const double requests = after->requests - before->requests;
    // The second INFO counted the first one.
    const double script_calls = after->commands - before->commands - 1 - requests;
    all.extra = {{"redis_round_trips_per_op", requests / ops},
                 {"script_calls_per_op", script_calls / ops},
                 {"redis_cores", (after->cpu_s - before->cpu_s) / window_s},
                 {"redis_cpu_us_per_op", (after->cpu_s - before->cpu_s) * 1e6 / ops},
                 {"script_us_per_op", (after->script_us - before->script_us) / ops},
                 {"bench_cores", (after->self_cpu_s - before->self_cpu_s) / window_s},
                 {"bench_cpu_us_per_op", (after->self_cpu_s - before->self_cpu_s) * 1e6 / ops}};
  }
  rows->insert(rows->end() - kKinds, std::move(all));
}

std::vector<Row> LoadBench::measure_group(int clients) {
  std::vector<Row> rows;
  reference_rows(clients, &rows);
  if (!interrupted()) kvstash_rows(clients, &rows);
  return rows;
}

std::vector<Row> LoadBench::measure_features(int clients) {
  std::vector<Row> rows;
  reference_rows(clients, &rows);
  metadata::CellAdmin admin(cell_.redis());
  const std::vector<std::pair<std::string, std::function<Status()>>> stages = {
      {"mix, no feature", [] { return Status{}; }},
      {"mix + grants (signed per node)", [&] { return hand_grant_keys(); }},
      {"mix + 4 quotas", [&] { return set_quotas(4); }},
      {"mix + policy arc", [&] { return admin.set_policy("arc").status(); }},
      {"mix + policy turn-ttl", [&] { return admin.set_policy("turn-ttl").status(); }},
  };
  for (const auto& [name, turn_on] : stages) {
    if (interrupted()) break;
    if (Status s = turn_on(); !s.is_ok()) {
      rows.push_back({.what = name, .clients = clients, .error = s.to_string()});
      break;
    }
    std::vector<Row> mix;
    kvstash_rows(clients, &mix);
    if (mix.empty()) continue;
    mix.front().what = name;  // "kvstash mix (all)", or the row that says why it did not run
    rows.push_back(std::move(mix.front()));
  }
  return rows;
}

void print_header() {
  std::printf("%-44s %7s %9s %8s %8s %9s %7s\n", "what", "clients", "ops/s", "p50 us", "p99 us", "trips/op",
              "x GET");
}

void print_group(const std::vector<Row>& rows, bool json) {
  double get_rate = 0;
  for (const Row& r : rows) {
    if (r.what == "redis-benchmark GET" && r.error.empty()) get_rate = r.ops_per_s;
  }
  for (const Row& r : rows) {
    // ops/s over redis-benchmark GET's; 0: none to compare with.
    const double ratio = get_rate > 0 && r.error.empty() ? r.ops_per_s / get_rate : 0;
    if (json) {
      nlohmann::json j{{"what", r.what}, {"clients", r.clients}};
      if (!r.error.empty()) j["error"] = r.error;
      if (r.ops_per_s > 0) {
        j.update({{"ops_per_s", r.ops_per_s},
                  {"p50_us", r.p50_us},
                  {"p99_us", r.p99_us},
                  {"round_trips_per_op", r.round_trips},
                  {"vs_redis_get", ratio > 0 ? nlohmann::json(ratio) : nlohmann::json(nullptr)}});
      }
      if (!r.extra.is_null()) j.update(r.extra);
      std::cout << j.dump() << "\n";
      continue;
    }
    if (r.ops_per_s <= 0) {
      std::printf("%-44s %7d   %s\n", r.what.c_str(), r.clients, r.error.c_str());
      continue;
    }
    char vs[16] = "-";
    if (ratio > 0) std::snprintf(vs, sizeof vs, "%.2fx", ratio);
    std::printf("%-44s %7d %9.0f %8.0f %8.0f %9.2f %7s\n", r.what.c_str(), r.clients, r.ops_per_s, r.p50_us,
                r.p99_us, r.round_trips, vs);
    if (!r.error.empty()) std::printf("%-44s %7s   %s\n", "", "", r.error.c_str());
    if (!r.extra.is_null()) {
      std::printf(
          "%-44s %7s   Redis counted %.2f round trips/op and %.1f redis.call()s in scripts/op; "
          "redis-server %.2f cores, %.0f us CPU/op (%.0f us in scripts); kvstash-bench %.2f cores, %.0f us "
          "CPU/op\n",
          "", "", r.extra.value("redis_round_trips_per_op", 0.0), r.extra.value("script_calls_per_op", 0.0),
          r.extra.value("redis_cores", 0.0), r.extra.value("redis_cpu_us_per_op", 0.0),
          r.extra.value("script_us_per_op", 0.0), r.extra.value("bench_cores", 0.0),
          r.extra.value("bench_cpu_us_per_op", 0.0));
    }
  }
  std::fflush(stdout);
}

}  // namespace

int run_metadata_load(const MetadataBenchOptions& o) {
  InterruptHandler interrupt;
  // --tls: the same server also listens on a TLS port, with certificates made for this run.
  harness::LocalRedisOptions ro;
  std::string tls_dir, tls_url;
  if (o.tls) {
    char dir[] = "/tmp/kvstash-bench-tls-XXXXXX";
    if (::mkdtemp(dir) == nullptr) {
      std::cerr << "metadata: cannot make a folder for the certificates\n";
      return 1;
    }
    tls_dir = dir;
    auto tls = harness::make_throwaway_tls(tls_dir);
    if (!tls.is_ok()) {
      std::cerr << "metadata: " << tls.status().to_string() << "\n";
      return 1;
    }
    const int port = harness::free_port();
    ro.extra_args = {
        "--tls-port",    std::to_string(port), "--tls-cert-file", tls->server_cert,     "--tls-key-file",
        tls->server_key, "--tls-ca-cert-file", tls->ca_cert,      "--tls-auth-clients", "no"};
    tls_url = "rediss://127.0.0.1:" + std::to_string(port) + "/0?ca=" + tls->ca_cert;
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } cleanup{tls_dir};
  auto redis = harness::LocalRedis::start(ro);
  if (!redis.is_ok()) {
    std::cerr << "metadata: " << redis.status().to_string() << "\n";
    return 1;
  }
  metadata::CellOptions options;
  options.redis.url = o.tls ? tls_url : (*redis)->url();
  options.redis.command_timeout = 10s;
  auto cell = Cell::open(options);
  if (!cell.is_ok()) {
    std::cerr << "metadata: " << cell.status().to_string() << "\n";
    return 1;
  }
  LoadBench bench(o, **redis, **cell, options);
  if (Status s = bench.prepare(); !s.is_ok()) {
    std::cerr << "metadata: preparing the cell: " << s.to_string() << "\n";
    return 1;
  }
  if (!o.json) {
    auto server = (*cell)->redis().command({"INFO", "server"});
    const std::string_view info = server.is_ok() ? server->str() : std::string_view{};
    const std::size_t v = info.find("redis_version:");
    const std::string version =
        v == std::string_view::npos ? "?" : std::string(info.substr(v + 14, info.find('\r', v) - v - 14));
    std::printf(
        "One private redis-server %s on 127.0.0.1, shared by everything below; %u CPUs on this host for "
        "Redis, the clients and redis-benchmark together.%s\nThe mix: put, get, contains_prefix in turn, "
        "each "
        "client on its own connection; %zu hot objects for gets; no eviction; %.1f s per client count.\n\n",
        version.c_str(), std::thread::hardware_concurrency(),
        o.tls ? "\nThe kvstash clients reach it over TLS (rediss://); redis-benchmark over plain tcp." : "",
        kHotObjects, o.seconds);
    print_header();
  }
  if (o.features) {
    print_group(bench.measure_features(o.clients.front()), o.json);
  } else {
    for (int clients : o.clients) {
      if (interrupted()) break;
      print_group(bench.measure_group(clients), o.json);
    }
  }
  if (!o.json) {
    std::printf(
        "\nops/s of a kind is how many of it the mix completed per second; x GET is ops/s over "
        "redis-benchmark GET's at the same client count.\nA put is one round trip (plus one per page "
        "reservation), a get one on its path (begin_get) and its share of an end_gets that ends the leases "
        "queued meanwhile, off the path as in a Store; the mix row's trips/op are counted by the client, "
        "Redis's own count follows it.\n");
  }
  return interrupted() ? 130 : 0;
}

int run_metadata_shards(const MetadataBenchOptions& o) {
  InterruptHandler interrupt;
  if (!o.json) {
    std::printf(
        "The mix (put, get, contains_prefix in turn) over a private Redis Cluster on 127.0.0.1: one master "
        "per shard, no replicas, one cell per shard, the clients spread evenly over the cells; %u CPUs on "
        "this host for every server and client together. %.1f s per row.\n\n",
        std::thread::hardware_concurrency(), o.seconds);
    std::printf("%-8s %7s %10s %12s %13s %9s %9s\n", "shards", "clients", "ops/s", "ops/s/shard",
                "redis cores", "p50 us", "p99 us");
  }
  for (int shards : o.shards) {
    if (interrupted()) break;
    auto cluster = harness::LocalRedisCluster::start({.masters = shards, .replicas_per_master = 0});
    if (!cluster.is_ok()) {
      std::cerr << "metadata: " << cluster.status().to_string() << "\n";
      return 1;
    }
    // One cell on each master: names tried in turn until every master serves one.
    std::vector<std::string> cells(static_cast<std::size_t>(shards));
    std::vector<std::size_t> masters(static_cast<std::size_t>(shards));
    std::size_t found = 0;
    for (int n = 0; found < cells.size() && n < 1000; ++n) {
      const std::string name = "shard-cell-" + std::to_string(n);
      auto m = (*cluster)->master_of(metadata::cell_prefix(name));
      if (!m.is_ok()) {
        std::cerr << "metadata: " << m.status().to_string() << "\n";
        return 1;
      }
      if (std::find(masters.begin(), masters.begin() + static_cast<std::ptrdiff_t>(found), *m) !=
          masters.begin() + static_cast<std::ptrdiff_t>(found)) {
        continue;
      }
      masters[found] = *m;
      cells[found++] = name;
    }
    std::vector<std::unique_ptr<Cell>> conns;
    std::vector<std::unique_ptr<LoadBench>> benches;
    for (std::size_t i = 0; i < cells.size(); ++i) {
      metadata::CellOptions options;
      options.redis.url = (*cluster)->url();
      options.redis.command_timeout = 10s;
      options.cell = cells[i];
      auto cell = Cell::open(options);
      if (!cell.is_ok()) {
        std::cerr << "metadata: " << cell.status().to_string() << "\n";
        return 1;
      }
      conns.push_back(std::move(cell).value());
      benches.push_back(
          std::make_unique<LoadBench>(o, (*cluster)->server(masters[i]), *conns.back(), options));
      if (Status s = benches.back()->prepare(); !s.is_ok()) {
        std::cerr << "metadata: preparing cell " << cells[i] << ": " << s.to_string() << "\n";
        return 1;
      }
    }
    for (int clients : o.clients) {
      if (interrupted()) break;
      // Every shard's clients run at once; each shard's rows come from its own window.
      const int per_shard = std::max(1, clients / shards);
      std::vector<std::vector<Row>> rows(benches.size());
      std::vector<std::thread> runs;
      for (std::size_t i = 0; i < benches.size(); ++i) {
        runs.emplace_back([&, i] { benches[i]->kvstash_rows(per_shard, &rows[i]); });
      }
      for (auto& t : runs) t.join();
      double ops = 0, cores = 0, p50 = 0, p99 = 0;
      std::string error;
      for (const auto& r : rows) {
        // "kvstash mix (all)" comes before the kinds' rows; a failed run left one row.
        const Row& all = r.size() > kKinds ? r[r.size() - kKinds - 1] : r.back();
        ops += all.ops_per_s;
        cores += all.extra.is_null() ? 0 : all.extra.value("redis_cores", 0.0);
        p50 = std::max(p50, all.p50_us);
        p99 = std::max(p99, all.p99_us);
        if (error.empty()) error = all.error;
      }
      const int total = per_shard * shards;
      if (o.json) {
        std::cout << nlohmann::json{{"shards", shards},          {"clients", total},
                                    {"ops_per_s", ops},          {"ops_per_s_per_shard", ops / shards},
                                    {"redis_cores", cores},      {"p50_us_worst_shard", p50},
                                    {"p99_us_worst_shard", p99}, {"error", error}}
                         .dump()
                  << "\n";
      } else {
        std::printf("%-8d %7d %10.0f %12.0f %13.2f %9.0f %9.0f%s%s\n", shards, total, ops, ops / shards,
                    cores, p50, p99, error.empty() ? "" : "   ", error.c_str());
      }
      std::fflush(stdout);
    }
  }
  if (!o.json) {
    std::printf(
        "\nops/s: the mix's operations completed per second over all shards; redis cores: the CPU the "
        "shards' redis-server used together; p50/p99: the worst shard's.\n");
  }
  return interrupted() ? 130 : 0;
}

}  // namespace kvstash::bench
