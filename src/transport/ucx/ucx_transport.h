// The ucx transport's factory; everything else about it is private to src/transport/ucx/.
#pragma once

#include <memory>

#include "kvstash/engine.h"
#include "transport/transport.h"

namespace kvstash::transport {

// Starts a ucx transport. Errors: kUnavailable when it cannot run on this host, kIoError.
Result<std::unique_ptr<Transport>> make_ucx_transport(const UcxOptions& options);

}  // namespace kvstash::transport
