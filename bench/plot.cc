#include "plot.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iterator>
#include <set>

#include <fmt/format.h>

namespace kvstash::bench {
namespace {

bool on_path(std::string_view program) {
  const char* env = std::getenv("PATH");
  std::string_view dirs = env != nullptr ? env : "/usr/bin:/bin";
  while (true) {
    const auto colon = dirs.find(':');
    const std::string_view dir = dirs.substr(0, colon);
    const std::string candidate = fmt::format("{}/{}", dir.empty() ? std::string_view(".") : dir, program);
    if (::access(candidate.c_str(), X_OK) == 0) return true;
    if (colon == std::string_view::npos) return false;
    dirs.remove_prefix(colon + 1);
  }
}

// 4096 -> "4K", 1048576 -> "1M", 1572864 -> "1.5M".
std::string size_label(std::size_t bytes) {
  static constexpr const char* kUnits[] = {"", "K", "M", "G", "T"};
  double v = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (v >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  return fmt::format("{:g}{}", v, kUnits[unit]);
}

// A gnuplot single-quoted string: a quote inside is written twice.
std::string quoted(std::string_view text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') out.push_back('\'');
    out.push_back(c);
  }
  return out + "'";
}

// While alive, a gnuplot that exits early makes our writes fail instead of killing us.
class IgnoreSigpipe {
 public:
  IgnoreSigpipe() {
    struct sigaction sa {};
    sa.sa_handler = SIG_IGN;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGPIPE, &sa, &old_);
  }
  ~IgnoreSigpipe() { ::sigaction(SIGPIPE, &old_, nullptr); }
  IgnoreSigpipe(const IgnoreSigpipe&) = delete;
  IgnoreSigpipe& operator=(const IgnoreSigpipe&) = delete;

 private:
  struct sigaction old_ {};
};

}  // namespace

std::string plot_title(std::string_view what) {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  char date[16] = "?";
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  if (::localtime_r(&now, &tm) != nullptr) std::strftime(date, sizeof date, "%Y-%m-%d", &tm);
  return fmt::format("{}, {}, {}", what, host, date);
}

namespace {

// Colours per group (a transport's write and read), from a palette that stays apart in print.
constexpr const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                                    "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};

// The head every plot shares: an SVG terminal, the output, the title and the grid.
std::string script_head(const std::string& path, const std::string& title) {
  std::string script;
  auto out = std::back_inserter(script);
  fmt::format_to(
      out, "set terminal svg size 960,600 dynamic noenhanced font 'Helvetica,13' background '#ffffff'\n");
  fmt::format_to(out, "set output {}\nset title {}\n", quoted(path), quoted(title));
  fmt::format_to(out, "set grid xtics ytics lc rgb '#e0e0e0'\nset key outside right top box opaque\n");
  return script;
}

// The plot command and its inline data: a line per series, coloured by group.
std::string series_lines(const std::vector<PlotSeries>& series) {
  std::vector<std::string> groups;
  for (const auto& s : series) {
    if (std::find(groups.begin(), groups.end(), s.group) == groups.end()) groups.push_back(s.group);
  }
  std::string plot;
  std::string data;
  for (const auto& s : series) {
    if (s.points.empty()) continue;
    const auto group = std::find(groups.begin(), groups.end(), s.group) - groups.begin();
    plot += fmt::format("{}'-' using 1:2 with linespoints lw 2 dt {} lc rgb '{}' pt {} ps 0.9 title {}",
                        plot.empty() ? "plot " : ", \\\n  ", s.dashed ? 2 : 1,
                        kColours[static_cast<std::size_t>(group) % std::size(kColours)],
                        s.second_marker ? 9 : 7, quoted(s.title));
    for (const auto& [x, y] : s.points) data += fmt::format("{:.6g} {:.6g}\n", x, y);
    data += "e\n";
  }
  return plot + "\n" + data;
}

// Feeds `script` to gnuplot and waits for it.
Status run_gnuplot(const std::string& path, const std::string& script) {
  if (!on_path("gnuplot")) {
    return Status::unavailable(
        "gnuplot is not on PATH (Debian: apt-get install gnuplot-nox; scripts/setup does)");
  }
  IgnoreSigpipe guard;
  FILE* gnuplot = ::popen("gnuplot", "w");
  if (gnuplot == nullptr) return Status::from_errno("start gnuplot", errno);
  const bool written = std::fwrite(script.data(), 1, script.size(), gnuplot) == script.size();
  const int status = ::pclose(gnuplot);
  if (!written || status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return Status::internal(fmt::format("gnuplot failed writing {} (exit status {})", path,
                                        status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  }
  return {};
}

bool no_points(const std::vector<PlotSeries>& series) {
  return std::all_of(series.begin(), series.end(), [](const PlotSeries& s) { return s.points.empty(); });
}

}  // namespace

Status plot_gbps(const std::string& path, const std::string& title, const std::vector<PlotSeries>& series) {
  std::set<std::size_t> sizes;
  for (const auto& s : series) {
    for (const auto& [size, gbps] : s.points) sizes.insert(static_cast<std::size_t>(size));
  }
  if (sizes.empty()) return Status::invalid_argument("nothing to plot: no row was measured");
  std::string script = script_head(path, title);
  auto out = std::back_inserter(script);
  fmt::format_to(out, "set xlabel 'request size (bytes)'\nset ylabel 'GB/s (10^9 bytes/s)'\n");
  // Both axes logarithmic: sizes span 4K..256M, and GB/s from a slow peer's 0.01 to memcpy's 40.
  fmt::format_to(out, "set logscale x 2\nset logscale y 10\nset format y '%g'\nset xrange [{}:{}]\n",
                 static_cast<double>(*sizes.begin()) / 1.4, static_cast<double>(*sizes.rbegin()) * 1.4);
  std::string tics;
  for (std::size_t size : sizes) {
    if (!tics.empty()) tics += ", ";
    tics += fmt::format("{} {}", quoted(size_label(size)), size);
  }
  fmt::format_to(out, "set xtics ({})\n", tics);
  return run_gnuplot(path, script + series_lines(series));
}

Status plot_over_time(const std::string& path, const std::string& title, const std::string& ylabel,
                      const std::vector<PlotSeries>& series) {
  if (no_points(series)) return Status::invalid_argument("nothing to plot: no interval was measured");
  std::string script = script_head(path, title);
  fmt::format_to(std::back_inserter(script), "set xlabel 'time (s)'\nset ylabel {}\nset yrange [0:*]\n",
                 quoted(ylabel));
  return run_gnuplot(path, script + series_lines(series));
}

Status plot_xy(const std::string& path, const std::string& title, const std::string& xlabel,
               const std::string& ylabel, const std::vector<PlotSeries>& series) {
  if (no_points(series)) return Status::invalid_argument("nothing to plot: no row was measured");
  std::string script = script_head(path, title);
  fmt::format_to(std::back_inserter(script),
                 "set xlabel {}\nset ylabel {}\nset logscale x 10\nset yrange [0:*]\n", quoted(xlabel),
                 quoted(ylabel));
  return run_gnuplot(path, script + series_lines(series));
}

}  // namespace kvstash::bench
