// The ucx transport's factory; everything else about it is private to src/transport/ucx/.
#pragma once

#include <memory>

#include "kvstash/transfer.h"
#include "transport/transport.h"

namespace kvstash::transport {

// Starts a ucx transport. UCX connects peers without any handshake of ours, so it cannot
// prove a cluster token: with a non-empty `cluster_token` it does not start (kUnsupported,
// which the engine takes quietly unless UCX was asked for by name) rather than serve peers
// that never proved it. Errors: kUnavailable
// when it cannot run on this host, kIoError.
Result<std::unique_ptr<Transport>> make_ucx_transport(const UcxOptions& options,
                                                      std::string_view cluster_token = {});

}  // namespace kvstash::transport
