// The tcp transport's factory; everything else about it is private to src/transport/tcp/.
#pragma once

#include <memory>

#include "kvstash/engine.h"
#include "transport/transport.h"

namespace kvstash::transport {

// Starts a tcp transport. Errors: kUnavailable when it cannot run on this host, kIoError.
Result<std::unique_ptr<Transport>> make_tcp_transport(const TcpOptions& options);

}  // namespace kvstash::transport
