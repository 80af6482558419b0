// The logging facade: one line per event, quiet by default (warnings and errors).
// KVSTASH_LOG=debug|info|warn|error|off sets the level at start-up.
#pragma once

#include <spdlog/spdlog.h>

namespace kvstash::log {

// The process-wide logger (stderr), configured from KVSTASH_LOG on first use.
spdlog::logger& get();

}  // namespace kvstash::log

#define KVSTASH_LOG_DEBUG(...) ::kvstash::log::get().debug(__VA_ARGS__)
#define KVSTASH_LOG_INFO(...) ::kvstash::log::get().info(__VA_ARGS__)
#define KVSTASH_LOG_WARN(...) ::kvstash::log::get().warn(__VA_ARGS__)
#define KVSTASH_LOG_ERROR(...) ::kvstash::log::get().error(__VA_ARGS__)
