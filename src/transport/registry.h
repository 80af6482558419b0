// The transports built into this binary, as the engine finds them: each one's kind, how to
// start it and how to look at the host for it. A transport plugs in with one folder that
// defines its Plugin (`<name>_plugin.cc`) and one line in src/meson.build; the engine reads
// this list and capabilities, never a kind.
//
// Internal header: src/engine and the transports include it.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "kvstash/status.h"
#include "kvstash/transfer.h"
#include "kvstash/types.h"

namespace kvstash::transport {

class Transport;

struct Plugin {
  TransportKind kind;
  // Starts the transport with its part of `options` (and the cluster token). kUnsupported
  // when it cannot run on this host or with these options (no device, a token it cannot
  // prove); other errors when it should have started and did not.
  Result<std::unique_ptr<Transport>> (*start)(const EngineOptions& options);
  // Looks at this host for the transport without starting it: its library's version, its
  // devices and their state, what stops it and how to fix that. Cheap enough for a CLI.
  std::vector<TransportFinding> (*probe)();
};

// Every transport built in, in the order the engine starts them when the caller names none.
std::span<const Plugin* const> plugins();

// The plugin of `kind`, or nullptr when this build has no such transport.
const Plugin* find_plugin(TransportKind kind);

}  // namespace kvstash::transport
