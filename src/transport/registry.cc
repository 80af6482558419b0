// The registry: the list of plugins comes from the build (builtin_transports.h,
// written by src/meson.build with one entry per transport it compiles).
#include "transport/registry.h"

#include <algorithm>

#include "builtin_transports.h"  // generated: build/src/

namespace kvstash::transport {

#define KVSTASH_DECLARE_PLUGIN(name) \
  namespace name {                   \
  const Plugin& plugin();            \
  }
KVSTASH_BUILTIN_TRANSPORTS(KVSTASH_DECLARE_PLUGIN)
#undef KVSTASH_DECLARE_PLUGIN

std::span<const Plugin* const> plugins() {
#define KVSTASH_PLUGIN_ENTRY(name) &name::plugin(),
  static const Plugin* const all[] = {KVSTASH_BUILTIN_TRANSPORTS(KVSTASH_PLUGIN_ENTRY)};
#undef KVSTASH_PLUGIN_ENTRY
  return all;
}

const Plugin* find_plugin(TransportKind kind) {
  const auto all = plugins();
  const auto it = std::find_if(all.begin(), all.end(), [kind](const Plugin* p) { return p->kind == kind; });
  return it == all.end() ? nullptr : *it;
}

}  // namespace kvstash::transport
