// kvstash-history's client process (`--client`): a Store over one transport and threads running
// random operations, each logged with its invocation and return times for the checker.
#pragma once

#include <cstdint>
#include <string>

namespace kvstash::history {

struct ClientConfig {
  std::string redis_url;
  std::string transport = "tcp";
  int id = 0;
  int threads = 2;
  double seconds = 10;
  std::uint64_t seed = 1;
  std::string log;
  std::string rkey_scope;  // "connection", "lease"; empty: the cell's
  int avoid_ms = -1;       // StoreOptions::avoid_unreachable_nodes; < 0: the default
};

// Runs the client's threads for its seconds; 0 when it ran to the end.
int run_client(const ClientConfig& c);

}  // namespace kvstash::history
