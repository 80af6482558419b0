#include "kvstash/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace kvstash::metrics {

void Histogram::observe(double seconds) {
  if (!(seconds >= 0)) seconds = 0;  // NaN, or a clock that went back
  const auto at = std::ranges::lower_bound(kLatencyBuckets, seconds);
  if (at != kLatencyBuckets.end()) {
    buckets_[static_cast<std::size_t>(at - kLatencyBuckets.begin())].fetch_add(1, std::memory_order_relaxed);
  }
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_ns_.fetch_add(static_cast<std::uint64_t>(std::llround(seconds * 1e9)), std::memory_order_relaxed);
}

std::uint64_t Histogram::at_or_below(std::size_t i) const {
  std::uint64_t n = 0;
  for (std::size_t b = 0; b <= i && b < buckets_.size(); ++b)
    n += buckets_[b].load(std::memory_order_relaxed);
  return n;
}

Registry::Family& Registry::family(std::string_view name, std::string_view help, bool histogram) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{}).first;
    it->second.help = std::string(help);
    it->second.histogram = histogram;
  }
  return it->second;
}

Counter& Registry::counter(std::string_view name, std::string_view help, const Labels& labels) {
  std::lock_guard lock(mu_);
  auto& slot = family(name, help, false).counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Histogram& Registry::histogram(std::string_view name, std::string_view help, const Labels& labels) {
  std::lock_guard lock(mu_);
  auto& slot = family(name, help, true).histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>();
  return *slot;
}

void Registry::append_samples(const std::string& name, const Family& f, std::vector<Sample>& out) {
  for (const auto& [labels, c] : f.counters) out.push_back({name, labels, static_cast<double>(c->value())});
  for (const auto& [labels, h] : f.histograms) {
    for (std::size_t i = 0; i < kLatencyBuckets.size(); ++i) {
      Labels with = labels;
      with.emplace_back("le", fmt::format("{}", kLatencyBuckets[i]));
      out.push_back({name + "_bucket", std::move(with), static_cast<double>(h->at_or_below(i))});
    }
    // Observations that land meanwhile may reach the buckets before the count: +Inf and the
    // count are never below the last bucket read.
    const std::uint64_t count = std::max(h->count(), h->at_or_below(kLatencyBuckets.size() - 1));
    Labels inf = labels;
    inf.emplace_back("le", "+Inf");
    out.push_back({name + "_bucket", std::move(inf), static_cast<double>(count)});
    out.push_back({name + "_sum", labels, h->sum()});
    out.push_back({name + "_count", labels, static_cast<double>(count)});
  }
}

std::vector<Sample> Registry::samples() const {
  std::vector<Sample> out;
  std::lock_guard lock(mu_);
  for (const auto& [name, f] : families_) append_samples(name, f, out);
  return out;
}

namespace {

// A label value as the format quotes it: backslash, double quote and newline escaped.
std::string quoted(std::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

std::string Registry::text() const {
  std::string out;
  std::vector<Sample> series;
  std::lock_guard lock(mu_);
  for (const auto& [name, f] : families_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, f.help, name,
                       f.histogram ? "histogram" : "counter");
    series.clear();
    append_samples(name, f, series);
    for (const Sample& s : series) {
      out += s.name;
      if (!s.labels.empty()) {
        out += '{';
        for (std::size_t i = 0; i < s.labels.size(); ++i) {
          out += fmt::format("{}{}=\"{}\"", i ? "," : "", s.labels[i].first, quoted(s.labels[i].second));
        }
        out += '}';
      }
      out += fmt::format(" {}\n", s.value);
    }
  }
  return out;
}

}  // namespace kvstash::metrics
