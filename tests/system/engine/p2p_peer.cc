// A target process for the two-process tests: serves one registered region and obeys
// commands on stdin.
//
//   p2p_peer SIZE [TRANSPORTS] [TOKEN]
// prints "address HEX", "key HEX" (the region registered Access::kRemote) and "leased HEX"
// (the same memory registered Access::kLeased), then reads lines: "dereg" drops both
// registrations (prints "ok"), "fill SEED" fills the region with test::fill_random (prints
// "ok"), "fence N" fences leases with tags up to N (Engine::fence; prints "ok"), EOF exits.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "kvstash/engine.h"
#include "test_util.h"

using namespace kvstash;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: p2p_peer SIZE [shm,tcp,ucx] [TOKEN]\n");
    return 2;
  }
  EngineOptions options;
  if (argc > 2) {
    std::stringstream list(argv[2]);
    for (std::string name; std::getline(list, name, ',');) {
      auto kind = parse_transport_kind(name);
      if (!kind) {
        std::fprintf(stderr, "unknown transport %s\n", name.c_str());
        return 2;
      }
      options.transports.push_back(*kind);
    }
  }
  if (argc > 3) options.cluster_token = argv[3];
  // A test target on loopback may accept UCX's emulated RMA (see UcxOptions), except in the
  // Soft-RoCE lane, where its UCX has RDMA and must serve keys only its NIC checks.
  options.ucx.allow_emulated_rma = std::getenv("KVSTASH_RDMA_LANE") == nullptr;
  auto engine = Engine::create(options);
  if (!engine.is_ok()) {
    std::fprintf(stderr, "%s\n", engine.status().to_string().c_str());
    return 1;
  }
  auto buffer = Buffer::allocate(std::stoull(argv[1])).value();
  auto handle =
      std::make_unique<MemoryHandle>((*engine)->register_memory(buffer.region(), Access::kRemote).value());
  auto leased =
      std::make_unique<MemoryHandle>((*engine)->register_memory(buffer.region(), Access::kLeased).value());
  std::cout << "address " << to_text((*engine)->address()) << "\nkey " << to_text(handle->remote_key())
            << "\nleased " << to_text(leased->remote_key()) << std::endl;
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "dereg") {
      handle.reset();
      leased.reset();
    } else if (line.rfind("fill ", 0) == 0) {
      test::fill_random(buffer.bytes(), std::stoull(line.substr(5)));
    } else if (line.rfind("fence ", 0) == 0) {
      (*engine)->fence(std::stoull(line.substr(6)));
    }
    std::cout << "ok" << std::endl;
  }
  return 0;
}
