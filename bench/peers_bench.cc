#include "peers_bench.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/units.h"
#include "measure.h"
#include "p2p_bench.h"
#include "plot.h"

#ifndef KVSTASH_BENCH_PEERS_DIR
#define KVSTASH_BENCH_PEERS_DIR ""
#endif
#ifndef KVSTASH_BENCH_PEERS_INSTALLED_DIR
#define KVSTASH_BENCH_PEERS_INSTALLED_DIR ""
#endif

namespace kvstash::bench {
namespace {

// One row of peer_bench.py: {"engine", "op", "size", "gbps", "p50_us", "p99_us", "verified",
// "compare_with"}, or {"engine", "error"}.
struct PeerRow {
  std::string engine;
  std::string op;
  std::size_t size = 0;
  double gbps = 0, p50_us = 0, p99_us = 0;
  double cpu_us_per_op = 0;  // both processes' CPU per request; 0 when not measured
  bool verified = false;
  std::string compare_with;  // the kvstash transport that moves bytes the same way
  std::string error;
};

// $KVSTASH_PEERS_SCRIPTS, else the source tree's bench/peers, else where meson installs them.
std::string peer_script() {
  const char* env = std::getenv("KVSTASH_PEERS_SCRIPTS");
  if (env != nullptr && *env != '\0') return std::string(env) + "/peer_bench.py";
  const std::string source = KVSTASH_BENCH_PEERS_DIR "/peer_bench.py";
  if (::access(source.c_str(), R_OK) == 0) return source;
  return KVSTASH_BENCH_PEERS_INSTALLED_DIR "/peer_bench.py";
}

std::string shell_quoted(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out.push_back(c);
  }
  return out + "'";
}

PeerRow parse_peer_row(const nlohmann::json& j, const std::string& engine) {
  PeerRow r;
  r.engine = j.value("engine", engine);
  r.op = j.value("op", "");
  r.size = j.value("size", std::size_t{0});
  r.gbps = j.value("gbps", 0.0);
  r.p50_us = j.value("p50_us", 0.0);
  r.p99_us = j.value("p99_us", 0.0);
  r.cpu_us_per_op = j.value("cpu_us_per_op", 0.0);
  r.verified = j.value("verified", false);
  r.compare_with = j.value("compare_with", "tcp");
  r.error = j.value("error", "");
  return r;
}

// Runs peer_bench.py for one engine with the venv's python and passes each row to on_row as it
// arrives. The engines' logs go to a file named in error rows (removed when all went well).
std::vector<PeerRow> run_peer(const std::string& engine, const PeersOptions& o,
                              const std::function<void(const PeerRow&)>& on_row) {
  std::vector<PeerRow> rows;
  auto fail = [&](std::string why) {
    PeerRow r;
    r.engine = engine;
    r.error = std::move(why);
    on_row(r);
    rows.push_back(std::move(r));
    return rows;
  };
  const std::string python = o.venv + "/bin/python", script = peer_script();
  if (::access(python.c_str(), X_OK) != 0)
    return fail("not installed: run scripts/peers-setup (no " + python + ")");
  if (::access(script.c_str(), R_OK) != 0) return fail("no " + script + " (set KVSTASH_PEERS_SCRIPTS)");
  std::string sizes;
  for (std::size_t s : o.sizes) sizes += (sizes.empty() ? "" : ",") + std::to_string(s);
  char log[] = "/tmp/kvstash-peers-XXXXXX";
  const int fd = ::mkstemp(log);
  if (fd < 0) return fail("cannot create a log file in /tmp");
  ::close(fd);
  // A backstop only: the script limits each of its own steps to a minute.
  const int limit = 180 + static_cast<int>(o.sizes.size() * (2 * o.seconds + 60));
  const std::string command =
      fmt::format("exec timeout -k 5 {} {} {} --engine {} --sizes {} --seconds {} 2>{}", limit,
                  shell_quoted(python), shell_quoted(script), shell_quoted(engine), sizes, o.seconds, log);
  FILE* out = ::popen(command.c_str(), "r");
  if (out == nullptr) return fail("cannot start " + python);
  bool failed = false;
  std::string line;
  for (int c; (c = std::fgetc(out)) != EOF;) {
    if (c != '\n') {
      line.push_back(static_cast<char>(c));
      continue;
    }
    auto j = nlohmann::json::parse(line, nullptr, false);
    line.clear();
    if (j.is_discarded() || !j.is_object()) continue;
    PeerRow r = parse_peer_row(j, engine);
    if (!r.error.empty()) {
      r.error += fmt::format(" (log: {})", log);
      failed = true;
    }
    on_row(r);
    rows.push_back(std::move(r));
  }
  const int status = ::pclose(out);
  const int code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rows.empty()) {
    return fail(code == 124 ? fmt::format("no answer within {} s (log: {})", limit, log)
                            : fmt::format("exited with status {} and no row (log: {})", code, log));
  }
  if (!failed) ::unlink(log);
  return rows;
}

// Two decimals; three significant digits below 0.1, where two decimals would read 0.00.
std::string cell(double v, int width) {
  return v >= 0.1 ? fmt::format("{:>{}.2f}", v, width) : fmt::format("{:>{}.3g}", v, width);
}

// kvstash's rows and the peers' side by side: GB/s per column, size and op.
struct Comparison {
  std::map<std::tuple<std::string, std::size_t, std::string>, double> gbps;
  std::map<std::tuple<std::string, std::size_t, std::string>, double> cpu;  // us per request
  std::vector<std::string> columns;  // "kvstash-<t>"..., the peers, the references
  // Each peer against the kvstash transport that moves bytes the same way (tcp if not measured).
  struct Ratio {
    std::string mine, peer, header;
  };
  std::vector<Ratio> ratios;
  std::vector<std::string> errors;  // one line each
  bool kvstash_failed = false;

  std::optional<double> value(const std::string& column, std::size_t size, const std::string& op) const {
    auto it = gbps.find({column, size, op});
    return it == gbps.end() ? std::nullopt : std::optional(it->second);
  }
  std::optional<double> ratio(const Ratio& r, std::size_t size, const std::string& op) const {
    auto a = value(r.mine, size, op), b = value(r.peer, size, op);
    return a && b && *b > 0 ? std::optional(*a / *b) : std::nullopt;
  }
};

Comparison compare(const std::vector<P2PRow>& kvstash, const std::vector<PeerRow>& peers) {
  Comparison c;
  std::vector<std::string> mine, theirs, references;
  auto add = [](std::vector<std::string>& columns, const std::string& name) {
    if (std::find(columns.begin(), columns.end(), name) == columns.end()) columns.push_back(name);
  };
  for (const auto& r : kvstash) {
    if (!r.error.empty()) {
      c.errors.push_back(
          fmt::format("kvstash-{} {} {}: {}", r.transport, r.op, units::format_size(r.size), r.error));
      c.kvstash_failed = true;
      continue;
    }
    if (r.op == "pingpong") continue;  // a latency reference: p2p's table shows it
    const std::string column = r.reference() ? r.transport : "kvstash-" + r.transport;
    add(r.reference() ? references : mine, column);
    for (const char* op : {"write", "read"}) {
      if (r.reference() || r.op == op) c.gbps[{column, r.size, op}] = r.gbps;
    }
    if (r.cpu_us_per_op > 0) c.cpu[{column, r.size, r.op}] = r.cpu_us_per_op;
  }
  for (const auto& r : peers) {
    add(theirs, r.engine);
    if (!r.error.empty()) {
      c.errors.push_back(fmt::format("{}: {}", r.engine, r.error));
      continue;
    }
    c.gbps[{r.engine, r.size, r.op}] = r.gbps;
    if (r.cpu_us_per_op > 0) c.cpu[{r.engine, r.size, r.op}] = r.cpu_us_per_op;
    std::string same = "kvstash-" + r.compare_with;
    if (std::find(mine.begin(), mine.end(), same) == mine.end()) same = "kvstash-tcp";
    if (std::none_of(c.ratios.begin(), c.ratios.end(), [&](const auto& x) { return x.peer == r.engine; })) {
      c.ratios.push_back({same, r.engine, same.substr(8) + " x " + r.engine});
    }
  }
  c.columns = mine;
  c.columns.insert(c.columns.end(), theirs.begin(), theirs.end());
  c.columns.insert(c.columns.end(), references.begin(), references.end());
  return c;
}

void print_table(const Comparison& c, const std::vector<std::size_t>& sizes) {
  auto width = [](const std::string& header) { return std::max<int>(8, static_cast<int>(header.size())); };
  auto put = [&](std::string& line, const std::string& header, std::optional<double> v) {
    line += "  " + (v ? cell(*v, width(header)) : fmt::format("{:>{}}", "-", width(header)));
  };
  std::string head = fmt::format("{:<10} {:<6}", "size", "op");
  for (const auto& h : c.columns) head += fmt::format("  {:>{}}", h, width(h));
  for (const auto& r : c.ratios) head += fmt::format("  {:>{}}", r.header, width(r.header));
  std::cout << "GB/s (1e9 bytes/s), one thread, batch depth 1, two processes on this host; "
               "\"t x peer\": kvstash over t / the peer\n"
            << head << "\n";
  for (std::size_t size : sizes) {
    for (const char* op : {"write", "read"}) {
      std::string line = fmt::format("{:<10} {:<6}", units::format_size(size), op);
      for (const auto& h : c.columns) put(line, h, c.value(h, size, op));
      for (const auto& r : c.ratios) put(line, r.header, c.ratio(r, size, op));
      std::cout << line << "\n";
    }
  }
  if (!c.cpu.empty()) {
    // What each request cost in CPU, both processes and every thread (a polling engine pays
    // for its latency here).
    std::string cpu_head = fmt::format("{:<10} {:<6}", "size", "op");
    std::vector<std::string> engines;
    for (const auto& h : c.columns) {
      if (std::any_of(c.cpu.begin(), c.cpu.end(), [&](const auto& kv) { return std::get<0>(kv.first) == h; })) {
        engines.push_back(h);
        cpu_head += fmt::format("  {:>{}}", h, width(h));
      }
    }
    std::cout << "\nCPU us per request (user + system, both processes, every thread)\n" << cpu_head << "\n";
    for (std::size_t size : sizes) {
      for (const char* op : {"write", "read"}) {
        std::string line = fmt::format("{:<10} {:<6}", units::format_size(size), op);
        for (const auto& h : engines) {
          auto it = c.cpu.find({h, size, op});
          line += "  " + (it != c.cpu.end() ? fmt::format("{:>{}.1f}", it->second, width(h))
                                            : fmt::format("{:>{}}", "-", width(h)));
        }
        std::cout << line << "\n";
      }
    }
  }
  for (const auto& e : c.errors) std::cout << e << "\n";
  std::cout << std::flush;
}

// The peers' rows (kvstash's went out as they were measured), then one object per ratio.
void print_json(const Comparison& c, const std::vector<PeerRow>& peers,
                const std::vector<std::size_t>& sizes) {
  for (const auto& r : peers) {
    nlohmann::json j{{"engine", r.engine}};
    if (r.error.empty()) {
      j.update({{"op", r.op},
                {"size", r.size},
                {"gbps", r.gbps},
                {"p50_us", r.p50_us},
                {"p99_us", r.p99_us},
                {"verified", r.verified},
                {"cpu_us_per_op", r.cpu_us_per_op},
                {"compare_with", r.compare_with}});
    } else {
      j["error"] = r.error;
    }
    std::cout << j.dump() << "\n";
  }
  for (std::size_t size : sizes) {
    for (const char* op : {"write", "read"}) {
      for (const auto& r : c.ratios) {
        const auto v = c.ratio(r, size, op);
        if (!v) continue;
        std::cout << nlohmann::json{{"ratio", r.mine + "/" + r.peer},
                                    {"kvstash", r.mine},
                                    {"peer", r.peer},
                                    {"op", op},
                                    {"size", size},
                                    {"value", *v}}
                         .dump()
                  << "\n";
      }
    }
  }
  std::cout << std::flush;
}

std::vector<PlotSeries> plot_series(const std::vector<P2PRow>& kvstash, const std::vector<PeerRow>& peers) {
  std::vector<PlotSeries> series = p2p_plot_series(kvstash);
  for (const auto& r : peers) {
    if (!r.error.empty()) continue;
    const std::string title = r.engine + " " + r.op;
    auto it = std::find_if(series.begin(), series.end(), [&](const auto& s) { return s.title == title; });
    if (it == series.end()) {
      PlotSeries s;
      s.title = title;
      s.group = r.engine;
      s.dashed = true;
      s.second_marker = r.op == "read";
      it = series.insert(series.end(), std::move(s));
    }
    it->points.emplace_back(r.size, r.gbps);
  }
  return series;
}

}  // namespace

std::string default_peers_venv() {
  const char* env = std::getenv("KVSTASH_PEERS_VENV");
  if (env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : "") + "/.cache/kvstash/peers-venv";
}

int run_peers(const PeersOptions& o) {
  Progress progress(!o.json);
  P2POptions p2p;
  p2p.transports = o.transports;
  p2p.sizes = o.sizes;
  p2p.seconds = o.seconds;
  p2p.busy_poll_us = o.busy_poll_us;
  auto kvstash = measure_p2p(p2p, [&](const P2PRow& r) {
    if (o.json) std::cout << to_json_line(r) << std::endl;
    progress.show(fmt::format("kvstash {} {} {}", r.transport, r.op, units::format_size(r.size)));
  });
  if (!kvstash.is_ok()) {
    progress.clear();
    std::cerr << "kvstash-bench: " << kvstash.status().to_string() << "\n";
    return 1;
  }
  std::vector<PeerRow> peers;
  for (const auto& engine : o.engines) {
    progress.show(engine + " (starting)");
    auto rows = run_peer(engine, o, [&](const PeerRow& r) {
      progress.show(fmt::format("{} {} {}", r.engine, r.op, units::format_size(r.size)));
    });
    peers.insert(peers.end(), rows.begin(), rows.end());
  }
  progress.clear();

  const Comparison c = compare(*kvstash, peers);
  if (o.json)
    print_json(c, peers, o.sizes);
  else
    print_table(c, o.sizes);
  if (o.plot.empty()) return c.kvstash_failed ? 1 : 0;
  Status plotted = plot_gbps(o.plot, plot_title("kvstash-bench peers"), plot_series(*kvstash, peers));
  if (!plotted.is_ok()) std::cerr << "kvstash-bench: --plot: " << plotted.to_string() << "\n";
  return c.kvstash_failed || !plotted.is_ok() ? 1 : 0;
}

}  // namespace kvstash::bench
