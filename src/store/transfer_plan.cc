#include "store/transfer_plan.h"

#include <algorithm>

#include "common/checksum_core.h"

namespace kvstash::store {

TransferPlan::TransferPlan(TransferOp op, const metadata::Placement& p, std::span<const Node> nodes,
                           std::span<const Slice> slices, std::span<const MemoryHandle* const> handles,
                           std::uint64_t begin, std::uint64_t end, std::uint64_t wave_bytes,
                           std::uint64_t* digests)
    : op_(op),
      p_(p),
      nodes_(nodes),
      slices_(slices),
      handles_(handles),
      offset_(begin),
      end_(end),
      wave_bytes_(std::max<std::uint64_t>(1, wave_bytes)),
      begin_(begin),
      digests_(digests) {}

std::size_t TransferPlan::node_index(const std::string& id) const {
  for (std::size_t i = 0; i < p_.nodes.size(); ++i) {
    if (p_.nodes[i].id == id) return i;
  }
  return p_.nodes.size();
}

Result<std::optional<std::uint64_t>> TransferPlan::next(std::vector<std::vector<TransferEntry>>& by_node) {
  if (offset_ >= end_) return std::optional<std::uint64_t>();
  by_node.resize(p_.nodes.size());
  for (auto& list : by_node) list.clear();
  const std::uint64_t wave_end = std::min(end_, (offset_ / wave_bytes_ + 1) * wave_bytes_);
  while (offset_ < wave_end) {
    while (slices_[si_].length == soff_) ++si_, soff_ = 0;
    const metadata::Extent& e = p_.extents[offset_ / p_.page_size];
    const std::size_t ni = node_index(e.node);
    if (ni >= nodes_.size()) {
      return Status::corrupt("store: page " + std::to_string(offset_ / p_.page_size) +
                             " of the object is on node " + e.node + ", which its placement does not list");
    }
    const std::uint64_t in_page = offset_ % p_.page_size;
    auto n = static_cast<std::size_t>(
        std::min({p_.page_size - in_page, static_cast<std::uint64_t>(slices_[si_].length - soff_),
                  wave_end - offset_}));
    // Where the node's transport digests writes, a piece that starts inside a block ends at
    // the block's end: the whole blocks after it start an entry that carries their digests.
    const bool digesting = digests_ != nullptr && nodes_[ni].digests;
    const std::uint64_t in_block = offset_ % sum::kBlockBytes;
    if (digesting && in_block != 0)
      n = static_cast<std::size_t>(std::min<std::uint64_t>(n, sum::kBlockBytes - in_block));
    auto* local = static_cast<std::byte*>(slices_[si_].addr) + soff_;
    const std::uint64_t remote = nodes_[ni].pool_base + e.page * p_.page_size + in_page;
    const RemoteMemory* lease = nodes_[ni].lease_of(remote);
    auto& list = by_node[ni];
    if (!list.empty() && list.back().local == handles_[si_] && list.back().remote == lease &&
        static_cast<std::byte*>(list.back().local_addr) + list.back().length == local &&
        list.back().remote_addr + list.back().length == remote &&
        !(digesting && in_block == 0 && list.back().block_digests == nullptr)) {
      list.back().length += n;
    } else {
      list.push_back({op_, handles_[si_], local, remote, lease, n});
      if (digesting && in_block == 0) {
        list.back().block_digests = digests_ + (offset_ - begin_) / sum::kBlockBytes;
      }
    }
    offset_ += n;
    soff_ += n;
  }
  if (digests_ != nullptr) settle_digests(by_node);
  return std::optional<std::uint64_t>(wave_end);
}

void TransferPlan::settle_digests(std::vector<std::vector<TransferEntry>>& by_node) {
  for (auto& list : by_node) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      TransferEntry& e = list[i];
      if (e.block_digests == nullptr) continue;
      const std::uint64_t from =
          begin_ + static_cast<std::uint64_t>(e.block_digests - digests_) * sum::kBlockBytes;
      const std::uint64_t to = from + e.length;
      const std::uint64_t whole = to == end_ ? to : to / sum::kBlockBytes * sum::kBlockBytes;
      if (whole == from) {
        e.block_digests = nullptr;  // less than a block: the caller digests it
        continue;
      }
      if (whole < to) {  // the short tail travels as an entry of its own, undigested
        TransferEntry tail = e;
        tail.local_addr = static_cast<std::byte*>(e.local_addr) + (whole - from);
        tail.remote_addr = e.remote_addr + (whole - from);
        tail.length = to - whole;
        tail.block_digests = nullptr;
        e.length = whole - from;
        list.insert(list.begin() + static_cast<std::ptrdiff_t>(i) + 1, tail);
      }
      digested_.emplace_back(from, whole);
    }
  }
}

}  // namespace kvstash::store
