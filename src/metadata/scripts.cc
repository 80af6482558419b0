#include "metadata/scripts.h"

#include <string>
#include <string_view>
#include <utility>

#include "metadata/lua_scripts.h"  // generated from lua/*.lua by embed_lua.py

namespace kvstash::metadata::scripts {
namespace {

// A script is the prelude (lua/prelude.lua: the prefix, Redis's clock, the helpers that keep
// the invariants in one place) followed by its body, so Redis runs, and caches by SHA1, one text
// per script. Built once per script, on first use.
Script make(std::string_view body) {
  std::string text(lua::kPrelude);
  text += body;
  return Script(std::move(text));
}

}  // namespace

// What each script takes (KEYS, ARGV) and returns is the header comment of lua/<name>.lua.

// ---------------------------------------------------------------------------------------
// Nodes

const Script& register_node() {
  static const Script s = make(lua::kRegisterNode);
  return s;
}

const Script& fence_master() {
  static const Script s = make(lua::kFenceMaster);
  return s;
}

const Script& heartbeat() {
  static const Script s = make(lua::kHeartbeat);
  return s;
}

const Script& drain_node() {
  static const Script s = make(lua::kDrainNode);
  return s;
}

const Script& deregister_node() {
  static const Script s = make(lua::kDeregisterNode);
  return s;
}

const Script& node_status() {
  static const Script s = make(lua::kNodeStatus);
  return s;
}

const Script& list_nodes() {
  static const Script s = make(lua::kListNodes);
  return s;
}

const Script& cordon_node() {
  static const Script s = make(lua::kCordonNode);
  return s;
}

const Script& known_nodes() {
  static const Script s = make(lua::kKnownNodes);
  return s;
}

const Script& forget_node() {
  static const Script s = make(lua::kForgetNode);
  return s;
}

const Script& cell_summary() {
  static const Script s = make(lua::kCellSummary);
  return s;
}

const Script& describe_objects() {
  static const Script s = make(lua::kDescribeObjects);
  return s;
}

const Script& evict_lru() {
  static const Script s = make(lua::kEvictLru);
  return s;
}

// ---------------------------------------------------------------------------------------
// Objects

const Script& begin_put() {
  static const Script s = make(lua::kBeginPut);
  return s;
}

const Script& commit_put() {
  static const Script s = make(lua::kCommitPut);
  return s;
}

const Script& abort_put() {
  static const Script s = make(lua::kAbortPut);
  return s;
}

const Script& reserve_pages() {
  static const Script s = make(lua::kReservePages);
  return s;
}

const Script& commit_reserved() {
  static const Script s = make(lua::kCommitReserved);
  return s;
}

const Script& commit_reserveds() {
  static const Script s = make(lua::kCommitReserveds);
  return s;
}

const Script& abort_reserved() {
  static const Script s = make(lua::kAbortReserved);
  return s;
}

const Script& release_reservation() {
  static const Script s = make(lua::kReleaseReservation);
  return s;
}

const Script& begin_get() {
  static const Script s = make(lua::kBeginGet);
  return s;
}

const Script& begin_gets() {
  static const Script s = make(lua::kBeginGets);
  return s;
}

const Script& end_gets() {
  static const Script s = make(lua::kEndGets);
  return s;
}

const Script& stat() {
  static const Script s = make(lua::kStat);
  return s;
}

const Script& remove() {
  static const Script s = make(lua::kRemove);
  return s;
}

const Script& touch() {
  static const Script s = make(lua::kTouch);
  return s;
}

const Script& announce() {
  static const Script s = make(lua::kAnnounce);
  return s;
}

const Script& live_nodes() {
  static const Script s = make(lua::kLiveNodes);
  return s;
}

const Script& grant_pool() {
  static const Script s = make(lua::kGrantPool);
  return s;
}

const Script& publish_handoff() {
  static const Script s = make(lua::kPublishHandoff);
  return s;
}

const Script& end_handoff() {
  static const Script s = make(lua::kEndHandoff);
  return s;
}

const Script& contains_prefix() {
  static const Script s = make(lua::kContainsPrefix);
  return s;
}

const Script& evict() {
  static const Script s = make(lua::kEvict);
  return s;
}

const Script& reclaim() {
  static const Script s = make(lua::kReclaim);
  return s;
}

const Script& set_policy() {
  static const Script s = make(lua::kSetPolicy);
  return s;
}

const Script& set_quota() {
  static const Script s = make(lua::kSetQuota);
  return s;
}

const Script& quota_scan() {
  static const Script s = make(lua::kQuotaScan);
  return s;
}

const Script& list_quotas() {
  static const Script s = make(lua::kListQuotas);
  return s;
}

const Script& begin_write_down() {
  static const Script s = make(lua::kBeginWriteDown);
  return s;
}

const Script& commit_write_down() {
  static const Script s = make(lua::kCommitWriteDown);
  return s;
}

const Script& abort_write_down() {
  static const Script s = make(lua::kAbortWriteDown);
  return s;
}

const Script& begin_promote() {
  static const Script s = make(lua::kBeginPromote);
  return s;
}

const Script& commit_promote() {
  static const Script s = make(lua::kCommitPromote);
  return s;
}

const Script& abort_promote() {
  static const Script s = make(lua::kAbortPromote);
  return s;
}

const Script& recover_tier() {
  static const Script s = make(lua::kRecoverTier);
  return s;
}

std::vector<const Script*> all() {
  return {&register_node(),
          &heartbeat(),
          &drain_node(),
          &deregister_node(),
          &node_status(),
          &list_nodes(),
          &begin_put(),
          &commit_put(),
          &abort_put(),
          &reserve_pages(),
          &commit_reserved(),
          &commit_reserveds(),
          &abort_reserved(),
          &release_reservation(),
          &begin_get(),
          &begin_gets(),
          &end_gets(),
          &stat(),
          &remove(),
          &touch(),
          &contains_prefix(),
          &announce(),
          &live_nodes(),
          &grant_pool(),
          &publish_handoff(),
          &end_handoff(),
          &evict(),
          &reclaim(),
          &cordon_node(),
          &known_nodes(),
          &forget_node(),
          &cell_summary(),
          &describe_objects(),
          &evict_lru(),
          &set_policy(),
          &set_quota(),
          &quota_scan(),
          &list_quotas(),
          &begin_write_down(),
          &commit_write_down(),
          &abort_write_down(),
          &begin_promote(),
          &commit_promote(),
          &abort_promote(),
          &recover_tier()};
}

}  // namespace kvstash::metadata::scripts
