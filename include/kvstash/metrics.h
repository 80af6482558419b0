// kvstash/metrics.h: a client's own metrics (docs/operations.md, "Engine-side metrics"):
// counters and latency histograms that the Store and the KvCache keep as they work
// (Store::metrics), and their text in Prometheus' exposition format, for an engine to serve or
// to hand to its own registry (vLLM's, SGLang's). An engine may count into the same registry.
//
// A series is made once (a lock and a map lookup) and then updated with relaxed atomics: the
// callers keep the Counter& or Histogram& they were given, which live as long as the registry.
//
// Thread safety: every member, from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvstash::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void add(std::uint64_t n = 1) { value_.fetch_add(n, std::memory_order_relaxed); }
  std::uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> value_{0};
};

// Upper bounds (seconds) of a latency histogram's buckets: 10 us to 10 s, about three per
// decade, as an operation of this library takes from microseconds (a hit on shm) to seconds
// (a deadline).
inline constexpr std::array<double, 19> kLatencyBuckets = {1e-5,   2.5e-5, 5e-5, 1e-4,   2.5e-4, 5e-4, 1e-3,
                                                           2.5e-3, 5e-3,   1e-2, 2.5e-2, 5e-2,   0.1,  0.25,
                                                           0.5,    1.0,    2.5,  5.0,    10.0};

class Histogram {
 public:
  void observe(double seconds);
  std::uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9; }
  // Observations at or below kLatencyBuckets[i] (cumulative, as the format wants them).
  std::uint64_t at_or_below(std::size_t i) const;

 private:
  std::array<std::atomic<std::uint64_t>, kLatencyBuckets.size()> buckets_{};  // per bucket, not cumulative
  std::atomic<std::uint64_t> count_{0}, sum_ns_{0};
};

// One line of the exposition: a series' name (with _bucket, _sum or _count for a histogram's),
// its labels (le last, for a bucket) and its value.
struct Sample {
  std::string name;
  Labels labels;
  double value = 0;
};

class Registry {
 public:
  // The series `name` with `labels`, made on first use. A name is one family: a counter or a
  // histogram, with the help text given first.
  Counter& counter(std::string_view name, std::string_view help, const Labels& labels = {});
  Histogram& histogram(std::string_view name, std::string_view help, const Labels& labels = {});

  // Every series now, in the text exposition format (version 0.0.4), families by name.
  std::string text() const;
  // The same as samples.
  std::vector<Sample> samples() const;

 private:
  struct Family {
    std::string help;
    bool histogram = false;
    std::map<Labels, std::unique_ptr<Counter>> counters;
    std::map<Labels, std::unique_ptr<Histogram>> histograms;
  };
  Family& family(std::string_view name, std::string_view help, bool histogram);
  // Family `name`'s series, a histogram's as its buckets, sum and count.
  static void append_samples(const std::string& name, const Family& f, std::vector<Sample>& out);
  mutable std::mutex mu_;
  std::map<std::string, Family, std::less<>> families_;
};

}  // namespace kvstash::metrics
