// The logging facade: one line per event, quiet by default (warnings and errors).
// KVSTASH_LOG=debug|info|warn|error|off sets the level at start-up.
//
// Lines a remote peer can trigger (a refused connection, a failed handshake, a malformed
// request) go through the *_LIMITED macros: each call site has its own allowance
// (log::Limiter: a burst, then one line a second), and the first line it lets through after
// dropping some says how many, so a hostile or broken peer cannot flood the log or the disk.
#pragma once

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdint>
#include <mutex>

#include "kvstash/types.h"

namespace kvstash::log {

// The process-wide logger (stderr), configured from KVSTASH_LOG on first use.
spdlog::logger& get();

// One call site's allowance of lines: `burst` at once, then `per_second`. Thread-safe.
class Limiter {
 public:
  static constexpr double kBurst = 10;
  static constexpr double kPerSecond = 1;
  // Whether a line may go out now. When it may, *suppressed is the number of lines this site
  // dropped since the last one it let through (0: none).
  bool allow(std::uint64_t* suppressed, Clock::time_point now = Clock::now());

 private:
  std::mutex mu_;
  double tokens_ = kBurst;
  Clock::time_point refilled_{};
  std::uint64_t dropped_ = 0;
};

// Logs "N similar messages suppressed" at `level`.
void suppressed(spdlog::level::level_enum level, std::uint64_t n);

}  // namespace kvstash::log

#define KVSTASH_LOG_DEBUG(...) ::kvstash::log::get().debug(__VA_ARGS__)
#define KVSTASH_LOG_INFO(...) ::kvstash::log::get().info(__VA_ARGS__)
#define KVSTASH_LOG_WARN(...) ::kvstash::log::get().warn(__VA_ARGS__)
#define KVSTASH_LOG_ERROR(...) ::kvstash::log::get().error(__VA_ARGS__)

// Rate-limited per call site (see log::Limiter); arguments are evaluated only for lines that
// go out.
#define KVSTASH_LOG_LIMITED(level, ...)                                     \
  do {                                                                      \
    if (::kvstash::log::get().should_log(level)) {                          \
      static ::kvstash::log::Limiter kvstash_log_limiter_;                  \
      std::uint64_t kvstash_log_dropped_ = 0;                               \
      if (kvstash_log_limiter_.allow(&kvstash_log_dropped_)) {              \
        if (kvstash_log_dropped_ != 0) {                                    \
          ::kvstash::log::suppressed(level, kvstash_log_dropped_);          \
        }                                                                   \
        ::kvstash::log::get().log(level, __VA_ARGS__);                      \
      }                                                                     \
    }                                                                       \
  } while (0)
#define KVSTASH_LOG_DEBUG_LIMITED(...) KVSTASH_LOG_LIMITED(::spdlog::level::debug, __VA_ARGS__)
#define KVSTASH_LOG_INFO_LIMITED(...) KVSTASH_LOG_LIMITED(::spdlog::level::info, __VA_ARGS__)
#define KVSTASH_LOG_WARN_LIMITED(...) KVSTASH_LOG_LIMITED(::spdlog::level::warn, __VA_ARGS__)
#define KVSTASH_LOG_ERROR_LIMITED(...) KVSTASH_LOG_LIMITED(::spdlog::level::err, __VA_ARGS__)
