// The verbs transport's factory; everything else about it is private to src/transport/verbs/.
#pragma once

#include <memory>

#include "kvstash/transfer.h"
#include "transport/transport.h"

namespace kvstash::transport {

// Starts a verbs transport on the first usable RDMA port. With a `cluster_token` every
// queue-pair setup proves it both ways (EngineOptions::cluster_token). Errors: kUnsupported
// when this host has no RDMA device with an active port (the engine then leaves verbs out
// quietly), kUnavailable (the setup listener cannot bind), kIoError.
Result<std::unique_ptr<Transport>> make_verbs_transport(const VerbsOptions& options,
                                                        std::string cluster_token = {});

}  // namespace kvstash::transport
