// kvstash-history: a Jepsen-style history checker for the store's first promise, "a get
// returns exactly the bytes its put wrote, or an error", with the checksum off.
//
// The orchestrator starts a private redis-server and several kvstashd with small pools (so
// eviction is routine), then client processes of its own binary (`--client`), each with a
// Store over its own transport (shm, tcp, ucx: clients mix them) and several threads running
// random puts (some with short TTLs, some with two copies), overwrites, gets (some cancelled from another
// thread), removes, touches, contains_prefix and put streams dropped half-way, every one with a random
// deadline. Meanwhile a nemesis stops nodes (SIGSTOP, some past the heartbeat TTL, so the cell
// declares them dead and they rejoin from the same process), kills and restarts them
// (SIGKILL) and restarts Redis empty. With --redis-mode sentinel the cell's Redis is a master, a
// replica and a sentinel, everyone reaches it through a redis+sentinel:// URL, and instead of
// restarting Redis the nemesis kills the master (a failover; the killed one comes back empty
// and the sentinel makes it a replica). Every put's bytes encode (key, put id, offset), so a
// get's bytes say whose they are. Clients log each operation with its invocation and return
// times (CLOCK_MONOTONIC, shared by the processes of one host); at the end the orchestrator
// checks every get that returned OK:
//
//   - its bytes are exactly the whole bytes of one put P of the same key, of the size it
//     reported, and P was not a put stream its client dropped (those never commit);
//   - P was invoked before the get returned;
//   - P was not definitely replaced before the get began: no put or remove of the key that
//     returned OK was invoked after P returned and returned before the get was invoked.
//
// A put that failed may or may not have committed (a lost reply), within its own call: it
// counts as a possible P. With --ssd-dir, half the keys are recoverable ("kvp:"): a Redis loss
// (restarted empty, a failover) may bring back an older put of one from a node's tier, so for
// them a change that a loss may have undone (the loss ended after the change was invoked, and
// began before the get returned) does not count as replacing P; such gets are counted, and
// every other rule holds for them. Anything else is wrong bytes. The run fails on wrong bytes, on an
// operation that outlived its deadline by more than a second, on a client that crashed or
// hung, and on a setup failure.
//
// The nemesis rests for 15 s of every 45 (--quiet-seconds, --quiet-every). The run is cut into
// phases: disturbed (a fault, and 6 s of settling after it; after a Redis fault, 10 s from
// when every node has rejoined; a quiet gap under 5 s between faults counts as disturbed) and
// quiet. Put success is reported
// per phase, and in the quiet phases, where the small pools keep the cell full and evicting,
// the run also fails when fewer than 99% of puts succeed: a full cell keeps taking puts.
//
//   kvstash-history --seconds 120              the bounded run scripts/test makes
//   kvstash-history --redis-mode sentinel --faults redis   failovers only
//   kvstash-history --minutes 30 --json r.json what scripts/chaos runs
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <hiredis/hiredis.h>

#include "kvstash/status.h"
#include "kvstash/store.h"
#include "metadata/cell_admin.h"
#include "metadata/records.h"
#include "metadata/redis_client.h"
#include "node/ssd_device.h"
#include "tools/common/local_cluster.h"
#include "watchdog.h"

namespace kvstash::history {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

constexpr std::uint64_t kMagic = 0x6b76737461736821ull;  // "!hsatsvk"
constexpr std::size_t kBlock = 512;                      // one header per block
constexpr int kKeys = 24;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Even keys are recoverable ("kvp:", which the nodes' tiers give back to a cell that lost its
// Redis: docs/metadata.md), odd ones are not.
std::string key_name(int k) {
  char buf[24];
  std::snprintf(buf, sizeof buf, k % 2 == 0 ? "kvp:h/k%02d" : "h/k%02d", k);
  return buf;
}
bool recoverable(std::string_view key) { return key.starts_with("kvp:"); }

std::uint64_t key_hash(std::string_view key) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : key) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// The bytes put `put_id` writes for `key`: each 512-byte block starts with (magic, key hash,
// put id, offset) and continues with bytes only that put and offset produce.
void encode(std::string_view key, std::uint64_t put_id, std::span<std::byte> out) {
  const std::uint64_t kh = key_hash(key);
  for (std::size_t off = 0; off < out.size(); off += kBlock) {
    const std::size_t n = std::min(kBlock, out.size() - off);
    std::uint64_t words[kBlock / 8];
    words[0] = kMagic;
    words[1] = kh;
    words[2] = put_id;
    words[3] = off;
    std::uint64_t x = put_id * 0x9e3779b97f4a7c15ull ^ (off + 1) * 0xbf58476d1ce4e5b9ull;
    for (std::size_t i = 4; i < kBlock / 8; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      words[i] = x;
    }
    std::memcpy(out.data() + off, words, n);
  }
}

// What a get's bytes hold: one whole put (its id), or a description of what is wrong.
struct Decoded {
  bool whole = false;
  std::uint64_t put_id = 0;
  std::string problem;
};

Decoded decode(std::string_view key, std::span<const std::byte> bytes, std::vector<std::byte>& scratch) {
  Decoded d;
  if (bytes.size() < 32) {
    d.problem = "object of " + std::to_string(bytes.size()) + " bytes is too short to hold a header";
    return d;
  }
  std::uint64_t h[4];
  std::memcpy(h, bytes.data(), sizeof h);
  if (h[0] != kMagic || h[1] != key_hash(key) || h[3] != 0) {
    d.problem = "first block is not this key's (foreign or garbage bytes)";
    return d;
  }
  d.put_id = h[2];
  scratch.resize(bytes.size());
  encode(key, d.put_id, scratch);
  if (std::memcmp(scratch.data(), bytes.data(), bytes.size()) == 0) {
    d.whole = true;
    return d;
  }
  for (std::size_t off = 0; off < bytes.size(); off += kBlock) {
    const std::size_t n = std::min(kBlock, bytes.size() - off);
    if (std::memcmp(scratch.data() + off, bytes.data() + off, n) == 0) continue;
    std::ostringstream m;
    m << "torn: put " << d.put_id << "'s bytes, but the block at offset " << off;
    if (n >= 32) {
      std::memcpy(h, bytes.data() + off, sizeof h);
      if (h[0] == kMagic) {
        m << " holds put " << h[2] << " of " << (h[1] == key_hash(key) ? "this key" : "another key")
          << " at offset " << h[3];
      } else {
        m << " holds no header";
      }
    } else {
      m << " differs";
    }
    d.problem = m.str();
    break;
  }
  return d;
}

// ---- the client process ---------------------------------------------------------------------

struct ClientConfig {
  std::string redis_url;
  std::string transport = "tcp";
  int id = 0;
  int threads = 2;
  double seconds = 10;
  std::uint64_t seed = 1;
  std::string log;
  std::string rkey_scope;  // "connection", "lease"; empty: the cell's
  int avoid_ms = -1;       // StoreOptions::avoid_unreachable_nodes; < 0: the default
};

// One line per operation, written when it returned:
//   P key put_id size t_inv t_ret code deadline_ms        a put (code 0: OK)
//   A key put_id size t_inv t_ret                         a put stream dropped before commit
//   G key t_inv t_ret code deadline_ms size put_id|-1 problem-or-"-"
//   R key t_inv t_ret code deadline_ms                    a remove
//   O kind t_inv t_ret code deadline_ms                   touch (T), contains_prefix (C)
class Log {
 public:
  // Line-buffered: a client that crashes loses at most the operation it was in.
  explicit Log(const std::string& path) : f_(std::fopen(path.c_str(), "w")) {
    if (f_ != nullptr) std::setvbuf(f_, nullptr, _IOLBF, 1 << 16);
  }
  ~Log() {
    if (f_ != nullptr) std::fclose(f_);
  }
  bool ok() const { return f_ != nullptr; }
  void line(const std::string& s) {
    std::lock_guard lock(mu_);
    std::fputs(s.c_str(), f_);
    std::fputc('\n', f_);
  }

 private:
  std::mutex mu_;
  std::FILE* f_;
};

// The status code for the log. Codes no fault should cause (a malformed record, a bug, a
// refused credential, a bad argument) are also told on stderr with their message, which the
// orchestrator's output then carries.
int code_of(const Status& s) {
  switch (s.code()) {
    case StatusCode::kCorrupt:
    case StatusCode::kInternal:
    case StatusCode::kInvalidArgument:
    case StatusCode::kPermissionDenied:
    case StatusCode::kIoError:
      std::fprintf(stderr, "history client: unexpected %s\n", s.to_string().c_str());
      break;
    default: break;
  }
  return static_cast<int>(s.code());
}

// What each client thread is doing, for the watchdog that names a hang (a thread that never
// returns from an operation leaves no line in the history).
struct Doing {
  std::atomic<const char*> what{"starting"};
  std::atomic<std::int64_t> since_ns{0};
  void set(const char* w) {
    since_ns = now_ns();
    what = w;
  }
};

void client_thread(Store& store, const ClientConfig& c, int thread, Log& log, Deadline stop, Doing& doing) {
  std::mt19937_64 rng(c.seed * 1000003 + static_cast<std::uint64_t>(thread));
  auto uniform = [&](std::uint64_t lo, std::uint64_t hi) {
    return std::uniform_int_distribution<std::uint64_t>(lo, hi)(rng);
  };
  std::uint64_t next_put =
      (static_cast<std::uint64_t>(c.id) << 40) | (static_cast<std::uint64_t>(thread) << 32);
  std::vector<std::byte> data(4u << 20), got(4u << 20), scratch;
  // Sizes from a KiB to a few pages (pages are 1 MiB), so objects span pages and nodes.
  auto random_size = [&] {
    const std::uint64_t r = uniform(0, 9);
    if (r < 4) return uniform(1024, 64u << 10);
    if (r < 8) return uniform(64u << 10, 1u << 20);
    return uniform(1u << 20, 3u << 20);
  };
  auto random_deadline = [&] { return std::chrono::milliseconds(uniform(50, 3000)); };
  char buf[512];
  while (Clock::now() < stop) {
    const std::string key = key_name(static_cast<int>(uniform(0, kKeys - 1)));
    const std::uint64_t dice = uniform(0, 99);
    const auto budget = random_deadline();
    if (dice < 35) {  // put, a third of them expiring soon
      const std::uint64_t id = ++next_put;
      const std::size_t size = random_size();
      encode(key, id, {data.data(), size});
      PutOptions o;
      o.deadline = deadline_after(budget);
      if (uniform(0, 2) == 0) o.ttl = std::chrono::milliseconds(uniform(200, 3000));
      // One put in five writes two copies, on two nodes (PutOptions::replicas): its gets may
      // read either, and a later put of the key must leave neither behind.
      if (uniform(0, 4) == 0) o.replicas = 2;
      Slice s{data.data(), size};
      doing.set("put");
      const std::int64_t t0 = now_ns();
      Status st = store.put(key, {&s, 1}, o);
      const std::int64_t t1 = now_ns();
      // A failed put's line ends with its message: the report names why a quiet phase refused.
      std::string why = st.is_ok() ? std::string("-") : st.to_string();
      std::replace(why.begin(), why.end(), '\n', ' ');
      std::snprintf(buf, sizeof buf, "P %s %" PRIu64 " %zu %" PRId64 " %" PRId64 " %d %lld %.300s",
                    key.c_str(), id, size, t0, t1, code_of(st), static_cast<long long>(budget.count()),
                    why.c_str());
      log.line(buf);
    } else if (dice < 40) {  // a put stream dropped half-way: it never commits
      const std::uint64_t id = ++next_put;
      const std::size_t size = random_size() + 2048;
      encode(key, id, {data.data(), size});
      doing.set("a dropped put stream");
      const std::int64_t t0 = now_ns();
      {
        auto stream = store.begin_put(key, size, {.deadline = deadline_after(budget)});
        if (stream.is_ok()) {
          Slice half{data.data(), size / 2};
          (void)stream->append({&half, 1});
          if (uniform(0, 1) == 0) (void)stream->wait_written(size / 2);
        }
      }  // dropped: aborted
      const std::int64_t t1 = now_ns();
      std::snprintf(buf, sizeof buf, "A %s %" PRIu64 " %zu %" PRId64 " %" PRId64, key.c_str(), id, size, t0,
                    t1);
      log.line(buf);
    } else if (dice < 80) {  // get, checksum off, some cancelled from another thread
      GetOptions o;
      o.deadline = deadline_after(budget);
      o.verify_checksum = false;
      std::future<void> canceller;
      if (uniform(0, 9) == 0) {
        o.cancel = CancelToken::make();
        const auto delay = std::chrono::microseconds(uniform(0, 30000));
        canceller = std::async(std::launch::async, [token = o.cancel, delay] {
          std::this_thread::sleep_for(delay);
          token.cancel();
        });
      }
      Slice s{got.data(), got.size()};
      doing.set(o.cancel ? "a get a canceller races" : "get");
      const std::int64_t t0 = now_ns();
      auto r = store.get(key, {&s, 1}, o);
      const std::int64_t t1 = now_ns();
      if (canceller.valid()) canceller.wait();
      if (r.is_ok()) {
        Decoded d = decode(key, {got.data(), r->size}, scratch);
        std::snprintf(buf, sizeof buf, "G %s %" PRId64 " %" PRId64 " 0 %lld %" PRIu64 " %lld %s", key.c_str(),
                      t0, t1, static_cast<long long>(budget.count()), r->size,
                      d.whole || d.problem.rfind("torn", 0) == 0 ? static_cast<long long>(d.put_id) : -1LL,
                      d.whole ? "-" : d.problem.c_str());
      } else {
        std::snprintf(buf, sizeof buf, "G %s %" PRId64 " %" PRId64 " %d %lld 0 -1 -", key.c_str(), t0, t1,
                      code_of(r.status()), static_cast<long long>(budget.count()));
      }
      log.line(buf);
    } else if (dice < 88) {  // remove
      doing.set("remove");
      const std::int64_t t0 = now_ns();
      Status st = store.remove(key, deadline_after(budget));
      const std::int64_t t1 = now_ns();
      std::snprintf(buf, sizeof buf, "R %s %" PRId64 " %" PRId64 " %d %lld", key.c_str(), t0, t1, code_of(st),
                    static_cast<long long>(budget.count()));
      log.line(buf);
    } else if (dice < 95) {  // touch with a new TTL (or none)
      doing.set("touch");
      const std::int64_t t0 = now_ns();
      Status st = store.touch(key, std::chrono::milliseconds(uniform(0, 1) ? uniform(200, 3000) : 0),
                              deadline_after(budget));
      const std::int64_t t1 = now_ns();
      std::snprintf(buf, sizeof buf, "O T %" PRId64 " %" PRId64 " %d %lld", t0, t1, code_of(st),
                    static_cast<long long>(budget.count()));
      log.line(buf);
    } else {  // contains_prefix over a chain of keys
      std::vector<std::string> chain;
      const int first = static_cast<int>(uniform(0, kKeys - 4));
      for (int i = 0; i < 4; ++i) chain.push_back(key_name(first + i));
      doing.set("contains_prefix");
      const std::int64_t t0 = now_ns();
      auto r = store.contains_prefix(chain, deadline_after(budget));
      const std::int64_t t1 = now_ns();
      std::snprintf(buf, sizeof buf, "O C %" PRId64 " %" PRId64 " %d %lld", t0, t1, code_of(r.status()),
                    static_cast<long long>(budget.count()));
      log.line(buf);
    }
  }
  doing.set("done");
}

// Aborts the client, saying what each thread was doing and for how long, when it has not
// finished `grace` after the run's end: a hang becomes a diagnosis (the orchestrator kills a
// silent one a minute later and can say only that it hung).
void report_hang(const ClientConfig& c, const std::vector<Doing>& doing) {
  std::fprintf(stderr, "history client %d (%s) hung:", c.id, c.transport.c_str());
  for (std::size_t t = 0; t < doing.size(); ++t) {
    std::fprintf(stderr, " thread %zu in %s for %.1f s;", t, doing[t].what.load(),
                 static_cast<double>(now_ns() - doing[t].since_ns.load()) / 1e9);
  }
  std::fprintf(stderr, "\n");
  std::abort();
}

int run_client(const ClientConfig& c) {
  Log log(c.log);
  if (!log.ok()) {
    std::cerr << "history client: cannot write " << c.log << "\n";
    return 2;
  }
  StoreOptions o;
  o.redis_url = c.redis_url;
  o.timeout = 3s;
  o.put_lease = 3s;
  o.read_lease = 2s;
  o.verify_checksum = false;
  o.redis_timeout = 1s;
  o.rkey_scope = parse_rkey_scope(c.rkey_scope);
  if (c.avoid_ms >= 0) o.avoid_unreachable_nodes = std::chrono::milliseconds(c.avoid_ms);
  auto kind = parse_transport_kind(c.transport);
  if (!kind) {
    std::cerr << "history client: unknown transport " << c.transport << "\n";
    return 2;
  }
  // Only the transport under test (a connect that times out on a stopped node would otherwise
  // fall back to the next one), and for UCX, which holds no leases at the node, tcp for the
  // puts (the store writes only over a transport the node can fence).
  o.engine.transports = {*kind};
  if (*kind == TransportKind::kUcx) o.engine.transports.push_back(TransportKind::kTcp);
  o.engine.prefer = *kind;
  o.engine.ucx.allow_emulated_rma = true;
  Result<std::unique_ptr<Store>> store = Status::unavailable("not opened");
  // Redis may be down for a moment (the nemesis restarts it): keep trying for a while.
  for (auto give_up = Clock::now() + 20s; Clock::now() < give_up; std::this_thread::sleep_for(200ms)) {
    store = Store::open(o);
    if (store.is_ok()) break;
  }
  if (!store.is_ok()) {
    std::cerr << "history client " << c.id << ": " << store.status().to_string() << "\n";
    return 2;
  }
  const Deadline stop = Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(c.seconds * 1000));
  std::vector<Doing> doing(static_cast<std::size_t>(c.threads) + 1);  // the last: the main thread
  test::Watchdog watchdog(stop + 30s, [&] { report_hang(c, doing); });
  std::vector<std::thread> threads;
  for (int t = 0; t < c.threads; ++t) {
    threads.emplace_back(
        [&, t] { client_thread(**store, c, t, log, stop, doing[static_cast<std::size_t>(t)]); });
  }
  for (auto& t : threads) t.join();
  doing.back().set("closing the store");
  store->reset();
  doing.back().set("done");
  return 0;
}

// ---- the checker ------------------------------------------------------------------------------

struct Put {
  std::string key;
  std::size_t size = 0;
  std::int64_t t_inv = 0, t_ret = 0;
  int code = 0;
  bool dropped = false;  // a stream never committed
};
struct Change {  // a put or remove of a key that returned OK
  std::int64_t t_inv = 0, t_ret = 0;
};
struct Get {
  std::string key;
  std::int64_t t_inv = 0, t_ret = 0;
  std::size_t size = 0;
  long long put_id = -1;
  std::string problem;
  std::string client;
};

struct Report {
  std::map<std::string, std::uint64_t> ops;     // by kind and outcome
  std::uint64_t gets_checked = 0;               // gets that returned bytes
  std::uint64_t gets_recovered = 0;             // of those, older bytes a Redis loss brought back
  std::vector<std::string> overdue;             // returned more than 1 s after their deadline
  std::vector<std::string> wrong;               // wrong bytes, described
  std::map<std::string, std::uint64_t> faults;  // the nemesis's actions
  std::vector<std::string> failures;            // clients that crashed or hung, setup errors
  std::vector<std::string> pages;               // page accounting problems at the end
  struct PutCall {
    std::int64_t t_inv = 0, t_ret = 0;
    bool ok = false;
    int code = 0;     // its StatusCode
    std::string why;  // a failure's message
  };
  std::vector<PutCall> put_calls;  // every put (not the dropped streams), for the phases
};

// A stretch of the run: disturbed (a fault, and the settling after it) or quiet.
struct Phase {
  std::int64_t from_ns = 0, to_ns = 0;
  std::vector<std::string> faults;  // empty: quiet
  std::uint64_t puts = 0, puts_ok = 0;
  std::map<int, std::uint64_t> failed;   // StatusCode -> puts that ended with it
  std::map<int, std::string> first_why;  // StatusCode -> the message of the first of them
  double success() const {
    return puts == 0 ? 1.0 : static_cast<double>(puts_ok) / static_cast<double>(puts);
  }
};

// After a fault ends, the cell settles: a dead node's heartbeat TTL runs out (2 s), clients
// stop avoiding a node they failed to reach (5 s). Puts before then count to the fault's phase.
// A Redis fault lasts until every node registered again with the master that serves now and
// it takes writes (the nemesis waits for that), and settles longer: clients find the new
// master, reservations and leases of the old one run out.
constexpr std::int64_t kSettleNs = 6'000'000'000;
constexpr std::int64_t kRedisSettleNs = 10'000'000'000;
// A quiet stretch shorter than this between two disturbed ones is part of them: the cell is
// still settling.
constexpr std::int64_t kMinQuietNs = 5'000'000'000;
// In the quiet phases at least this share of puts succeed, once there are enough to tell.
constexpr double kQuietPutSuccess = 0.99;
constexpr std::uint64_t kMinQuietPuts = 200;

// The run from `from` to `to` cut into phases by the nemesis's faults (each [start, end]); a
// put belongs to a quiet phase only when it began and returned inside it.
std::vector<Phase> phases_of(std::int64_t from, std::int64_t to,
                             std::vector<std::tuple<std::int64_t, std::int64_t, std::string>> faults,
                             const std::vector<Report::PutCall>& puts) {
  std::sort(faults.begin(), faults.end());
  std::vector<Phase> out;
  std::int64_t at = from;
  for (const auto& [start, end, name] : faults) {
    const bool short_gap = !out.empty() && !out.back().faults.empty() && start - at < kMinQuietNs;
    if (start > at && !short_gap) out.push_back({at, start, {}});
    if (out.empty() || out.back().faults.empty()) out.push_back({start, start, {}});
    Phase& d = out.back();
    const std::int64_t settle = name.find("redis") != std::string::npos ? kRedisSettleNs : kSettleNs;
    d.to_ns = std::max(d.to_ns, std::min(to, end + settle));
    if (std::find(d.faults.begin(), d.faults.end(), name) == d.faults.end()) d.faults.push_back(name);
    at = std::max(at, d.to_ns);
  }
  if (at < to) out.push_back({at, to, {}});
  for (const auto& p : puts) {
    for (Phase& ph : out) {
      const bool in = ph.faults.empty() ? p.t_inv >= ph.from_ns && p.t_ret <= ph.to_ns
                                        : p.t_inv >= ph.from_ns && p.t_inv < ph.to_ns;
      if (in) {
        ++ph.puts;
        ph.puts_ok += p.ok;
        if (!p.ok && ph.failed[p.code]++ == 0) ph.first_why[p.code] = p.why;
        break;
      }
    }
  }
  return out;
}

std::string code_name(int code) { return std::string(to_string(static_cast<StatusCode>(code))); }

// `losses`: when ([from, to]) the cell's Redis lost writes (restarted empty, failed over) while
// the nodes' tiers could give recoverable keys back. A get of a recoverable key may then return
// the bytes of a put that a change replaced, if a loss ended after that change was invoked (it
// may have undone the change) and began before the get returned: the contract of keys that
// name their content (docs/metadata.md, "A cell that lost its Redis"). Every other rule holds
// for them too.
void check(const std::vector<std::string>& logs, Report& report,
           const std::vector<std::pair<std::int64_t, std::int64_t>>& losses) {
  std::unordered_map<std::uint64_t, Put> puts;
  std::map<std::string, std::vector<Change>> changes;
  std::vector<Get> gets;
  for (const auto& path : logs) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream f(line);
      char kind = 0;
      f >> kind;
      long long deadline_ms = 0;
      std::int64_t t0 = 0, t1 = 0;
      int code = 0;
      if (kind == 'P' || kind == 'A') {
        Put p;
        std::uint64_t id = 0;
        f >> p.key >> id >> p.size >> p.t_inv >> p.t_ret;
        std::string why;
        if (kind == 'P') f >> p.code >> deadline_ms, std::getline(f >> std::ws, why);
        p.dropped = kind == 'A';
        t0 = p.t_inv, t1 = p.t_ret, code = p.code;
        if (kind == 'P' && p.code == 0) changes[p.key].push_back({p.t_inv, p.t_ret});
        report.ops[kind == 'P' ? "put " + code_name(p.code) : std::string("put stream dropped")]++;
        if (kind == 'P') report.put_calls.push_back({p.t_inv, p.t_ret, p.code == 0, p.code, std::move(why)});
        puts.emplace(id, std::move(p));
      } else if (kind == 'G') {
        Get g;
        f >> g.key >> g.t_inv >> g.t_ret >> code >> deadline_ms >> g.size >> g.put_id;
        std::getline(f >> std::ws, g.problem);
        if (g.problem == "-") g.problem.clear();
        g.client = path;
        t0 = g.t_inv, t1 = g.t_ret;
        report.ops[std::string("get ") + code_name(code)]++;
        if (code == 0) gets.push_back(std::move(g));
      } else if (kind == 'R') {
        std::string key;
        f >> key >> t0 >> t1 >> code >> deadline_ms;
        if (code == 0) changes[key].push_back({t0, t1});
        report.ops[std::string("remove ") + code_name(code)]++;
      } else if (kind == 'O') {
        char what = 0;
        f >> what >> t0 >> t1 >> code >> deadline_ms;
        report.ops[std::string(what == 'T' ? "touch " : "contains_prefix ") + code_name(code)]++;
      } else {
        continue;
      }
      if (deadline_ms > 0 && t1 - t0 > (deadline_ms + 1000) * 1000000) {
        report.overdue.push_back("`" + line + "` took " + std::to_string((t1 - t0) / 1000000) +
                                 " ms with a deadline of " + std::to_string(deadline_ms) + " ms");
      }
    }
  }
  for (auto& [key, list] : changes) {
    std::sort(list.begin(), list.end(), [](const Change& a, const Change& b) { return a.t_ret < b.t_ret; });
  }
  for (const Get& g : gets) {
    ++report.gets_checked;
    auto fail = [&](const std::string& why) {
      if (report.wrong.size() < 200)
        report.wrong.push_back("get of " + g.key + " (" + g.client + "): " + why);
    };
    if (!g.problem.empty()) {
      fail(g.problem);
      continue;
    }
    auto it = puts.find(static_cast<std::uint64_t>(g.put_id));
    if (it == puts.end()) {
      fail("bytes of put " + std::to_string(g.put_id) + ", which no client made");
      continue;
    }
    const Put& p = it->second;
    if (p.key != g.key) {
      fail("bytes of a put of " + p.key);
    } else if (p.dropped) {
      fail("bytes of put " + std::to_string(g.put_id) + ", a stream its client dropped before commit");
    } else if (p.size != g.size) {
      fail("size " + std::to_string(g.size) + ", but put " + std::to_string(g.put_id) + " wrote " +
           std::to_string(p.size));
    } else if (p.t_inv >= g.t_ret) {
      fail("bytes of put " + std::to_string(g.put_id) + ", invoked after the get returned");
    } else {
      // Replaced for sure before the get began: a change invoked after P returned that
      // returned before the get was invoked (and that no loss may have undone).
      bool brought_back = false;
      for (const Change& c : changes[g.key]) {
        if (c.t_ret >= g.t_inv) break;
        if (c.t_inv <= p.t_ret) continue;
        if (recoverable(g.key) && std::ranges::any_of(losses, [&](const auto& r) {
              return r.second > c.t_inv && r.first < g.t_ret;
            })) {
          brought_back = true;
          continue;
        }
        fail("bytes of put " + std::to_string(g.put_id) + ", replaced or removed " +
             std::to_string((g.t_inv - c.t_ret) / 1000000) + " ms before the get began");
        brought_back = false;
        break;
      }
      report.gets_recovered += brought_back;
    }
  }
}

// ---- the orchestrator -----------------------------------------------------------------------

struct RunConfig {
  double seconds = 60;
  int nodes = 2;
  std::string capacity = "16MiB";
  std::vector<std::string> transports{"shm", "tcp", "ucx"};
  int threads = 2;
  std::uint64_t seed = 0;
  bool nemesis = true;
  // "mixed": pauses, kills and Redis restarts (failovers); "kill": only kill -9 and restart
  // of a node; "redis": only Redis restarts (failovers).
  std::string faults = "mixed";
  std::string redis_mode = "single";  // "sentinel": a master, a replica and a sentinel
  std::string json_path;
  std::string dir;
  std::string rkey_scope;
  std::string policy = "lru";  // the cell's eviction policy
  int avoid_ms = -1;           // passed to the clients
  // The nemesis rests for the last quiet_seconds of every quiet_every seconds (0: never).
  double quiet_seconds = 15;
  double quiet_every = 45;
  // Puts that ran out of their deadline (50 ms..3 s) do not count against the quiet phases:
  // for a host too slow to keep them (the Soft-RoCE lane's emulated guest), not for the cell.
  bool excuse_quiet_timeouts = false;
  std::string netns;  // the namespaces' prefix (scripts/netns-cell); empty: everything on loopback
  int hosts = 5;      // with netns: how many hosts the script made
  // Give each node an NVMe tier: DIR/h<i>.tier (a file system with O_DIRECT), and the nemesis
  // its faults: bytes overwritten or the file cut short under a node, a node restarted over a
  // device that fails its reads (EIO) for a while.
  std::string ssd_dir;
};

// Where the cell's processes run: all on this host's loopback, or (--netns P) on the hosts
// scripts/netns-cell made: network namespaces P-h<i>, each with address 10.231.0.<10+i> on
// one bridge in P-sw, this process in P-ctl. Redis (a master, two replicas, three
// sentinels) runs on hosts 0-2, the clients too, the memory nodes on hosts 3 and up: every
// client reaches every node across the bridge, over tcp.
struct Hosts {
  std::string prefix;
  int count = 1;

  bool netns() const { return !prefix.empty(); }
  std::string ns(int host) const { return std::string(prefix).append("-h").append(std::to_string(host)); }
  std::string addr(int host) const {
    return netns() ? std::string("10.231.0.").append(std::to_string(10 + host)) : std::string("127.0.0.1");
  }
  std::vector<std::string> wrapper(int host) const {
    if (!netns()) return {};
    return {"ip", "netns", "exec", ns(host)};
  }
  int redis_host(int i) const { return netns() ? i % 3 : 0; }
  int client_host(int i) const { return netns() ? i % 3 : 0; }
  int node_host(int i) const { return netns() ? 3 + i % std::max(1, count - 3) : 0; }
};

// Runs a command (ip, tc) to its end; false when it failed.
bool run_command(std::vector<std::string> argv) {
  auto child =
      tools::ChildProcess::start({.argv = std::move(argv), .capture_stdout = false, .discard_stderr = true});
  if (!child.is_ok()) return false;
  auto status = child->wait(deadline_after(10s));
  if (!status) child->kill();
  return status && *status == 0;
}

// The cell's Redis: one server, or (sentinel) servers, one master and the rest replicating
// it, and sentinels over them: on loopback two servers and one sentinel; on the netns hosts a
// master and two replicas on hosts 0-2 and a sentinel on each (quorum 2).
class CellRedis {
 public:
  static Result<std::unique_ptr<CellRedis>> start(bool sentinel, const Hosts& hosts) {
    auto r = std::unique_ptr<CellRedis>(new CellRedis);
    r->hosts_ = hosts;
    if (!sentinel) {
      KVSTASH_ASSIGN_OR_RETURN(
          auto one, tools::LocalRedis::start({.host = hosts.addr(0), .wrapper = hosts.wrapper(0)}));
      r->servers_.push_back(std::move(one));
      return r;
    }
    // As docs/operations.md asks of Sentinel deployments: a master without a replica in sync
    // refuses writes, so one that comes back empty before Sentinel demotes it takes none.
    const std::vector<std::string> guarded{"--min-replicas-to-write", "1", "--min-replicas-max-lag", "2"};
    const int servers = hosts.netns() ? 3 : 2;
    const int sentinels = hosts.netns() ? 3 : 1;
    for (int i = 0; i < servers; ++i) {
      std::vector<std::string> args = guarded;
      if (i > 0) {
        args.insert(args.end(),
                    {"--replicaof", r->servers_[0]->host(), std::to_string(r->servers_[0]->port())});
      }
      const int host = hosts.redis_host(i);
      KVSTASH_ASSIGN_OR_RETURN(
          auto server, tools::LocalRedis::start(
                           {.extra_args = args, .host = hosts.addr(host), .wrapper = hosts.wrapper(host)}));
      r->servers_.push_back(std::move(server));
    }
    for (int i = 0; i < sentinels; ++i) {
      const int host = hosts.redis_host(i);
      KVSTASH_ASSIGN_OR_RETURN(auto sentinel,
                               tools::LocalRedis::start({.sentinel_for = r->servers_[0]->port(),
                                                         .sentinel_host = r->servers_[0]->host(),
                                                         .quorum = sentinels / 2 + 1,
                                                         .service = "history",
                                                         .host = hosts.addr(host),
                                                         .wrapper = hosts.wrapper(host)}));
      r->sentinels_.push_back(std::move(sentinel));
    }
    // A failover needs the replicas in sync and known to the sentinels.
    KVSTASH_ASSIGN_OR_RETURN(auto watcher, r->ask_sentinel());
    for (auto end = Clock::now() + 30s;; std::this_thread::sleep_for(100ms)) {
      auto replicas = watcher->command({"SENTINEL", "replicas", "history"});
      int in_sync = 0;
      for (std::size_t k = 0; replicas.is_ok() && k < replicas->size(); ++k) {
        const redisReply* fields = replicas->element(k);
        for (std::size_t i = 0; i + 1 < fields->elements; i += 2) {
          if (std::string_view(fields->element[i]->str) == "master-link-status" &&
              std::string_view(fields->element[i + 1]->str) == "ok") {
            ++in_sync;
          }
        }
      }
      if (in_sync == servers - 1) return r;
      if (Clock::now() > end) return Status::unavailable("the sentinel never saw the replicas in sync");
    }
  }

  std::string url() const {
    if (sentinels_.empty()) return servers_[0]->url();
    std::string url = "redis+sentinel://";
    for (std::size_t i = 0; i < sentinels_.size(); ++i) {
      url.append(i > 0 ? "," : "")
          .append(sentinels_[i]->host())
          .append(":")
          .append(std::to_string(sentinels_[i]->port()));
    }
    return url.append("/history/0");
  }

  // Single: restarts Redis empty. Sentinel: kills the master, waits for the failover (or
  // its time), and brings the killed server back, empty (the sentinel makes it a replica).
  // Returns the fault's name.
  Result<std::string> fault(std::mt19937_64& rng) {
    if (sentinels_.empty()) {
      KVSTASH_RETURN_IF_ERROR(servers_[0]->restart());
      return std::string("redis restarted empty");
    }
    KVSTASH_ASSIGN_OR_RETURN(auto watcher, ask_sentinel());
    KVSTASH_ASSIGN_OR_RETURN(auto master,
                             watcher->command({"SENTINEL", "get-master-addr-by-name", "history"}));
    if (master.size() != 2) return Status::internal("the sentinel names no master");
    const std::string host(master.element(0)->str);
    const int port = std::atoi(master.element(1)->str);
    auto victim =
        std::ranges::find_if(servers_, [&](const auto& s) { return s->host() == host && s->port() == port; });
    if (victim == servers_.end()) return Status::internal("the sentinel names a master that is none of ours");
    std::printf("  at %" PRId64 " ms: killing the master %s:%d\n", now_ns() / 1000000, host.c_str(), port);
    (*victim)->kill();
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(1500, 3000)(rng)));
    KVSTASH_RETURN_IF_ERROR((*victim)->restart());
    return std::string("redis master killed (failover)");
  }

 private:
  CellRedis() = default;
  // A plain connection to a sentinel that answers.
  Result<std::unique_ptr<metadata::RedisClient>> ask_sentinel() const {
    Status last = Status::unavailable("no sentinel");
    for (const auto& sentinel : sentinels_) {
      auto c = metadata::RedisClient::connect({.url = std::string("redis://")
                                                          .append(sentinel->host())
                                                          .append(":")
                                                          .append(std::to_string(sentinel->port()))});
      if (c.is_ok()) return c;
      last = c.status();
    }
    return last;
  }
  Hosts hosts_;
  std::vector<std::unique_ptr<tools::LocalRedis>> servers_;
  std::vector<std::unique_ptr<tools::LocalRedis>> sentinels_;
};

// The network nemesis of the netns hosts: a host's link down (a partition from every other
// host), or its link degraded for a while: netem delay and loss where the kernel has netem;
// else a token bucket of 2 Mbit/s (a slow link, its queue the delay) and nftables dropping
// 3% of the host's packets each way (random loss). Returns the fault's name; empty when the
// commands failed.
std::string network_fault(const Hosts& hosts, int host, bool partition, std::chrono::milliseconds lasting) {
  const std::string sw = std::string(hosts.prefix).append("-sw");
  const std::string port = std::string("h").append(std::to_string(host));
  if (partition) {
    if (!run_command({"ip", "-n", sw, "link", "set", port, "down"})) return {};
    std::this_thread::sleep_for(lasting);
    run_command({"ip", "-n", sw, "link", "set", port, "up"});
    return "host partitioned (link down)";
  }
  const std::string ns = hosts.ns(host);
  std::string what = "link degraded (netem 20 ms +-10 ms, 3% loss)";
  bool nft = false;
  if (!run_command({"tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "20ms", "10ms",
                    "loss", "3%"})) {
    if (!run_command({"tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "2mbit", "burst",
                      "32kbit", "latency", "400ms"})) {
      return {};
    }
    const std::vector<std::string> in_ns{"ip", "netns", "exec", ns, "nft"};
    auto nft_cmd = [&](std::vector<std::string> words) {
      std::vector<std::string> argv = in_ns;
      argv.insert(argv.end(), words.begin(), words.end());
      return run_command(std::move(argv));
    };
    nft = nft_cmd({"add", "table", "inet", "kvs_nemesis"});
    for (const char* hook : {"input", "output"}) {
      nft =
          nft &&
          nft_cmd({"add", "chain", "inet", "kvs_nemesis", hook,
                   std::string("{ type filter hook ").append(hook).append(" priority 0; policy accept; }")});
      nft = nft && nft_cmd({"add", "rule", "inet", "kvs_nemesis", hook, "numgen", "random", "mod", "100", "<",
                            "3", "drop"});
    }
    what = nft ? "link degraded (tbf 2 Mbit/s and nft 3% loss: this kernel has no netem)"
               : "link slowed (tbf 2 Mbit/s; no netem in this kernel, no nft for loss)";
    if (!nft) nft_cmd({"delete", "table", "inet", "kvs_nemesis"});
  }
  std::this_thread::sleep_for(lasting);
  run_command({"tc", "-n", ns, "qdisc", "del", "dev", "eth0", "root"});
  if (nft) run_command({"ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kvs_nemesis"});
  return what;
}

// Every page of every live node accounted for, once the cell is quiet (no pending put, no
// zombie, no sweep left): each page a node handed out (below its next_page) is in a run on its
// free list or in exactly one object's run, and no page is both or twice; each object's run
// still holds its generation at its first page, and the node's free_pages counts its free
// list. Problems as text; empty when all hold.
const metadata::Script& accounting_script() {
  static const metadata::Script script(R"(
local P = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local busy = redis.call('ZCARD', P .. ':pending') + redis.call('ZCARD', P .. ':zombies') + redis.call('LLEN', P .. ':sweep')
if busy > 0 then return {'busy'} end
local problems = {'ok'}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':nodes', now, '+inf')) do
  local owner, held, free = {}, 0, 0
  local gk = P .. ':gen:' .. id
  local function hold(first, count, what, gen)
    local g = tonumber(redis.call('HGET', gk, first) or '0')
    if gen ~= nil and g ~= gen then
      problems[#problems + 1] = 'node ' .. id .. ' page ' .. first .. ': ' .. what .. ' names generation ' .. gen .. ', the page has ' .. g
    end
    for page = first, first + count - 1 do
      if owner[page] then
        problems[#problems + 1] = 'node ' .. id .. ' page ' .. page .. ': held by ' .. owner[page] .. ' and by ' .. what
        return
      end
      owner[page] = what
      held = held + 1
    end
  end
  for _, e in ipairs(redis.call('LRANGE', P .. ':free:' .. id, 0, -1)) do
    local first, count = string.match(e, '^(%d+),?(%d*)$')
    count = tonumber(count) or 1
    hold(tonumber(first), count, 'the free list', nil)
    free = free + count
  end
  local counted = tonumber(redis.call('HGET', P .. ':node:' .. id, 'free_pages') or '0')
  if counted ~= free then
    problems[#problems + 1] = 'node ' .. id .. ': free_pages says ' .. counted .. ', its free list holds ' .. free
  end
  for _, key in ipairs(redis.call('SMEMBERS', P .. ':objs:' .. id)) do
    local ext = redis.call('HGET', P .. ':obj:' .. key, 'extents')
    if not ext then
      problems[#problems + 1] = 'node ' .. id .. ': its objects name ' .. key .. ', which has no record'
    else
      for node, page, gen, count in string.gmatch(ext, '([^,;]+),(%d+),(%d+),?(%d*)') do
        if node == id then hold(tonumber(page), tonumber(count) or 1, 'object ' .. key, tonumber(gen)) end
      end
    end
  end
  local handed = tonumber(redis.call('HGET', P .. ':node:' .. id, 'next_page') or '0')
  for page, what in pairs(owner) do
    if page >= handed then
      problems[#problems + 1] = 'node ' .. id .. ' page ' .. page .. ': held by ' .. what .. ', but never handed out'
    end
  end
  if held ~= handed then
    problems[#problems + 1] = 'node ' .. id .. ': ' .. held .. ' of the ' .. handed .. ' pages it handed out are accounted for'
  end
end
return problems
)");
  return script;
}

// Waits, up to `limit`, until `nodes` memory nodes are in the cell again (after a Redis fault
// they register anew with the master that serves now) and that master takes writes. Whether
// both hold.
bool wait_cell_whole(const std::string& url, int nodes, std::chrono::seconds limit) {
  const std::string key = metadata::cell_prefix("default") + ":nodes";
  for (auto end = Clock::now() + limit; Clock::now() < end; std::this_thread::sleep_for(200ms)) {
    auto redis = metadata::RedisClient::connect({.url = url});
    if (!redis.is_ok()) continue;
    // Live ones: a heartbeat deadline still ahead on the Redis that serves now.
    auto t = (*redis)->command({"TIME"});
    if (!t.is_ok() || t->size() < 2) continue;
    const std::string now_ms =
        std::to_string(std::stoll(std::string(t->element(0)->str, t->element(0)->len)) * 1000 +
                       std::stoll(std::string(t->element(1)->str, t->element(1)->len)) / 1000);
    auto n = (*redis)->command({"ZCOUNT", key, now_ms, "+inf"});
    if (!n.is_ok() || n->integer() < nodes) continue;
    // And the master takes writes: under min-replicas-to-write it refuses them (NOREPLICAS)
    // until a replica is in sync again, which a replica's full resync (or a slowed link) can
    // hold off well after the nodes registered.
    if ((*redis)->command({"SET", "kvstash-history:probe", now_ms}).is_ok()) return true;
  }
  return false;
}

// The cell's NVMe tier counters (P:stats) now; empty when Redis does not answer.
// Sets the cell's eviction policy (kvstash policy): at the start, and again after a Redis that
// came back empty forgot it.
Status set_policy(const std::string& url, const std::string& policy) {
  KVSTASH_ASSIGN_OR_RETURN(auto redis, metadata::RedisClient::connect({.url = url}));
  return metadata::CellAdmin(*redis).set_policy(policy).status();
}

std::map<std::string, std::uint64_t> tier_counters(const std::string& url) {
  static const char* const kFields[] = {"written_down", "promoted",     "tier_hits",
                                        "tier_lost",    "tier_evicted", "recovered"};
  std::map<std::string, std::uint64_t> out;
  auto redis = metadata::RedisClient::connect({.url = url});
  if (!redis.is_ok()) return out;
  const std::string key = metadata::cell_prefix("default") + ":stats";
  std::vector<std::string_view> args{"HMGET", key};
  for (const char* f : kFields) args.push_back(f);
  auto r = (*redis)->command(args);
  if (!r.is_ok() || r->size() != std::size(kFields)) return out;
  for (std::size_t i = 0; i < std::size(kFields); ++i) {
    const redisReply* e = r->element(i);
    out[kFields[i]] =
        e != nullptr && e->type == REDIS_REPLY_STRING ? std::stoull(std::string(e->str, e->len)) : 0;
  }
  return out;
}

std::vector<std::string> account_pages(const std::string& url) {
  auto redis = metadata::RedisClient::connect({.url = url});
  if (!redis.is_ok()) return {"page accounting: " + redis.status().to_string()};
  const std::string prefix = metadata::cell_prefix("default");
  // Put leases (3 s) and read leases (2 s) end, the nodes' reclaim (every 200 ms) frees
  // what they held and sweeps what dead incarnations left.
  for (auto end = Clock::now() + 60s;; std::this_thread::sleep_for(500ms)) {
    auto r = (*redis)->eval(accounting_script(), {prefix}, {});
    if (!r.is_ok()) {
      if (Clock::now() < end) continue;
      return {"page accounting: " + r.status().to_string()};
    }
    std::vector<std::string> out;
    for (std::size_t i = 0; i < r->size(); ++i) out.emplace_back(r->element(i)->str, r->element(i)->len);
    if (out.empty()) return {"page accounting: an empty reply"};
    if (out.front() == "busy" && Clock::now() < end) continue;
    if (out.front() == "busy")
      return {"page accounting: puts, zombies or sweeps still pending 60 s after the run"};
    out.erase(out.begin());
    return out;
  }
}

int run(const RunConfig& rc, const std::string& self) {
  Report report;
  const Hosts hosts{rc.netns, rc.netns.empty() ? 1 : rc.hosts};
  auto redis = CellRedis::start(rc.redis_mode == "sentinel", hosts);
  if (!redis.is_ok()) {
    std::cerr << "history: " << redis.status().to_string() << "\n";
    return 2;
  }
  const std::string url = (*redis)->url();
  // `initial`: before the run, where a node that does not start is a setup failure.
  auto tier_file = [&](int i) { return rc.ssd_dir + "/h" + std::to_string(i) + ".tier"; };
  auto start_node = [&](int i, bool initial = false,
                        const std::string& ssd_fault = "none") -> std::unique_ptr<tools::LocalNode> {
    std::vector<std::string> args{
        "--heartbeat-ttl", "2s", "--reclaim-interval", "200ms", "--ucx-allow-emulated-rma",
        "--huge-pages",    "off"};
    if (!rc.ssd_dir.empty()) {
      args.insert(args.end(), {"--ssd", tier_file(i), "--ssd-capacity", "64MiB", "--ssd-fault", ssd_fault,
                               "--ssd-recover", "kvp:"});
    }
    if (hosts.netns()) {
      const std::string at = hosts.addr(hosts.node_host(i));
      args.insert(args.end(), {"--listen", at + ":0", "--admin", at + ":0", "--transports", "tcp"});
    }
    // kvstashd exits when it cannot register (Redis mid-failover, its host partitioned);
    // like a supervisor, start it again for a while.
    Result<std::unique_ptr<tools::LocalNode>> n = Status::unavailable("not started");
    for (auto give_up = Clock::now() + 30s; Clock::now() < give_up; std::this_thread::sleep_for(500ms)) {
      n = tools::LocalNode::start({.redis_url = url,
                                   .capacity = rc.capacity,
                                   .page_size = "1MiB",
                                   .node_id = "h" + std::to_string(i),
                                   .extra_args = args,
                                   .wrapper = hosts.wrapper(hosts.node_host(i))});
      if (n.is_ok() || n.status().code() != StatusCode::kUnavailable) break;
    }
    if (!n.is_ok() && !initial && n.status().code() == StatusCode::kUnavailable) {
      // An outcome, not a failure: the cell's Redis had no master it could register with
      // (the nemesis's failovers and partitions); the nemesis tries again later.
      std::printf("  node h%d could not rejoin for 30 s: %s\n", i, n.status().to_string().c_str());
      ++report.faults["node restart put off: no Redis master for 30 s"];
      return nullptr;
    }
    if (!n.is_ok()) {
      report.failures.push_back("node h" + std::to_string(i) + ": " + n.status().to_string());
      return nullptr;
    }
    return std::move(n).value();
  };
  std::vector<std::unique_ptr<tools::LocalNode>> nodes;
  for (int i = 0; i < rc.nodes; ++i) {
    nodes.push_back(start_node(i, /*initial=*/true));
    if (!nodes.back()) {
      std::cerr << "history: " << report.failures.back() << "\n";
      return 2;
    }
  }

  if (Status s = set_policy(url, rc.policy); !s.is_ok()) {
    std::cerr << "history: setting the eviction policy: " << s.to_string() << "\n";
    return 2;
  }
  std::mt19937_64 rng(rc.seed);
  const std::int64_t run_start = now_ns();
  std::vector<tools::ChildProcess> clients;
  std::vector<std::string> logs;
  for (std::size_t i = 0; i < rc.transports.size(); ++i) {
    const std::string log = rc.dir + "/client-" + std::to_string(i) + "-" + rc.transports[i] + ".log";
    logs.push_back(log);
    std::vector<std::string> argv = hosts.wrapper(hosts.client_host(static_cast<int>(i)));
    argv.insert(argv.end(), {self,           "--client",
                             "--redis",      url,
                             "--transport",  rc.transports[i],
                             "--id",         std::to_string(i + 1),
                             "--threads",    std::to_string(rc.threads),
                             "--seconds",    std::to_string(rc.seconds),
                             "--seed",       std::to_string(rc.seed + i + 1),
                             "--log",        log,
                             "--rkey-scope", rc.rkey_scope,
                             "--avoid-ms",   std::to_string(rc.avoid_ms)});
    auto child = tools::ChildProcess::start({.argv = argv, .capture_stdout = false});
    if (!child.is_ok()) {
      std::cerr << "history: client: " << child.status().to_string() << "\n";
      return 2;
    }
    clients.push_back(std::move(child).value());
  }

  // The nemesis, on this thread (children die with the thread that started them).
  const auto end = Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(rc.seconds * 1000));
  auto pick = [&](int n) { return static_cast<int>(std::uniform_int_distribution<int>(0, n - 1)(rng)); };
  auto ms = [&](int lo, int hi) {
    return std::chrono::milliseconds(std::uniform_int_distribution<int>(lo, hi)(rng));
  };
  auto last_redis_restart = Clock::now();
  std::map<std::string, std::uint64_t> tier_before;  // the tiers' counters before Redis faults
  const auto began = Clock::now();
  // Each nemesis action as a window [start, end] named by what it did, for the phases.
  std::vector<std::tuple<std::int64_t, std::int64_t, std::string>> windows;
  auto quiet_now = [&] {
    if (rc.quiet_seconds <= 0 || rc.quiet_every <= rc.quiet_seconds) return false;
    const double t = std::chrono::duration<double>(Clock::now() - began).count();
    return std::fmod(t, rc.quiet_every) >= rc.quiet_every - rc.quiet_seconds;
  };
  while (rc.nemesis && Clock::now() + 5s < end) {
    std::this_thread::sleep_for(ms(500, 2500));
    if (quiet_now()) {
      // A quiet phase: every node up, no fault, so that the checker holds the cell to its
      // fault-free promises (puts succeed) for a while in every run.
      for (int i = 0; i < rc.nodes; ++i) {
        if (nodes[i]) continue;
        const std::int64_t t0 = now_ns();
        nodes[i] = start_node(i);
        if (nodes[i]) ++report.faults["node restarted"];
        windows.emplace_back(t0, now_ns(), "node restarted");
      }
      continue;
    }
    const int victim = pick(rc.nodes);
    const std::int64_t fault_start = now_ns();
    const std::map<std::string, std::uint64_t> faults_before = report.faults;
    const auto record = [&] {
      std::string what;
      for (const auto& [name, count] : report.faults) {
        auto it = faults_before.find(name);
        if (it != faults_before.end() && it->second == count) continue;
        what += (what.empty() ? "" : ", ") + name;
      }
      if (!what.empty()) windows.emplace_back(fault_start, now_ns(), what);
    };
    // 0-5 a pause, 6-8 a kill -9, 9 a Redis fault, 10 a partition, 11 a degraded link. Across
    // hosts, the network and the master get a larger share.
    constexpr int kAcrossHosts[] = {0, 1, 3, 4, 6, 7, 9, 9, 10, 10, 11, 11};
    // With tiers, 12 bytes overwritten or the file cut short under a node, 13 a node over a
    // device that fails its reads for a while.
    constexpr int kWithTiers[] = {0, 2, 4, 6, 7, 9, 12, 12, 12, 13, 13};
    const int action = rc.faults == "kill"    ? 6
                       : rc.faults == "redis" ? 9
                       : rc.faults == "net"   ? 10 + pick(2)
                       : rc.faults == "ssd"   ? 12 + pick(2)
                       : hosts.netns()        ? kAcrossHosts[pick(12)]
                       : !rc.ssd_dir.empty()  ? kWithTiers[pick(11)]
                                              : pick(10);
    if (!nodes[victim]) {
      nodes[victim] = start_node(victim);
      ++report.faults["node restarted"];
      record();
      continue;
    }
    if (action == 12) {  // the tier's bytes changed under the node: junk, or the file cut short
      const std::string path = tier_file(victim);
      const int fd = ::open(path.c_str(), O_WRONLY);
      bool done = fd >= 0;
      if (done && pick(3) == 0) {
        // Cut short: everything past a random point of the first half is gone.
        done = ::ftruncate(fd, static_cast<off_t>(1 + pick(32)) << 20) == 0;
        ++report.faults["tier file cut short under a node"];
      } else if (done) {
        std::string junk(static_cast<std::size_t>(64 + pick(4032)) << 10, '\0');
        for (char& c : junk) c = static_cast<char>(pick(256));
        const off_t at = (static_cast<off_t>(1) << 20) + (static_cast<off_t>(pick(60 << 8)) << 12);
        done = ::pwrite(fd, junk.data(), junk.size(), at) == static_cast<ssize_t>(junk.size());
        ++report.faults["tier bytes overwritten under a node"];
      }
      if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
      }
      if (!done) report.failures.push_back("tier fault on " + path + ": " + std::strerror(errno));
    } else if (action == 13) {  // a node restarted over a device whose reads fail, then healed
      nodes[victim]->kill();
      nodes[victim] = start_node(victim, false, "read-eio");
      ++report.faults["node restarted over a device failing its reads"];
      std::this_thread::sleep_for(ms(1000, 3000));
      if (nodes[victim]) nodes[victim]->kill();
      nodes[victim] = start_node(victim);
      if (nodes[victim]) ++report.faults["node restarted"];
    } else if (action >= 10) {  // a host partitioned, or its link degraded, for a while
      const int host = pick(hosts.count);
      const std::string fault = network_fault(hosts, host, action == 10, ms(1000, 4000));
      if (fault.empty())
        report.failures.push_back("network fault on host " + std::to_string(host) + " failed");
      ++report.faults[fault.empty() ? std::string("network fault failed") : fault];
    } else if (action < 6) {  // a pause: half of them past the 2 s heartbeat TTL
      const auto pause = action < 3 ? ms(500, 1800) : ms(2200, 4000);
      ::kill(nodes[victim]->pid(), SIGSTOP);
      std::this_thread::sleep_for(pause);
      ::kill(nodes[victim]->pid(), SIGCONT);
      ++report.faults[pause > 2s ? "node paused past its heartbeat TTL" : "node paused"];
    } else if (action < 9) {  // a crash, and a restart of the same id a little later
      nodes[victim]->kill();
      nodes[victim].reset();
      ++report.faults["node killed (SIGKILL)"];
      std::this_thread::sleep_for(ms(200, 1500));
      nodes[victim] = start_node(victim);
      if (nodes[victim]) ++report.faults["node restarted"];
    } else if (Clock::now() - last_redis_restart > (rc.faults == "redis" ? 5s : hosts.netns() ? 8s : 15s)) {
      // Redis restarts empty, or its master dies, now and then. (The tiers' counters go with
      // an emptied Redis: keep what they said.)
      if (!rc.ssd_dir.empty()) {
        for (const auto& [k, v] : tier_counters(url)) tier_before[k] += v;
      }
      auto fault = (*redis)->fault(rng);
      if (!fault.is_ok()) report.failures.push_back("redis fault: " + fault.status().to_string());
      ++report.faults[fault.is_ok() ? *fault : std::string("redis fault failed")];
      if (fault.is_ok()) std::printf("  at %" PRId64 " ms: %s\n", now_ns() / 1000000, fault->c_str());
      // The fault lasts until the cell is whole again (the phases settle from then on).
      if (fault.is_ok() && !wait_cell_whole(url, rc.nodes, 30s)) {
        std::printf("  at %" PRId64
                    " ms: the cell was not whole (nodes rejoined, master taking writes) after 30 s\n",
                    now_ns() / 1000000);
      }
      if (rc.policy != "lru") (void)set_policy(url, rc.policy);  // a Redis that came back empty forgot it
      last_redis_restart = Clock::now();
    }
    record();
  }
  const std::int64_t run_end = run_start + static_cast<std::int64_t>(rc.seconds * 1e9);
  for (auto& n : nodes) {
    if (n) ::kill(n->pid(), SIGCONT);
  }
  for (std::size_t i = 0; i < clients.size(); ++i) {
    auto status = clients[i].wait(end + 60s);
    if (!status) {
      clients[i].kill();
      report.failures.push_back("client " + rc.transports[i] + " hung past the run's end (killed)");
    } else if (*status != 0) {
      report.failures.push_back("client " + rc.transports[i] + " exited with status " +
                                std::to_string(*status));
    }
  }
  // Every page accounted for, with the nemesis stopped (restart nodes it left down first).
  for (int i = 0; i < rc.nodes; ++i) {
    if (!nodes[i]) nodes[i] = start_node(i);
  }
  report.pages = account_pages(url);
  for (const auto& p : report.pages) report.failures.push_back("PAGES " + p);
  std::map<std::string, std::uint64_t> tier;
  if (!rc.ssd_dir.empty()) {
    tier = tier_before;
    for (const auto& [k, v] : tier_counters(url)) tier[k] += v;
    // A run over tiers that never moved an object down and back proved nothing about them.
    if (tier["written_down"] == 0 || tier["promoted"] == 0) {
      report.failures.push_back("the tiers were not exercised: " + std::to_string(tier["written_down"]) +
                                " objects moved down, " + std::to_string(tier["promoted"]) + " promoted");
    }
    for (int i = 0; i < rc.nodes; ++i) ::unlink(tier_file(i).c_str());
  }
  nodes.clear();
  std::vector<std::pair<std::int64_t, std::int64_t>> losses;
  if (!rc.ssd_dir.empty()) {
    for (const auto& [from, to, what] : windows) {
      if (what.find("redis") != std::string::npos) losses.emplace_back(from, to);
    }
  }
  check(logs, report, losses);

  std::uint64_t total = 0;
  for (const auto& [k, v] : report.ops) total += v;
  std::uint64_t faults = 0;
  for (const auto& [k, v] : report.faults) faults += v;
  json j;
  j["seconds"] = rc.seconds;
  j["seed"] = rc.seed;
  j["transports"] = rc.transports;
  j["nodes"] = rc.nodes;
  j["ops"] = total;
  j["ops_by_kind"] = report.ops;
  j["gets_checked"] = report.gets_checked;
  j["gets_recovered"] = report.gets_recovered;
  j["faults"] = faults;
  j["faults_by_kind"] = report.faults;
  if (!tier.empty()) j["tier"] = tier;
  j["wrong_bytes"] = report.wrong.size();
  j["overdue"] = report.overdue.size();
  j["violations"] = report.wrong;
  j["overdue_ops"] = report.overdue;
  j["failures"] = report.failures;
  j["page_problems"] = report.pages;
  std::uint64_t puts = 0, puts_ok = 0;
  for (const auto& [k, v] : report.ops) {
    if (k.starts_with("put ") && k != "put stream dropped") puts += v;
    if (k == "put ok") puts_ok += v;
  }
  j["put_success"] = puts > 0 ? static_cast<double>(puts_ok) / static_cast<double>(puts) : 0.0;
  // Put success per phase; in the quiet ones (no fault, the cell settled) the cell is held to
  // its promise that a full cell keeps taking puts: 99% of them succeed.
  const std::vector<Phase> phases = phases_of(run_start, run_end, windows, report.put_calls);
  std::uint64_t quiet_puts = 0, quiet_ok = 0;
  j["phases"] = json::array();
  std::uint64_t excused = 0;
  for (const Phase& ph : phases) {
    if (ph.faults.empty()) quiet_puts += ph.puts, quiet_ok += ph.puts_ok;
    if (ph.faults.empty() && rc.excuse_quiet_timeouts) {
      const auto t = ph.failed.find(static_cast<int>(StatusCode::kTimeout));
      if (t != ph.failed.end()) excused += t->second;
    }
    j["phases"].push_back({{"from_s", static_cast<double>(ph.from_ns - run_start) / 1e9},
                           {"to_s", static_cast<double>(ph.to_ns - run_start) / 1e9},
                           {"faults", ph.faults},
                           {"puts", ph.puts},
                           {"put_success", ph.success()}});
  }
  quiet_puts -= excused;
  const double quiet_success =
      quiet_puts == 0 ? 1.0 : static_cast<double>(quiet_ok) / static_cast<double>(quiet_puts);
  j["quiet_timeouts_excused"] = excused;
  j["quiet_puts"] = quiet_puts;
  j["quiet_put_success"] = quiet_success;
  if (quiet_puts >= kMinQuietPuts && quiet_success < kQuietPutSuccess) {
    char line[200];
    std::snprintf(line, sizeof line,
                  "put success %.2f%% in the fault-free phases (%" PRIu64 " puts), below %.0f%%",
                  100 * quiet_success, quiet_puts, 100 * kQuietPutSuccess);
    report.failures.push_back(line);
  }
  std::cout << "history: " << total << " ops, " << report.gets_checked << " gets checked ("
            << report.gets_recovered << " of recoverable keys brought back by a Redis loss), " << faults
            << " faults injected, " << report.wrong.size() << " wrong bytes, " << report.overdue.size()
            << " past their deadline, " << report.failures.size() << " failures\n";
  if (puts > 0)
    std::printf("  puts OK: %" PRIu64 " of %" PRIu64 " (%.1f%%)\n", puts_ok, puts, 100.0 * puts_ok / puts);
  for (const Phase& ph : phases) {
    std::string what = ph.faults.empty() ? "quiet" : "disturbed:";
    for (std::size_t i = 0; i < ph.faults.size() && i < 3; ++i) what += (i == 0 ? " " : ", ") + ph.faults[i];
    if (ph.faults.size() > 3) what += ", ...";
    std::string failed;
    for (const auto& [code, n] : ph.failed)
      failed += (failed.empty() ? "; failed: " : ", ") + code_name(code) + " " + std::to_string(n);
    std::printf("  phase %5.1f-%5.1f s: puts OK %" PRIu64 " of %" PRIu64 " (%.1f%%), %s%s\n",
                static_cast<double>(ph.from_ns - run_start) / 1e9,
                static_cast<double>(ph.to_ns - run_start) / 1e9, ph.puts_ok, ph.puts, 100 * ph.success(),
                what.c_str(), failed.c_str());
    if (!ph.faults.empty()) continue;
    for (const auto& [code, why] : ph.first_why)
      std::printf("    first %s: %s\n", code_name(code).c_str(), why.c_str());
  }
  if (quiet_puts < kMinQuietPuts) {
    std::printf("  (fewer than %" PRIu64 " puts in quiet phases: their success is reported, not held)\n",
                kMinQuietPuts);
  }
  if (rc.excuse_quiet_timeouts) {
    std::printf("  (quiet phases held to %.0f%% without their %" PRIu64
                " kTimeouts: --excuse-quiet-timeouts)\n",
                100 * kQuietPutSuccess, excused);
  }
  for (const auto& [k, v] : report.ops) std::cout << "  " << k << ": " << v << "\n";
  for (const auto& [k, v] : report.faults) std::cout << "  fault " << k << ": " << v << "\n";
  for (const auto& [k, v] : tier) std::cout << "  tier " << k << ": " << v << "\n";
  for (const auto& w : report.wrong) std::cout << "  WRONG BYTES " << w << "\n";
  for (std::size_t i = 0; i < std::min<std::size_t>(report.overdue.size(), 20); ++i) {
    std::cout << "  OVERDUE " << report.overdue[i] << "\n";
  }
  for (const auto& f : report.failures) std::cout << "  FAILURE " << f << "\n";
  if (!rc.json_path.empty()) std::ofstream(rc.json_path) << j.dump(2) << "\n";
  const bool clean = report.wrong.empty() && report.overdue.empty() && report.failures.empty();
  return clean && report.gets_checked > 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvstash::history

int main(int argc, char** argv) {
  using namespace kvstash::history;
  CLI::App app{
      "kvstash-history: a history checker for the store's first promise (see the file's opening comment)"};
  bool client = false;
  ClientConfig cc;
  RunConfig rc;
  double minutes = 0;
  std::string transports = "shm,tcp,ucx";
  bool no_nemesis = false, keep_logs = false;
  app.add_flag("--client", client, "Run as one client process (the orchestrator starts these)");
  app.add_option("--redis", cc.redis_url, "client: the cell's Redis");
  app.add_option("--transport", cc.transport, "client: shm, tcp or ucx");
  app.add_option("--id", cc.id, "client: its number (put ids carry it)");
  app.add_option("--log", cc.log, "client: its history file");
  app.add_option("--threads", rc.threads, "Threads per client process")->capture_default_str();
  app.add_option("--seconds", rc.seconds, "How long the run lasts")->capture_default_str();
  app.add_option("--minutes", minutes, "How long the run lasts, in minutes (overrides --seconds)");
  app.add_option("--seed", rc.seed, "Seed of the nemesis and the clients (default: random)");
  app.add_option("--nodes", rc.nodes, "Memory nodes")->capture_default_str();
  app.add_option("--capacity", rc.capacity, "Pool of each node (small: eviction is routine)")
      ->capture_default_str();
  app.add_option("--transports", transports, "One client process per transport listed")
      ->capture_default_str();
  app.add_option("--json", rc.json_path, "Write the report as JSON here");
  app.add_option("--rkey-scope", rc.rkey_scope, "verbs clients: connection or lease (default: the cell's)")
      ->check(CLI::IsMember({"", "connection", "lease"}));
  app.add_flag("--no-nemesis", no_nemesis, "Inject no faults (a baseline)");
  app.add_option("--quiet-seconds", rc.quiet_seconds,
                 "The nemesis rests this long at the end of every --quiet-every seconds: a fault-free phase, "
                 "where 99% of puts must succeed (0: no rest)")
      ->capture_default_str();
  app.add_option("--quiet-every", rc.quiet_every, "The period of the quiet phases")->capture_default_str();
  app.add_flag("--excuse-quiet-timeouts", rc.excuse_quiet_timeouts,
               "Puts that ran out of their deadline do not count against the quiet phases' 99% (a host too "
               "slow for 50 ms deadlines: the Soft-RoCE lane's emulated guest)");
  app.add_option(
         "--faults", rc.faults,
         "mixed: pauses, kills, Redis faults (and with --netns partitions and degraded links); kill: only "
         "kill -9 and restart nodes; redis: only Redis faults; net: only partitions and degraded links; ssd: "
         "only the tiers' faults (with --ssd-dir)")
      ->check(CLI::IsMember({"mixed", "kill", "redis", "net", "ssd"}))
      ->capture_default_str();
  app.add_option(
         "--redis-mode", rc.redis_mode,
         "single: one redis-server (its fault: a restart, empty); sentinel: a master, a replica and a "
         "sentinel (its fault: the master killed)")
      ->check(CLI::IsMember({"single", "sentinel"}))
      ->capture_default_str();
  app.add_option("--avoid-ms", rc.avoid_ms,
                 "Clients' StoreOptions::avoid_unreachable_nodes in ms (0: off; default: the store's)");
  app.add_flag("--keep-logs", keep_logs, "Keep the clients' histories even when the run is clean");
  app.add_option(
      "--netns", rc.netns,
      "Run on the hosts scripts/netns-cell made (network namespaces PREFIX-h<i>; this process in "
      "PREFIX-ctl): Redis, clients and memory nodes on separate hosts, tcp across them, and network "
      "faults in the nemesis");
  app.add_option("--hosts", rc.hosts, "With --netns: how many hosts there are (at least 4)")
      ->capture_default_str();
  app.add_option("--policy", rc.policy, "The cell's eviction policy (kvstash policy)")
      ->capture_default_str()
      ->check(CLI::IsMember({"lru", "arc", "turn-ttl"}));
  app.add_option(
      "--ssd-dir", rc.ssd_dir,
      "Give each node an NVMe tier, a file DIR/h<i>.tier (a file system with O_DIRECT, not tmpfs), and "
      "the nemesis the tiers' faults: bytes overwritten or the file cut short under a node, a node over "
      "a device failing its reads");
  CLI11_PARSE(app, argc, argv);
  if (client) {
    cc.threads = rc.threads;
    cc.seconds = rc.seconds;
    cc.seed = rc.seed;
    cc.rkey_scope = rc.rkey_scope;
    cc.avoid_ms = rc.avoid_ms;
    return run_client(cc);
  }
  if (minutes > 0) rc.seconds = minutes * 60;
  if (rc.faults == "ssd" && rc.ssd_dir.empty()) {
    std::cerr << "history: --faults ssd needs --ssd-dir\n";
    return 2;
  }
  if (!rc.ssd_dir.empty()) {
    // A file system without O_DIRECT (tmpfs, overlayfs) or a kernel without io_uring: a skip
    // (77), saying why, not a failure.
    const std::string probe = rc.ssd_dir + "/history-probe-" + std::to_string(::getpid());
    const kvstash::Status can = kvstash::node::SsdDevice::open({.path = probe, .capacity = 1 << 20}).status();
    ::unlink(probe.c_str());
    if (can.code() == kvstash::StatusCode::kUnsupported) {
      std::cout << "history: SKIP: no NVMe tier can live in " << rc.ssd_dir << ": " << can.to_string()
                << "\n";
      return 77;
    }
  }
  if (rc.seed == 0) rc.seed = std::random_device{}();
  rc.nemesis = !no_nemesis;
  if (!rc.netns.empty() && app.count("--transports") == 0)
    transports = "tcp,tcp,tcp";  // one client per Redis host
  rc.transports.clear();
  std::stringstream ts(transports);
  for (std::string t; std::getline(ts, t, ',');) {
    if (!t.empty()) rc.transports.push_back(t);
  }
  if (!rc.netns.empty() &&
      (rc.hosts < 4 || std::ranges::any_of(rc.transports, [](const auto& t) { return t != "tcp"; }))) {
    std::cerr << "history: --netns needs at least 4 hosts and only tcp clients (the others cross no host)\n";
    return 2;
  }
  char dir[] = "/tmp/kvstash-history-XXXXXX";
  if (::mkdtemp(dir) == nullptr) {
    std::perror("mkdtemp");
    return 2;
  }
  rc.dir = dir;
  std::cout << "history: " << rc.seconds << " s, seed " << rc.seed << ", logs in " << rc.dir << "\n";
  int rcode = run(rc, std::filesystem::read_symlink("/proc/self/exe").string());
  if (rcode == 0 && !keep_logs) std::filesystem::remove_all(rc.dir);
  return rcode;
}
