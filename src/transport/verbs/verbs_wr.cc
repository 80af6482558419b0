#include "transport/verbs/verbs_wr.h"

#include <algorithm>

namespace kvstash::transport::verbs {
namespace {

// An SGE's length is 32 bits; keep every request and SGE well inside it.
constexpr std::uint64_t kMaxSgeBytes = 1ull << 31;

}  // namespace

WrBuilder::WrBuilder(const WrLimits& limits) : limits_(limits) {
  limits_.max_wrs = std::max<std::uint32_t>(1, limits_.max_wrs);
  limits_.max_sge = std::max<std::uint32_t>(1, limits_.max_sge);
  limits_.max_msg = std::clamp<std::uint64_t>(limits_.max_msg, 1, kMaxSgeBytes);
  wrs_.resize(limits_.max_wrs);
  sges_.resize(static_cast<std::size_t>(limits_.max_wrs) * limits_.max_sge);
  lengths_.resize(limits_.max_wrs);
}

void WrBuilder::reset() {
  count_ = 0;
  signaled_ = 0;
}

std::uint32_t WrBuilder::requests_needed(std::uint64_t length) const {
  return static_cast<std::uint32_t>((length + limits_.max_msg - 1) / limits_.max_msg);
}

bool WrBuilder::add(ibv_wr_opcode op, const Piece& piece, std::uint64_t id) {
  if (piece.length == 0) return true;
  // All or nothing: the worst case takes one new request per max_msg bytes.
  if (count_ + requests_needed(piece.length) > limits_.max_wrs) {
    // It may still fit whole into the last request (same remote run, an SGE to extend or
    // one left); anything else is refused before touching the chain.
    bool fits_last = false;
    if (count_ > 0) {
      const ibv_send_wr& last = wrs_[count_ - 1];
      const ibv_sge& sge = last.sg_list[last.num_sge - 1];
      const bool extends = sge.lkey == piece.lkey && sge.addr + sge.length == piece.local_addr;
      fits_last = last.opcode == op && last.wr.rdma.rkey == piece.rkey &&
                  last.wr.rdma.remote_addr + lengths_[count_ - 1] == piece.remote_addr &&
                  lengths_[count_ - 1] + piece.length <= limits_.max_msg &&
                  (extends || static_cast<std::uint32_t>(last.num_sge) < limits_.max_sge);
    }
    if (!fits_last) return false;
  }

  std::uint64_t done = 0;
  while (done < piece.length) {
    const std::uint64_t local = piece.local_addr + done;
    const std::uint64_t remote = piece.remote_addr + done;
    std::uint64_t left = piece.length - done;

    if (count_ > 0) {
      ibv_send_wr& last = wrs_[count_ - 1];
      std::uint64_t& last_len = lengths_[count_ - 1];
      const bool follows = last.opcode == op && last.wr.rdma.rkey == piece.rkey &&
                           last.wr.rdma.remote_addr + last_len == remote && last_len < limits_.max_msg;
      if (follows) {
        const std::uint64_t room = limits_.max_msg - last_len;
        const std::uint64_t n = std::min(left, room);
        ibv_sge& sge = last.sg_list[last.num_sge - 1];
        if (sge.lkey == piece.lkey && sge.addr + sge.length == local) {
          sge.length += static_cast<std::uint32_t>(n);  // the local range continues too
          last_len += n;
          done += n;
          continue;
        }
        if (static_cast<std::uint32_t>(last.num_sge) < limits_.max_sge) {
          last.sg_list[last.num_sge++] = {local, static_cast<std::uint32_t>(n), piece.lkey};
          last_len += n;
          last.wr_id = id;
          done += n;
          continue;
        }
      }
    }

    // A new request.
    ibv_send_wr& wr = wrs_[count_];
    wr = {};
    wr.wr_id = id;
    wr.opcode = op;
    wr.sg_list = &sges_[static_cast<std::size_t>(count_) * limits_.max_sge];
    const std::uint64_t n = std::min(left, limits_.max_msg);
    wr.sg_list[0] = {local, static_cast<std::uint32_t>(n), piece.lkey};
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = remote;
    wr.wr.rdma.rkey = piece.rkey;
    lengths_[count_] = n;
    ++count_;
    done += n;
  }
  wrs_[count_ - 1].wr_id = id;
  return true;
}

ibv_send_wr* WrBuilder::chain(std::uint32_t signal_every) {
  if (count_ == 0) return nullptr;
  signaled_ = 0;
  const std::uint32_t every = std::max<std::uint32_t>(1, signal_every);
  for (std::uint32_t i = 0; i < count_; ++i) {
    ibv_send_wr& wr = wrs_[i];
    wr.next = i + 1 < count_ ? &wrs_[i + 1] : nullptr;
    const bool signal = (i + 1) % every == 0 || i + 1 == count_;
    wr.send_flags = signal ? IBV_SEND_SIGNALED : 0;
    signaled_ += signal;
  }
  return &wrs_[0];
}

}  // namespace kvstash::transport::verbs
