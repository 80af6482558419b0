// A memory node's grant check: the leases it serves must carry a grant its cell signed with
// the key the node handed it at its latest registration (kvstash/grant.h, src/common/grant.h).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kvstash/grant.h"

namespace kvstash::node {

class NodeGrants final : public GrantCheck {
 public:
  NodeGrants(std::string id, std::uint64_t base, std::uint64_t page_size, std::uint64_t page_count);

  // A fresh key for the incarnation `epoch`, in hex for its registration: grants signed for
  // an earlier one stop verifying at once.
  std::string rotate(const std::string& epoch);

  // The pool ranges of a grant for this node's current incarnation (pages to addresses).
  Result<Grant> check(std::string_view grant) const override;

 private:
  const std::string id_;
  const std::uint64_t base_, page_size_, page_count_;
  mutable std::mutex mu_;
  std::vector<std::uint8_t> key_;  // mu_
  std::string epoch_;              // mu_
};

}  // namespace kvstash::node
