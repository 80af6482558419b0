// UCX's libucp, loaded at run time. kvstash calls the UCP API as usual (<ucp/api/ucp.h>); the
// functions it calls are defined in ucx_library.cc, each one resolved from libucp.so.0 (and its
// libucs) at its first call, so that nothing links UCX and a host without it runs every other
// transport.
#pragma once

#include "common/runtime_library.h"

namespace kvstash::transport::ucx {

// libucp.so.0, opened at the first call. When it is unavailable the ucx transport does not
// start (kUnsupported with error()), `kvstash doctor` says so, and a UCP call that happens
// anyway returns UCS_ERR_UNSUPPORTED (or nothing, for those that return nothing).
const sys::RuntimeLibrary& library();

}  // namespace kvstash::transport::ucx
