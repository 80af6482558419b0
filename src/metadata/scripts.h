// The Lua scripts of the metadata plane, one per change (docs/metadata.md). Each script gets
// the cell's key prefix as KEYS[1] and everything else in ARGV; every key it touches starts
// with that prefix, so all of them share one hash tag.
#pragma once

#include "metadata/redis_client.h"

namespace kvstash::metadata::scripts {

// Nodes.
const Script& register_node();
const Script& heartbeat();
const Script& drain_node();
const Script& deregister_node();
const Script& node_status();
const Script& list_nodes();
const Script& fence_master();

// Objects.
const Script& begin_put();
const Script& commit_put();
const Script& abort_put();
const Script& reserve_pages();
const Script& commit_reserved();
const Script& commit_reserveds();
const Script& abort_reserved();
const Script& release_reservation();
const Script& begin_get();
const Script& begin_gets();
const Script& end_gets();
const Script& stat();
const Script& remove();
const Script& touch();
const Script& contains_prefix();
const Script& announce();  // KV events (docs/events.md)
const Script& live_nodes();
const Script& grant_pool();
const Script& publish_handoff();
const Script& end_handoff();
const Script& evict();
const Script& reclaim();

// Administration (the kvstash CLI).
const Script& cordon_node();
const Script& known_nodes();
const Script& forget_node();
const Script& cell_summary();
const Script& describe_objects();
const Script& evict_lru();
const Script& set_policy();

// Quotas per key prefix (quotas.h).
const Script& set_quota();
const Script& quota_scan();
const Script& list_quotas();

// The NVMe tier (tier_catalog.h).
const Script& begin_write_down();
const Script& commit_write_down();
const Script& abort_write_down();
const Script& recover_tier();
const Script& begin_promote();
const Script& commit_promote();
const Script& abort_promote();

// The function library every script above is a function of (kvstash doctor asks Redis for it).
const FunctionLibrary& library();

}  // namespace kvstash::metadata::scripts
