#include "common/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

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

}  // namespace kvstash::log
