// Tests that need RDMA: they skip on machines without a device, and fail instead inside the
// Soft-RoCE lane (scripts/rdma-vm sets KVSTASH_RDMA_LANE), where a missing device means the
// lane itself is broken and must not pass by skipping.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "kvstash/engine.h"

namespace kvstash::test {

// OK when this host can start the verbs transport, else why not.
inline Status verbs_available() { return Engine::create({.transports = {TransportKind::kVerbs}}).status(); }

// Whether the kernel lists an RDMA device, which UCX's rc transports use where it has them
// (independent of whether this build has the verbs transport).
inline bool rdma_device_listed() {
  std::error_code ec;
  return std::filesystem::directory_iterator("/sys/class/infiniband", ec) !=
         std::filesystem::directory_iterator();
}

inline bool in_rdma_lane() { return std::getenv("KVSTASH_RDMA_LANE") != nullptr; }

}  // namespace kvstash::test

// Skips (or, in the lane, fails) the current test unless `available` holds.
#define KVSTASH_REQUIRE_RDMA(available, why)                                                               \
  if (!(available)) {                                                                                      \
    if (std::getenv("KVSTASH_RDMA_LANE") != nullptr) FAIL() << "the Soft-RoCE lane has no RDMA: " << why;  \
    GTEST_SKIP() << "no RDMA device here (" << why << "); the Soft-RoCE lane runs this (scripts/rdma-vm)"; \
  }
