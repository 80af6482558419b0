// Human units for sizes and durations. Sizes: "4096", "64KiB", "1.5GiB", "10GB" (binary and decimal
// suffixes).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvstash/status.h"

namespace kvstash::units {

// Errors: kInvalidArgument naming the text, for an empty, negative or unknown-suffix size.
Result<std::uint64_t> parse_size(std::string_view text);
// "4 KiB", "64 MiB", "1.5 GiB": the largest binary unit that keeps the number >= 1.
std::string format_size(std::uint64_t bytes);

// Durations: "250ms", "3s", "2m", "1h"; a bare number is milliseconds. Errors:
// kInvalidArgument naming the text.
Result<std::chrono::milliseconds> parse_duration(std::string_view text);

}  // namespace kvstash::units
