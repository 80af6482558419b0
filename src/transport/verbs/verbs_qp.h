// Reliable-connected queue pairs: creation and the INIT -> RTR -> RTS walk, given what the two
// sides exchanged (QPN, PSN, GID or LID, MTU). Control path.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>

#include "kvstash/status.h"
#include "transport/verbs/verbs_device.h"

namespace kvstash::transport::verbs {

// What one side of a connection tells the other.
struct QpEndpoint {
  std::uint32_t qpn = 0;
  std::uint32_t psn = 0;  // the first PSN this side sends with
  ibv_gid gid{};          // RoCE (and IB across subnets)
  std::uint16_t lid = 0;  // InfiniBand
  ibv_mtu mtu = IBV_MTU_1024;
};

struct QpConfig {
  std::uint32_t max_send_wr = 256;
  std::uint32_t max_send_sge = 16;
  // READs this side keeps in flight, and accepts in flight from the peer (both bounded by
  // the device's max_qp_rd_atom).
  std::uint8_t max_rd_atomic = 16;
  // Transport retries (x 4.096 us x 2^timeout) before a request fails with RETRY_EXC_ERR: a
  // dead peer is noticed within about timeout x retry_cnt.
  std::uint8_t timeout = 14;  // ~67 ms
  std::uint8_t retry_cnt = 7;
};

// An RC QP on `pd` whose send and receive completions go to `cq`. Errors: kNoSpace (the
// device's limits), kIoError.
Result<Qp> create_rc_qp(ibv_pd* pd, ibv_cq* cq, const QpConfig& config);

// RESET -> INIT (remote READ and WRITE allowed) -> RTR (toward `remote`) -> RTS.
// `local_gid`: the GID this side sends from (RoCE: pick_gid). The path MTU is the smaller of
// both sides'. Errors: kIoError naming the state that failed.
Status connect_rc_qp(ibv_qp* qp, const Port& port, const Gid& local_gid, std::uint32_t local_psn,
                     const QpEndpoint& remote, const QpConfig& config);

}  // namespace kvstash::transport::verbs
