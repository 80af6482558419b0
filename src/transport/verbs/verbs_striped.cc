// Several devices: one connection to a peer is a lane (queue pair, CQ, poller) per device
// pair, and the engine's slices of a large op go round-robin over the lanes. This endpoint
// only routes: each lane is a whole VerbsEndpoint, keys and leases are made on every lane
// (a type-2B window is bound to one queue pair, so a lease is one window set per lane, all
// under the same lease id), and a revoke goes through one lane. An op whose local memory
// prefers some devices (GPU memory: the NICs nearest its GPU) goes to the lanes on those.
#include <algorithm>

#include "transport/verbs/verbs_internal.h"

namespace kvstash::transport::verbs {
namespace {

// A key (or lease) as every lane uses it, in lane order.
class StripedKey final : public RemoteKey {
 public:
  std::vector<std::unique_ptr<RemoteKey>> lanes;
};

class StripedEndpoint final : public Endpoint {
 public:
  explicit StripedEndpoint(std::vector<std::shared_ptr<VerbsEndpoint>> lanes) : lanes_(std::move(lanes)) {
    for (const auto& lane : lanes_) lane_devices_.push_back(lane->device_index());
  }

  Result<std::unique_ptr<RemoteKey>> import_key(std::uint64_t base, std::uint64_t length,
                                                std::string_view packed, Deadline deadline) override {
    auto key = std::make_unique<StripedKey>();
    key->base = base;
    key->length = length;
    for (const auto& lane : lanes_) {
      KVSTASH_ASSIGN_OR_RETURN(auto k, lane->import_key(base, length, packed, deadline));
      key->lanes.push_back(std::move(k));
    }
    return std::unique_ptr<RemoteKey>(std::move(key));
  }

  Result<std::unique_ptr<RemoteKey>> lease_key(const RemoteKey& region, std::span<const RemoteRange> ranges,
                                               const LeaseTerms& terms, Deadline deadline) override {
    const auto& striped = static_cast<const StripedKey&>(region);
    auto key = std::make_unique<StripedKey>();
    key->base = region.base;
    key->length = region.length;
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      KVSTASH_ASSIGN_OR_RETURN(auto k, lanes_[i]->lease_key(*striped.lanes[i], ranges, terms, deadline));
      key->lanes.push_back(std::move(k));
    }
    return std::unique_ptr<RemoteKey>(std::move(key));
  }

  // Every lane leads to the same target, which ends the lease id on every connection it
  // accepted (all lanes, and any that broke) before it confirms: one lane's confirmation covers
  // them all. Another lane is asked only when one cannot confirm. `key` may be the key of an
  // earlier connection (the engine revokes through the current one): only the id counts.
  Status revoke(const RemoteKey& key, const LeaseTerms& terms, Deadline deadline) override {
    Status last = Status::unavailable("verbs: no lane to revoke the lease through");
    for (const auto& lane : lanes_) {
      last = lane->revoke(key, terms, deadline);
      if (last.is_ok() || Clock::now() >= deadline) return last;
    }
    return last;
  }

  void post(std::span<const Op> ops) override {
    // Per-thread scratch: posting allocates nothing once it has grown.
    thread_local std::vector<std::vector<Op>> by_lane;
    if (by_lane.size() < lanes_.size()) by_lane.resize(lanes_.size());
    for (const Op& op : ops) {
      const auto* reg = dynamic_cast<const Registration*>(op.local_reg);
      const std::size_t lane =
          pick_lane(lane_devices_, reg != nullptr ? reg->preferred_devices() : 0, op.lane);
      Op o = op;
      if (o.remote_key != nullptr)
        o.remote_key = static_cast<const StripedKey*>(op.remote_key)->lanes[lane].get();
      by_lane[lane].push_back(o);
    }
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      if (by_lane[i].empty()) continue;
      lanes_[i]->post(by_lane[i]);
      by_lane[i].clear();
    }
  }

  void abort(CompletionSink* sink, const Status& reason) override {
    for (const auto& lane : lanes_) lane->abort(sink, reason);
  }

  // One lane down makes the connection unhealthy: the engine reconnects every lane.
  bool healthy() const override {
    return std::all_of(lanes_.begin(), lanes_.end(), [](const auto& lane) { return lane->healthy(); });
  }

 private:
  std::vector<std::shared_ptr<VerbsEndpoint>> lanes_;
  std::vector<std::size_t> lane_devices_;  // lane i runs on the transport's device lane_devices_[i]
};

}  // namespace

std::shared_ptr<Endpoint> make_striped_endpoint(std::vector<std::shared_ptr<VerbsEndpoint>> lanes) {
  return std::make_shared<StripedEndpoint>(std::move(lanes));
}

}  // namespace kvstash::transport::verbs
