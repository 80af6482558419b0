// The shm transport's factory; everything else about it is private to src/transport/shm/.
#pragma once

#include <memory>

#include "kvstash/transfer.h"
#include "transport/transport.h"

namespace kvstash::transport {

// Starts a shm transport. Errors: kUnavailable when it cannot run on this host,
// kPermissionDenied when the socket directory is a symlink or another user's,
// kInvalidArgument when the socket path is too long, kIoError.
Result<std::unique_ptr<Transport>> make_shm_transport(const ShmOptions& options);

}  // namespace kvstash::transport
