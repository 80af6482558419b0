// The libibverbs functions kvstash calls, forwarded to libibverbs.so.1 (verbs_library.h). The
// list is what the binaries reference (`nm -D --undefined-only`); a verbs call not listed here
// fails to link, which is how a new one is noticed. Names are parenthesized where verbs.h
// defines a macro of the same name (ibv_reg_mr, ibv_query_port): these are the functions the
// macros call.
#include "transport/verbs/verbs_library.h"

#include <infiniband/verbs.h>

#include <cerrno>

namespace kvstash::transport::verbs {

const sys::RuntimeLibrary& library() {
  static const sys::RuntimeLibrary lib(
      {"libibverbs.so.1"}, "install rdma-core (Debian and Ubuntu: libibverbs1 ibverbs-providers)");
  return lib;
}
}  // namespace kvstash::transport::verbs

// `fail` is what the call returns when the library or the function is missing.
#define KVSTASH_VERBS_CALL(ret, name, fail, params, args)                          \
  extern "C" ret(name) params {                                                    \
    using Fn = ret(*) params;                                                      \
    static const Fn fn = kvstash::transport::verbs::library().function<Fn>(#name); \
    if (fn == nullptr) {                                                           \
      errno = ENOSYS;                                                              \
      return fail;                                                                 \
    }                                                                              \
    return fn args;                                                                \
  }
#define KVSTASH_VERBS_CALL_VOID(name, params, args)                                \
  extern "C" void(name) params {                                                   \
    using Fn = void(*) params;                                                     \
    static const Fn fn = kvstash::transport::verbs::library().function<Fn>(#name); \
    if (fn != nullptr) fn args;                                                    \
  }

KVSTASH_VERBS_CALL(ibv_device**, ibv_get_device_list, nullptr, (int* n), (n))
KVSTASH_VERBS_CALL_VOID(ibv_free_device_list, (ibv_device * *list), (list))
KVSTASH_VERBS_CALL(const char*, ibv_get_device_name, nullptr, (ibv_device * device), (device))
KVSTASH_VERBS_CALL(ibv_context*, ibv_open_device, nullptr, (ibv_device * device), (device))
KVSTASH_VERBS_CALL(int, ibv_close_device, ENOSYS, (ibv_context * context), (context))
KVSTASH_VERBS_CALL(int, ibv_query_device, ENOSYS, (ibv_context * context, ibv_device_attr* attr),
                   (context, attr))
KVSTASH_VERBS_CALL(int, ibv_query_port, ENOSYS,
                   (ibv_context * context, uint8_t port, _compat_ibv_port_attr* attr), (context, port, attr))
KVSTASH_VERBS_CALL(int, _ibv_query_gid_ex, ENOSYS,
                   (ibv_context * context, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                    uint32_t flags, size_t size),
                   (context, port, index, entry, flags, size))
KVSTASH_VERBS_CALL(ibv_pd*, ibv_alloc_pd, nullptr, (ibv_context * context), (context))
KVSTASH_VERBS_CALL(int, ibv_dealloc_pd, ENOSYS, (ibv_pd * pd), (pd))
KVSTASH_VERBS_CALL(ibv_mr*, ibv_reg_mr, nullptr, (ibv_pd * pd, void* addr, size_t length, int access),
                   (pd, addr, length, access))
KVSTASH_VERBS_CALL(ibv_mr*, ibv_reg_mr_iova2, nullptr,
                   (ibv_pd * pd, void* addr, size_t length, uint64_t iova, unsigned int access),
                   (pd, addr, length, iova, access))
KVSTASH_VERBS_CALL(ibv_mr*, ibv_reg_dmabuf_mr, nullptr,
                   (ibv_pd * pd, uint64_t offset, size_t length, uint64_t iova, int fd, int access),
                   (pd, offset, length, iova, fd, access))
KVSTASH_VERBS_CALL(int, ibv_dereg_mr, ENOSYS, (ibv_mr * mr), (mr))
KVSTASH_VERBS_CALL(ibv_comp_channel*, ibv_create_comp_channel, nullptr, (ibv_context * context), (context))
KVSTASH_VERBS_CALL(int, ibv_destroy_comp_channel, ENOSYS, (ibv_comp_channel * channel), (channel))
KVSTASH_VERBS_CALL(ibv_cq*, ibv_create_cq, nullptr,
                   (ibv_context * context, int cqe, void* cq_context, ibv_comp_channel* channel, int vector),
                   (context, cqe, cq_context, channel, vector))
KVSTASH_VERBS_CALL(int, ibv_destroy_cq, ENOSYS, (ibv_cq * cq), (cq))
KVSTASH_VERBS_CALL(int, ibv_get_cq_event, ENOSYS,
                   (ibv_comp_channel * channel, ibv_cq** cq, void** cq_context), (channel, cq, cq_context))
KVSTASH_VERBS_CALL_VOID(ibv_ack_cq_events, (ibv_cq * cq, unsigned int n), (cq, n))
KVSTASH_VERBS_CALL(ibv_qp*, ibv_create_qp, nullptr, (ibv_pd * pd, ibv_qp_init_attr* attr), (pd, attr))
KVSTASH_VERBS_CALL(int, ibv_modify_qp, ENOSYS, (ibv_qp * qp, ibv_qp_attr* attr, int mask), (qp, attr, mask))
KVSTASH_VERBS_CALL(int, ibv_destroy_qp, ENOSYS, (ibv_qp * qp), (qp))
KVSTASH_VERBS_CALL(const char*, ibv_wc_status_str, "libibverbs unavailable", (ibv_wc_status status), (status))
