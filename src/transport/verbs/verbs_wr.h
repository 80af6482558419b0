// The work-request builder of the verbs datapath: turns one-sided transfer pieces into a chain
// of RDMA WRITE/READ work requests, within the device's limits, without allocating.
//
// - A piece longer than the device's max message size is split.
// - Pieces whose remote ranges follow each other (same rkey, same opcode) share one work
//   request, one SGE per local piece (gather on WRITE, scatter on READ), up to max_sge; a
//   local piece that continues the previous one extends its SGE instead.
// - The chain is linked once and signaled selectively: every `signal_every`-th request and
//   the last, so the send queue can be reclaimed without a completion per request.
//
// Thread safety: one builder per posting thread. Storage is reserved at construction; add()
// and chain() never allocate.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <vector>

namespace kvstash::transport::verbs {

struct WrLimits {
  std::uint32_t max_wrs = 64;          // requests in one chain (bounded by the send queue)
  std::uint32_t max_sge = 16;          // per request (the device's max_sge, or max_sge_rd)
  std::uint64_t max_msg = 1ull << 31;  // bytes per request (the port's max_msg_sz)
};

// One contiguous local range to or from one contiguous remote range.
struct Piece {
  std::uint64_t local_addr = 0;
  std::uint32_t lkey = 0;
  std::uint64_t remote_addr = 0;
  std::uint32_t rkey = 0;
  std::uint64_t length = 0;
};

class WrBuilder {
 public:
  explicit WrBuilder(const WrLimits& limits);

  // Appends `piece` as `op` (IBV_WR_RDMA_WRITE or IBV_WR_RDMA_READ). `id` lands in the wr_id
  // of the requests it ends in (the completion of a signaled request says every piece up to
  // that id is done). Returns false, having added nothing, when the chain has no room: post
  // what was built, reset(), and add again.
  bool add(ibv_wr_opcode op, const Piece& piece, std::uint64_t id);

  // Links the requests and sets IBV_SEND_SIGNALED on every `signal_every`-th and the last.
  // nullptr when empty. Valid until the next add() or reset().
  ibv_send_wr* chain(std::uint32_t signal_every);

  void reset();
  std::uint32_t size() const { return count_; }         // requests built
  std::uint32_t signaled() const { return signaled_; }  // of them, signaled (after chain())
  const ibv_send_wr& request(std::uint32_t i) const { return wrs_[i]; }

 private:
  // Requests and SGEs this piece needs at most (for the all-or-nothing check).
  std::uint32_t requests_needed(std::uint64_t length) const;

  WrLimits limits_;
  std::vector<ibv_send_wr> wrs_;
  std::vector<ibv_sge> sges_;           // max_sge per request, request i owns [i * max_sge, ...)
  std::vector<std::uint64_t> lengths_;  // bytes of each request
  std::uint32_t count_ = 0;
  std::uint32_t signaled_ = 0;
};

}  // namespace kvstash::transport::verbs
