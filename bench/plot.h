// Plots for kvstash-bench (`--plot FILE.svg`): GB/s over request size, or values over a run's
// time, drawn by gnuplot into an SVG. gnuplot is needed only when a plot is asked for; nothing else runs it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvstash/status.h"

namespace kvstash::bench {

// One line of a plot.
struct PlotSeries {
  std::string title;           // legend entry, e.g. "tcp write"
  std::string group;           // lines of one group share a colour (a transport's write and read)
  bool dashed = false;         // references and peer engines; kvstash's own lines are solid
  bool second_marker = false;  // triangles instead of circles (reads, beside the writes)
  std::vector<std::pair<double, double>> points;  // x, y: request size in bytes, GB/s (plot_gbps)
};

// "<what>, <host>, <YYYY-MM-DD>": what a plot's title says.
std::string plot_title(std::string_view what);

// Writes the series to `path` as an SVG: GB/s over request size, the size axis logarithmic and
// labelled 4K, 64K, 1M, ... Runs gnuplot (Debian: gnuplot-nox) as a child process fed the script
// and the data on its stdin, and blocks until it exits. Errors: kUnavailable when gnuplot is not
// on PATH, kInvalidArgument when no series has a point, kInternal when gnuplot fails (its own
// message went to stderr).
Status plot_gbps(const std::string& path, const std::string& title, const std::vector<PlotSeries>& series);

// As plot_gbps, for values over a run's time: x is seconds from the start, both axes linear,
// y labelled `ylabel`.
Status plot_over_time(const std::string& path, const std::string& title, const std::string& ylabel,
                      const std::vector<PlotSeries>& series);

// As plot_gbps, for any y over any x: x on a logarithmic axis (capacities that span decades),
// y linear from 0, each labelled.
Status plot_xy(const std::string& path, const std::string& title, const std::string& xlabel,
               const std::string& ylabel, const std::vector<PlotSeries>& series);

}  // namespace kvstash::bench
