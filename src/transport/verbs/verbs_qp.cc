#include "transport/verbs/verbs_qp.h"

#include <algorithm>
#include <cerrno>

namespace kvstash::transport::verbs {

Result<Qp> create_rc_qp(ibv_pd* pd, ibv_cq* cq, const QpConfig& config) {
  ibv_qp_init_attr attr{};
  attr.send_cq = cq;
  attr.recv_cq = cq;
  attr.qp_type = IBV_QPT_RC;
  attr.sq_sig_all = 0;  // selective signaling: the datapath asks for the completions it needs
  attr.cap.max_send_wr = config.max_send_wr;
  attr.cap.max_recv_wr = 1;
  attr.cap.max_send_sge = config.max_send_sge;
  attr.cap.max_recv_sge = 1;
  Qp qp(ibv_create_qp(pd, &attr));
  if (!qp) {
    int e = errno;
    if (e == ENOMEM || e == EINVAL) {
      return Status::no_space("verbs: cannot create an RC QP with " + std::to_string(config.max_send_wr) +
                              " WRs x " + std::to_string(config.max_send_sge) + " SGEs");
    }
    return Status::from_errno("verbs: create QP", e);
  }
  return qp;
}

Status connect_rc_qp(ibv_qp* qp, const Port& port, const Gid& local_gid, std::uint32_t local_psn,
                     const QpEndpoint& remote, const QpConfig& config) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = port.number;
  a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    return Status::from_errno("verbs: QP to INIT", rc);
  }

  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = std::min(port.active_mtu, remote.mtu);
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = config.max_rd_atomic;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = port.number;
  if (port.ethernet) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = remote.gid;
    a.ah_attr.grh.sgid_index = static_cast<std::uint8_t>(local_gid.index);
    a.ah_attr.grh.hop_limit = 64;
  } else {
    a.ah_attr.dlid = remote.lid;
  }
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                 IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
    return Status::from_errno("verbs: QP to RTR", rc);
  }

  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = local_psn;
  a.timeout = config.timeout;
  a.retry_cnt = config.retry_cnt;
  a.rnr_retry = 7;
  a.max_rd_atomic = config.max_rd_atomic;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                 IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC)) {
    return Status::from_errno("verbs: QP to RTS", rc);
  }
  return {};
}

}  // namespace kvstash::transport::verbs
