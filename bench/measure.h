// What the kvstash-bench subcommands measure with: percentiles, elapsed time, where two
// buffers differ, a progress line, and Ctrl-C handling that lets a run unwind.
#pragma once

#include <csignal>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvstash/types.h"

namespace kvstash::bench {

// The p-th percentile (0 < p <= 1) by nearest rank: with few samples p99 is the slowest one,
// not an interpolation below it. 0 for no samples.
double percentile(std::vector<double> v, double p);

// Time from `t0` to now, in microseconds or in seconds.
double us_since(Clock::time_point t0);
double seconds_since(Clock::time_point t0);

// Where in [a, a+n) the two buffers first differ (n when they do not), for error messages.
std::size_t first_difference(const std::byte* a, const std::byte* b, std::size_t n);

// A process's resident memory by kind (/proc/PID/status; "self" for this one), in bytes;
// zeros when it cannot be read.
struct ResidentMemory {
  std::uint64_t total = 0;  // VmRSS
  std::uint64_t anon = 0;   // RssAnon: heap, stacks
  std::uint64_t file = 0;   // RssFile: code, mapped files
  std::uint64_t shmem = 0;  // RssShmem: shared memory mapped (buffers, pools)
};
ResidentMemory resident_memory(const std::string& pid);

// CPU time (user + system, all threads) a process has used so far, in seconds, from
// /proc/PID/stat ("self" for this one); 0 when it cannot be read.
double cpu_seconds(const std::string& pid);

// A progress line on a terminal (stderr), overwritten in place; nothing when redirected.
class Progress {
 public:
  explicit Progress(bool enabled);
  ~Progress() { clear(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void show(const std::string& text);
  void clear();

 private:
  bool enabled_;
  bool shown_ = false;
};

// Ctrl-C or SIGTERM while one lives: the operation under way finishes, then the run sees
// interrupted() and unwinds, so a private kvstashd drains before its Redis goes and their
// temporary files are removed. (They run in process groups of their own: the terminal's
// SIGINT reaches only us.) A second signal ends the process at once.
class InterruptHandler {
 public:
  InterruptHandler();
  ~InterruptHandler();
  InterruptHandler(const InterruptHandler&) = delete;
  InterruptHandler& operator=(const InterruptHandler&) = delete;

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

bool interrupted();

}  // namespace kvstash::bench
