// `kvstash-bench churn`: clients keep a cell full (churn_bench.h). Every put's bytes are a window of
// one random buffer, named in its object layout, so every get that finds an object compares
// all of its bytes with what was put.
#include "churn_bench.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvstash/memory.h"
#include "kvstash/store.h"
#include "measure.h"
#include "metadata/cell.h"
#include "plot.h"
#include "sessions.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::bench {

using namespace std::chrono_literals;

namespace {

// Where the bytes of one put start in the shared source buffer: up to this far in, 8-aligned.
constexpr std::uint64_t kWindowSlack = 64u << 10;

enum Op : std::size_t { kPut, kStream, kGet, kRemove, kTouch, kOps };
constexpr const char* kOpNames[kOps] = {"put", "stream", "get", "remove", "touch"};

// Outcomes counted per operation: ok, and each failure kind the run tells apart.
enum Outcome : std::size_t { kOk, kNoSpace, kTimedOut, kCancelled, kMiss, kOther, kOutcomes };

struct Counters {
  std::atomic<std::uint64_t> n[kOps][kOutcomes] = {};
  void add(Op op, Outcome o) { n[op][o].fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t get(Op op, Outcome o) const { return n[op][o].load(std::memory_order_relaxed); }
};

Outcome outcome_of(const Status& s) {
  switch (s.code()) {
    case StatusCode::kOk: return kOk;
    case StatusCode::kNoSpace: return kNoSpace;
    case StatusCode::kTimeout: return kTimedOut;
    case StatusCode::kCancelled: return kCancelled;
    case StatusCode::kNotFound: return kMiss;
    default: return kOther;
  }
}

// What the cell says at one moment.
struct Gauge {
  double t = 0;
  std::uint64_t stored_bytes = 0, pool_bytes = 0, evicted = 0, expired = 0;
  std::uint64_t free_pages = 0, object_pages = 0, reserved_pages = 0, limbo_pages = 0, pages = 0;
  std::uint64_t pending = 0;  // pending put records (puts and reservations)
};

Result<Gauge> read_gauge(metadata::Cell& cell, const std::vector<std::string>& nodes) {
  Gauge g;
  KVSTASH_ASSIGN_OR_RETURN(auto sum, cell.admin().summary());
  g.stored_bytes = sum.bytes;
  g.evicted = sum.evicted;
  g.expired = sum.expired;
  for (const auto& id : nodes) {
    KVSTASH_ASSIGN_OR_RETURN(auto ns, cell.admin().node_status(id));
    g.pool_bytes += ns.page_count * ns.page_size;
    g.pages += ns.page_count;
    g.free_pages += ns.free_pages;
    g.reserved_pages += ns.reserved_pages;
    g.limbo_pages += ns.limbo_pages;
    g.object_pages += ns.object_pages();
  }
  const std::string pending = cell.prefix() + ":pending";
  KVSTASH_ASSIGN_OR_RETURN(auto r, cell.redis().command({"ZCARD", pending}));
  g.pending = static_cast<std::uint64_t>(r.integer());
  return g;
}

// One row of the report: what happened between two gauges.
struct Sample {
  double t = 0;
  std::uint64_t puts = 0, puts_ok = 0, no_space = 0, timeouts = 0, other = 0;
  std::uint64_t gets = 0, hits = 0;
  double efficiency = 0, evictions_per_s = 0;
  Gauge gauge;
  double put_success() const {
    return puts == 0 ? 1.0 : static_cast<double>(puts_ok) / static_cast<double>(puts);
  }
  double hit_ratio() const { return gets == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(gets); }
};

// Puts and stream puts that count toward put success: every attempt except those the client
// itself cancelled.
std::uint64_t put_attempts(const Counters& c, Op op) {
  std::uint64_t n = 0;
  for (std::size_t o = 0; o < kOutcomes; ++o) {
    if (o != kCancelled) n += c.get(op, static_cast<Outcome>(o));
  }
  return n;
}

struct Totals {
  std::uint64_t puts = 0, ok = 0, no_space = 0, timeouts = 0, other = 0, gets = 0, hits = 0;
};

Totals totals_of(const Counters& c) {
  Totals t;
  for (Op op : {kPut, kStream}) {
    t.puts += put_attempts(c, op);
    t.ok += c.get(op, kOk);
    t.no_space += c.get(op, kNoSpace);
    t.timeouts += c.get(op, kTimedOut);
    t.other += c.get(op, kOther) + c.get(op, kMiss);
  }
  t.gets = c.get(kGet, kOk) + c.get(kGet, kMiss) + c.get(kGet, kNoSpace) + c.get(kGet, kTimedOut) +
           c.get(kGet, kOther);
  t.hits = c.get(kGet, kOk);
  return t;
}

class Client {
 public:
  Client(const ChurnBenchOptions& o, Store& store, const Buffer& source, const MemoryHandle& source_handle,
         Counters& counters, std::uint32_t index)
      : o_(o),
        store_(store),
        source_(source),
        source_handle_(source_handle),
        counters_(counters),
        rng_(o.seed * 1000003 + index) {}

  Status prepare() {
    auto b = Buffer::allocate(o_.max_size);
    if (!b.is_ok()) return b.status();
    into_ = std::move(*b);
    auto h = store_.register_memory(into_.region());
    if (!h.is_ok()) return h.status();
    into_handle_ = std::move(*h);
    return Status::ok();
  }

  // Runs operations until `stop`; returns the first wrong byte a get found, if any.
  Status run(const std::atomic<bool>& stop) {
    const double weights[kOps] = {o_.put, o_.stream, o_.get, o_.remove, o_.touch};
    std::discrete_distribution<std::size_t> pick(std::begin(weights), std::end(weights));
    while (!stop.load(std::memory_order_relaxed) && !interrupted()) {
      const std::string key =
          fmt::format("churn/{}", std::uniform_int_distribution<std::uint32_t>(0, o_.keys - 1)(rng_));
      switch (static_cast<Op>(pick(rng_))) {
        case kPut: counters_.add(kPut, outcome_of(put(key))); break;
        case kStream: counters_.add(kStream, outcome_of(stream_put(key))); break;
        case kGet: {
          Status s = get(key);
          if (s.code() == StatusCode::kCorrupt || s.code() == StatusCode::kInternal) return s;
          counters_.add(kGet, outcome_of(s));
          break;
        }
        case kRemove: counters_.add(kRemove, outcome_of(store_.remove(key))); break;
        case kTouch: counters_.add(kTouch, outcome_of(store_.touch(key, 0ms))); break;
        default: break;
      }
    }
    return Status::ok();
  }

 private:
  double uniform() { return std::uniform_real_distribution<double>(0, 1)(rng_); }

  std::uint64_t size() {
    const double lo = std::log(static_cast<double>(o_.min_size)),
                 hi = std::log(static_cast<double>(o_.max_size));
    return std::clamp<std::uint64_t>(static_cast<std::uint64_t>(std::exp(lo + (hi - lo) * uniform())),
                                     o_.min_size, o_.max_size);
  }

  PutOptions options(std::uint64_t offset, std::uint64_t n) {
    PutOptions po;
    po.object_layout = fmt::format("churn {} {}", offset, n);
    if (uniform() < o_.ttl_fraction) po.ttl = std::chrono::milliseconds(200 + rng_() % 1800);
    if (uniform() < o_.short_deadline_fraction)
      po.deadline = Clock::now() + std::chrono::milliseconds(1 + rng_() % 50);
    return po;
  }

  std::uint64_t offset() { return (rng_() % (kWindowSlack / 8)) * 8; }

  Status put(const std::string& key) {
    const std::uint64_t n = size(), at = offset();
    Slice s{source_.data() + at, n, &source_handle_};
    return store_.put(key, {&s, 1}, options(at, n));
  }

  // A put in four pieces, each appended as if a layer had just been computed; a cancelled one
  // is aborted after a random number of them.
  Status stream_put(const std::string& key) {
    const std::uint64_t n = size(), at = offset();
    auto stream = store_.begin_put(key, n, options(at, n));
    if (!stream.is_ok()) return stream.status();
    const bool cancel = uniform() < o_.cancel_fraction;
    const std::uint64_t stop_after = cancel ? rng_() % 4 : 4;
    const std::uint64_t piece = (n + 3) / 4;
    for (std::uint64_t i = 0, done = 0; done < n; ++i) {
      if (i == stop_after) {
        stream->abort();
        return Status::cancelled("churn: the client dropped this stream put");
      }
      const std::uint64_t len = std::min(piece, n - done);
      Slice s{source_.data() + at + done, len, &source_handle_};
      KVSTASH_RETURN_IF_ERROR(stream->append({&s, 1}));
      done += len;
    }
    return stream->commit();
  }

  Status get(const std::string& key) {
    Slice into{into_.data(), into_.size(), &into_handle_};
    Result<ObjectInfo> info = Status::ok();
    if (uniform() < o_.cancel_fraction) {
      GetOptions go;
      go.cancel = CancelToken::make();
      auto f = store_.get_async(key, {into}, go);
      std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 2000));
      go.cancel.cancel();
      info = f.get();
    } else {
      info = store_.get(key, {&into, 1});
    }
    if (!info.is_ok()) return info.status();
    std::uint64_t at = 0, n = 0;
    if (std::sscanf(info->object_layout.c_str(), "churn %lu %lu", &at, &n) != 2 || n != info->size ||
        at + n > source_.size()) {
      return Status::internal(
          fmt::format("churn: {} came back with a layout no put wrote: '{}'", key, info->object_layout));
    }
    if (std::memcmp(into_.data(), source_.data() + at, n) != 0) {
      return Status::corrupt(fmt::format("churn: {} came back with wrong bytes (byte {} of {})", key,
                                         first_difference(into_.data(), source_.data() + at, n), n));
    }
    return Status::ok();
  }

  const ChurnBenchOptions& o_;
  Store& store_;
  const Buffer& source_;
  const MemoryHandle& source_handle_;
  Counters& counters_;
  std::mt19937_64 rng_;
  Buffer into_;
  MemoryHandle into_handle_;
};

void print_header() {
  std::cout << fmt::format("{:>6} {:>7} {:>8} {:>8} {:>7} {:>6} {:>10} {:>8} {:>8} {:>7} {:>7} {:>6}\n",
                           "t s", "puts/s", "put ok", "nospace", "timeout", "other", "efficiency", "evict/s",
                           "reserved", "limbo", "pending", "hits");
}

void print_sample(const Sample& s, double seconds, bool json) {
  if (json) {
    nlohmann::json j{{"t", s.t},
                     {"puts", s.puts},
                     {"put_success", s.put_success()},
                     {"no_space", s.no_space},
                     {"timeouts", s.timeouts},
                     {"other_failures", s.other},
                     {"efficiency", s.efficiency},
                     {"evictions_per_s", s.evictions_per_s},
                     {"stored_bytes", s.gauge.stored_bytes},
                     {"pool_bytes", s.gauge.pool_bytes},
                     {"free_pages", s.gauge.free_pages},
                     {"reserved_pages", s.gauge.reserved_pages},
                     {"limbo_pages", s.gauge.limbo_pages},
                     {"pending_records", s.gauge.pending},
                     {"gets", s.gets},
                     {"hit_ratio", s.gets == 0 ? nlohmann::json(nullptr) : nlohmann::json(s.hit_ratio())}};
    std::cout << j.dump() << std::endl;
    return;
  }
  std::cout << fmt::format(
      "{:>6.1f} {:>7.0f} {:>7.1f}% {:>8} {:>7} {:>6} {:>10.3f} {:>8.1f} {:>8} {:>7} {:>7} {:>6}\n", s.t,
      static_cast<double>(s.puts) / seconds, 100 * s.put_success(), s.no_space, s.timeouts, s.other,
      s.efficiency, s.evictions_per_s, s.gauge.reserved_pages, s.gauge.limbo_pages, s.gauge.pending,
      s.gets == 0 ? std::string("-") : fmt::format("{:.0f}%", 100 * s.hit_ratio()));
  std::cout.flush();  // a row per interval, as it comes
}

Status plot(const ChurnBenchOptions& o, const std::vector<Sample>& samples) {
  std::vector<PlotSeries> series(3);
  series[0] = {.title = "efficiency (stored / pool bytes)", .group = "efficiency"};
  series[1] = {.title = "put success", .group = "success", .second_marker = true};
  series[2] = {.title = "pages in limbo / pool pages", .group = "limbo", .dashed = true};
  for (const Sample& s : samples) {
    series[0].points.emplace_back(s.t, s.efficiency);
    series[1].points.emplace_back(s.t, s.put_success());
    series[2].points.emplace_back(s.t, s.gauge.pages == 0 ? 0.0
                                                          : static_cast<double>(s.gauge.limbo_pages) /
                                                                static_cast<double>(s.gauge.pages));
  }
  return plot_over_time(o.plot,
                        plot_title(fmt::format("kvstash-bench churn, {}..{} objects over {} x {} nodes",
                                               units::format_size(o.min_size), units::format_size(o.max_size),
                                               o.nodes, units::format_size(o.node_capacity))),
                        "fraction", series);
}

}  // namespace

Status parse_churn_mix(std::string_view text, ChurnBenchOptions* o) {
  o->put = o->stream = o->get = o->remove = o->touch = 0;
  double* fields[kOps] = {&o->put, &o->stream, &o->get, &o->remove, &o->touch};
  double total = 0;
  while (!text.empty()) {
    const auto comma = text.find(',');
    const std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    const auto eq = item.find('=');
    const std::string_view name = item.substr(0, eq);
    const auto it = std::find(std::begin(kOpNames), std::end(kOpNames), name);
    double w = -1;
    if (eq != std::string_view::npos) {
      const std::string_view v = item.substr(eq + 1);
      if (std::from_chars(v.data(), v.data() + v.size(), w).ec != std::errc{}) w = -1;
    }
    if (it == std::end(kOpNames) || w < 0) {
      return Status::invalid_argument(fmt::format(
          "'{}': expected OP=WEIGHT with OP one of put, stream, get, remove, touch and WEIGHT >= 0", item));
    }
    *fields[it - std::begin(kOpNames)] = w;
    total += w;
  }
  if (o->put + o->stream <= 0 || total <= 0) return Status::invalid_argument("the mix needs put or stream");
  return Status::ok();
}

Status parse_churn_sizes(std::string_view text, ChurnBenchOptions* o) {
  if (text == "mixed") {
    o->min_size = 4u << 10;
    o->max_size = 8u << 20;
    return Status::ok();
  }
  if (text == "kv") {
    o->min_size = 1u << 20;
    o->max_size = 128u << 20;
    return Status::ok();
  }
  const auto dash = text.find('-');
  auto lo = units::parse_size(text.substr(0, dash));
  auto hi = dash == std::string_view::npos ? lo : units::parse_size(text.substr(dash + 1));
  if (!lo.is_ok() || !hi.is_ok() || *lo == 0 || *lo > *hi) {
    return Status::invalid_argument(fmt::format("'{}': mixed, kv, or MIN-MAX sizes (4KiB-8MiB)", text));
  }
  o->min_size = *lo;
  o->max_size = *hi;
  return Status::ok();
}

int run_churn(const ChurnBenchOptions& options) {
  ChurnBenchOptions o = options;
  const double mean =
      (static_cast<double>(o.max_size) - static_cast<double>(o.min_size)) /
      std::max(1e-9, std::log(static_cast<double>(o.max_size) / static_cast<double>(o.min_size)));
  if (o.keys == 0) {
    o.keys = static_cast<std::uint32_t>(
        std::ceil(3.0 * static_cast<double>(o.node_capacity * o.nodes) / std::max(1.0, mean)));
  }
  if (o.max_size > o.node_capacity * o.nodes) {
    std::cerr << "kvstash-bench churn: objects of up to " << units::format_size(o.max_size)
              << " do not fit a pool of " << units::format_size(o.node_capacity * o.nodes) << "\n";
    return 2;
  }
  InterruptHandler on_interrupt;
  auto redis = harness::LocalRedis::start({});
  if (!redis.is_ok()) {
    std::cerr << "kvstash-bench churn: redis-server: " << redis.status().to_string() << "\n";
    return 1;
  }
  std::vector<std::unique_ptr<harness::LocalNode>> nodes;
  std::vector<std::string> ids;
  std::vector<std::string> tier_files;
  for (std::uint32_t i = 0; i < o.nodes; ++i) {
    std::vector<std::string> args{"--transports", "all"};
    if (!o.ssd_dir.empty()) {
      tier_files.push_back(fmt::format("{}/churn-{}-{}.tier", o.ssd_dir, ::getpid(), i));
      const std::uint64_t cap = o.ssd_capacity > 0 ? o.ssd_capacity : 8 * o.node_capacity;
      args.insert(args.end(), {"--ssd", tier_files.back(), "--ssd-capacity", std::to_string(cap)});
    }
    auto n = harness::LocalNode::start({.redis_url = (*redis)->url(),
                                        .capacity = std::to_string(o.node_capacity),
                                        .page_size = std::to_string(o.page_size),
                                        .node_id = fmt::format("churn-{}", i),
                                        .extra_args = args});
    if (!n.is_ok()) {
      std::cerr << "kvstash-bench churn: kvstashd: " << n.status().to_string() << "\n";
      return 1;
    }
    ids.push_back((*n)->node_id());
    nodes.push_back(std::move(*n));
  }
  metadata::CellOptions co;
  co.redis.url = (*redis)->url();
  auto cell = metadata::Cell::open(co);
  if (!cell.is_ok()) {
    std::cerr << "kvstash-bench churn: " << cell.status().to_string() << "\n";
    return 1;
  }
  StoreOptions so;
  so.redis_url = (*redis)->url();
  so.engine.prefer = o.transport;
  so.redis_connections = std::max<std::uint32_t>(4, o.clients * 2);
  auto store = Store::open(so);
  if (!store.is_ok()) {
    std::cerr << "kvstash-bench churn: " << store.status().to_string() << "\n";
    return 1;
  }
  auto source = Buffer::allocate(o.max_size + kWindowSlack);
  if (!source.is_ok()) {
    std::cerr << "kvstash-bench churn: " << source.status().to_string() << "\n";
    return 1;
  }
  fill_pattern(source->data(), source->size(), 0x636875726e, 0, 0);
  auto source_handle = (*store)->register_memory(source->region());
  if (!source_handle.is_ok()) {
    std::cerr << "kvstash-bench churn: " << source_handle.status().to_string() << "\n";
    return 1;
  }

  Counters counters;
  std::vector<std::unique_ptr<Client>> clients;
  for (std::uint32_t i = 0; i < o.clients; ++i) {
    clients.push_back(std::make_unique<Client>(o, **store, *source, *source_handle, counters, i));
    if (Status s = clients.back()->prepare(); !s.is_ok()) {
      std::cerr << "kvstash-bench churn: " << s.to_string() << "\n";
      return 1;
    }
  }
  if (!o.json) {
    std::cout << fmt::format(
        "kvstash-bench churn: {} client(s) over {} keys, objects {}..{} (log-uniform, mean {}), {} over {}\n"
        "  cell   {} node(s) x {} in pages of {}: the key space holds {:.1f}x the pool\n"
        "  mix    put {} stream {} get {} remove {} touch {}; of puts {:.0f}% with a TTL of 0.2-2 s, {:.0f}% "
        "with a deadline of 1-50 ms; {:.0f}% of streams and gets cancelled\n\n",
        o.clients, o.keys, units::format_size(o.min_size), units::format_size(o.max_size),
        units::format_size(static_cast<std::uint64_t>(mean)), o.seconds, to_string(o.transport), o.nodes,
        units::format_size(o.node_capacity), units::format_size(o.page_size),
        mean * o.keys / static_cast<double>(o.node_capacity * o.nodes), o.put, o.stream, o.get, o.remove,
        o.touch, 100 * o.ttl_fraction, 100 * o.short_deadline_fraction, 100 * o.cancel_fraction);
    print_header();
  }

  std::atomic<bool> stop{false};
  std::mutex failure_mu;
  Status failure;
  std::vector<std::thread> threads;
  for (auto& c : clients) {
    threads.emplace_back([&, c = c.get()] {
      Status s = c->run(stop);
      if (!s.is_ok()) {
        std::lock_guard lock(failure_mu);
        if (failure.is_ok()) failure = s;
        stop = true;
      }
    });
  }
  std::vector<Sample> samples;
  const auto t0 = Clock::now();
  Totals before;
  auto last = read_gauge(**cell, ids);
  int rc = 0;
  while (!stop && !interrupted()) {
    const auto next = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                               o.interval * static_cast<double>(samples.size() + 1)));
    std::this_thread::sleep_until(next);
    auto g = read_gauge(**cell, ids);
    if (!g.is_ok()) {
      std::cerr << "kvstash-bench churn: reading the cell: " << g.status().to_string() << "\n";
      rc = 1;
      break;
    }
    const Totals now = totals_of(counters);
    Sample s;
    s.t = seconds_since(t0);
    g->t = s.t;
    s.gauge = *g;
    s.puts = now.puts - before.puts;
    s.puts_ok = now.ok - before.ok;
    s.no_space = now.no_space - before.no_space;
    s.timeouts = now.timeouts - before.timeouts;
    s.other = now.other - before.other;
    s.gets = now.gets - before.gets;
    s.hits = now.hits - before.hits;
    s.efficiency =
        g->pool_bytes == 0 ? 0 : static_cast<double>(g->stored_bytes) / static_cast<double>(g->pool_bytes);
    const std::uint64_t evicted_before = last.is_ok() ? last->evicted : 0;
    s.evictions_per_s = static_cast<double>(g->evicted - evicted_before) / o.interval;
    print_sample(s, o.interval, o.json);
    samples.push_back(s);
    before = now;
    last = g;
    if (s.t >= o.seconds) stop = true;
  }
  stop = true;
  for (auto& t : threads) t.join();
  if (!failure.is_ok()) {
    std::cerr << "kvstash-bench churn: " << failure.to_string() << "\n";
    rc = 1;
  }

  const Totals all = totals_of(counters);
  nodes.clear();  // their tier files go with them
  for (const std::string& f : tier_files) ::unlink(f.c_str());
  const double success = all.puts == 0 ? 1.0 : static_cast<double>(all.ok) / static_cast<double>(all.puts);
  // Steady state: the second half of the run.
  double eff_sum = 0;
  std::size_t eff_n = 0;
  for (std::size_t i = samples.size() / 2; i < samples.size(); ++i, ++eff_n) eff_sum += samples[i].efficiency;
  const double efficiency = eff_n == 0 ? 0 : eff_sum / static_cast<double>(eff_n);
  if (o.json) {
    std::cout << nlohmann::json{{"summary", true},
                                {"puts", all.puts},
                                {"put_success", success},
                                {"no_space", all.no_space},
                                {"timeouts", all.timeouts},
                                {"other_failures", all.other},
                                {"steady_efficiency", efficiency},
                                {"gets", all.gets},
                                {"gets_per_s", static_cast<double>(all.gets) / o.seconds},
                                {"tier", !o.ssd_dir.empty()},
                                {"hit_ratio", all.gets == 0 ? 0.0
                                                            : static_cast<double>(all.hits) /
                                                                  static_cast<double>(all.gets)}}
                     .dump()
              << std::endl;
  } else {
    std::cout << fmt::format(
        "\nputs {} ({:.2f}% ok: {} kNoSpace, {} kTimeout, {} other), steady-state efficiency {:.3f} (mean of "
        "the second half), gets {} ({:.0f}/s, {:.1f}% hits){}\n",
        all.puts, 100 * success, all.no_space, all.timeouts, all.other, efficiency, all.gets,
        static_cast<double>(all.gets) / o.seconds,
        all.gets == 0 ? 0.0 : 100.0 * static_cast<double>(all.hits) / static_cast<double>(all.gets),
        o.ssd_dir.empty() ? "" : " with an NVMe tier under each node");
    std::cout
        << "efficiency: bytes of live objects over pool bytes; reserved: pages held by pending puts and "
           "page\n"
           "reservations within their leases; limbo: pages freed but not yet reusable (waiting for a read\n"
           "lease or a node's fence); pending: pending put records in Redis.\n";
  }
  if (!o.plot.empty()) {
    if (Status s = plot(o, samples); !s.is_ok()) {
      std::cerr << "kvstash-bench churn: --plot: " << s.to_string() << "\n";
      rc = 1;
    }
  }
  if (o.min_put_success > 0 && success < o.min_put_success) {
    std::cerr << fmt::format("kvstash-bench churn: put success {:.4f} is below --min-put-success {:.4f}\n",
                             success, o.min_put_success);
    rc = 1;
  }
  clients.clear();
  store->reset();
  return rc;
}

}  // namespace kvstash::bench
