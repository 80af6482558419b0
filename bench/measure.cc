#include "measure.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace kvstash::bench {
namespace {

std::atomic<bool> g_interrupted{false};

extern "C" void on_interrupt(int) { g_interrupted.store(true); }

}  // namespace

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  auto rank = static_cast<std::size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<std::size_t>(rank, 1, v.size()) - 1];
}

ResidentMemory resident_memory(const std::string& pid) {
  ResidentMemory r;
  std::ifstream in("/proc/" + pid + "/status");
  for (std::string line; std::getline(in, line);) {
    std::uint64_t* field = line.starts_with("VmRSS:")      ? &r.total
                           : line.starts_with("RssAnon:")  ? &r.anon
                           : line.starts_with("RssFile:")  ? &r.file
                           : line.starts_with("RssShmem:") ? &r.shmem
                                                           : nullptr;
    if (field != nullptr) *field = std::strtoull(line.c_str() + line.find(':') + 1, nullptr, 10) << 10;
  }
  return r;
}

double cpu_seconds(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string line;
  if (!std::getline(in, line)) return 0;
  // The command name (field 2) may hold spaces; the fields after its ')' are plain.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::strtod(field.c_str(), nullptr);  // utime, stime
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::size_t first_difference(const std::byte* a, const std::byte* b, std::size_t n) {
  std::size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

Progress::Progress(bool enabled) : enabled_(enabled && ::isatty(2) == 1) {}

void Progress::show(const std::string& text) {
  if (!enabled_) return;
  std::fprintf(stderr, "\r\033[K  %s", text.c_str());
  std::fflush(stderr);
  shown_ = true;
}

void Progress::clear() {
  if (!shown_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  shown_ = false;
}

InterruptHandler::InterruptHandler() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int_);
  ::sigaction(SIGTERM, &sa, &old_term_);
}

InterruptHandler::~InterruptHandler() {
  ::sigaction(SIGINT, &old_int_, nullptr);
  ::sigaction(SIGTERM, &old_term_, nullptr);
}

bool interrupted() { return g_interrupted.load(std::memory_order_relaxed); }

}  // namespace kvstash::bench
