// rdma-core's libibverbs, loaded at run time. kvstash calls the verbs API as usual
// (<infiniband/verbs.h>); the functions it calls are defined in verbs_library.cc, each one
// resolved from libibverbs.so.1 at its first call, so that nothing links libibverbs and a host
// without rdma-core runs every other transport. Inline verbs (posting, polling) go through the
// device's own function table and need nothing from here.
#pragma once

#include "common/runtime_library.h"

namespace kvstash::transport::verbs {

// libibverbs.so.1, opened at the first call. When it is unavailable the verbs transport does
// not start (kUnsupported with error()), `kvstash doctor` says so, and a verbs call that
// happens anyway fails as the library would (nullptr or an errno value, errno ENOSYS).
const sys::RuntimeLibrary& library();

}  // namespace kvstash::transport::verbs
