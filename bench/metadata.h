// `kvstash-bench metadata`: how long each metadata script holds Redis in a cell of many
// objects (Redis runs one script at a time, so that is how long every client waits).
#pragma once

#include <cstdint>

namespace kvstash::bench {

struct MetadataBenchOptions {
  std::uint64_t objects = 1000000;  // one-page objects in the cell
  bool json = false;
};

// Prints a table of server time per script (p50, p99, max); 0 on success.
int run_metadata(const MetadataBenchOptions& options);

}  // namespace kvstash::bench
