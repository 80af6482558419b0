// `kvstash-bench store`: the Store measured per backend against the Redis-bytes baseline
// (store_redis_bench.cc), on the synthetic sessions (sessions.h), and the run that starts a private
// cell when it is given none.
#include "store_bench.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/units.h"
#include "kvstash/memory.h"
#include "kvstash/store.h"
#include "kvstash_config.h"
#include "metadata/redis_client.h"
#include "references.h"
#include "store_bench_internal.h"
#include "tests/harness/local_cluster.h"

namespace kvstash::bench {

using namespace std::chrono_literals;

namespace {

std::string key_of(const std::string& backend, std::uint32_t round, std::uint32_t session) {
  return "bench/" + backend + "/" + std::to_string(round) + "/" + std::to_string(session);
}

}  // namespace

// The Store: register every session's buffer once (as an inference engine registers its KV
// cache), then per round put every session and get every one back.
std::pair<Row, Row> StoreBench::measure_store(const std::string& backend, TransportKind kind,
                                              const StoreOptions& so, std::uint64_t backend_index) {
  Row put{.backend = backend, .op = "put", .kvstash = true};
  Row get{.backend = backend, .op = "get", .kvstash = true};
  auto store = Store::open(so);
  std::optional<std::uint32_t> live_round;  // whose objects are in the cell
  // On a failure the round's objects are removed (best effort: some were never put), so
  // that an existing cell keeps no garbage.
  auto fail = [&](const std::string& what) {
    progress_.clear();
    put.error = get.error = what;
    if (live_round) {
      for (std::uint32_t i = 0; i < o_.sessions; ++i) (void)(*store)->remove(key_of(backend, *live_round, i));
    }
    return std::pair{put, get};
  };
  if (!store.is_ok()) return fail("cannot open the store: " + store.status().to_string());
  const auto offered = (*store)->engine().transports();
  if (std::find(offered.begin(), offered.end(), kind) == offered.end()) {
    put.skipped = get.skipped = "this process's engine has no " + std::string(to_string(kind)) +
                                " transport (not built in or cannot start here)";
    return {put, get};
  }
  std::vector<MemoryHandle> handles;  // destroyed before the store (declared after it)
  for (const auto& b : s_.source) {
    auto h = (*store)->register_memory(b.region());
    if (!h.is_ok()) return fail("register_memory: " + h.status().to_string());
    handles.push_back(std::move(*h));
  }
  auto restore_handle = (*store)->register_memory(s_.restore.region());
  if (!restore_handle.is_ok()) return fail("register_memory: " + restore_handle.status().to_string());

  // Warm-up, not measured: the first operation connects to the node and loads the scripts.
  {
    const std::string key = "bench/" + backend + "/warmup";
    Slice slice{s_.restore.data(), std::min<std::size_t>(s_.restore.size(), 4096), &*restore_handle};
    Status st = (*store)->put(key, {&slice, 1});
    if (st.is_ok()) st = (*store)->get(key, {&slice, 1}).status();
    if (st.is_ok()) st = (*store)->remove(key);
    if (!st.is_ok()) {
      (void)(*store)->remove(key);
      return fail("warm-up put/get of " + key + ": " + st.to_string());
    }
  }

  for (std::uint32_t round = 0; round < o_.rounds; ++round) {
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      fill_pattern(s_.source[i].data(), s_.sizes[i], backend_index, round, i);
    }
    live_round = round;
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      if (interrupted()) return fail("interrupted");
      progress_.show(
          fmt::format("{}: round {}/{}, put {}/{}", backend, round + 1, o_.rounds, i + 1, o_.sessions));
      const std::string key = key_of(backend, round, i);
      Slice slice{s_.source[i].data(), s_.sizes[i], &handles[i]};
      OpTimings t;
      const auto t0 = Clock::now();
      Status st = (*store)->put(key, {&slice, 1}, PutOptions{.timings = &t});
      const double us = us_since(t0);
      if (!st.is_ok()) return fail("put " + key + ": " + st.to_string());
      put.stats.latency_us.push_back(us);
      put.stats.metadata_us.push_back(std::chrono::duration<double, std::micro>(t.metadata).count());
      put.stats.round_trips += t.redis_round_trips;
      put.stats.node_round_trips += t.node_round_trips;
      put.stats.node_us.push_back(std::chrono::duration<double, std::micro>(t.node).count());
      put.stats.bytes += s_.sizes[i];
      put.stats.seconds += us / 1e6;
    }
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      if (interrupted()) return fail("interrupted");
      progress_.show(
          fmt::format("{}: round {}/{}, get {}/{}", backend, round + 1, o_.rounds, i + 1, o_.sessions));
      const std::string key = key_of(backend, round, i);
      const std::size_t size = s_.sizes[i];
      std::memset(s_.restore.data(), 0, size);
      Slice into{s_.restore.data(), size, &*restore_handle};
      OpTimings t;
      const auto t0 = Clock::now();
      auto info = (*store)->get(key, {&into, 1}, GetOptions{.timings = &t});
      const double us = us_since(t0);
      if (!info.is_ok()) return fail("get " + key + ": " + info.status().to_string());
      if (info->size != size) {
        return fail("get " + key + ": the object has " + std::to_string(info->size) + " bytes, " +
                    std::to_string(size) + " were put");
      }
      if (std::memcmp(s_.restore.data(), s_.source[i].data(), size) != 0) {
        const std::size_t at = first_difference(s_.restore.data(), s_.source[i].data(), size);
        return fail("get " + key + ": wrong bytes (byte " + std::to_string(at) + " of " +
                    std::to_string(size) + " differs from what was put)");
      }
      get.stats.latency_us.push_back(us);
      get.stats.metadata_us.push_back(std::chrono::duration<double, std::micro>(t.metadata).count());
      get.stats.round_trips += t.redis_round_trips;
      get.stats.node_round_trips += t.node_round_trips;
      get.stats.node_us.push_back(std::chrono::duration<double, std::micro>(t.node).count());
      get.stats.bytes += size;
      get.stats.seconds += us / 1e6;
    }
    // Each round's objects go before the next round's arrive: the pool holds one round.
    live_round.reset();
    for (std::uint32_t i = 0; i < o_.sessions; ++i) {
      const std::string key = key_of(backend, round, i);
      Status st = (*store)->remove(key);
      if (!st.is_ok()) return fail("remove " + key + ": " + st.to_string());
    }
  }
  progress_.clear();
  put.verified = get.verified = true;
  put.stats.client_anon_bytes = get.stats.client_anon_bytes = resident_memory("self").anon;
  client_anon_ = std::max(client_anon_, put.stats.client_anon_bytes);
  return {put, get};
}

void StoreBench::print(const Row& r, const std::optional<double>& redis_gbps) {
  const double rate = gbps(r.stats);
  std::optional<double> ratio;
  if (r.error.empty() && r.skipped.empty() && redis_gbps && *redis_gbps > 0) ratio = rate / *redis_gbps;
  if (o_.json) {
    nlohmann::json j{{"backend", r.backend}, {"op", r.op}, {"sessions", o_.sessions}, {"rounds", o_.rounds}};
    j["object_bytes"] = s_.sizes.empty() ? 0 : s_.total / s_.sizes.size();
    j["min_object_bytes"] = *std::min_element(s_.sizes.begin(), s_.sizes.end());
    j["max_object_bytes"] = s_.largest;
    if (!r.skipped.empty()) {
      j["skipped"] = r.skipped;
    } else if (!r.error.empty()) {
      j["error"] = r.error;
      j["verified"] = false;
    } else {
      j["bytes"] = r.stats.bytes;
      j["gbps"] = rate;
      j["p50_us"] = percentile(r.stats.latency_us, 0.50);
      j["p99_us"] = percentile(r.stats.latency_us, 0.99);
      j["vs_redis"] = ratio ? nlohmann::json(*ratio) : nlohmann::json(nullptr);
      if (memcpy_gbps_ > 0) {
        j["memcpy_gbps"] = memcpy_gbps_;
        j["vs_memcpy"] = rate / memcpy_gbps_;
      }
      j["verified"] = r.verified;
      if (r.kvstash) {
        j["metadata_p50_us"] = percentile(r.stats.metadata_us, 0.50);
        j["metadata_p99_us"] = percentile(r.stats.metadata_us, 0.99);
        j["redis_round_trips"] =
            static_cast<double>(r.stats.round_trips) / static_cast<double>(r.stats.latency_us.size());
        j["node_round_trips"] =
            static_cast<double>(r.stats.node_round_trips) / static_cast<double>(r.stats.latency_us.size());
        j["node_us_mean"] = std::accumulate(r.stats.node_us.begin(), r.stats.node_us.end(), 0.0) /
                            static_cast<double>(r.stats.node_us.size());
        j["client_anon_bytes"] = r.stats.client_anon_bytes;
      }
    }
    std::cout << j.dump() << std::endl;
    return;
  }
  if (!r.skipped.empty()) {
    std::cout << fmt::format("{:<13} {:<4} skipped: {}\n", r.backend, r.op, r.skipped);
    return;
  }
  if (!r.error.empty()) {
    std::cout << fmt::format("{:<13} {:<4} FAILED: {}\n", r.backend, r.op, r.error);
    return;
  }
  std::string meta = fmt::format("{:>9} {:>9} {:>8}", "-", "-", "-");
  if (r.kvstash) {
    meta = fmt::format(
        "{:>9.0f} {:>9.0f} {:>8.1f}", percentile(r.stats.metadata_us, 0.50),
        percentile(r.stats.metadata_us, 0.99),
        static_cast<double>(r.stats.round_trips) / static_cast<double>(r.stats.latency_us.size()));
  }
  std::cout << fmt::format("{:<13} {:<4} {:>8.2f} {:>8} {:>8} {:>10.0f} {:>10.0f} {}  {}\n", r.backend, r.op,
                           rate, ratio ? fmt::format("{:.2f}", *ratio) : "-",
                           memcpy_gbps_ > 0 ? fmt::format("{:.2f}", rate / memcpy_gbps_) : "-",
                           percentile(r.stats.latency_us, 0.50), percentile(r.stats.latency_us, 0.99), meta,
                           "yes");
  std::cout.flush();
}

namespace {

// What the memory node and this client keep resident (table only; JSON rows carry it): the
// node's RSS per GiB of pool (its pool is resident from the start), and the client's own
// memory (heap, stacks: RssAnon, at its largest while a store was open) beside the session
// buffers it maps.
void report_memory(const harness::LocalNode* node, std::uint64_t client_anon, const Sessions& s) {
  std::cout << "\nmemory    ";
  if (node != nullptr) {
    const ResidentMemory n = resident_memory(std::to_string(node->pid()));
    const std::uint64_t pool = node->pages() * node->page_size();
    std::cout << fmt::format(
        "kvstashd: {} resident for a {} pool ({:.3f} GiB per GiB of pool; {} beside the pool)\n          ",
        units::format_size(n.total), units::format_size(pool),
        static_cast<double>(n.total) / static_cast<double>(pool), units::format_size(n.anon + n.file));
  }
  std::cout << fmt::format(
      "this client: {} of its own (heap, stacks; {} per MiB of the largest object in flight) beside its "
      "{} of session buffers\n",
      units::format_size(client_anon),
      units::format_size(client_anon / std::max<std::uint64_t>(1, s.largest >> 20)),
      units::format_size(s.total + s.largest));
}

// A 0600 temporary file holding a secret (the cluster token for kvstashd), removed when this
// goes. Never on a command line: `ps` shows those to every local user.
class SecretFile {
 public:
  static Result<SecretFile> create(std::string_view content) {
    std::error_code ec;
    std::string path = (std::filesystem::temp_directory_path(ec) / "kvstash-token-XXXXXX").string();
    const int fd = ::mkstemp(path.data());  // 0600
    if (fd < 0) return Status::from_errno("mkstemp " + path, errno);
    SecretFile f(path);
    const bool ok = ::write(fd, content.data(), content.size()) == static_cast<ssize_t>(content.size());
    const int err = errno;
    ::close(fd);
    if (!ok) return Status::from_errno("write " + path, err);
    return f;
  }
  SecretFile(SecretFile&& o) noexcept : path_(std::exchange(o.path_, {})) {}
  SecretFile& operator=(SecretFile&&) = delete;
  SecretFile(const SecretFile&) = delete;
  SecretFile& operator=(const SecretFile&) = delete;
  ~SecretFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  explicit SecretFile(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace

Status parse_token_range(std::string_view text, StoreBenchOptions* options) {
  auto number = [](std::string_view t, std::uint32_t* out) {
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), *out);
    return ec == std::errc() && end == t.data() + t.size() && !t.empty();
  };
  const auto dash = text.find('-');
  std::uint32_t a = 0, b = 0;
  const bool ok = dash == std::string_view::npos
                      ? number(text, &a) && (b = a, true)
                      : number(text.substr(0, dash), &a) && number(text.substr(dash + 1), &b);
  if (!ok || a < 1 || b < a || b > kMaxTokens) {
    return Status::invalid_argument(
        fmt::format("'{}' is not a token count or range A-B with 1 <= A <= B <= {}", text, kMaxTokens));
  }
  options->min_tokens = a;
  options->max_tokens = b;
  return {};
}

Result<std::vector<std::string>> parse_backends(std::string_view list) {
  std::vector<std::string> out;
  if (list.empty() || list == "all") return out;
  std::stringstream in{std::string(list)};
  for (std::string name; std::getline(in, name, ',');) {
    if (name.empty()) continue;
    const bool known = name == kRedisBytes || std::find(std::begin(kStoreBackends), std::end(kStoreBackends),
                                                        name) != std::end(kStoreBackends);
    if (!known) {
      return Status::invalid_argument(
          "unknown backend '" + name +
          "' (kvstash-shm, kvstash-tcp, kvstash-ucx, kvstash-verbs, redis-bytes)");
    }
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  if (out.empty()) return Status::invalid_argument("no backend given");
  return out;
}

int run_store(const StoreBenchOptions& options) {
  StoreBenchOptions o = options;
  if (o.redis_url.empty()) o.redis_password.clear();  // for an existing cell only: ours has none
  std::vector<std::string> backends = o.backends;
  if (backends.empty()) {
    backends = {"kvstash-shm", "kvstash-tcp"};
    if (KVSTASH_HAVE_UCX) backends.emplace_back("kvstash-ucx");
    // verbs only where this host has an RDMA device to run it on.
    if (Engine::create({.transports = {TransportKind::kVerbs}}).is_ok())
      backends.emplace_back("kvstash-verbs");
    backends.emplace_back(kRedisBytes);
  }
  auto wanted = [&](std::string_view name) {
    return std::find(backends.begin(), backends.end(), name) != backends.end();
  };
  std::vector<std::pair<std::string, TransportKind>> store_backends;
  for (auto [name, kind] :
       {std::pair{"kvstash-shm", TransportKind::kShm}, std::pair{"kvstash-tcp", TransportKind::kTcp},
        std::pair{"kvstash-ucx", TransportKind::kUcx}, std::pair{"kvstash-verbs", TransportKind::kVerbs}}) {
    if (wanted(name)) store_backends.emplace_back(name, kind);
  }
  const bool with_ucx = wanted("kvstash-ucx");
  const bool private_cell = o.redis_url.empty();
  if (!private_cell) {
    if (auto u = metadata::RedisUrl::parse(o.redis_url); !u.is_ok()) {
      std::cerr << "kvstash-bench: --redis: " << u.status().message() << "\n";
      return 2;
    }
  }

  Sessions s;
  s.sizes = session_sizes(o);
  for (auto size : s.sizes) {
    s.total += size;
    s.largest = std::max(s.largest, size);
  }

  // Refuse a run this host cannot hold rather than let the OOM killer pick a victim: the
  // sessions, the restore buffer, the private node's pool, and Redis holding every session
  // (plus hiredis' and Redis's copies of the largest) for the baseline.
  const std::uint64_t guess_page = o.page_size != 0 ? o.page_size : 4ull << 20;  // kvstashd's default
  std::uint64_t capacity = o.capacity != 0
                               ? o.capacity
                               : round_up(pages_for(s.sizes, guess_page) * guess_page * 5 / 4, guess_page);
  if (o.capacity != 0 && !store_backends.empty() && private_cell) {
    const std::uint64_t need = (pages_for(s.sizes, guess_page) + 1) * guess_page;
    if (o.capacity < need) {
      std::cerr << "kvstash-bench: --capacity " << units::format_size(o.capacity)
                << " cannot hold one round: " << o.sessions << " sessions in pages of "
                << units::format_size(guess_page) << " (plus one for "
                << "a warm-up object) need " << units::format_size(need) << "\n";
      return 2;
    }
  }
  {
    std::uint64_t need = s.total + s.largest;
    if (private_cell && !store_backends.empty()) need += capacity;
    if (wanted(kRedisBytes)) need += s.total + 2 * s.largest;
    const std::uint64_t available = mem_available();
    if (available != 0 && need > available) {
      std::cerr << "kvstash-bench: this run needs about " << units::format_size(need) << " of memory ("
                << o.sessions << " sessions of " << units::format_size(s.total) << " in all, their copies in "
                << "the memory node and in Redis) but " << units::format_size(available)
                << " is available: use fewer --sessions, fewer --tokens or a smaller --object-size\n";
      return 1;
    }
  }

  InterruptHandler interrupt_handler;
  auto stop_interrupted = [] {
    std::cerr << "kvstash-bench: interrupted\n";
    return 130;  // the shell's code for SIGINT
  };

  // The private cell. Destroyed in reverse order: the node says goodbye to Redis before
  // Redis goes, and the token file outlives the node that reads it.
  std::optional<SecretFile> token_file;
  std::unique_ptr<harness::LocalRedis> local_redis;
  std::unique_ptr<harness::LocalNode> node;
  std::string url = o.redis_url;
  if (private_cell) {
    auto r = harness::LocalRedis::start({});
    if (!r.is_ok()) {
      std::cerr << "kvstash-bench: cannot start a private redis-server: " << r.status().to_string() << "\n";
      return 1;
    }
    local_redis = std::move(*r);
    url = local_redis->url();
    if (!store_backends.empty()) {
      harness::LocalNodeOptions no;
      no.redis_url = url;
      if (o.page_size != 0) no.page_size = std::to_string(o.page_size);
      no.extra_args = {"--transports", "all"};
      if (!o.token.empty()) {
        auto f = SecretFile::create(o.token);
        if (!f.is_ok()) {
          std::cerr << "kvstash-bench: cluster token file: " << f.status().to_string() << "\n";
          return 1;
        }
        token_file.emplace(std::move(*f));
        no.extra_args.insert(no.extra_args.end(), {"--cluster-token-file", token_file->path()});
      }
      if (KVSTASH_HAVE_UCX && with_ucx) no.extra_args.emplace_back("--ucx-allow-emulated-rma");
      // Started once with a guessed page size; once kvstashd says its real one, started again
      // bigger if whole pages for every session (and the warm-up object) do not fit.
      for (int attempt = 0; attempt < 2 && !node; ++attempt) {
        no.capacity = std::to_string(capacity);
        auto n = harness::LocalNode::start(no);
        if (!n.is_ok()) {
          std::cerr << "kvstash-bench: cannot start a private kvstashd: " << n.status().to_string() << "\n";
          return 1;
        }
        const std::uint64_t page = (*n)->page_size(), need = pages_for(s.sizes, page) + 1;
        if ((*n)->pages() >= need) {
          node = std::move(*n);
        } else if (o.capacity != 0 || attempt == 1) {
          std::cerr << "kvstash-bench: " << (o.capacity != 0 ? "--capacity " : "a pool of ")
                    << units::format_size(capacity) << " is " << (*n)->pages() << " pages of "
                    << units::format_size(page) << "; the sessions of one round need " << need << " ("
                    << units::format_size(need * page) << ")\n";
          return o.capacity != 0 ? 2 : 1;
        } else {
          capacity = round_up(need * page * 5 / 4, page);
        }
      }
    }
  }

  if (interrupted()) return stop_interrupted();
  if (!private_cell) {
    // One clear line for an unreachable cell or wrong credentials, not one per backend.
    metadata::RedisOptions ro;
    ro.url = url;
    ro.password = o.redis_password;
    auto c = metadata::RedisClient::connect(ro);
    if (!c.is_ok()) {
      std::cerr << "kvstash-bench: --redis: " << c.status().to_string() << "\n";
      return 1;
    }
  }
  const auto u = metadata::RedisUrl::parse(url);
  const std::string shown_url = u.is_ok() ? u->redacted() : url;
  if (!o.json) {
    std::cout << "kvstash-bench store: offload the KV cache of " << o.sessions
              << (o.sessions == 1 ? " session" : " sessions") << " to remote memory and restore it\n";
    std::cout << "  model     Llama-2-7B shape, fp16: " << units::format_size(kKvBytesPerToken)
              << " of K and V per token\n";
    const std::uint64_t smallest = *std::min_element(s.sizes.begin(), s.sizes.end());
    if (o.object_size != 0) {
      std::cout << fmt::format("  sessions  {} x {} (--object-size), {} in all\n", o.sessions,
                               units::format_size(o.object_size), units::format_size(s.total));
    } else if (o.min_tokens == o.max_tokens) {
      std::cout << fmt::format("  sessions  {} x {} tokens = {} each, {} in all\n", o.sessions, o.min_tokens,
                               units::format_size(s.largest), units::format_size(s.total));
    } else {
      std::cout << fmt::format("  sessions  {} of {}-{} tokens: {} to {}, {} in all\n", o.sessions,
                               o.min_tokens, o.max_tokens, units::format_size(smallest),
                               units::format_size(s.largest), units::format_size(s.total));
    }
    std::cout << "  rounds    " << o.rounds
              << ": each puts every session, then gets every one back and compares every byte\n";
    std::cout << "  redis     " << shown_url
              << (private_cell ? ", a private redis-server started for this run" : ", an existing cell")
              << "\n";
    if (node) {
      std::cout << fmt::format("  node      kvstashd '{}' started for this run: {} in {} pages of {}\n",
                               node->node_id(), units::format_size(node->pages() * node->page_size()),
                               node->pages(), units::format_size(node->page_size()));
    } else if (!private_cell && !store_backends.empty()) {
      std::cout << "  nodes     the cell's memory nodes\n";
    }
    std::cout << "\n"
              << fmt::format("{:<13} {:<4} {:>8} {:>8} {:>8} {:>10} {:>10} {:>9} {:>9} {:>8}  {}\n",
                             "backend", "op", "GB/s", "x redis", "x memcpy", "p50 us", "p99 us", "meta p50",
                             "meta p99", "redis/op", "verified");
  }

  if (Status st = allocate_sessions(s); !st.is_ok()) {
    std::cerr << "kvstash-bench: " << st.to_string() << "\n";
    return 1;
  }

  StoreBench bench(o, s);
  // The reference the shm rows are held to: one core copying one session's bytes, between
  // buffers as large as a session (up to 256 MiB), measured here before the backends run.
  const double copy_gbps = memcpy_gbps(std::min<std::uint64_t>(s.largest, 256u << 20), 0.5);
  bench.set_memcpy_gbps(copy_gbps);
  if (!o.json) {
    std::cout << fmt::format(
        "{:<13} {:<4} {:>8.2f} {:>8} {:>8}   (single-core memcpy of {}: the reference)\n", "memcpy", "copy",
        copy_gbps, "-", "1.00", units::format_size(std::min<std::uint64_t>(s.largest, 256u << 20)));
  }
  int failures = 0;
  std::map<std::string, double> redis_gbps;  // op -> GB/s of the baseline
  auto report = [&](const Row& put, const Row& get) {
    failures += !put.error.empty() || !get.error.empty();
    const bool whole =
        put.error == get.error && put.skipped == get.skipped && (!put.error.empty() || !put.skipped.empty());
    if (whole && !o.json) {  // failed or skipped as a whole: one line in the table
      Row r = put;
      r.op = "-";
      bench.print(r, std::nullopt);
      return;
    }
    for (const Row* r : {&put, &get}) {
      std::optional<double> baseline;
      if (auto it = redis_gbps.find(r->op); it != redis_gbps.end()) baseline = it->second;
      bench.print(*r, baseline);
    }
  };
  std::uint64_t backend_index = 0;
  if (wanted(kRedisBytes)) {
    auto [put, get] = bench.measure_redis(url, backend_index++);
    if (interrupted()) return stop_interrupted();
    for (const Row* r : {&put, &get}) {
      if (r->error.empty() && r->skipped.empty()) redis_gbps[r->op] = gbps(r->stats);
    }
    report(put, get);
  }
  for (const auto& [name, kind] : store_backends) {
    StoreOptions so;
    so.redis_url = url;
    so.redis_password = o.redis_password;
    so.engine.prefer = kind;
    so.engine.cluster_token = o.token;
    so.engine.ucx.allow_emulated_rma = kind == TransportKind::kUcx;
    so.rkey_scope = parse_rkey_scope(o.rkey_scope);
    // Long enough for the largest session at 100 MB/s (UCX emulating RMA over TCP is slow),
    // and never below the defaults.
    const auto slow = std::chrono::milliseconds(s.largest / 100'000 + 1);
    so.timeout = std::max(so.timeout, slow);
    so.put_lease = std::max(so.put_lease, slow);
    so.read_lease = std::max(so.read_lease, slow);
    auto [put, get] = bench.measure_store(name, kind, so, backend_index++);
    if (interrupted()) return stop_interrupted();
    report(put, get);
  }
  if (!o.json) {
    std::cout
        << "\nGB/s: bytes moved / time spent in the operations (1 GB = 1e9 bytes); x redis: GB/s over\n"
           "redis-bytes' for the same op. p50/p99: latency of one session's put or get; meta: the part\n"
           "spent in Redis (metadata), redis/op: Redis round trips per op. redis-bytes is the tutorial's\n"
           "approach, HSET/HGET of the bytes through Redis itself; kvstash moves them one-sided and keeps\n"
           "only metadata in Redis. kvstash-ucx's puts travel over the best transport the memory node can\n"
           "fence (shm on one host): UCX holds no leases at the node, so the store never writes over it.\n"
           "x memcpy: GB/s over one core's memcpy of a session's bytes, measured at the start of this run.\n";
  }
  if (!o.json) report_memory(node.get(), bench.client_anon(), s);
  if (failures != 0) std::cerr << "kvstash-bench: " << failures << " backend(s) failed\n";
  return failures == 0 ? 0 : 1;
}

}  // namespace kvstash::bench
