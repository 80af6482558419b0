#include "store/transfer_plan.h"

#include <algorithm>

namespace kvstash::store {

TransferPlan::TransferPlan(TransferOp op, const metadata::Placement& p, std::span<const Node> nodes,
                           std::span<const Slice> slices, std::span<const MemoryHandle* const> handles,
                           std::uint64_t begin, std::uint64_t end, std::uint64_t wave_bytes)
    : op_(op),
      p_(p),
      nodes_(nodes),
      slices_(slices),
      handles_(handles),
      offset_(begin),
      end_(end),
      wave_bytes_(std::max<std::uint64_t>(1, wave_bytes)) {}

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
    const auto n = static_cast<std::size_t>(
        std::min({p_.page_size - in_page, static_cast<std::uint64_t>(slices_[si_].length - soff_),
                  wave_end - offset_}));
    auto* local = static_cast<std::byte*>(slices_[si_].addr) + soff_;
    const std::uint64_t remote = nodes_[ni].pool_base + e.page * p_.page_size + in_page;
    const RemoteMemory* lease = nodes_[ni].lease_of(remote);
    auto& list = by_node[ni];
    if (!list.empty() && list.back().local == handles_[si_] && list.back().remote == lease &&
        static_cast<std::byte*>(list.back().local_addr) + list.back().length == local &&
        list.back().remote_addr + list.back().length == remote) {
      list.back().length += n;
    } else {
      list.push_back({op_, handles_[si_], local, remote, lease, n});
    }
    offset_ += n;
    soff_ += n;
  }
  return std::optional<std::uint64_t>(wave_end);
}

}  // namespace kvstash::store
