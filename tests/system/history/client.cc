#include "history/client.h"

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
#include "tests/harness/local_cluster.h"
#include "watchdog.h"

#include "history/codec.h"

namespace kvstash::history {

using namespace std::chrono_literals;
using nlohmann::json;

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

}  // namespace kvstash::history
