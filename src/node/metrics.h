// MetricsText: builds a Prometheus text exposition (format 0.0.4) for the admin endpoint.
//
// Each call adds one sample. Samples are grouped by metric name in the order names were first
// seen, under a single `# HELP` / `# TYPE` pair, because the Prometheus parser rejects a name
// whose samples are split or described twice; callers may therefore add the samples of one
// metric in any order, interleaved with others.
//
// Invalid input is skipped, not asserted, so a bad label from one subsystem cannot take the
// daemon down or empty the whole scrape:
//  - a metric name not matching [a-zA-Z_:][a-zA-Z0-9_:]* drops the sample;
//  - a label name not matching [a-zA-Z_][a-zA-Z0-9_]* (or starting with the reserved "__")
//    drops the sample, and so does a label name given twice;
//  - a name first added as a counter and later as a gauge (or the reverse) drops the later
//    samples; the HELP text of the first call wins.
// Label values and HELP text may hold any bytes; they are escaped as the format requires.
//
// Thread safety: a plain value; const methods may be called concurrently, the rest need
// external synchronization.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvstash::node {

class MetricsText {
 public:
  using Labels = std::initializer_list<std::pair<std::string_view, std::string_view>>;

  // A monotonically increasing count (requests served, bytes moved).
  void counter(std::string_view name, std::string_view help, double value, Labels labels = {});
  // A value that may go up and down (pages free, peers connected).
  void gauge(std::string_view name, std::string_view help, double value, Labels labels = {});

  // The exposition text: every metric's HELP, TYPE and sample lines, each line ending in "\n".
  // Empty when nothing valid was added.
  std::string str() const;

 private:
  struct Family {
    std::string name;
    std::string help;  // already escaped
    std::string_view type;
    std::string samples;  // rendered sample lines
  };

  void add(std::string_view type, std::string_view name, std::string_view help, double value, Labels labels);

  // Insertion order is the output order; a daemon has tens of metrics, so a linear search
  // is cheaper than keeping an index in step with the vector.
  std::vector<Family> families_;
};

}  // namespace kvstash::node
