// The tcp transport's factory; everything else about it is private to src/transport/tcp/.
#pragma once

#include <memory>

#include "kvstash/transfer.h"
#include "transport/transport.h"

namespace kvstash::transport {

// Starts a tcp transport. With a `cluster_token` both sides of every connection prove they
// know it (EngineOptions::cluster_token). Its I/O threads spin `busy_poll` after their last
// event before they sleep (EngineOptions::busy_poll). Errors: kUnavailable when it cannot run
// on this host, kIoError.
Result<std::unique_ptr<Transport>> make_tcp_transport(const TcpOptions& options,
                                                      std::string cluster_token = {},
                                                      std::chrono::microseconds busy_poll = {});

}  // namespace kvstash::transport
