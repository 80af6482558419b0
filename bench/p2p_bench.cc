#include "p2p_bench.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "child.h"
#include "common/net.h"
#include "common/units.h"
#include "kvstash/engine.h"
#include "measure.h"
#include "plot.h"
#include "references.h"
#include "tests/harness/throwaway_tls.h"

namespace kvstash::bench {
namespace {

using namespace std::chrono_literals;

using Row = P2PRow;

void fill_random(std::byte* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<std::byte>(x);
  }
}

void print_header() {
  std::cout << fmt::format("{:<10} {:<8} {:>10} {:>7} {:>8} {:>10} {:>10} {:>9} {:>9} {:>7} {:>10}\n",
                           "transport", "op", "size", "thr x q", "GB/s", "p50 us", "p99 us", "x memcpy",
                           "x socket", "x ping", "cpu us/op");
}

void print(const Row& r, bool json) {
  if (json) {
    std::cout << to_json_line(r) << std::endl;
    return;
  }
  if (!r.error.empty()) {
    std::cout << fmt::format("{:<10} {:<6} {:>10}  error: {}\n", r.transport, r.op,
                             units::format_size(r.size), r.error);
    return;
  }
  // Reference rows have no per-request latency.
  // Reference rows have no per-request latency, except the ping-pong, which is one.
  auto us = [&](double v) {
    return r.reference() && (r.op != "pingpong" || v == 0) ? std::string() : fmt::format("{:.1f}", v);
  };
  std::cout << fmt::format(
      "{:<10} {:<8} {:>10} {:>3}x{:<3} {:>8.2f} {:>10} {:>10} {:>9} {:>9} {:>7} {:>10}\n", r.transport, r.op,
      units::format_size(r.size), r.threads, r.depth, r.gbps, us(r.p50_us), us(r.p99_us),
      r.memcpy_gbps > 0 ? fmt::format("{:.2f}", r.gbps / r.memcpy_gbps) : "",
      r.socket_gbps > 0 ? fmt::format("{:.2f}", r.gbps / r.socket_gbps) : "",
      r.pingpong_us > 0 ? fmt::format("{:.2f}", r.p50_us / r.pingpong_us) : "",
      r.cpu_us_per_op > 0 ? fmt::format("{:.1f}", r.cpu_us_per_op) : "");
}

Row reference_row(std::string transport, std::string op, std::size_t size, double gbps) {
  Row r;
  r.transport = std::move(transport);
  r.op = std::move(op);
  r.size = size;
  r.gbps = gbps;
  return r;
}

// Writes random bytes to the peer and reads them back elsewhere: the row's data check.
Status verify(Peer& peer, const MemoryHandle& mem, Buffer& local, const RemoteMemory& remote,
              std::size_t size) {
  fill_random(local.data(), size, size);
  TransferEntry w{TransferOp::kWrite, &mem, local.data(), remote.base(), &remote, size};
  KVSTASH_RETURN_IF_ERROR(peer.transfer({&w, 1}, deadline_after(60s)));
  std::memset(local.data(), 0, size);
  TransferEntry r{TransferOp::kRead, &mem, local.data(), remote.base(), &remote, size};
  KVSTASH_RETURN_IF_ERROR(peer.transfer({&r, 1}, deadline_after(60s)));
  std::vector<std::byte> expect(size);
  fill_random(expect.data(), size, size);
  if (std::memcmp(expect.data(), local.data(), size) != 0)
    return Status::corrupt("read back differs from what was written");
  return {};
}

// `target_pid`: the target process, whose CPU counts with ours in cpu_us_per_op ("" when it
// is not ours to look at: then the row has none).
Row measure(Peer& peer, const MemoryHandle& mem, Buffer& local, const RemoteMemory& remote, TransferOp op,
            std::size_t size, const P2POptions& o, const std::string& target_pid) {
  Row row;
  row.op = std::string(to_string(op));
  row.size = size;
  row.threads = o.threads;
  row.depth = o.depth;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> bytes{0};
  std::vector<std::vector<double>> lat(o.threads);
  std::vector<Status> errors(o.threads);
  const double cpu_start = target_pid.empty() ? 0 : cpu_seconds("self") + cpu_seconds(target_pid);
  auto start = Clock::now();
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < o.threads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<TransferEntry> es;
      for (unsigned d = 0; d < o.depth; ++d) {
        std::size_t off = (static_cast<std::size_t>(t) * o.depth + d) * size;
        es.push_back({op, &mem, local.data() + off, remote.base() + off, &remote, size});
      }
      std::size_t iters = 0;
      while (!stop.load(std::memory_order_relaxed) || iters < 3) {
        auto t0 = Clock::now();
        Status s = peer.transfer(es, deadline_after(60s));
        if (!s.is_ok()) {
          errors[t] = s;
          stop = true;
          return;
        }
        lat[t].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
        bytes.fetch_add(size * o.depth, std::memory_order_relaxed);
        ++iters;
      }
    });
  }
  while (Clock::now() - start < std::chrono::duration<double>(o.seconds) && !stop)
    std::this_thread::sleep_for(1ms);
  stop = true;
  for (auto& t : threads) t.join();
  double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu = target_pid.empty() ? 0 : cpu_seconds("self") + cpu_seconds(target_pid) - cpu_start;
  for (const auto& e : errors) {
    if (!e.is_ok()) row.error = e.to_string();
  }
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  row.gbps = static_cast<double>(bytes.load()) / elapsed / 1e9;
  row.p50_us = percentile(all, 0.50);
  row.p99_us = percentile(all, 0.99);
  if (!all.empty()) row.cpu_us_per_op = cpu * 1e6 / static_cast<double>(all.size() * o.depth);
  return row;
}

}  // namespace

int run_p2p_target(std::size_t region_bytes, const std::vector<TransportKind>& transports,
                   const TcpOptions& tcp, const std::string& cluster_token, unsigned busy_poll_us) {
  EngineOptions eo;
  eo.busy_poll = std::chrono::microseconds(busy_poll_us);
  eo.transports = transports;
  eo.tcp = tcp;
  eo.tcp.tls = {};  // the TLS listener is an engine of its own, below
  eo.cluster_token = cluster_token;
  // The verbs queue-pair setup listens on the same host as tcp (any free port).
  eo.verbs.listen = net::same_host_any_port(tcp.listen);
  eo.ucx.allow_emulated_rma = true;  // a benchmark target on loopback: see UcxOptions
  auto engine = Engine::create(eo);
  if (!engine.is_ok()) {
    std::cerr << "p2p-target: " << engine.status().to_string() << "\n";
    return 1;
  }
  auto buffer = Buffer::allocate(region_bytes);
  if (!buffer.is_ok()) {
    std::cerr << "p2p-target: " << buffer.status().to_string() << "\n";
    return 1;
  }
  auto mem = (*engine)->register_memory(buffer->region(), Access::kRemote);
  if (!mem.is_ok()) {
    std::cerr << "p2p-target: " << mem.status().to_string() << "\n";
    return 1;
  }
  const std::string host = tcp.listen.substr(0, tcp.listen.rfind(':'));
  const std::uint16_t port = start_socket_sink(host);
  if (port == 0) {
    std::cerr << "p2p-target: cannot listen for the socket reference on " << host
              << " (numeric IPv4 needed)\n";
    return 1;
  }
  std::cout << "address " << to_text((*engine)->address()) << "\nkey " << to_text(mem->remote_key())
            << "\nsocket " << host << ":" << port << std::endl;
  // The same region behind a tcp listener that serves TLS only.
  std::unique_ptr<Engine> tls_engine;
  MemoryHandle tls_mem;
  if (!tcp.tls.cert_file.empty()) {
    EngineOptions to = eo;
    to.transports = {TransportKind::kTcp};
    to.tcp = tcp;
    to.tcp.listen = net::same_host_any_port(tcp.listen);
    auto made = Engine::create(to);
    auto registered = made.is_ok() ? (*made)->register_memory(buffer->region(), Access::kRemote)
                                   : Result<MemoryHandle>(made.status());
    if (!registered.is_ok()) {
      std::cerr << "p2p-target: tls: " << registered.status().to_string() << "\n";
      return 1;
    }
    tls_engine = std::move(made).value();
    tls_mem = std::move(registered).value();
    std::cout << "tls-address " << to_text(tls_engine->address()) << "\ntls-key "
              << to_text(tls_mem.remote_key()) << std::endl;
  }
  std::string ignored;
  while (std::getline(std::cin, ignored)) {
  }
  return 0;
}

std::string to_json_line(const P2PRow& r) {
  nlohmann::json j{{"transport", r.transport}, {"op", r.op},     {"size", r.size},     {"threads", r.threads},
                   {"depth", r.depth},         {"gbps", r.gbps}, {"p50_us", r.p50_us}, {"p99_us", r.p99_us}};
  if (r.memcpy_gbps > 0) {
    j["memcpy_gbps"] = r.memcpy_gbps;
    j["vs_memcpy"] = r.gbps / r.memcpy_gbps;
  }
  if (r.socket_gbps > 0) {
    j["socket_gbps"] = r.socket_gbps;
    j["vs_socket"] = r.gbps / r.socket_gbps;
  }
  if (r.cpu_us_per_op > 0) j["cpu_us_per_op"] = r.cpu_us_per_op;
  if (r.pingpong_us > 0) {
    j["pingpong_us"] = r.pingpong_us;
    j["p50_vs_pingpong"] = r.p50_us / r.pingpong_us;
  }
  if (r.op == "read" || r.op == "write") j["verified"] = r.verified;
  if (!r.error.empty()) j["error"] = r.error;
  return j.dump();
}

Result<std::vector<P2PRow>> measure_p2p(const P2POptions& o,
                                        const std::function<void(const P2PRow&)>& on_row) {
  std::vector<P2PRow> rows;
  auto add = [&](P2PRow r) {
    if (on_row) on_row(r);
    rows.push_back(std::move(r));
  };
  // TLS is this benchmark's to choose per row (--tls): a client CA in the environment would turn
  // the plain tcp rows into TLS ones that the plain listener refuses.
  for (const char* name :
       {"KVSTASH_TLS_CA", "KVSTASH_TLS_CERT", "KVSTASH_TLS_KEY", "KVSTASH_TLS_SERVER_NAME"}) {
    ::unsetenv(name);
  }
  const std::size_t max_size = *std::max_element(o.sizes.begin(), o.sizes.end());
  const std::size_t region = max_size * o.threads * o.depth;
  std::vector<TransportKind> kinds = o.transports;
  if (kinds.empty()) {
    auto probe = Engine::create({});
    if (!probe.is_ok()) return probe.status();
    kinds = (*probe)->transports();
  }
  std::string list;
  for (auto k : kinds) {
    if (!list.empty()) list.push_back(',');
    list.append(to_string(k));
  }
  // The target: spawned here on loopback, or already running (possibly on another host)
  // and described by the three lines it printed.
  std::unique_ptr<Child> target;
  // A spawned target's throwaway TLS credentials, removed at the end.
  std::string tls_dir, tls_ca = o.tls_ca;
  struct RemoveDir {
    const std::string& dir;
    ~RemoveDir() {
      std::error_code ignored;
      if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
    }
  } remove_tls_dir{tls_dir};
  if (o.tls && !o.peer_file.empty() && tls_ca.empty()) {
    return Status::invalid_argument("--tls with --peer needs --tls-ca: the CA of the target's --tls-cert");
  }
  std::ifstream peer_stream;
  std::function<std::string()> read_line;
  if (o.peer_file.empty()) {
    // The token reaches the target through its environment, not its command line (ps).
    if (o.token.empty()) {
      ::unsetenv("KVSTASH_CLUSTER_TOKEN");
    } else {
      ::setenv("KVSTASH_CLUSTER_TOKEN", o.token.c_str(), 1);
    }
    std::vector<std::string> argv{"p2p-target",
                                  "--region",
                                  std::to_string(region),
                                  "--tcp-io-threads",
                                  std::to_string(o.tcp.io_threads),
                                  "--transports",
                                  list,
                                  "--busy-poll-us",
                                  std::to_string(o.busy_poll_us)};
    if (o.tls) {
      // Throwaway credentials: a CA, and a certificate for 127.0.0.1 that the target serves.
      std::string pattern = (std::filesystem::temp_directory_path() / "kvstash-bench-tls-XXXXXX").string();
      if (::mkdtemp(pattern.data()) == nullptr) return Status::from_errno("mkdtemp", errno);
      tls_dir = pattern;
      auto made = harness::make_throwaway_tls(tls_dir);
      if (!made.is_ok()) return made.status();
      tls_ca = made->ca_cert;
      argv.insert(argv.end(), {"--tls-cert", made->server_cert, "--tls-key", made->server_key});
    }
    target = std::make_unique<Child>(argv);
    read_line = [&] { return target->read_line(); };
  } else {
    if (o.peer_file != "-") peer_stream.open(o.peer_file);
    std::istream& in = o.peer_file == "-" ? std::cin : peer_stream;
    read_line = [&in] {
      std::string line;
      std::getline(in, line);
      return line;
    };
  }
  const std::string target_pid = target ? std::to_string(target->pid()) : std::string();
  std::string address_line = read_line(), key_line = read_line(), socket_line = read_line();
  auto address = from_text(address_line.rfind("address ", 0) == 0 ? address_line.substr(8) : "");
  auto key = from_text(key_line.rfind("key ", 0) == 0 ? key_line.substr(4) : "");
  const auto colon = socket_line.rfind(':');
  unsigned port = 0;
  if (colon != std::string::npos) {
    const char* digits = socket_line.data() + colon + 1;
    auto [end, ec] = std::from_chars(digits, socket_line.data() + socket_line.size(), port);
    if (ec != std::errc() || end != socket_line.data() + socket_line.size() || port > 65535) port = 0;
  }
  if (!address.is_ok() || !key.is_ok() || socket_line.rfind("socket ", 0) != 0 || port == 0) {
    const std::string from = target ? std::string("the target process") : o.peer_file;
    return Status::unavailable("no valid address, key and socket lines from " + from);
  }
  const std::string socket_host = socket_line.substr(7, colon - 7);
  Result<std::string> tls_address = Status::not_found("no TLS"), tls_key = Status::not_found("no TLS");
  if (o.tls) {
    const std::string a = read_line(), k = read_line();
    tls_address = from_text(a.rfind("tls-address ", 0) == 0 ? a.substr(12) : "");
    tls_key = from_text(k.rfind("tls-key ", 0) == 0 ? k.substr(8) : "");
    if (!tls_address.is_ok() || !tls_key.is_ok()) {
      return Status::unavailable(
          "--tls: no valid tls-address and tls-key lines from the target (p2p-target "
          "prints them when it has --tls-cert and --tls-key)");
    }
  }

  // References, measured now, in this run, between these two processes: per size, the
  // median of three socket streams (at least 512 MiB each) and single-core memcpy.
  // Sizes up to 64 KiB also get a raw request/response round trip, what a small transfer's
  // latency is held to.
  constexpr std::size_t kPingPongMax = 64u << 10;
  std::map<std::size_t, double> memcpy_ref, socket_ref, pingpong_ref;
  for (std::size_t size : o.sizes) {
    std::vector<double> runs;
    for (int i = 0; i < 3; ++i) {
      runs.push_back(socket_stream_gbps(socket_host, static_cast<std::uint16_t>(port), size,
                                        std::max<std::size_t>(size * 2, 512u << 20)));
    }
    socket_ref[size] = percentile(runs, 0.5);
    memcpy_ref[size] = memcpy_gbps(size, std::min(o.seconds, 0.3));
    add(reference_row("memcpy", "copy", size, memcpy_ref[size]));
    add(reference_row("tcp-socket", "stream", size, socket_ref[size]));
    if (size <= kPingPongMax) {
      pingpong_ref[size] =
          socket_roundtrip_us(socket_host, static_cast<std::uint16_t>(port), size, std::min(o.seconds, 0.3));
      Row ping =
          reference_row("tcp-socket", "pingpong", size,
                        pingpong_ref[size] > 0 ? static_cast<double>(size) / pingpong_ref[size] / 1e3 : 0);
      ping.p50_us = pingpong_ref[size];
      add(std::move(ping));
    }
  }

  auto local = Buffer::allocate(region, {.shareable = false}).value();
  // Each transport's rows; with --tls, tcp's over TLS right after its plain ones.
  struct Pass {
    TransportKind kind;
    std::string name;
    bool tls = false;
  };
  std::vector<Pass> passes;
  for (TransportKind kind : kinds) {
    passes.push_back({kind, std::string(to_string(kind))});
    if (kind == TransportKind::kTcp && o.tls) passes.push_back({kind, "tcp+tls", true});
  }
  if (o.tls && std::find(kinds.begin(), kinds.end(), TransportKind::kTcp) == kinds.end()) {
    passes.push_back({TransportKind::kTcp, "tcp+tls", true});
  }
  for (const Pass& pass : passes) {
    const TransportKind kind = pass.kind;
    EngineOptions eo;
    eo.transports = {kind};
    eo.tcp = o.tcp;
    eo.tcp.tls = {};
    if (pass.tls) eo.tcp.tls.ca_file = tls_ca;
    eo.cluster_token = o.token;
    eo.shm = o.shm;
    eo.busy_poll = std::chrono::microseconds(o.busy_poll_us);
    auto engine = Engine::create(eo);
    auto fail = [&](const Status& s) {
      Row r;
      r.transport = pass.name;
      r.error = s.to_string();
      add(std::move(r));
    };
    if (!engine.is_ok()) {
      fail(engine.status());
      continue;
    }
    auto mem = (*engine)->register_memory(local.region(), Access::kLocal);
    auto peer = mem.is_ok() ? (*engine)->connect(pass.tls ? *tls_address : *address, deadline_after(10s))
                            : mem.status();
    if (!peer.is_ok()) {
      fail(peer.status());
      continue;
    }
    auto remote = (*peer)->import_key(pass.tls ? *tls_key : *key);
    if (!remote.is_ok()) {
      fail(remote.status());
      continue;
    }
    if (remote->length() < region) {
      fail(Status::invalid_argument("the target's region (" + std::to_string(remote->length()) +
                                    " bytes) is smaller than sizes x threads x depth (" +
                                    std::to_string(region) + " bytes)"));
      continue;
    }
    for (std::size_t size : o.sizes) {
      Status v = verify(**peer, *mem, local, *remote, size);
      for (TransferOp op : o.ops) {
        Row r = v.is_ok() ? measure(**peer, *mem, local, *remote, op, size, o, target_pid) : Row{};
        r.transport = pass.name;
        r.op = std::string(to_string(op));
        r.size = size;
        r.threads = o.threads;
        r.depth = o.depth;
        r.verified = v.is_ok();
        if (!v.is_ok()) r.error = "verification failed: " + v.to_string();
        r.memcpy_gbps = memcpy_ref[size];
        r.socket_gbps = socket_ref[size];
        if (kind == TransportKind::kTcp && pingpong_ref.count(size)) r.pingpong_us = pingpong_ref[size];
        add(std::move(r));
      }
    }
  }
  if (target) target->finish();
  return rows;
}

std::vector<PlotSeries> p2p_plot_series(const std::vector<P2PRow>& rows) {
  std::vector<PlotSeries> series;
  for (const auto& r : rows) {
    if (!r.error.empty() || r.op == "pingpong") continue;  // bandwidth only
    const std::string title = r.reference() ? r.transport : r.transport + " " + r.op;
    auto it = std::find_if(series.begin(), series.end(), [&](const auto& s) { return s.title == title; });
    if (it == series.end()) {
      PlotSeries s;
      s.title = title;
      s.group = r.transport;
      s.dashed = r.reference();
      s.second_marker = r.op == "read";
      it = series.insert(series.end(), std::move(s));
    }
    it->points.emplace_back(r.size, r.gbps);
  }
  return series;
}

int run_p2p(const P2POptions& o) {
  bool header = false;
  auto rows = measure_p2p(o, [&](const P2PRow& r) {
    if (!o.json && !std::exchange(header, true)) print_header();
    print(r, o.json);
  });
  if (!rows.is_ok()) {
    std::cerr << "kvstash-bench: " << rows.status().to_string() << "\n";
    return 1;
  }
  const bool failed = std::any_of(rows->begin(), rows->end(), [](const auto& r) { return !r.error.empty(); });
  if (o.plot.empty()) return failed ? 1 : 0;
  Status plotted = plot_gbps(o.plot, plot_title("kvstash-bench p2p"), p2p_plot_series(*rows));
  if (!plotted.is_ok()) std::cerr << "kvstash-bench: --plot: " << plotted.to_string() << "\n";
  return failed || !plotted.is_ok() ? 1 : 0;
}

}  // namespace kvstash::bench
