// Several devices: one connection to a peer is a lane (queue pair, CQ, poller) per device
// pair, and the engine's slices of a large op go round-robin over the lanes. This endpoint
// only routes: each lane is a whole VerbsEndpoint, keys and leases are made on every lane
// (a type-2B window is bound to one queue pair, so a lease is one window set per lane, all
// under the same lease id), and a revoke goes through one lane. An op whose local memory
// prefers some devices (GPU memory: the NICs nearest its GPU) goes to the lanes on those. GPU
// memory is registered only on those NICs, at either end: a peer's key for it is valid on the
// lanes to the peer's nearest devices only, and ops on it go to those lanes alone.
#include <algorithm>

#include "transport/verbs/verbs_gpu.h"
#include "transport/verbs/verbs_internal.h"

namespace kvstash::transport::verbs {
namespace {

// A key (or lease) as every lane uses it, in lane order; nullptr on a lane whose device pair the
// peer did not register the region on (GPU memory, registered on the NICs nearest its GPU only).
class StripedKey final : public RemoteKey {
 public:
  std::vector<std::unique_ptr<RemoteKey>> lanes;
  bool every_lane = true;   // no lane is nullptr
  std::uint64_t keyed = 0;  // bit i: lanes[i] is a key (the first 64 lanes)
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
    Status missing;
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      auto k = lanes_[i]->import_key(base, length, packed, deadline);
      if (k.is_ok()) {
        if (i < 64) key->keyed |= std::uint64_t{1} << i;
        key->lanes.push_back(std::move(k).value());
        continue;
      }
      // kUnsupported: the peer did not register the region on this lane's device (GPU memory).
      if (k.status().code() != StatusCode::kUnsupported) return k.status();
      if (missing.is_ok()) missing = k.status();
      key->every_lane = false;
      key->lanes.push_back(nullptr);
    }
    if (!key->every_lane && key->keyed == 0) return missing;  // no lane reaches it
    return std::unique_ptr<RemoteKey>(std::move(key));
  }

  Result<std::unique_ptr<RemoteKey>> lease_key(const RemoteKey& region, std::span<const RemoteRange> ranges,
                                               const LeaseTerms& terms, Deadline deadline) override {
    const auto& striped = static_cast<const StripedKey&>(region);
    auto key = std::make_unique<StripedKey>();
    key->base = region.base;
    key->length = region.length;
    key->every_lane = striped.every_lane;
    key->keyed = striped.keyed;
    for (std::size_t i = 0; i < lanes_.size(); ++i) {
      if (striped.lanes[i] == nullptr) {  // the region cannot be reached through this lane
        key->lanes.push_back(nullptr);
        continue;
      }
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
      const auto* key = static_cast<const StripedKey*>(op.remote_key);
      const std::uint64_t preferred = reg != nullptr ? reg->preferred_devices() : 0;
      // Only lanes the peer's key is valid on; among those, the ones on our devices nearest the
      // local GPU memory. Were local memory registered on none of the lanes left, the lane's
      // datapath finds no MR for it there and fails the op, naming why, instead of posting it.
      const std::size_t lane = key == nullptr || key->every_lane
                                   ? pick_lane(lane_devices_, preferred, op.lane)
                                   : pick_keyed_lane(lane_devices_, preferred, key->keyed, op.lane);
      Op o = op;
      if (key != nullptr) o.remote_key = key->lanes[lane].get();
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
