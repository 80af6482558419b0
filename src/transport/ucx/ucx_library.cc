// The UCP and UCS functions kvstash calls, forwarded to libucp.so.0 (ucx_library.h). The list is
// what the binaries reference (`nm -D --undefined-only`); a UCX call not listed here fails to
// link, which is how a new one is noticed. ucp_init is an inline that calls ucp_init_version.
#include "transport/ucx/ucx_library.h"

#include <ucp/api/ucp.h>

#include <cstdio>

namespace kvstash::transport::ucx {

const sys::RuntimeLibrary& library() {
  static const sys::RuntimeLibrary lib({"libucp.so.0"}, "install UCX (Debian and Ubuntu: libucx0)");
  return lib;
}
}  // namespace kvstash::transport::ucx

// `fail` is what the call returns when the library or the function is missing.
#define KVSTASH_UCX_CALL(ret, name, fail, params, args)                          \
  extern "C" ret name params {                                                   \
    using Fn = ret(*) params;                                                    \
    static const Fn fn = kvstash::transport::ucx::library().function<Fn>(#name); \
    return fn != nullptr ? fn args : (fail);                                     \
  }
#define KVSTASH_UCX_CALL_VOID(name, params, args)                                \
  extern "C" void name params {                                                  \
    using Fn = void(*) params;                                                   \
    static const Fn fn = kvstash::transport::ucx::library().function<Fn>(#name); \
    if (fn != nullptr) fn args;                                                  \
  }

namespace {
constexpr ucs_status_t kMissing = UCS_ERR_UNSUPPORTED;
const ucs_status_ptr_t kMissingPtr = UCS_STATUS_PTR(UCS_ERR_UNSUPPORTED);
}  // namespace

KVSTASH_UCX_CALL_VOID(ucp_get_version, (unsigned* major, unsigned* minor, unsigned* release),
                      (major, minor, release))
KVSTASH_UCX_CALL(const char*, ucs_status_string, "UCX unavailable", (ucs_status_t status), (status))
KVSTASH_UCX_CALL(ucs_status_t, ucp_config_read, kMissing,
                 (const char* prefix, const char* file, ucp_config_t** config), (prefix, file, config))
KVSTASH_UCX_CALL(ucs_status_t, ucp_config_modify, kMissing,
                 (ucp_config_t * config, const char* name, const char* value), (config, name, value))
KVSTASH_UCX_CALL_VOID(ucp_config_release, (ucp_config_t * config), (config))
KVSTASH_UCX_CALL(ucs_status_t, ucp_init_version, kMissing,
                 (unsigned major, unsigned minor, const ucp_params_t* params, const ucp_config_t* config,
                  ucp_context_h* context),
                 (major, minor, params, config, context))
KVSTASH_UCX_CALL_VOID(ucp_cleanup, (ucp_context_h context), (context))
KVSTASH_UCX_CALL(ucs_status_t, ucp_context_query, kMissing, (ucp_context_h context, ucp_context_attr_t* attr),
                 (context, attr))
KVSTASH_UCX_CALL_VOID(ucp_context_print_info, (const ucp_context_h context, FILE* stream), (context, stream))
KVSTASH_UCX_CALL(ucs_status_t, ucp_worker_create, kMissing,
                 (ucp_context_h context, const ucp_worker_params_t* params, ucp_worker_h* worker),
                 (context, params, worker))
KVSTASH_UCX_CALL_VOID(ucp_worker_destroy, (ucp_worker_h worker), (worker))
KVSTASH_UCX_CALL(ucs_status_t, ucp_worker_get_address, kMissing,
                 (ucp_worker_h worker, ucp_address_t** address, size_t* length), (worker, address, length))
KVSTASH_UCX_CALL_VOID(ucp_worker_release_address, (ucp_worker_h worker, ucp_address_t* address),
                      (worker, address))
KVSTASH_UCX_CALL(ucs_status_t, ucp_worker_get_efd, kMissing, (ucp_worker_h worker, int* fd), (worker, fd))
KVSTASH_UCX_CALL(ucs_status_t, ucp_worker_arm, kMissing, (ucp_worker_h worker), (worker))
KVSTASH_UCX_CALL(unsigned, ucp_worker_progress, 0u, (ucp_worker_h worker), (worker))
KVSTASH_UCX_CALL(ucs_status_t, ucp_ep_create, kMissing,
                 (ucp_worker_h worker, const ucp_ep_params_t* params, ucp_ep_h* ep), (worker, params, ep))
KVSTASH_UCX_CALL(ucs_status_ptr_t, ucp_ep_close_nbx, kMissingPtr,
                 (ucp_ep_h ep, const ucp_request_param_t* param), (ep, param))
KVSTASH_UCX_CALL(ucs_status_ptr_t, ucp_ep_flush_nbx, kMissingPtr,
                 (ucp_ep_h ep, const ucp_request_param_t* param), (ep, param))
KVSTASH_UCX_CALL_VOID(ucp_ep_print_info, (ucp_ep_h ep, FILE* stream), (ep, stream))
KVSTASH_UCX_CALL(ucs_status_t, ucp_ep_rkey_unpack, kMissing,
                 (ucp_ep_h ep, const void* buffer, ucp_rkey_h* rkey), (ep, buffer, rkey))
KVSTASH_UCX_CALL_VOID(ucp_rkey_destroy, (ucp_rkey_h rkey), (rkey))
KVSTASH_UCX_CALL(ucs_status_t, ucp_mem_map, kMissing,
                 (ucp_context_h context, const ucp_mem_map_params_t* params, ucp_mem_h* memh),
                 (context, params, memh))
KVSTASH_UCX_CALL(ucs_status_t, ucp_mem_unmap, kMissing, (ucp_context_h context, ucp_mem_h memh),
                 (context, memh))
KVSTASH_UCX_CALL(ucs_status_t, ucp_rkey_pack, kMissing,
                 (ucp_context_h context, ucp_mem_h memh, void** buffer, size_t* size),
                 (context, memh, buffer, size))
KVSTASH_UCX_CALL_VOID(ucp_rkey_buffer_release, (void* buffer), (buffer))
KVSTASH_UCX_CALL(ucs_status_ptr_t, ucp_put_nbx, kMissingPtr,
                 (ucp_ep_h ep, const void* buffer, size_t count, uint64_t remote, ucp_rkey_h rkey,
                  const ucp_request_param_t* param),
                 (ep, buffer, count, remote, rkey, param))
KVSTASH_UCX_CALL(ucs_status_ptr_t, ucp_get_nbx, kMissingPtr,
                 (ucp_ep_h ep, void* buffer, size_t count, uint64_t remote, ucp_rkey_h rkey,
                  const ucp_request_param_t* param),
                 (ep, buffer, count, remote, rkey, param))
KVSTASH_UCX_CALL_VOID(ucp_request_free, (void* request), (request))
