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

// Objects.
const Script& begin_put();
const Script& commit_put();
const Script& abort_put();
const Script& begin_get();
const Script& end_get();
const Script& stat();
const Script& remove();
const Script& touch();
const Script& contains_prefix();
const Script& evict();
const Script& reclaim();

}  // namespace kvstash::metadata::scripts
