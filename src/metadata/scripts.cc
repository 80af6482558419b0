#include "metadata/scripts.h"

#include <algorithm>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "metadata/lua_scripts.h"  // generated from lua/*.lua by embed_lua.py

namespace kvstash::metadata::scripts {
namespace {

// A script: its name, its body (what each takes and returns is the header comment of
// lua/<name>.lua), and whether it only reads (a function flagged no-writes runs on a master
// that refuses writes, NOREPLICAS: kvstash status keeps working while a failover settles).
struct Body {
  std::string_view name;
  std::string_view text;
  bool reads_only;
};

// Every script of the cell (a function-local table: built at first use, never in a static
// initializer, as the lua:: constants' users may be).
std::span<const Body> bodies() {
  static const Body all[] = {
      {"register_node", lua::kRegisterNode, false},
      {"fence_master", lua::kFenceMaster, false},
      {"heartbeat", lua::kHeartbeat, false},
      {"drain_node", lua::kDrainNode, false},
      {"deregister_node", lua::kDeregisterNode, false},
      {"node_status", lua::kNodeStatus, true},
      {"list_nodes", lua::kListNodes, true},
      {"cordon_node", lua::kCordonNode, false},
      {"known_nodes", lua::kKnownNodes, true},
      {"forget_node", lua::kForgetNode, false},
      {"cell_summary", lua::kCellSummary, true},
      {"describe_objects", lua::kDescribeObjects, true},
      {"evict_lru", lua::kEvictLru, false},
      {"begin_put", lua::kBeginPut, false},
      {"commit_put", lua::kCommitPut, false},
      {"abort_put", lua::kAbortPut, false},
      {"reserve_pages", lua::kReservePages, false},
      {"commit_reserved", lua::kCommitReserved, false},
      {"commit_reserveds", lua::kCommitReserveds, false},
      {"abort_reserved", lua::kAbortReserved, false},
      {"release_reservation", lua::kReleaseReservation, false},
      {"begin_get", lua::kBeginGet, false},
      {"begin_gets", lua::kBeginGets, false},
      {"end_gets", lua::kEndGets, false},
      {"stat", lua::kStat, false},
      {"remove", lua::kRemove, false},
      {"touch", lua::kTouch, false},
      {"announce", lua::kAnnounce, false},
      {"live_nodes", lua::kLiveNodes, true},
      {"grant_pool", lua::kGrantPool, false},
      {"publish_handoff", lua::kPublishHandoff, false},
      {"end_handoff", lua::kEndHandoff, false},
      {"contains_prefix", lua::kContainsPrefix, false},
      {"evict", lua::kEvict, false},
      {"reclaim", lua::kReclaim, false},
      {"set_policy", lua::kSetPolicy, false},
      {"set_quota", lua::kSetQuota, false},
      {"quota_scan", lua::kQuotaScan, false},
      {"list_quotas", lua::kListQuotas, true},
      {"begin_write_down", lua::kBeginWriteDown, false},
      {"commit_write_down", lua::kCommitWriteDown, false},
      {"abort_write_down", lua::kAbortWriteDown, false},
      {"begin_promote", lua::kBeginPromote, false},
      {"commit_promote", lua::kCommitPromote, false},
      {"abort_promote", lua::kAbortPromote, false},
      {"recover_tier", lua::kRecoverTier, false},
  };
  return all;
}

constexpr std::string_view kLibraryPrefix = "kvstash_";

// This build's function library: the prelude once, then a function per body, `<name>_<tag>`,
// that calls enter first; the tag is the first 16 hex digits of the SHA1 of its text.
const FunctionLibrary& the_library() {
  static const FunctionLibrary lib = [] {
    std::string functions(lua::kPrelude);
    for (const Body& b : bodies()) {
      functions.append("redis.register_function{function_name='").append(b.name).append("_@', ");
      functions.append("callback=function(keys, args)\nenter(keys, args)\n").append(b.text).append("\nend");
      if (b.reads_only) functions.append(", flags={'no-writes'}");
      functions.append("}\n");
    }
    const std::string tag = Script(functions).sha.substr(0, 16);
    for (auto at = functions.find("_@'"); at != std::string::npos; at = functions.find("_@'", at)) {
      functions.replace(at + 1, 1, tag);
    }
    const std::string name = std::string(kLibraryPrefix) + tag;
    return FunctionLibrary{name, "#!lua name=" + name + "\n" + functions};
  }();
  return lib;
}

// Script `name`: its function in the library, and its EVAL text (the prelude, enter, the
// body) for a Redis without Functions. Each accessor below makes its own once, at first use.
Script make(std::string_view name) {
  const Body& b =
      *std::find_if(bodies().begin(), bodies().end(), [&](const Body& x) { return x.name == name; });
  std::string eval("local eval_keys, eval_args = KEYS, ARGV\n");
  eval.append(lua::kPrelude).append("enter(eval_keys, eval_args)\n").append(b.text);
  const FunctionLibrary& lib = the_library();
  const std::string_view tag = std::string_view(lib.name).substr(kLibraryPrefix.size());
  return Script(std::move(eval), std::string(name).append("_").append(tag), &lib);
}

}  // namespace

const FunctionLibrary& library() { return the_library(); }

const Script& register_node() {
  static const Script s = make("register_node");
  return s;
}
const Script& fence_master() {
  static const Script s = make("fence_master");
  return s;
}
const Script& heartbeat() {
  static const Script s = make("heartbeat");
  return s;
}
const Script& drain_node() {
  static const Script s = make("drain_node");
  return s;
}
const Script& deregister_node() {
  static const Script s = make("deregister_node");
  return s;
}
const Script& node_status() {
  static const Script s = make("node_status");
  return s;
}
const Script& list_nodes() {
  static const Script s = make("list_nodes");
  return s;
}
const Script& cordon_node() {
  static const Script s = make("cordon_node");
  return s;
}
const Script& known_nodes() {
  static const Script s = make("known_nodes");
  return s;
}
const Script& forget_node() {
  static const Script s = make("forget_node");
  return s;
}
const Script& cell_summary() {
  static const Script s = make("cell_summary");
  return s;
}
const Script& describe_objects() {
  static const Script s = make("describe_objects");
  return s;
}
const Script& evict_lru() {
  static const Script s = make("evict_lru");
  return s;
}
const Script& begin_put() {
  static const Script s = make("begin_put");
  return s;
}
const Script& commit_put() {
  static const Script s = make("commit_put");
  return s;
}
const Script& abort_put() {
  static const Script s = make("abort_put");
  return s;
}
const Script& reserve_pages() {
  static const Script s = make("reserve_pages");
  return s;
}
const Script& commit_reserved() {
  static const Script s = make("commit_reserved");
  return s;
}
const Script& commit_reserveds() {
  static const Script s = make("commit_reserveds");
  return s;
}
const Script& abort_reserved() {
  static const Script s = make("abort_reserved");
  return s;
}
const Script& release_reservation() {
  static const Script s = make("release_reservation");
  return s;
}
const Script& begin_get() {
  static const Script s = make("begin_get");
  return s;
}
const Script& begin_gets() {
  static const Script s = make("begin_gets");
  return s;
}
const Script& end_gets() {
  static const Script s = make("end_gets");
  return s;
}
const Script& stat() {
  static const Script s = make("stat");
  return s;
}
const Script& remove() {
  static const Script s = make("remove");
  return s;
}
const Script& touch() {
  static const Script s = make("touch");
  return s;
}
const Script& announce() {
  static const Script s = make("announce");
  return s;
}
const Script& live_nodes() {
  static const Script s = make("live_nodes");
  return s;
}
const Script& grant_pool() {
  static const Script s = make("grant_pool");
  return s;
}
const Script& publish_handoff() {
  static const Script s = make("publish_handoff");
  return s;
}
const Script& end_handoff() {
  static const Script s = make("end_handoff");
  return s;
}
const Script& contains_prefix() {
  static const Script s = make("contains_prefix");
  return s;
}
const Script& evict() {
  static const Script s = make("evict");
  return s;
}
const Script& reclaim() {
  static const Script s = make("reclaim");
  return s;
}
const Script& set_policy() {
  static const Script s = make("set_policy");
  return s;
}
const Script& set_quota() {
  static const Script s = make("set_quota");
  return s;
}
const Script& quota_scan() {
  static const Script s = make("quota_scan");
  return s;
}
const Script& list_quotas() {
  static const Script s = make("list_quotas");
  return s;
}
const Script& begin_write_down() {
  static const Script s = make("begin_write_down");
  return s;
}
const Script& commit_write_down() {
  static const Script s = make("commit_write_down");
  return s;
}
const Script& abort_write_down() {
  static const Script s = make("abort_write_down");
  return s;
}
const Script& begin_promote() {
  static const Script s = make("begin_promote");
  return s;
}
const Script& commit_promote() {
  static const Script s = make("commit_promote");
  return s;
}
const Script& abort_promote() {
  static const Script s = make("abort_promote");
  return s;
}
const Script& recover_tier() {
  static const Script s = make("recover_tier");
  return s;
}

}  // namespace kvstash::metadata::scripts
