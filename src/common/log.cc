#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <algorithm>
#include <cstdlib>

namespace kvstash::log {

spdlog::logger& get() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("kvstash");
    l->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ kvstash[%P] %v");
    const char* level = std::getenv("KVSTASH_LOG");
    l->set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
    return l;
  }();
  return *logger;
}

bool Limiter::allow(std::uint64_t* suppressed, Clock::time_point now) {
  std::lock_guard lock(mu_);
  if (refilled_ != Clock::time_point{}) {
    const double seconds = std::chrono::duration<double>(now - refilled_).count();
    tokens_ = std::min(kBurst, tokens_ + std::max(0.0, seconds) * kPerSecond);
  }
  refilled_ = now;
  if (tokens_ < 1) {
    ++dropped_;
    return false;
  }
  tokens_ -= 1;
  *suppressed = dropped_;
  dropped_ = 0;
  return true;
}

void suppressed(spdlog::level::level_enum level, std::uint64_t n) {
  get().log(level, "{} similar message{} suppressed (this line is rate-limited)", n, n == 1 ? "" : "s");
}

}  // namespace kvstash::log
