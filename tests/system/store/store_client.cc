// A client process the store tests kill at a chosen moment.
//   store_client begin-put REDIS_URL KEY SIZE LEASE_MS
// starts a put (pages allocated, pending record leased), prints "pending" and waits to be
// killed: a client that dies between begin_put and commit_put.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "metadata/cell.h"

int main(int argc, char** argv) {
  using namespace kvstash;
  if (argc != 6 || std::string(argv[1]) != "begin-put") {
    std::fprintf(stderr, "usage: store_client begin-put REDIS_URL KEY SIZE LEASE_MS\n");
    return 2;
  }
  auto cell = metadata::Cell::open({.redis = {.url = argv[2]}});
  if (!cell.is_ok()) {
    std::fprintf(stderr, "store_client: %s\n", cell.status().to_string().c_str());
    return 1;
  }
  auto placed = (*cell)->catalog().begin_put("store-client-" + std::to_string(getpid()), argv[3],
                                             std::strtoull(argv[4], nullptr, 10),
                                             std::chrono::milliseconds(std::atoll(argv[5])));
  if (!placed.is_ok()) {
    std::fprintf(stderr, "store_client: %s\n", placed.status().to_string().c_str());
    return 1;
  }
  std::printf("pending\n");
  std::fflush(stdout);
  for (;;) pause();
}
