#include "metadata/scripts.h"

#include <openssl/sha.h>

#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "common/wire.h"
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

// The scripts of this build, made once: one function library (the prelude once, then a
// function per body that calls enter first; its name the SHA1 of its text) and each script's
// EVAL text (the prelude, enter, the body) for a Redis without Functions.
class Scripts {
 public:
  Scripts() {
    // Every script of the cell (built at first use, never in a static initializer).
    const Body bodies[] = {
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
    std::string functions(lua::kPrelude);
    for (const Body& b : bodies) {
      functions.append("redis.register_function{function_name='").append(b.name).append("_@', ");
      functions.append("callback=function(keys, args)\nenter(keys, args)\n").append(b.text).append("\nend");
      if (b.reads_only) functions.append(", flags={'no-writes'}");
      functions.append("}\n");
    }
    const std::string tag = digest(functions).substr(0, 16);
    for (auto at = functions.find("_@'"); at != std::string::npos; at = functions.find("_@'", at)) {
      functions.replace(at + 1, 1, tag);
    }
    library_.name = "kvstash_" + tag;
    library_.text = "#!lua name=" + library_.name + "\n" + functions;
    for (const Body& b : bodies) {
      std::string eval("local eval_keys, eval_args = KEYS, ARGV\n");
      eval.append(lua::kPrelude).append("enter(eval_keys, eval_args)\n").append(b.text);
      by_name_.emplace(std::piecewise_construct, std::forward_as_tuple(b.name),
                       std::forward_as_tuple(std::move(eval), std::string(b.name) + "_" + tag, &library_));
    }
  }
  const Script& operator[](std::string_view name) const { return by_name_.find(name)->second; }

 private:
  static std::string digest(std::string_view text) {
    unsigned char d[SHA_DIGEST_LENGTH];
    SHA1(reinterpret_cast<const unsigned char*>(text.data()), text.size(), d);
    return wire::to_hex(std::string_view(reinterpret_cast<const char*>(d), sizeof d));
  }
  FunctionLibrary library_;
  std::map<std::string_view, Script, std::less<>> by_name_;
};

const Script& script(std::string_view name) {
  static const Scripts all;
  return all[name];
}

}  // namespace

const Script& register_node() {
  static const Script& s = script("register_node");
  return s;
}
const Script& fence_master() {
  static const Script& s = script("fence_master");
  return s;
}
const Script& heartbeat() {
  static const Script& s = script("heartbeat");
  return s;
}
const Script& drain_node() {
  static const Script& s = script("drain_node");
  return s;
}
const Script& deregister_node() {
  static const Script& s = script("deregister_node");
  return s;
}
const Script& node_status() {
  static const Script& s = script("node_status");
  return s;
}
const Script& list_nodes() {
  static const Script& s = script("list_nodes");
  return s;
}
const Script& cordon_node() {
  static const Script& s = script("cordon_node");
  return s;
}
const Script& known_nodes() {
  static const Script& s = script("known_nodes");
  return s;
}
const Script& forget_node() {
  static const Script& s = script("forget_node");
  return s;
}
const Script& cell_summary() {
  static const Script& s = script("cell_summary");
  return s;
}
const Script& describe_objects() {
  static const Script& s = script("describe_objects");
  return s;
}
const Script& evict_lru() {
  static const Script& s = script("evict_lru");
  return s;
}
const Script& begin_put() {
  static const Script& s = script("begin_put");
  return s;
}
const Script& commit_put() {
  static const Script& s = script("commit_put");
  return s;
}
const Script& abort_put() {
  static const Script& s = script("abort_put");
  return s;
}
const Script& reserve_pages() {
  static const Script& s = script("reserve_pages");
  return s;
}
const Script& commit_reserved() {
  static const Script& s = script("commit_reserved");
  return s;
}
const Script& commit_reserveds() {
  static const Script& s = script("commit_reserveds");
  return s;
}
const Script& abort_reserved() {
  static const Script& s = script("abort_reserved");
  return s;
}
const Script& release_reservation() {
  static const Script& s = script("release_reservation");
  return s;
}
const Script& begin_get() {
  static const Script& s = script("begin_get");
  return s;
}
const Script& begin_gets() {
  static const Script& s = script("begin_gets");
  return s;
}
const Script& end_gets() {
  static const Script& s = script("end_gets");
  return s;
}
const Script& stat() {
  static const Script& s = script("stat");
  return s;
}
const Script& remove() {
  static const Script& s = script("remove");
  return s;
}
const Script& touch() {
  static const Script& s = script("touch");
  return s;
}
const Script& announce() {
  static const Script& s = script("announce");
  return s;
}
const Script& live_nodes() {
  static const Script& s = script("live_nodes");
  return s;
}
const Script& grant_pool() {
  static const Script& s = script("grant_pool");
  return s;
}
const Script& publish_handoff() {
  static const Script& s = script("publish_handoff");
  return s;
}
const Script& end_handoff() {
  static const Script& s = script("end_handoff");
  return s;
}
const Script& contains_prefix() {
  static const Script& s = script("contains_prefix");
  return s;
}
const Script& evict() {
  static const Script& s = script("evict");
  return s;
}
const Script& reclaim() {
  static const Script& s = script("reclaim");
  return s;
}
const Script& set_policy() {
  static const Script& s = script("set_policy");
  return s;
}
const Script& set_quota() {
  static const Script& s = script("set_quota");
  return s;
}
const Script& quota_scan() {
  static const Script& s = script("quota_scan");
  return s;
}
const Script& list_quotas() {
  static const Script& s = script("list_quotas");
  return s;
}
const Script& begin_write_down() {
  static const Script& s = script("begin_write_down");
  return s;
}
const Script& commit_write_down() {
  static const Script& s = script("commit_write_down");
  return s;
}
const Script& abort_write_down() {
  static const Script& s = script("abort_write_down");
  return s;
}
const Script& begin_promote() {
  static const Script& s = script("begin_promote");
  return s;
}
const Script& commit_promote() {
  static const Script& s = script("commit_promote");
  return s;
}
const Script& abort_promote() {
  static const Script& s = script("abort_promote");
  return s;
}
const Script& recover_tier() {
  static const Script& s = script("recover_tier");
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
