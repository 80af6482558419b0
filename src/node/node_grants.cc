#include "node/node_grants.h"

#include <algorithm>

#include "common/grant.h"
#include "common/ranges.h"

namespace kvstash::node {

NodeGrants::NodeGrants(std::string id, std::uint64_t base, std::uint64_t page_size, std::uint64_t page_count)
    : id_(std::move(id)), base_(base), page_size_(page_size), page_count_(page_count) {}

std::string NodeGrants::rotate(const std::string& epoch) {
  std::lock_guard lock(mu_);
  key_ = grant::new_key();
  epoch_ = epoch;
  return grant::hex(key_);
}

Result<Grant> NodeGrants::check(std::string_view text) const {
  if (text.empty())
    return Status::permission_denied("the node serves leases only under a grant of its cell; none came");
  grant::Terms t;
  {
    std::lock_guard lock(mu_);
    if (key_.empty()) return Status::permission_denied("the node has not joined its cell yet");
    KVSTASH_ASSIGN_OR_RETURN(t, grant::verify(key_, text));
    if (t.issuer != id_) return Status::permission_denied("a grant for node " + t.issuer + ", not this one");
    if (t.epoch != epoch_) {
      return Status::permission_denied("a grant for an earlier registration of this node (epoch " + t.epoch +
                                       ")");
    }
  }
  Grant g;
  g.op = t.op;
  g.fence = t.deadline;
  if (t.whole) {
    g.ranges.push_back({base_, page_count_ * page_size_});
    return g;
  }
  for (const auto& [first, count] : t.runs) {
    if (first >= page_count_ || count > page_count_ - first) {
      return Status::permission_denied("a grant past the node's " + std::to_string(page_count_) + " pages");
    }
    g.ranges.push_back({base_ + first * page_size_, count * page_size_});
  }
  rangeset::merge(g.ranges);
  return g;
}

}  // namespace kvstash::node
